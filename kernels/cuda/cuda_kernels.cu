#include "cuda/cuda_kernels.h"

#include <string>

#include "cuda/device_types.cuh"
#include "cuda/launch.cuh"

namespace plsh::cuda {

namespace {

// ---- kernels -----------------------------------------------------------------

// Per slot: the tile's rows and key chunk (tile_plan.h, the same code the
// host tests check) and the cuBLAS pointer arrays into the tensors.
__global__ void build_round_kernel(DeviceProblem pr, Round round, const LanePass* lanes, RoundBuffers rb) {
  TileDesc d;
  const int64_t slot = round_slot(pr.shape, round, lanes, rb.desc, &d);
  if (slot < 0) return;
  // Byte offsets from slot_operands, which the host tests check for 16-byte
  // alignment.
  const SlotOperands o = slot_operands(pr.operands, lanes[d.lane], d, slot, pr.shape.tile_rows, round.key_cols);
  set_slot_pointers(pr, rb, slot, o);
  rb.partial_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.partial) + o.partial);
}

// Row softmax of one tile's scores under the pass's rule: P = exp(s - m)
// (0 where not allowed), rounded to the input dtype for the second GEMM, with
// the row max m and the sum of the rounded P. One block per slot
// (slot_view); rows another tile owns get P = 0, m = -inf and a sum of 0.
template <typename TP>
__global__ void __launch_bounds__(kThreads)
    masked_softmax_kernel(DeviceProblem pr, int64_t key_cols, const LanePass* lanes, RoundBuffers rb) {
  const SlotView v = slot_view(rb.desc, lanes, pr.shape, pr.k_pos0, key_cols);
  TP* probs = reinterpret_cast<TP*>(rb.probs);
  float* row_max = rb.row_max + v.slot * v.T;
  float* row_sum = rb.row_sum + v.slot * v.T;
  auto row_softmax = [&](int64_t r, int64_t, int64_t base, const SlotRow& row) {
    // The row's logits stay in registers between the max and the exp pass
    // (Kc <= 512: 16 per lane, indexed by unrolled constants), so the scores
    // are read from memory once: 12 bytes per score moved instead of 16.
    constexpr int kPerLane = static_cast<int>(kMaxKeyCols / 32);
    float logits[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = v.lane + 32 * t;
      float s = -INFINITY;
      if (x >= v.Kc || !slot_logit_at(v, pr.shape.causal, row, pr.k_pos0, x, rb.scores[base + x], &s)) s = -INFINITY;
      logits[t] = s;
      m = fmaxf(m, s);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = v.lane + 32 * t;
      if (x >= v.Kc) continue;
      // Allowed logits are finite; -inf marks the masked ones (and m = -inf
      // only when the whole row is masked).
      const float p = logits[t] == -INFINITY ? 0.0f : expf(logits[t] - m);
      const TP pv = from_float<TP>(p);
      probs[base + x] = pv;
      sum += to_float(pv);
    }
    sum = warp_sum(sum);
    if (v.lane == 0) {
      row_max[r] = m;
      row_sum[r] = sum;
    }
  };
  for_slot_rows(v, pr.shape, pr.q_pos0, probs, row_softmax, [&](int64_t r) {
    if (v.lane == 0) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  });
}

// Folds one round's partial outputs into the running per-row accumulators
// (online log-sum-exp; SPEC section 3's merge, over samples and key chunks).
// Each row of a lane has one owner tile per round, so no two warps meet.
__global__ void __launch_bounds__(kThreads)
    merge_kernel(DeviceProblem pr, const LanePass* lanes, RoundBuffers rb, Accumulators a) {
  const int64_t D = pr.head_dim;
  const int lane = threadIdx.x % 32;
  for_owned_acc_rows(rb.desc, lanes, pr.shape, a, [&](int64_t part_row, int64_t idx) {
    const float l_part = rb.row_sum[part_row];
    if (l_part == 0.0f) return;  // no allowed key in this chunk
    const float m_part = rb.row_max[part_row];
    const float l_acc = a.acc_sum[idx];
    const float m_acc = a.acc_max[idx];
    const MergeCoefficients c = merge_coefficients(m_acc, l_acc, m_part);
    float* acc = a.acc + idx * D;
    const float* part = rb.partial + part_row * partial_pitch(D);
    for (int64_t x = lane; x < D; x += 32) acc[x] = acc[x] * c.c_acc + part[x] * c.c_part;
    __syncwarp();
    if (lane == 0) {
      a.acc_max[idx] = c.m_new;
      a.acc_sum[idx] = l_acc * c.c_acc + l_part * c.c_part;
    }
  });
}

// out = acc / l in the output dtype; lse = row_lse (tile_plan.h), in double.
template <typename TO>
__global__ void __launch_bounds__(kThreads) finalize_kernel(DeviceOutput o, int64_t q_len, int64_t head_dim,
                                                            int64_t lane0, const HeadLse* head_lse, Accumulators a) {
  AccRow r;
  if (!acc_row(a, q_len, o.heads, lane0, &r)) return;
  const int lane = threadIdx.x % 32;
  const float l = a.acc_sum[r.idx];
  TO* out = static_cast<TO*>(o.out) + r.b * o.o_bs + r.i * o.o_rs + r.h * o.o_hs;
  const float* acc = a.acc + r.idx * head_dim;
  for (int64_t x = lane; x < head_dim; x += 32) out[x] = from_float<TO>(l > 0.0f ? acc[x] / l : 0.0f);
  if (lane == 0 && o.lse != nullptr)
    o.lse[r.b * o.lse_bs + r.i * o.lse_rs + r.h] =
        static_cast<float>(row_lse(a.acc_max[r.idx], l, head_lse[r.h], nearest_key_distance(o.shape, r.i)));
}

__global__ void bins_kernel(const long long* pos, long long* out, int64_t n, double pitch, double shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = span_bin(pos[i], pitch, shift);
}

}  // namespace

Status launch_build_round(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                          cudaStream_t stream) {
  return launch("build_round_kernel", ceil_div(round.slots, kThreads), 1, stream, build_round_kernel, pr, round, lanes,
                rb);
}

Status launch_masked_softmax(DType dtype, const DeviceProblem& pr, const Round& round, const LanePass* lanes,
                             const RoundBuffers& rb, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto tag) {
    return launch("masked_softmax_kernel", round.slots, 1, stream, masked_softmax_kernel<decltype(tag)>, pr,
                  round.key_cols, lanes, rb);
  });
}

Status launch_merge(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                    const Accumulators& acc, cudaStream_t stream) {
  return launch("merge_kernel", round.slots, 1, stream, merge_kernel, pr, lanes, rb, acc);
}

Status launch_finalize(DType out_dtype, const DeviceOutput& out, int64_t q_len, int64_t head_dim, int64_t lane0,
                       int64_t lanes, const HeadLse* head_lse, const Accumulators& acc, cudaStream_t stream) {
  return dispatch_dtype(out_dtype, [&](auto tag) {
    return launch("finalize_kernel", ceil_div(acc.rows_per_lane, kWarps), lanes, stream, finalize_kernel<decltype(tag)>,
                  out, q_len, head_dim, lane0, head_lse, acc);
  });
}

Status launch_bins(const long long* positions, long long* bins, int64_t n, double pitch, double shift,
                   cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  return launch("bins_kernel", ceil_div(n, kThreads), 1, stream, bins_kernel, positions, bins, n, pitch, shift);
}

}  // namespace plsh::cuda
