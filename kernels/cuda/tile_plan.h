// How the CUDA backend cuts one attention call into uniform cuBLAS batches:
// pure host code (and a few inline functions that the device runs as is),
// so that every index computed on the GPU is unit-tested on the CPU.
//
// One "lane" is a (batch item, query head). Each lane runs one or more
// "passes": exact and window one, lsh one per hash sample (SPEC section 3,
// the per-sample reduction). In a pass, the lane's query rows are cut into
// tiles of T consecutive rows (the last tile is shifted back so that it stays
// inside the tensor and owns only its new rows); a tile may only see the key
// rows in its span (every key an owned row can be allowed by the pass's rule),
// and the span is cut into chunks of Kc key columns. One (tile, chunk) is one
// GEMM of a batch: T x Kc scores, masked by the rule inside the tile (so
// several small lsh blocks share a tile and are kept apart by the mask), then
// T x D partial outputs, merged into per-row accumulators by log-sum-exp.
// Pointers of a GEMM always stay inside the tensors: the tile's first row and
// the chunk's first column are clamped, and the valid ranges say which of the
// rows and columns count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/status.h"

#if defined(__CUDACC__)
#define PLSH_HD __host__ __device__
#else
#define PLSH_HD
#endif

namespace plsh::cuda {

// 64-row tiles: the GEMM's n; small enough that the last, shifted tile wastes
// little and that lsh blocks of 1-3 rows still share one tile.
inline constexpr int64_t kTileRows = 64;
// Widest key chunk of one GEMM (a power of two); wider spans take more chunks.
inline constexpr int64_t kMaxKeyCols = 512;
// Narrowest key chunk (keeps the GEMMs' m a multiple of the tensor-core tile).
inline constexpr int64_t kMinKeyCols = 32;

// Launch limits. One slot is one thread block of masked_softmax and merge
// (grid.x, at most 2^31 - 1); the lanes of a chunk are finalize's grid.y (at
// most 65535).
inline constexpr int64_t kMaxSlots = int64_t{1} << 22;
inline constexpr int64_t kMaxLanesPerChunk = 65535;
// Matrices per cublasGemmBatchedEx call. Its batchCount is an int, and no
// limit is documented for it; but cuBLASLt's documentation warns that many
// kernels do not support batches above 65535 (the grid's z dimension),
// CUTLASS's batched GEMM fails at 65536 (NVIDIA/cutlass#1369) and cuBLAS
// once returned CUBLAS_STATUS_NOT_SUPPORTED for cublasGemmBatchedEx at
// 65536 (tensorflow#23473 era reports). A round with more slots is issued
// as several calls (gemm_batches): nothing rides on an undocumented limit.
inline constexpr int64_t kMaxGemmBatch = 65535;
static_assert(kMaxSlots <= (int64_t{1} << 31) - 1, "slots are grid.x");
static_assert(kMaxLanesPerChunk <= 65535, "lanes are grid.y");

// Every GEMM operand (a pointer in the batched arrays, and each leading
// dimension in bytes) is a multiple of this: cuBLAS's kernels load 16-byte
// vectors, and a batched call cannot check pointers that live on the device,
// so an unaligned one risks a misaligned access, which loses the context.
inline constexpr int64_t kOperandAlign = 16;
// n elements of elem_bytes, rounded up to whole kOperandAlign bytes.
PLSH_HD inline int64_t aligned_count(int64_t n, int64_t elem_bytes) {
  const int64_t per = kOperandAlign / elem_bytes;  // elem_bytes is 2 or 4
  return (n + per - 1) / per * per;
}
// Row pitch (elements) of the scores (float) and probabilities (2 or 4
// bytes) of a key chunk of key_cols columns: 8 elements make 16 bytes of
// either (kMinKeyCols and up are multiples already; Nk < 32 is not).
PLSH_HD inline int64_t key_pitch(int64_t key_cols) { return (key_cols + 7) / 8 * 8; }
// Row pitch (floats) of a partial output of D columns.
PLSH_HD inline int64_t partial_pitch(int64_t head_dim) { return aligned_count(head_dim, 4); }

// Where q, k and v sit for the GEMMs: element strides from each tensor's
// base. Host tensors are staged with each head's D elements padded to
// whole 16 bytes (operand_layout); device tensors are read where they are,
// and supports() refuses them unless they are aligned already.
struct OperandLayout {
  int64_t q_bs = 0, q_rs = 0, q_hs = 0;
  int64_t k_bs = 0, k_rs = 0, k_hs = 0;
  int64_t v_bs = 0, v_rs = 0, v_hs = 0;
  int64_t elem_bytes = 0;
  int64_t head_group = 1;
  int64_t head_dim = 0;
};

// Which keys a pass allows for a query, besides causality.
enum class SpanRule : int32_t {
  kAll = 0,      // every key, weight exp(-slope |d|) (exact; lsh with slope 0)
  kWindow = 1,   // |d| < window, weight exp(-slope |d|)
  kSameBin = 2,  // bin(pos_q) == bin(pos_k) for the pass's hash, weight 1 (lsh)
};

// The shape every pass of one call shares.
struct SpanShape {
  int64_t q_len = 0;      // Nq
  int64_t kv_len = 0;     // Nk
  int64_t qk_offset = 0;  // q_pos0 - k_pos0: query row i sits at key row i + qk_offset
  bool causal = false;
  int64_t tile_rows = 0;  // T = min(kTileRows, Nq)
};

// One lane in one pass, as the device reads it.
struct LanePass {
  int32_t acc_lane = 0;  // lane index within the chunk's accumulators
  int32_t batch = 0;     // b
  int32_t head = 0;      // query head h
  SpanRule rule = SpanRule::kAll;
  int64_t reach = -1;  // max |pos_q - pos_k| the rule allows; -1: unbounded
  double pitch = 0;    // kSameBin: delta
  double shift = 0;    // kSameBin: u
  float slope = 0;     // kAll, kWindow: ALiBi slope m_h
  int32_t pad = 0;
  int64_t window = 0;      // kWindow: keys with |d| < window
  int64_t tile_begin = 0;  // this round's tiles of the lane: [tile_begin, tile_end)
  int64_t tile_end = 0;
  int64_t slot_begin = 0;  // batch slot of tile_begin
};

// One uniform batch: every (lane, tile) of it computes chunk `chunk` of its
// span with `key_cols` columns. Lanes are [lane_begin, lane_end) of the
// chunk's LanePass table, slots [0, slots).
struct Round {
  int64_t pass = 0;
  int64_t key_cols = 0;
  int64_t chunk = 0;
  int64_t lane_begin = 0, lane_end = 0;
  int64_t slots = 0;
};

// What the device derives for one slot of a round.
struct TileDesc {
  int32_t lane = 0;  // index into the LanePass table
  int32_t pad = 0;
  int64_t row0 = 0;       // first query row the GEMM reads (T rows)
  int64_t own_begin = 0;  // query rows this tile writes
  int64_t own_end = 0;
  int64_t col0 = 0;         // first key row the GEMM reads (Kc rows)
  int64_t valid_begin = 0;  // key rows of this chunk that count
  int64_t valid_end = 0;
};

struct TileRows {
  int64_t row0, own_begin, own_end;
};
struct KeySpan {
  int64_t begin, end;  // key rows, clamped to [0, Nk); empty when begin == end
};
struct KeyChunk {
  int64_t col0, valid_begin, valid_end;
};

PLSH_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
PLSH_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
PLSH_HD inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

PLSH_HD inline int64_t tile_count(const SpanShape& s) { return ceil_div(s.q_len, s.tile_rows); }

PLSH_HD inline TileRows tile_rows_of(const SpanShape& s, int64_t t) {
  const int64_t own_begin = t * s.tile_rows;
  const int64_t own_end = min64(own_begin + s.tile_rows, s.q_len);
  return {min64(own_begin, s.q_len - s.tile_rows), own_begin, own_end};
}

// Keys any owned row of tile t may see under a rule of the given reach.
PLSH_HD inline KeySpan tile_key_span(const SpanShape& s, int64_t reach, int64_t t) {
  const TileRows r = tile_rows_of(s, t);
  int64_t lo, hi;
  if (reach < 0) {
    lo = 0;
    hi = s.causal ? s.qk_offset + r.own_end : s.kv_len;
  } else {
    lo = s.qk_offset + r.own_begin - reach;
    hi = s.qk_offset + r.own_end + (s.causal ? 0 : reach);  // exclusive: last row + reach + 1
  }
  lo = max64(lo, 0);
  hi = min64(hi, s.kv_len);
  if (hi < lo) hi = lo;
  return {lo, hi};
}

// Chunk c of a span, Kc = key_cols <= Nk columns read from col0.
PLSH_HD inline KeyChunk key_chunk(const KeySpan& span, int64_t key_cols, int64_t kv_len, int64_t c) {
  const int64_t start = span.begin + c * key_cols;
  const int64_t valid_begin = min64(start, span.end);
  const int64_t valid_end = min64(start + key_cols, span.end);
  return {min64(start, kv_len - key_cols), valid_begin, valid_end};
}

// Widest span any tile of a pass can have.
PLSH_HD inline int64_t max_span_width(const SpanShape& s, int64_t reach) {
  if (reach < 0) return s.kv_len;
  return min64(s.kv_len, s.tile_rows + reach * (s.causal ? 1 : 2));
}

// bin(p) = floor((p - u) / delta) in IEEE double (SPEC section 5): correctly
// rounded subtraction and division on both sides, so host and device agree
// bit for bit. Pitches below kSingletonPitch label each position by itself,
// as plsh::bin_of does (plsh/draws.h): the same one-position blocks, without
// a quotient too large for int64.
PLSH_HD inline int64_t span_bin(int64_t pos, double pitch, double shift) {
  if (pitch < 0.5) return pos;  // plsh::kSingletonPitch
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(floor(__ddiv_rn(__dsub_rn(static_cast<double>(pos), shift), pitch)));
#else
  return static_cast<int64_t>(std::floor((static_cast<double>(pos) - shift) / pitch));
#endif
}

// Whether a pass lets query position pq see key position pk (causality
// included). The device evaluates the bins once per tile instead; the tests
// use this.
PLSH_HD inline bool pair_allowed(const LanePass& l, bool causal, int64_t pq, int64_t pk) {
  if (causal && pk > pq) return false;
  const int64_t d = pq > pk ? pq - pk : pk - pq;
  switch (l.rule) {
    case SpanRule::kAll:
      return true;
    case SpanRule::kWindow:
      return d < l.window;
    case SpanRule::kSameBin:
      return span_bin(pq, l.pitch, l.shift) == span_bin(pk, l.pitch, l.shift);
  }
  return false;
}

// Distance from query row i to the nearest key position, [k_pos0, k_pos0 +
// Nk): no key the row may see is closer. The logits leave out this much of
// the bias (slot_logit) and row_lse adds it back in double, as the CPU
// backend does (cpu_exact.cpp): a query 1e6 positions from every key would
// otherwise carry a float bias of -slope * 1e6, whose rounding (0.03 at
// 5e5) swamps the scores. Window and lsh queries sit among the keys
// (validate_options), so theirs is 0.
PLSH_HD inline int64_t nearest_key_distance(const SpanShape& s, int64_t i) {
  const int64_t r = i + s.qk_offset;  // the query's position as a key row
  return r < 0 ? -r : r >= s.kv_len ? r - (s.kv_len - 1) : 0;
}

// The logit of key column j (key row) for query row i of a slot, relative to
// the bias of the row's nearest key (nearest_key_distance), or false when
// the pass does not allow the pair there: outside the chunk's valid keys,
// after the query under causality, outside the window, or in another bin
// (bins given, evaluated once per row and column by the caller).
PLSH_HD inline bool slot_logit(const LanePass& l, const TileDesc& d, bool causal, int64_t pos_i, int64_t j,
                               int64_t pos_j, int64_t nearest, int64_t q_bin, int64_t k_bin, float score,
                               float* logit) {
  if (j < d.valid_begin || j >= d.valid_end) return false;
  if (causal && pos_j > pos_i) return false;
  const int64_t dist = pos_i > pos_j ? pos_i - pos_j : pos_j - pos_i;
  if (l.rule == SpanRule::kWindow && dist >= l.window) return false;
  if (l.rule == SpanRule::kSameBin && k_bin != q_bin) return false;
  // dist - nearest is at most Nk - 1: exact in float below 2^24 keys.
  *logit = score - l.slope * static_cast<float>(dist - nearest);
  return true;
}

// Query row i's terms of slot_logit, evaluated once per row: its position,
// its nearest key's distance, and its bin under a same-bin pass (else 0).
struct SlotRow {
  int64_t pos = 0, nearest = 0, bin = 0;
};
PLSH_HD inline SlotRow slot_row(const LanePass& l, const SpanShape& s, int64_t q_pos0, int64_t i) {
  SlotRow r;
  r.pos = q_pos0 + i;
  r.nearest = nearest_key_distance(s, i);
  r.bin = l.rule == SpanRule::kSameBin ? span_bin(r.pos, l.pitch, l.shift) : 0;
  return r;
}

// What a head's lse adds to m + log(l) at finalize, in double.
struct HeadLse {
  double offset = 0;  // -log(samples) where the passes are hashes (M~ averages them), else 0
  double slope = 0;   // m_h where the logits carry the ALiBi bias, else 0: -slope * nearest goes back in
};

// lse of a row: m + log(l) + offset - slope * nearest, in double, as the
// CPU backend's write_rows; -inf for a row that saw no key (l == 0).
PLSH_HD inline double row_lse(float m, float l, const HeadLse& h, int64_t nearest) {
  if (!(l > 0.0f)) return -INFINITY;
  return static_cast<double>(m) + log(static_cast<double>(l)) + h.offset - h.slope * static_cast<double>(nearest);
}

// Online log-sum-exp merge of a partial row (max m_part, sum l_part > 0)
// into a running one (l_acc == 0: empty): acc <- acc * c_acc + part * c_part.
struct MergeCoefficients {
  float m_new, c_acc, c_part;
};
PLSH_HD inline MergeCoefficients merge_coefficients(float m_acc, float l_acc, float m_part) {
  if (l_acc == 0.0f) return {m_part, 0.0f, 1.0f};
  const float m_new = m_acc > m_part ? m_acc : m_part;
  return {m_new, expf(m_acc - m_new), expf(m_part - m_new)};
}

}  // namespace plsh::cuda
