#include "cuda/cuda_kernels.h"

#include <string>

#include "cuda/cuda_check.h"
#include "cuda/device_types.cuh"

namespace plsh::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps: one query row per warp at a time
constexpr int kWarps = kThreads / 32;

// ---- kernels -----------------------------------------------------------------

// Per slot: the tile's rows and key chunk (tile_plan.h, the same code the
// host tests check) and the cuBLAS pointer arrays into the tensors.
__global__ void build_round_kernel(DeviceProblem pr, Round round, const LanePass* lanes, RoundBuffers rb) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= round.slots) return;
  const TileDesc d = describe_slot(pr.shape, round, lanes, slot);
  rb.desc[slot] = d;
  // Byte offsets from slot_operands, which the host tests check for 16-byte
  // alignment.
  const SlotOperands o = slot_operands(pr.operands, lanes[d.lane], d, slot, pr.shape.tile_rows, round.key_cols);
  rb.q_ptr[slot] = pr.q + o.q;
  rb.k_ptr[slot] = pr.k + o.k;
  rb.v_ptr[slot] = pr.v + o.v;
  rb.score_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.scores) + o.scores);
  rb.prob_ptr[slot] = rb.probs + o.probs;
  rb.partial_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.partial) + o.partial);
}

// Row softmax of one tile's scores under the pass's rule: P = exp(s - m)
// (0 where not allowed), rounded to the input dtype for the second GEMM, with
// the row max m and the sum of the rounded P. One block per slot; the key
// bins of the chunk are computed once per block, in IEEE double.
template <typename TP>
__global__ void __launch_bounds__(kThreads) masked_softmax_kernel(DeviceProblem pr, int64_t key_cols,
                                                                  const LanePass* lanes, RoundBuffers rb) {
  __shared__ long long key_bin[kMaxKeyCols];
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const LanePass l = lanes[d.lane];
  const int64_t T = pr.shape.tile_rows;
  const int64_t Kc = key_cols;
  const int64_t Kp = key_pitch(Kc);  // row pitch of scores and probabilities
  const bool same_bin = l.rule == SpanRule::kSameBin;
  if (same_bin) {
    for (int64_t x = threadIdx.x; x < Kc; x += kThreads) key_bin[x] = span_bin(pr.k_pos0 + d.col0 + x, l.pitch, l.shift);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  TP* probs = reinterpret_cast<TP*>(rb.probs);
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    const int64_t base = (slot * T + r) * Kp;
    if (i < d.own_begin || i >= d.own_end) {
      // Rows another tile owns: zeros keep the second GEMM's inputs defined.
      for (int64_t x = lane; x < Kc; x += 32) probs[base + x] = from_float<TP>(0.0f);
      if (lane == 0) {
        rb.row_max[slot * T + r] = -INFINITY;
        rb.row_sum[slot * T + r] = 0.0f;
      }
      continue;
    }
    const int64_t pos_i = pr.q_pos0 + i;
    const int64_t nearest = nearest_key_distance(pr.shape, i);
    const int64_t q_bin = same_bin ? span_bin(pos_i, l.pitch, l.shift) : 0;
    auto logit = [&](int64_t x, float* s) {
      const int64_t j = d.col0 + x;
      return slot_logit(l, d, pr.shape.causal, pos_i, j, pr.k_pos0 + j, nearest, q_bin, same_bin ? key_bin[x] : 0,
                        rb.scores[base + x], s);
    };
    // The row's logits stay in registers between the max and the exp pass
    // (Kc <= 512: 16 per lane, indexed by unrolled constants), so the scores
    // are read from memory once: 12 bytes per score moved instead of 16.
    constexpr int kPerLane = static_cast<int>(kMaxKeyCols / 32);
    float logits[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = lane + 32 * t;
      float s = -INFINITY;
      if (x >= Kc || !logit(x, &s)) s = -INFINITY;
      logits[t] = s;
      m = fmaxf(m, s);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = lane + 32 * t;
      if (x >= Kc) continue;
      // Allowed logits are finite; -inf marks the masked ones (and m = -inf
      // only when the whole row is masked).
      const float p = logits[t] == -INFINITY ? 0.0f : expf(logits[t] - m);
      const TP pv = from_float<TP>(p);
      probs[base + x] = pv;
      sum += to_float(pv);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      rb.row_max[slot * T + r] = m;
      rb.row_sum[slot * T + r] = sum;
    }
  }
}

// Folds one round's partial outputs into the running per-row accumulators
// (online log-sum-exp; SPEC section 3's merge, over samples and key chunks).
// Each row of a lane has one owner tile per round, so no two warps meet.
__global__ void __launch_bounds__(kThreads) merge_kernel(DeviceProblem pr, const LanePass* lanes, RoundBuffers rb,
                                                         Accumulators a) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const int64_t acc_lane = lanes[d.lane].acc_lane;
  const int64_t T = pr.shape.tile_rows;
  const int64_t D = pr.head_dim;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    if (i < d.own_begin || i >= d.own_end) continue;
    const float l_part = rb.row_sum[slot * T + r];
    if (l_part == 0.0f) continue;  // no allowed key in this chunk
    const float m_part = rb.row_max[slot * T + r];
    const int64_t idx = acc_lane * a.rows_per_lane + (i - a.row0);
    const float l_acc = a.acc_sum[idx];
    const float m_acc = a.acc_max[idx];
    const MergeCoefficients c = merge_coefficients(m_acc, l_acc, m_part);
    float* acc = a.acc + idx * D;
    const float* part = rb.partial + (slot * T + r) * partial_pitch(D);
    for (int64_t x = lane; x < D; x += 32) acc[x] = acc[x] * c.c_acc + part[x] * c.c_part;
    __syncwarp();
    if (lane == 0) {
      a.acc_max[idx] = c.m_new;
      a.acc_sum[idx] = l_acc * c.c_acc + l_part * c.c_part;
    }
  }
}

// out = acc / l in the output dtype; lse = row_lse (tile_plan.h), in double.
template <typename TO>
__global__ void __launch_bounds__(kThreads) finalize_kernel(DeviceOutput o, int64_t q_len, int64_t head_dim,
                                                            int64_t lane0, const HeadLse* head_lse, Accumulators a) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t local = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (local >= a.rows_per_lane) return;
  const int64_t i = a.row0 + local;
  if (i >= q_len) return;
  const int64_t acc_lane = blockIdx.y;
  const int64_t g = lane0 + acc_lane;
  const int64_t b = g / o.heads;
  const int64_t h = g % o.heads;
  const int64_t idx = acc_lane * a.rows_per_lane + local;
  const float l = a.acc_sum[idx];
  TO* out = static_cast<TO*>(o.out) + b * o.o_bs + i * o.o_rs + h * o.o_hs;
  const float* acc = a.acc + idx * head_dim;
  for (int64_t x = lane; x < head_dim; x += 32) out[x] = from_float<TO>(l > 0.0f ? acc[x] / l : 0.0f);
  if (lane == 0 && o.lse != nullptr)
    o.lse[b * o.lse_bs + i * o.lse_rs + h] =
        static_cast<float>(row_lse(a.acc_max[idx], l, head_lse[h], nearest_key_distance(o.shape, i)));
}

__global__ void bins_kernel(const long long* pos, long long* out, int64_t n, double pitch, double shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = span_bin(pos[i], pitch, shift);
}

// grid.x <= 2^31 - 1, grid.y and grid.z <= 65535 (CUDA's limits on every
// GPU this builds for): an INTERNAL error rather than a failed launch.
Status check_grid(const char* kernel, int64_t x, int64_t y = 1) {
  if (x >= 1 && x <= 2147483647 && y >= 1 && y <= 65535) return Status::Ok();
  return internal_error(std::string("cuda backend: ") + kernel + " grid (" + std::to_string(x) + ", " +
                        std::to_string(y) + ") is beyond CUDA's limits (2^31 - 1, 65535)");
}

}  // namespace

Status launch_build_round(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                          cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("build_round_kernel", ceil_div(round.slots, kThreads)));
  build_round_kernel<<<static_cast<unsigned>(ceil_div(round.slots, kThreads)), kThreads, 0, stream>>>(pr, round, lanes, rb);
  LAUNCH_RETURN_IF_ERROR("build_round_kernel");
  return Status::Ok();
}

Status launch_masked_softmax(DType dtype, const DeviceProblem& pr, const Round& round, const LanePass* lanes,
                             const RoundBuffers& rb, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("masked_softmax_kernel", round.slots));
  dispatch_dtype(dtype, [&](auto tag) {
    using TP = decltype(tag);
    masked_softmax_kernel<TP><<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, round.key_cols, lanes, rb);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("masked_softmax_kernel");
  return Status::Ok();
}

Status launch_merge(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                    const Accumulators& acc, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("merge_kernel", round.slots));
  merge_kernel<<<static_cast<unsigned>(round.slots), kThreads, 0, stream>>>(pr, lanes, rb, acc);
  LAUNCH_RETURN_IF_ERROR("merge_kernel");
  return Status::Ok();
}

Status launch_finalize(DType out_dtype, const DeviceOutput& out, int64_t q_len, int64_t head_dim, int64_t lane0,
                       int64_t lanes, const HeadLse* head_lse, const Accumulators& acc, cudaStream_t stream) {
  RETURN_IF_ERROR(check_grid("finalize_kernel", ceil_div(acc.rows_per_lane, kWarps), lanes));
  const dim3 grid(static_cast<unsigned>(ceil_div(acc.rows_per_lane, kWarps)), static_cast<unsigned>(lanes));
  dispatch_dtype(out_dtype, [&](auto tag) {
    using TO = decltype(tag);
    finalize_kernel<TO><<<grid, kThreads, 0, stream>>>(out, q_len, head_dim, lane0, head_lse, acc);
    return 0;
  });
  LAUNCH_RETURN_IF_ERROR("finalize_kernel");
  return Status::Ok();
}

Status launch_bins(const long long* positions, long long* bins, int64_t n, double pitch, double shift,
                   cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  RETURN_IF_ERROR(check_grid("bins_kernel", ceil_div(n, 256)));
  bins_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(positions, bins, n, pitch, shift);
  LAUNCH_RETURN_IF_ERROR("bins_kernel");
  return Status::Ok();
}

}  // namespace plsh::cuda
