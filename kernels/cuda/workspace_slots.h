// The host side of the CUDA backend's planning: how far a pass reaches, the
// workspace that bounds a request's device memory and how it is carved into
// slices, the staging of host tensors, the cuBLAS batches and the lanes'
// passes. Host code only; the tile arithmetic that the device also runs is
// tile_plan.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/status.h"
#include "tile_plan.h"

namespace plsh::cuda {

// Reach of an lsh hash: two integer positions in one bin are at most
// ceil(delta) - 1 apart; two more cover a quotient rounded across a bin edge
// (the host tests fail at ceil(delta) - 2). Pitches too large to matter are
// unbounded (the mask is exact either way).
int64_t lsh_reach(double pitch);
// Reach of a window |d| < w; kNoWindow or beyond 2^53: unbounded.
int64_t window_reach(int64_t window);

// Key columns for a pass whose spans are at most `width` wide: the next power
// of two in [kMinKeyCols, kMaxKeyCols], never more than Nk.
int64_t key_cols_for(int64_t width, int64_t kv_len);

// Sizes that bound the device workspace, whatever N is.
struct WorkspaceShape {
  int64_t lanes = 0;  // B * H
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t head_dim = 0;
  int64_t elem_bytes = 0;  // of q, k, v (and of the probabilities fed to the second GEMM)
};

struct WorkspaceSlots {
  int64_t tile_rows = 0;        // T
  int64_t key_cols = 0;         // widest Kc
  int64_t bytes_per_slot = 0;   // every slice of the work buffer for one slot (work_slices)
  int64_t lanes_per_chunk = 0;  // lanes whose accumulators live at once
  int64_t tiles_per_chunk = 0;  // query tiles per lane at once
  int64_t slots = 0;            // lanes_per_chunk * tiles_per_chunk: the largest batch
  int64_t bytes = 0;            // slots * bytes_per_slot, before the slices' alignment padding
};

// Every slice of device memory starts at a multiple of this (cuBLAS wants
// 16 bytes; 256 keeps each slice on its own cache lines).
inline constexpr int64_t kSliceAlign = 256;
inline int64_t align_slice(int64_t bytes) { return (bytes + kSliceAlign - 1) / kSliceAlign * kSliceAlign; }

// Slices of one allocation, in order, each aligned. With base == nullptr it
// only measures: the sizing and the carving of a buffer are then the same
// code, called twice.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const int64_t at = offset_;
    offset_ += align_slice(count * static_cast<int64_t>(sizeof(T)));
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + at);
  }
  int64_t bytes() const { return offset_; }

 private:
  char* base_;
  int64_t offset_ = 0;
};

// The slices a forward's and a backward's round both have (RoundBuffers,
// BackwardRoundBuffers): S and P ([slot][T][Kp], float32 and the input
// dtype), the cuBLAS pointer arrays of q, k, v, S and P that
// set_slot_pointers fills, one entry a slot, and the slots' tiles. The
// caller carves its own slices after them.
template <typename Buffers>
void carve_round_slices(Carver& c, int64_t slots, int64_t tile_rows, int64_t key_pitch, int64_t elem_bytes,
                        Buffers* r) {
  r->scores = c.take<float>(slots * tile_rows * key_pitch);
  r->probs = c.take<char>(slots * tile_rows * key_pitch * elem_bytes);
  r->q_ptr = c.take<const void*>(slots);
  r->k_ptr = c.take<const void*>(slots);
  r->v_ptr = c.take<const void*>(slots);
  r->score_ptr = c.take<float*>(slots);
  r->prob_ptr = c.take<void*>(slots);
  r->desc = c.take<TileDesc>(slots);
}

// One round's slices of the work buffer (device pointers on the GPU).
struct RoundBuffers {
  TileDesc* desc = nullptr;
  const void** q_ptr = nullptr;  // cuBLAS pointer arrays, one entry per slot
  const void** k_ptr = nullptr;
  const void** v_ptr = nullptr;
  float** score_ptr = nullptr;
  void** prob_ptr = nullptr;
  float** partial_ptr = nullptr;
  float* scores = nullptr;   // [slot][T][Kc] float32
  char* probs = nullptr;     // [slot][T][Kc] input dtype
  float* partial = nullptr;  // [slot][T][D]
  float* row_max = nullptr;  // [slot][T]
  float* row_sum = nullptr;  // [slot][T]
};

// The running per-row accumulators of a chunk of lanes and tiles.
struct Accumulators {
  float* acc = nullptr;       // [lane][row][D]
  float* acc_max = nullptr;   // [lane][row]
  float* acc_sum = nullptr;   // [lane][row]
  int64_t row0 = 0;           // first query row of the chunk
  int64_t rows_per_lane = 0;  // tiles_per_chunk * T
};

// The work buffer for `slots` slots: the round's slices (scores and
// probabilities key_pitch(key_cols) wide, partial outputs
// partial_pitch(head_dim)) and the accumulators. Returns its bytes,
// alignment included.
int64_t carve_work(int64_t slots, int64_t tile_rows, int64_t key_cols, int64_t head_dim, int64_t elem_bytes, char* base,
                   RoundBuffers* round, Accumulators* acc);

// The GEMMs' view of q, k and v: for host tensors the staging layout
// (dense, each head's D elements padded to aligned_count(D)); for device
// tensors the caller's strides.
OperandLayout operand_layout(const AttentionParams& p);

// Why these params cannot give the GEMMs 16-byte aligned operands, or OK:
// device tensors whose strides (or, once bound, base pointers) are not
// multiples of 16 bytes (bf16 with D = 20: a 40-byte head stride), host
// tensors that are not dense (the staging copy pads dense rows only), a
// leading dimension beyond cuBLAS's int. UNIMPLEMENTED, naming the tensor.
Status check_operands(const AttentionParams& p);

// Device copies of host q, k and v in operand_layout (each head's row
// padded to 16 bytes): the forward's and the backward's staging.
struct StagedQkv {
  char* q = nullptr;
  char* k = nullptr;
  char* v = nullptr;
};

// Device copies of host tensors: q, k and v (StagedQkv), out and lse
// spanning their strided extents.
struct StagingBuffers {
  StagedQkv qkv;
  char* out = nullptr;
  float* lse = nullptr;
  // Bytes of each tensor's extent (what is copied in or out).
  int64_t q_bytes = 0, k_bytes = 0, v_bytes = 0, out_bytes = 0, lse_bytes = 0;
};
int64_t carve_staging(const AttentionParams& p, char* base, StagingBuffers* out);

// The per-head lse terms, the lane table of the largest chunk and cuBLAS's
// workspace.
struct TableBuffers {
  HeadLse* head_lse = nullptr;  // [H]
  LanePass* lanes = nullptr;    // [entries]
  int64_t entries = 0;
  void* cublas_workspace = nullptr;  // given to cublasSetWorkspace
  int64_t cublas_workspace_bytes = 0;
};
int64_t carve_tables(int64_t heads, int64_t entries, int64_t cublas_workspace_bytes, char* base, TableBuffers* out);

// cuBLAS's workspace, from the plan rather than cuBLAS's own pool, so that
// forward holds exactly what the plan charged: the 32 MiB that the cuBLAS
// documentation (cublasSetWorkspace) recommends for Hopper where that is at
// most 1/8 of the request's device memory, else the 16 KiB it names as
// enough to avoid CUBLAS_STATUS_ALLOC_FAILED.
inline constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
inline constexpr int64_t kCublasMinWorkspaceBytes = int64_t{16} << 10;
int64_t cublas_workspace_for(int64_t device_cap_bytes);

// The device memory one request may plan for, out of a pool of
// pool_budget bytes: the caller's share (PlanLimits::device_bytes; the
// server passes its device budget / workers) capped at the pool, or, when
// the caller gives none (0), half the pool: one request must not take the
// whole pool, or every concurrent one fails its reservation; a request
// that does not fit in half may still take the whole pool (CudaBackend::plan
// retries), since it could only ever run alone.
int64_t request_device_cap(int64_t pool_budget, int64_t limit_bytes);

// The cublasGemmBatchedEx calls of a round of `slots` matrices: [first,
// first + count) with count <= kMaxGemmBatch.
struct GemmBatch {
  int64_t first = 0, count = 0;
};
std::vector<GemmBatch> gemm_batches(int64_t slots);

// One cuBLAS GEMM as cublasGemmBatchedEx takes it: column-major, op(A) is
// m x k, op(B) k x n, C m x n.
struct GemmArgs {
  bool trans_a = false;  // CUBLAS_OP_T
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
};

// The two GEMMs of a forward round; row-major views of the results (the
// backward's five: backward_plan.h).
struct ForwardGemms {
  GemmArgs scores;   // S [T][Kp] = K^T Q (alpha scale)   A = K, B = Q
  GemmArgs partial;  // O [T][Dp] = P V   (alpha 1)       A = V, B = P
};
ForwardGemms forward_gemms(const OperandLayout& o, int64_t tile_rows, int64_t key_cols);

// The largest chunk of (lanes x tiles) whose work buffer (carve_work) fits
// `budget_bytes`; RESOURCE_EXHAUSTED when not even one tile fits.
StatusOr<WorkspaceSlots> size_workspace(const WorkspaceShape& shape, int64_t budget_bytes);
// The same for any work buffer whose bytes for a number of slots
// work_bytes gives (the backward's, backward_plan.h).
StatusOr<WorkspaceSlots> size_workspace_for(const WorkspaceShape& shape, int64_t budget_bytes,
                                            const std::function<int64_t(int64_t slots)>& work_bytes);

// The device bytes a request's cap leaves to its work buffer once staging
// and tables are carved; RESOURCE_EXHAUSTED, naming `what` (the forward's
// or the backward's workspace), when it leaves none.
StatusOr<int64_t> work_budget(const char* what, int64_t device_cap_bytes, int64_t staging_bytes, int64_t table_bytes);

// One lane's passes, as the planner needs them: per pass the rule and its
// parameters (acc_lane, batch and head filled, tiles and slots not).
struct LaneSetup {
  std::vector<LanePass> passes;
};

SpanShape span_shape(const AttentionParams& p);
// The workspace shape of a request: B * H lanes, its lengths, head_dim and
// the bytes of its dtype.
WorkspaceShape workspace_shape(const AttentionParams& p);

// Per query head (batch 0, acc_lane 0): exact one pass, weight
// exp(-slope |d|); window one pass, also |d| < W_h (exact where W_h is
// unbounded); lsh one pass per hash of the plan's draws (SPEC section 5),
// and for a slope of 0 one unbiased pass over every key (every hash then
// puts every position in one bin: M~ = 1).
std::vector<LaneSetup> head_passes(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws);

// The lane-table entries one chunk of `lanes` lanes can need at most: one
// per lane, pass and key chunk.
int64_t lane_table_entries(const SpanShape& shape, const std::vector<LaneSetup>& heads, int64_t lanes_per_chunk);

// The backward's device layout (backward_plan.h), when the plan was made
// with PlanLimits::backward: what plan.backward_workspace.device_bytes
// counts is exactly what backward allocates.
struct CudaBackwardLayout {
  WorkspaceSlots work;        // slots of carve_backward_work
  int64_t staging_bytes = 0;  // carve_backward_staging
  int64_t table_bytes = 0;    // carve_tables, as the forward's
  int64_t work_bytes = 0;     // carve_backward_work for work.slots
  int64_t fused_bytes = 0;    // the fused backward: carve_fused_backward (fused_plan.h); the rest 0
  int64_t device_bytes() const { return fused_bytes > 0 ? fused_bytes : staging_bytes + table_bytes + work_bytes; }
};

// The fused kernels' part of a layout (fused_plan.h).
struct FusedLayout;

// The whole device layout of one request, made once by the CUDA backend's
// plan() and read by its forward(): what plan.forward_workspace.device_bytes
// counts is exactly what forward allocates.
struct CudaLayout : BackendLayout {
  std::vector<LaneSetup> heads;  // head_passes of the plan's draws
  WorkspaceSlots work;
  int64_t staging_bytes = 0;           // carve_staging (0 for device tensors)
  int64_t table_entries = 0;           // lane_table_entries of the largest chunk of lanes
  int64_t cublas_workspace_bytes = 0;  // cublas_workspace_for the cap
  int64_t table_bytes = 0;             // carve_tables
  int64_t work_bytes = 0;              // carve_work for work.slots
  bool has_backward = false;           // planned with PlanLimits::backward
  CudaBackwardLayout backward;         // then: the backward's layout
  // The fused kernels run this request (fused_plan.h): their tables and
  // carve_fused_forward's bytes, and none of the cuBLAS pipeline's above.
  std::shared_ptr<const FusedLayout> fused;
  int64_t fused_bytes = 0;
  int64_t device_bytes() const { return fused != nullptr ? fused_bytes : staging_bytes + table_bytes + work_bytes; }
};

// OK when forward, carving for the bound params p, stays inside every
// buffer this layout sized; INTERNAL naming the buffer otherwise (a plan
// made for other params, e.g. device tensors bound as host ones): forward
// never writes past what the plan charged.
Status check_layout_fits(const CudaLayout& layout, const AttentionParams& p);

// Plans the layout against a device-memory cap: staging and tables first,
// the work buffer gets the rest (at most what all lanes and tiles at once
// would use). RESOURCE_EXHAUSTED when even one tile does not fit.
StatusOr<CudaLayout> plan_layout(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws,
                                 int64_t device_cap_bytes);

// The lanes [lane0, lane1) of a chunk (lane g = batch item g / H, head
// g % H), each a copy of its head's passes pointed at its accumulator slot
// and batch item.
std::vector<LaneSetup> chunk_lanes(const std::vector<LaneSetup>& heads, int64_t num_heads, int64_t lane0,
                                   int64_t lane1);

// One chunk of a request's work: lanes [lane0, lane1) (their passes in
// `setups`, chunk_lanes) by tiles [tile0, tile1); `index` counts the chunks
// from 0 in the order they run.
struct Chunk {
  int64_t lane0, lane1, tile0, tile1;
  int64_t index;
  const std::vector<LaneSetup>& setups;
};

// How many chunks `lanes` lanes of `tiles` tiles make under `work`.
inline int64_t chunk_count(const WorkspaceSlots& work, int64_t lanes, int64_t tiles) {
  return ceil_div(lanes, work.lanes_per_chunk) * ceil_div(tiles, work.tiles_per_chunk);
}

// Calls f(chunk) for every chunk, lane ranges of lanes_per_chunk outside and
// tile ranges of tiles_per_chunk inside, as the forward and the backward
// (and their host emulations) run them; stops at the first error f returns.
template <typename F>
Status for_each_chunk(const WorkspaceSlots& work, const std::vector<LaneSetup>& heads, int64_t num_heads, int64_t lanes,
                      int64_t tiles, F&& f) {
  int64_t index = 0;
  for (int64_t lane0 = 0; lane0 < lanes; lane0 += work.lanes_per_chunk) {
    const int64_t lane1 = std::min(lanes, lane0 + work.lanes_per_chunk);
    const std::vector<LaneSetup> setups = chunk_lanes(heads, num_heads, lane0, lane1);
    for (int64_t t0 = 0; t0 < tiles; t0 += work.tiles_per_chunk)
      RETURN_IF_ERROR(f(Chunk{lane0, lane1, t0, std::min(tiles, t0 + work.tiles_per_chunk), index++, setups}));
  }
  return Status::Ok();
}

// Head h's terms of row_lse: -log(samples) where the passes are hashes,
// and the head's slope (p.slopes, double) where they carry the bias.
HeadLse head_lse(const AttentionParams& p, const LaneSetup& head);

// The rounds of one chunk: lanes [0, lanes.size()) (acc_lane = index) and
// query tiles [tile_begin, tile_end). Appends to `table` the LanePass entries
// each round reads, grouped so that lanes of one round share key_cols.
std::vector<Round> plan_rounds(const SpanShape& shape, const std::vector<LaneSetup>& lanes, int64_t tile_begin,
                               int64_t tile_end, std::vector<LanePass>* table);

// The slot of a round: which LanePass (binary search on slot_begin) and tile.
PLSH_HD inline int64_t find_lane(const LanePass* lanes, int64_t lane_begin, int64_t lane_end, int64_t slot) {
  int64_t lo = lane_begin, hi = lane_end - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (lanes[mid].slot_begin <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

PLSH_HD inline TileDesc describe_slot(const SpanShape& s, const Round& round, const LanePass* lanes, int64_t slot) {
  const int64_t li = find_lane(lanes, round.lane_begin, round.lane_end, slot);
  const LanePass& l = lanes[li];
  const int64_t t = l.tile_begin + (slot - l.slot_begin);
  const TileRows r = tile_rows_of(s, t);
  const KeyChunk c = key_chunk(tile_key_span(s, l.reach, t), round.key_cols, s.kv_len, round.chunk);
  return TileDesc{static_cast<int32_t>(li), 0, r.row0, r.own_begin, r.own_end, c.col0, c.valid_begin, c.valid_end};
}

// Byte offsets of one slot's GEMM operands: q, k, v from their tensors'
// bases, scores, probabilities and partial output from their round slices.
struct SlotOperands {
  int64_t q, k, v;
  int64_t scores, probs, partial;
};
PLSH_HD inline SlotOperands slot_operands(const OperandLayout& o, const LanePass& l, const TileDesc& d, int64_t slot,
                                          int64_t tile_rows, int64_t key_cols) {
  const int64_t hk = l.head / o.head_group;
  const int64_t kp = key_pitch(key_cols);
  SlotOperands s;
  s.q = (l.batch * o.q_bs + d.row0 * o.q_rs + l.head * o.q_hs) * o.elem_bytes;
  s.k = (l.batch * o.k_bs + d.col0 * o.k_rs + hk * o.k_hs) * o.elem_bytes;
  s.v = (l.batch * o.v_bs + d.col0 * o.v_rs + hk * o.v_hs) * o.elem_bytes;
  s.scores = slot * tile_rows * kp * 4;
  s.probs = slot * tile_rows * kp * o.elem_bytes;
  s.partial = slot * tile_rows * partial_pitch(o.head_dim) * 4;
  return s;
}

}  // namespace plsh::cuda
