#include "cuda/cuda_backward_kernels.h"

#include <algorithm>
#include <string>

#include "cuda/device_types.cuh"
#include "cuda/launch.cuh"

namespace plsh::cuda {

namespace {

__device__ __forceinline__ int64_t lane_of(const BackwardProblem& pr, const LanePass& l) {
  return static_cast<int64_t>(l.batch) * pr.heads + l.head;
}

// Per slot: the tile's rows and key chunk (describe_slot, as the forward)
// and the cuBLAS pointer arrays (backward_slot_operands).
__global__ void backward_build_round_kernel(BackwardProblem pr, Round round, const LanePass* lanes,
                                            BackwardRoundBuffers rb) {
  TileDesc d;
  const int64_t slot = round_slot(pr.shape, round, lanes, rb.desc, &d);
  if (slot < 0) return;
  const BackwardSlotOperands o =
      backward_slot_operands(pr.operands, lanes[d.lane], d, slot, pr.shape.tile_rows, round.key_cols);
  set_slot_pointers(pr, rb, slot, o);
  rb.dq_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dq_part) + o.dq);
  rb.dk_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dk_part) + o.dk);
  rb.dv_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dv_part) + o.dv);
  rb.dout_ptr[slot] = pr.dout + o.dout;
  rb.ds_ptr[slot] = rb.ds + o.ds;
}

// P of one tile under the pass's rule, from each row's lse (row_lse_for):
// the forward's masked softmax with the row's max and sum replaced by the
// forward's result. One block per slot (slot_view); rows another tile owns
// get P = 0, so that they add nothing to dK, dV.
template <typename TP>
__global__ void __launch_bounds__(kThreads)
    backward_probs_kernel(BackwardProblem pr, int64_t key_cols, const LanePass* lanes, BackwardRoundBuffers rb) {
  const SlotView v = slot_view(rb.desc, lanes, pr.shape, pr.k_pos0, key_cols);
  TP* probs = reinterpret_cast<TP*>(rb.probs);
  const float* row_lse = pr.row_lse + lane_of(pr, v.l) * pr.shape.q_len;
  auto row_probs = [&](int64_t, int64_t i, int64_t base, const SlotRow& row) {
    const float lse = row_lse[i];
    for (int64_t x = v.lane; x < v.Kc; x += 32) {
      float logit = 0;
      const bool ok = slot_logit_at(v, pr.shape.causal, row, pr.k_pos0, x, rb.scores[base + x], &logit);
      probs[base + x] = from_float<TP>(ok ? backward_prob(logit, lse) : 0.0f);
    }
  };
  for_slot_rows(v, pr.shape, pr.q_pos0, probs, row_probs, [](int64_t) {});
}

// dS = P * (dP - D_i), dP in the scores slice; zero on rows another tile owns.
template <typename TP>
__global__ void __launch_bounds__(kThreads)
    backward_ds_kernel(BackwardProblem pr, int64_t key_cols, const LanePass* lanes, BackwardRoundBuffers rb) {
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
__global__ void __launch_bounds__(kThreads)
    dq_merge_kernel(BackwardProblem pr, const LanePass* lanes, BackwardRoundBuffers rb, Accumulators a) {
  const int64_t D = pr.head_dim;
  const int64_t Dp = partial_pitch(D);
  const int lane = threadIdx.x % 32;
  for_owned_acc_rows(rb.desc, lanes, pr.shape, a, [&](int64_t part_row, int64_t idx) {
    float* acc = a.acc + idx * D;
    const float* part = rb.dq_part + part_row * Dp;
    for (int64_t x = lane; x < D; x += 32) acc[x] += part[x];
  });
}

// dk_acc, dv_acc += each slot's shares for its valid keys.
__global__ void __launch_bounds__(kThreads)
    kv_scatter_kernel(BackwardProblem pr, int64_t key_cols, const LanePass* lanes, BackwardRoundBuffers rb) {
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
__global__ void __launch_bounds__(kThreads)
    dq_finalize_kernel(TG* dq, int64_t q_len, int64_t heads, int64_t head_dim, int64_t lane0, Accumulators a) {
  AccRow r;
  if (!acc_row(a, q_len, heads, lane0, &r)) return;
  const int lane = threadIdx.x % 32;
  const float* acc = a.acc + r.idx * head_dim;
  TG* out = dq + ((r.b * q_len + r.i) * heads + r.h) * head_dim;
  for (int64_t x = lane; x < head_dim; x += 32) out[x] = from_float<TG>(acc[x]);
}

template <typename TG>
__global__ void to_dtype_kernel(const float* acc, TG* out, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[e] = from_float<TG>(acc[e]);
}

}  // namespace

Status launch_backward_build_round(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                                   const BackwardRoundBuffers& rb, cudaStream_t stream) {
  return launch("backward_build_round_kernel", ceil_div(round.slots, kThreads), 1, stream, backward_build_round_kernel,
                pr, round, lanes, rb);
}

Status launch_backward_probs(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                             const BackwardRoundBuffers& rb, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto tag) {
    return launch("backward_probs_kernel", round.slots, 1, stream, backward_probs_kernel<decltype(tag)>, pr,
                  round.key_cols, lanes, rb);
  });
}

Status launch_backward_ds(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                          const BackwardRoundBuffers& rb, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto tag) {
    return launch("backward_ds_kernel", round.slots, 1, stream, backward_ds_kernel<decltype(tag)>, pr, round.key_cols,
                  lanes, rb);
  });
}

Status launch_dq_merge(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                       const BackwardRoundBuffers& rb, const Accumulators& acc, cudaStream_t stream) {
  return launch("dq_merge_kernel", round.slots, 1, stream, dq_merge_kernel, pr, lanes, rb, acc);
}

Status launch_kv_scatter(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                         const BackwardRoundBuffers& rb, cudaStream_t stream) {
  return launch("kv_scatter_kernel", round.slots, 1, stream, kv_scatter_kernel, pr, round.key_cols, lanes, rb);
}

Status launch_dq_finalize(DType grad_dtype, void* dq, int64_t q_len, int64_t heads, int64_t head_dim, int64_t lane0,
                          int64_t lanes, const Accumulators& acc, cudaStream_t stream) {
  return dispatch_dtype(grad_dtype, [&](auto tag) {
    using TG = decltype(tag);
    return launch("dq_finalize_kernel", ceil_div(acc.rows_per_lane, kWarps), lanes, stream, dq_finalize_kernel<TG>,
                  static_cast<TG*>(dq), q_len, heads, head_dim, lane0, acc);
  });
}

Status launch_to_dtype(DType grad_dtype, const float* acc, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 65535);
  return dispatch_dtype(grad_dtype, [&](auto tag) {
    using TG = decltype(tag);
    return launch("to_dtype_kernel", blocks, 1, stream, to_dtype_kernel<TG>, acc, static_cast<TG*>(out), n);
  });
}

}  // namespace plsh::cuda
