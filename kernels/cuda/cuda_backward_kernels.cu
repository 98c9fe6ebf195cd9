#include "cuda/cuda_backward_kernels.h"

#include <algorithm>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/device_types.cuh"

namespace plsh::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps: one query row per warp at a time
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int64_t lane_of(const BackwardProblem& pr, const LanePass& l) {
  return static_cast<int64_t>(l.batch) * pr.heads + l.head;
}

// Per slot: the tile's rows and key chunk (describe_slot, as the forward)
// and the cuBLAS pointer arrays (backward_slot_operands).
__global__ void backward_build_round_kernel(BackwardProblem pr, Round round, const LanePass* lanes,
                                            BackwardRoundBuffers rb) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= round.slots) return;
  const TileDesc d = describe_slot(pr.shape, round, lanes, slot);
  rb.desc[slot] = d;
  const BackwardSlotOperands o =
      backward_slot_operands(pr.operands, lanes[d.lane], d, slot, pr.shape.tile_rows, round.key_cols);
  rb.q_ptr[slot] = pr.q + o.q;
  rb.k_ptr[slot] = pr.k + o.k;
  rb.v_ptr[slot] = pr.v + o.v;
  rb.dout_ptr[slot] = pr.dout + o.dout;
  rb.score_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.scores) + o.scores);
  rb.prob_ptr[slot] = rb.probs + o.probs;
  rb.ds_ptr[slot] = rb.ds + o.ds;
  rb.dq_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dq_part) + o.dq);
  rb.dk_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dk_part) + o.dk);
  rb.dv_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dv_part) + o.dv);
}

// P of one tile under the pass's rule, from each row's lse (row_lse_for):
// the forward's masked softmax with the row's max and sum replaced by the
// forward's result. The key bins of the chunk are computed once per block.
template <typename TP>
__global__ void __launch_bounds__(kThreads) backward_probs_kernel(BackwardProblem pr, int64_t key_cols,
                                                                  const LanePass* lanes, BackwardRoundBuffers rb) {
  __shared__ long long key_bin[kMaxKeyCols];
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const LanePass l = lanes[d.lane];
  const int64_t T = pr.shape.tile_rows;
  const int64_t Kc = key_cols;
  const int64_t Kp = key_pitch(Kc);
  const bool same_bin = l.rule == SpanRule::kSameBin;
  if (same_bin) {
    for (int64_t x = threadIdx.x; x < Kc; x += kThreads) key_bin[x] = span_bin(pr.k_pos0 + d.col0 + x, l.pitch, l.shift);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  TP* probs = reinterpret_cast<TP*>(rb.probs);
  const int64_t g = lane_of(pr, l);
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    const int64_t base = (slot * T + r) * Kp;
    if (i < d.own_begin || i >= d.own_end) {
      // Rows another tile owns: zeros, so that they add nothing to dK, dV.
      for (int64_t x = lane; x < Kc; x += 32) probs[base + x] = from_float<TP>(0.0f);
      continue;
    }
    const int64_t pos_i = pr.q_pos0 + i;
    const int64_t nearest = nearest_key_distance(pr.shape, i);
    const int64_t q_bin = same_bin ? span_bin(pos_i, l.pitch, l.shift) : 0;
    const float lse = pr.row_lse[g * pr.shape.q_len + i];
    for (int64_t x = lane; x < Kc; x += 32) {
      const int64_t j = d.col0 + x;
      float logit = 0;
      const bool ok = slot_logit(l, d, pr.shape.causal, pos_i, j, pr.k_pos0 + j, nearest, q_bin,
                                 same_bin ? key_bin[x] : 0, rb.scores[base + x], &logit);
      probs[base + x] = from_float<TP>(ok ? backward_prob(logit, lse) : 0.0f);
    }
  }
}

// dS = P * (dP - D_i), dP in the scores slice; zero on rows another tile owns.
template <typename TP>
__global__ void __launch_bounds__(kThreads) backward_ds_kernel(BackwardProblem pr, int64_t key_cols,
                                                               const LanePass* lanes, BackwardRoundBuffers rb) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const LanePass l = lanes[d.lane];
  const int64_t T = pr.shape.tile_rows;
  const int64_t Kc = key_cols;
  const int64_t Kp = key_pitch(Kc);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const TP* probs = reinterpret_cast<const TP*>(rb.probs);
  TP* ds = reinterpret_cast<TP*>(rb.ds);
  const int64_t g = lane_of(pr, l);
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    const int64_t base = (slot * T + r) * Kp;
    const bool owned = i >= d.own_begin && i < d.own_end;
    const float di = owned ? pr.row_d[g * pr.shape.q_len + i] : 0.0f;
    for (int64_t x = lane; x < Kc; x += 32) {
      const float p = owned ? to_float(probs[base + x]) : 0.0f;
      ds[base + x] = from_float<TP>(p * (rb.scores[base + x] - di));
    }
  }
}

// The chunk's dq accumulators += each slot's dQ share over its owned rows.
__global__ void __launch_bounds__(kThreads) dq_merge_kernel(BackwardProblem pr, const LanePass* lanes,
                                                            BackwardRoundBuffers rb, Accumulators a) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const int64_t acc_lane = lanes[d.lane].acc_lane;
  const int64_t T = pr.shape.tile_rows;
  const int64_t D = pr.head_dim;
  const int64_t Dp = partial_pitch(D);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    if (i < d.own_begin || i >= d.own_end) continue;
    float* acc = a.acc + (acc_lane * a.rows_per_lane + (i - a.row0)) * D;
    const float* part = rb.dq_part + (slot * T + r) * Dp;
    for (int64_t x = lane; x < D; x += 32) acc[x] += part[x];
  }
}

// dk_acc, dv_acc += each slot's shares for its valid keys.
__global__ void __launch_bounds__(kThreads) kv_scatter_kernel(BackwardProblem pr, int64_t key_cols,
                                                              const LanePass* lanes, BackwardRoundBuffers rb) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const LanePass l = lanes[d.lane];
  const int64_t D = pr.head_dim;
  const int64_t Dp = partial_pitch(D);
  const int64_t hk = l.head / pr.operands.head_group;
  const int64_t x0 = d.valid_begin - d.col0, x1 = d.valid_end - d.col0;
  const int64_t n = (x1 - x0) * D;
  for (int64_t e = threadIdx.x; e < n; e += kThreads) {
    const int64_t x = x0 + e / D, c = e % D;
    const int64_t j = d.col0 + x;
    const int64_t at = ((static_cast<int64_t>(l.batch) * pr.shape.kv_len + j) * pr.kv_heads + hk) * D + c;
    const int64_t from = (slot * key_cols + x) * Dp + c;
    atomicAdd(pr.dk_acc + at, rb.dk_part[from]);
    atomicAdd(pr.dv_acc + at, rb.dv_part[from]);
  }
}

template <typename TG>
__global__ void __launch_bounds__(kThreads) dq_finalize_kernel(TG* dq, int64_t q_len, int64_t heads, int64_t head_dim,
                                                               int64_t lane0, Accumulators a) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t local = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (local >= a.rows_per_lane) return;
  const int64_t i = a.row0 + local;
  if (i >= q_len) return;
  const int64_t acc_lane = blockIdx.y;
  const int64_t g = lane0 + acc_lane;
  const int64_t b = g / heads, h = g % heads;
  const float* acc = a.acc + (acc_lane * a.rows_per_lane + local) * head_dim;
  TG* out = dq + ((b * q_len + i) * heads + h) * head_dim;
  for (int64_t x = lane; x < head_dim; x += 32) out[x] = from_float<TG>(acc[x]);
}

template <typename TG>
__global__ void to_dtype_kernel(const float* acc, TG* out, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[e] = from_float<TG>(acc[e]);
}

Status check_grid(const char* kernel, int64_t x, int64_t y = 1) {
  if (x >= 1 && x <= 2147483647 && y >= 1 && y <= 65535) return Status::Ok();
  return internal_error(std::string("cuda backend: ") + kernel + " grid (" + std::to_string(x) + ", " +
                        std::to_string(y) + ") is beyond CUDA's limits (2^31 - 1, 65535)");
}

}  // namespace

Status launch_backward_build_round(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                                   const BackwardRoundBuffers& rb, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("backward_build_round_kernel", ceil_div(round.slots, kThreads)));
  backward_build_round_kernel<<<static_cast<unsigned>(ceil_div(round.slots, kThreads)), kThreads, 0, stream>>>(
      pr, round, lanes, rb);
  LAUNCH_RETURN_IF_ERROR("backward_build_round_kernel");
  return Status::Ok();
}

Status launch_backward_probs(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                             const BackwardRoundBuffers& rb, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("backward_probs_kernel", round.slots));
  dispatch_dtype(dtype, [&](auto tag) {
    using TP = decltype(tag);
    backward_probs_kernel<TP><<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, round.key_cols, lanes, rb);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("backward_probs_kernel");
  return Status::Ok();
}

Status launch_backward_ds(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                          const BackwardRoundBuffers& rb, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("backward_ds_kernel", round.slots));
  dispatch_dtype(dtype, [&](auto tag) {
    using TP = decltype(tag);
    backward_ds_kernel<TP><<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, round.key_cols, lanes, rb);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("backward_ds_kernel");
  return Status::Ok();
}

Status launch_dq_merge(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                       const BackwardRoundBuffers& rb, const Accumulators& acc, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("dq_merge_kernel", round.slots));
  dq_merge_kernel<<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, lanes, rb, acc);
  LAUNCH_RETURN_IF_ERROR("dq_merge_kernel");
  return Status::Ok();
}

Status launch_kv_scatter(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                         const BackwardRoundBuffers& rb, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("kv_scatter_kernel", round.slots));
  kv_scatter_kernel<<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, round.key_cols, lanes, rb);
  LAUNCH_RETURN_IF_ERROR("kv_scatter_kernel");
  return Status::Ok();
}

Status launch_dq_finalize(DType grad_dtype, void* dq, int64_t q_len, int64_t heads, int64_t head_dim, int64_t lane0,
                          int64_t lanes, const Accumulators& acc, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("dq_finalize_kernel", ceil_div(acc.rows_per_lane, kWarps), lanes));
  const dim3 grid(static_cast<unsigned>(ceil_div(acc.rows_per_lane, kWarps)), static_cast<unsigned>(lanes));
  dispatch_dtype(grad_dtype, [&](auto tag) {
    using TG = decltype(tag);
    dq_finalize_kernel<TG><<<grid, kThreads, 0, stream>>>(static_cast<TG*>(dq), q_len, heads, head_dim, lane0, acc);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("dq_finalize_kernel");
  return Status::Ok();
}

Status launch_to_dtype(DType grad_dtype, const float* acc, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 65535);
  dispatch_dtype(grad_dtype, [&](auto tag) {
    using TG = decltype(tag);
    to_dtype_kernel<TG><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(acc, static_cast<TG*>(out), n);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("to_dtype_kernel");
  return Status::Ok();
}

}  // namespace plsh::cuda
