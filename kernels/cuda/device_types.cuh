// Device-side helpers the CUDA backend's kernel files share: the block
// shape, the one switch that turns a runtime DType into a template argument
// (STYLE: dispatch in one place), float conversions of the three dtypes,
// warp reductions, and what the forward's and the backward's kernels both do
// per slot: build_round's slot and pointers (round_slot, set_slot_pointers),
// and the masked rows of the softmax and of P (SlotView, for_slot_rows,
// slot_logit_at); and per chunk, the row a finalize writes (acc_row) and
// the rows a merge folds (for_owned_acc_rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/tile_plan.h"
#include "plsh/params.h"

namespace plsh::cuda {

inline constexpr int kThreads = 256;  // 8 warps: one query row per warp at a time
inline constexpr int kWarps = kThreads / 32;

template <typename F>
auto dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF16:
      return f(__half{});
    case DType::kBF16:
      return f(__nv_bfloat16{});
    case DType::kF32:
      break;
  }
  return f(float{});
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A finalize kernel's row (grid: rows_per_lane / kWarps by the chunk's
// lanes, one warp per row): query row i of lane g = lane0 + blockIdx.y
// (batch b = g / heads, head h = g % heads) and its row idx in the chunk's
// accumulators; false past the chunk's rows or past Nq.
struct AccRow {
  int64_t i, b, h, idx;
};
__device__ __forceinline__ bool acc_row(const Accumulators& a, int64_t q_len, int64_t heads, int64_t lane0, AccRow* r) {
  const int64_t local = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (local >= a.rows_per_lane) return false;
  const int64_t i = a.row0 + local;
  if (i >= q_len) return false;
  const int64_t acc_lane = blockIdx.y;
  const int64_t g = lane0 + acc_lane;
  *r = AccRow{i, g / heads, g % heads, acc_lane * a.rows_per_lane + local};
  return true;
}

// A merge kernel's rows (one block of kThreads per slot, one warp per
// row): on_row(part_row, idx) for each row of the slot's tile that the tile
// owns, part_row its row in the round's per-slot outputs (slot * T + r) and
// idx its row in the chunk's accumulators.
template <typename OnRow>
__device__ __forceinline__ void for_owned_acc_rows(const TileDesc* desc, const LanePass* lanes, const SpanShape& shape,
                                                   const Accumulators& a, OnRow&& on_row) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = desc[slot];
  const int64_t acc_lane = lanes[d.lane].acc_lane;
  const int64_t T = shape.tile_rows;
  for (int64_t r = threadIdx.x / 32; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    if (i >= d.own_begin && i < d.own_end) on_row(slot * T + r, acc_lane * a.rows_per_lane + (i - a.row0));
  }
}

// build_round's slot: one thread per slot, -1 past the round's slots; its
// tile (describe_slot) goes to desc[slot] for the round's other kernels.
__device__ __forceinline__ int64_t round_slot(const SpanShape& shape, const Round& round, const LanePass* lanes,
                                              TileDesc* desc, TileDesc* d) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= round.slots) return -1;
  *d = describe_slot(shape, round, lanes, slot);
  desc[slot] = *d;
  return slot;
}

// The cuBLAS pointers both passes' rounds have (RoundBuffers,
// BackwardRoundBuffers): q, k and v in the tensors, S and P in the round's
// slices, at the byte offsets of `o` (slot_operands,
// backward_slot_operands).
template <typename Problem, typename Buffers, typename Operands>
__device__ __forceinline__ void set_slot_pointers(const Problem& pr, const Buffers& rb, int64_t slot,
                                                  const Operands& o) {
  rb.q_ptr[slot] = pr.q + o.q;
  rb.k_ptr[slot] = pr.k + o.k;
  rb.v_ptr[slot] = pr.v + o.v;
  rb.score_ptr[slot] = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.scores) + o.scores);
  rb.prob_ptr[slot] = rb.probs + o.probs;
}

// A per-slot kernel's slot (one block of kThreads per slot): its tile and
// pass, the tile rows T, the chunk's key columns Kc and their pitch Kp in
// scores and probabilities, this thread's lane in its warp, and under a
// same-bin pass the chunk's key bins (key_bin[x] for key row d.col0 + x),
// computed once per block in IEEE double into shared memory. Every thread
// of the block calls it (it synchronises them).
struct SlotView {
  int64_t slot;
  TileDesc d;
  LanePass l;
  int64_t T, Kc, Kp;
  int lane;
  const long long* key_bin;
};

__device__ __forceinline__ SlotView slot_view(const TileDesc* desc, const LanePass* lanes, const SpanShape& shape,
                                              int64_t k_pos0, int64_t key_cols) {
  __shared__ long long key_bin[kMaxKeyCols];
  SlotView v;
  v.slot = blockIdx.x;
  v.d = desc[v.slot];
  v.l = lanes[v.d.lane];
  v.T = shape.tile_rows;
  v.Kc = key_cols;
  v.Kp = key_pitch(key_cols);
  v.lane = threadIdx.x % 32;
  v.key_bin = key_bin;
  if (v.l.rule == SpanRule::kSameBin) {
    for (int64_t x = threadIdx.x; x < key_cols; x += kThreads)
      key_bin[x] = span_bin(k_pos0 + v.d.col0 + x, v.l.pitch, v.l.shift);
  }
  __syncthreads();
  return v;
}

// The rows r of the slot's tile, one warp per row: a row another tile owns
// gets zero probabilities (which keep the next GEMM's inputs defined and
// add nothing), then on_other(r); a row i the tile owns, on_row(r, i, base,
// row), base its first element in scores and probabilities and row its
// terms of slot_logit (slot_row).
template <typename TP, typename OnRow, typename OnOther>
__device__ __forceinline__ void for_slot_rows(const SlotView& v, const SpanShape& shape, int64_t q_pos0, TP* probs,
                                              OnRow&& on_row, OnOther&& on_other) {
  for (int64_t r = threadIdx.x / 32; r < v.T; r += kWarps) {
    const int64_t i = v.d.row0 + r;
    const int64_t base = (v.slot * v.T + r) * v.Kp;
    if (i < v.d.own_begin || i >= v.d.own_end) {
      for (int64_t x = v.lane; x < v.Kc; x += 32) probs[base + x] = from_float<TP>(0.0f);
      on_other(r);
      continue;
    }
    on_row(r, i, base, slot_row(v.l, shape, q_pos0, i));
  }
}

// slot_logit of a row (slot_row) and the chunk's key column x, from its
// score.
__device__ __forceinline__ bool slot_logit_at(const SlotView& v, bool causal, const SlotRow& row, int64_t k_pos0,
                                              int64_t x, float score, float* logit) {
  const int64_t j = v.d.col0 + x;
  return slot_logit(v.l, v.d, causal, row.pos, j, k_pos0 + j, row.nearest, row.bin,
                    v.l.rule == SpanRule::kSameBin ? v.key_bin[x] : 0, score, logit);
}

}  // namespace plsh::cuda
