// The fused kernels' tile logic (fused_forward.h, fused_backward.h), in
// __host__ __device__ functions that the device runs as they are and the
// host emulation (fused_host.h) runs on the CPU, so that every rule below is
// tested without a GPU against the float64 reference:
//   - the geometry: query tiles of kFusedRows rows, key tiles of kFusedKeys
//     keys, both counted from row 0 of their tensor;
//   - which key tiles a query tile reaches (fused_key_tiles): for lsh the
//     union of its rows' blocks over the s hashes (the CPU banded
//     algorithm's key range), for ALiBi |d| < W_h or every key, under
//     causality the part before the last row; and the inverse, which query
//     tiles reach a key tile (the backward's loop);
//   - the rows' terms: the nearest-key anchor that keeps ALiBi logits small
//     far from the keys, the causal limit, the window;
//   - lsh blocks: every row's block of every hash as a key-row interval,
//     computed from the bins bin(p) = floor((p - u) / delta) in IEEE
//     double, and the per-(warp rows, key tile) classification of each hash
//     as all-same-bin, none, or mixed, so that only mixed hashes cost work
//     per element;
//   - the online softmax in base 2 (rescale, merge, finalize with lse in
//     double).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/tile_plan.h"  // PLSH_HD, span_bin, min64/max64

namespace plsh::cuda {

// 64-row query tiles (4 warps of 16 rows) and 64-key tiles: FlashAttention-2's
// shape for sm80 at d = 128 is 128 x 64; 64 rows keep the band of an lsh tile
// (rows + the widest block) narrow and Q's fragments in registers. To be
// measured against 128 on the GPU (bench/gpu/run.sh).
inline constexpr int kFusedWarps = 4;
inline constexpr int kFusedThreads = kFusedWarps * 32;
inline constexpr int kFusedRows = kFusedWarps * 16;
inline constexpr int kFusedKeys = 64;
// Hashes per head the fused lsh kernels hold on chip (each row's block per
// hash, 8 bytes, in shared memory); more samples take the per-sample path.
inline constexpr int kFusedMaxHashes = 64;

// How a head weighs a (query, key) pair.
enum class FusedRule : int32_t {
  kAlibi = 0,   // logit - slope (|d| - nearest), keys with |d| < window
  kHashes = 1,  // weight c_ij / s, c_ij = hashes that put i and j in one bin
};

// One query head as the fused kernels read it (a device table, [H]).
struct FusedHead {
  FusedRule rule = FusedRule::kAlibi;
  int32_t samples = 0;  // kHashes: s
  float slope2 = 0;     // slope * log2(e): kAlibi's bias on the logits in base 2; kHashes: the probe's L*
  int32_t pad = 0;
  int64_t window = 0;     // kAlibi: keys with |d| < window; kNoWindow: every key
  int64_t hash0 = 0;      // kHashes: the head's first pitch/shift pair in FusedArgs::hashes
  double lse_offset = 0;  // kHashes: -log(s) (M~ = c / s)
  double slope = 0;       // m_h in double, for lse (-slope * nearest; nearest is 0 under kHashes)
};

// What the forward and backward kernels read, by value (FlashAttention's
// Flash_fwd_params). Element strides; pointers are device memory on the
// GPU and host memory in the emulation.
struct FusedArgs {
  const void* q = nullptr;  // [B, Nq, H, D]
  const void* k = nullptr;  // [B, Nk, Hkv, D]
  const void* v = nullptr;  // [B, Nk, Hkv, D]
  void* out = nullptr;      // [B, Nq, H, D] out_dtype
  float* lse = nullptr;     // [B, Nq, H] or null
  int64_t q_bs = 0, q_rs = 0, q_hs = 0;
  int64_t k_bs = 0, k_rs = 0, k_hs = 0;
  int64_t v_bs = 0, v_rs = 0, v_hs = 0;
  int64_t o_bs = 0, o_rs = 0, o_hs = 0;
  int64_t lse_bs = 0, lse_rs = 0;
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, head_group = 1;
  int64_t qk_offset = 0;  // q_pos0 - k_pos0: query row i sits at key row i + qk_offset
  int64_t q_pos0 = 0;     // absolute position of query row 0 (the bins read it)
  int64_t k_pos0 = 0;
  int32_t causal = 0;
  int32_t out_dtype = 0;                  // DType of out
  float scale2 = 0;                       // softmax scale * log2(e)
  int32_t max_samples = 0;                // the most hashes of any head (shared-memory sizing)
  const FusedHead* head_table = nullptr;  // [H]
  const double* hashes = nullptr;         // [sum of samples][2]: pitch, shift
  // The backward's statistics pass (fused_forward.h with stats_only): m +
  // log2 l per (b, h, row), [B * H][Nq], instead of out and lse.
  float* row_lse2 = nullptr;
  int32_t stats_only = 0;
  int32_t pad = 0;
  // The backward (fused_backward.h): dout [B, Nq, H, D] in the dtype of q
  // (its strides q's), the per-row terms, dq's float32 accumulator [B, Nq,
  // H, D], dk and dv [B, Nk, Hkv, D] dense in grad_dtype, and every (head,
  // query tile)'s key tiles [H][tiles][2] (fused_spans).
  const void* dout = nullptr;
  int64_t do_bs = 0, do_rs = 0, do_hs = 0;
  const float* row_d = nullptr;
  const float* row_lse2_in = nullptr;
  float* dq_acc = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t kv_heads = 0;
  int32_t grad_dtype = 0;
  int32_t pad2 = 0;
  const int32_t* spans = nullptr;
  // (warp, key tile) products run, for the FLOP count; null: not counted.
  unsigned long long* tiles_done = nullptr;
};

PLSH_HD inline int64_t fused_tiles(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

// Key rows a query row may see, as the fused kernels evaluate them with
// 32-bit arithmetic on key rows j in [0, Nk): R = i + qk_offset is the
// row's position as a key row; anchor = R clamped into the keys, so that
// |anchor - j| = |d| - nearest (the nearest key's distance left out of the
// logit, as nearest_key_distance); limit = the last key row allowed by
// causality (-1: none; Nk - 1 without causality); window_left = W - nearest
// (the window as seen from the anchor), clamped to int32.
struct FusedRow {
  int32_t anchor = 0;
  int32_t limit = -1;
  int32_t window_left = 0;
  int32_t valid = 0;    // row < Nq
  int64_t nearest = 0;  // distance to the nearest key (lse adds -slope * nearest back)
};

PLSH_HD inline FusedRow fused_row(const FusedArgs& a, const FusedHead& h, int64_t i) {
  FusedRow r;
  r.valid = i < a.q_len;
  const int64_t R = i + a.qk_offset;
  const int64_t last = a.kv_len - 1;
  r.anchor = static_cast<int32_t>(R < 0 ? 0 : R > last ? last : R);
  r.nearest = R < 0 ? -R : R > last ? R - last : 0;
  r.limit = static_cast<int32_t>(!a.causal ? last : R < 0 ? -1 : R > last ? last : R);
  int64_t w = h.rule == FusedRule::kAlibi ? h.window - r.nearest : INT32_MAX;
  if (h.rule == FusedRule::kAlibi && h.window == kNoWindow) w = INT32_MAX;
  r.window_left = static_cast<int32_t>(w < 0 ? 0 : w > INT32_MAX ? INT32_MAX : w);
  if (!r.valid) r.limit = -1;  // a row past Nq allows nothing
  return r;
}

// ---- lsh blocks --------------------------------------------------------------

// The pitch and shift of hash k of head h.
struct FusedHash {
  double pitch, shift;
};
PLSH_HD inline FusedHash fused_hash(const FusedArgs& a, const FusedHead& h, int k) {
  const double* p = a.hashes + 2 * (h.hash0 + k);
  return {p[0], p[1]};
}

// First position of the block holding pos, and the first position past it,
// exact with respect to span_bin (plsh::block_begin / block_end, for the
// device too: the estimate from the formula, then steps that agree with the
// bins whatever the rounding), searched no further than [lo, hi]: callers
// clamp to the keys anyway, and a pitch far beyond every position (a slope
// of 1e-20) has blocks reaching past anything an int64 or a loop could walk.
// Finite pitches only (the kHashes rule).
PLSH_HD inline int64_t clamp_estimate(double e, int64_t lo, int64_t hi) {
  if (!(e > static_cast<double>(lo))) return lo;
  if (!(e < static_cast<double>(hi))) return hi;
  return static_cast<int64_t>(e);
}
PLSH_HD inline int64_t fused_block_begin(int64_t pos, const FusedHash& h, int64_t lo) {
  if (h.pitch < 0.5) return pos;
  const int64_t b = span_bin(pos, h.pitch, h.shift);
  int64_t s = clamp_estimate(floor(static_cast<double>(b) * h.pitch + h.shift), lo, pos);
  while (s < pos && span_bin(s, h.pitch, h.shift) < b) ++s;
  while (s > lo && span_bin(s - 1, h.pitch, h.shift) == b) --s;
  return s;
}
PLSH_HD inline int64_t fused_block_end(int64_t pos, const FusedHash& h, int64_t hi) {
  if (h.pitch < 0.5) return pos + 1;
  const int64_t b = span_bin(pos, h.pitch, h.shift);
  int64_t e = clamp_estimate(ceil(static_cast<double>(b + 1) * h.pitch + h.shift), pos + 1, hi);
  while (e - 1 > pos && span_bin(e - 1, h.pitch, h.shift) > b) --e;
  while (e < hi && span_bin(e, h.pitch, h.shift) <= b) ++e;
  return e;
}
// The search limits for a query position: the keys, and the position itself.
PLSH_HD inline int64_t fused_search_lo(const FusedArgs& a, int64_t pos) { return min64(pos, a.k_pos0); }
PLSH_HD inline int64_t fused_search_hi(const FusedArgs& a, int64_t pos) { return max64(pos + 1, a.k_pos0 + a.kv_len); }

// A row's block under one hash as key rows [begin, end), clamped to [0, Nk].
struct FusedBlock {
  int32_t begin, end;
};
PLSH_HD inline int32_t fused_key_row(const FusedArgs& a, int64_t pos) {
  const int64_t j = pos - a.k_pos0;
  return static_cast<int32_t>(j < 0 ? 0 : j > a.kv_len ? a.kv_len : j);
}

// Every row of a query tile gets its block per hash from one bin each
// (fused_block_rows): rows with one bin share a block, whose edges inside
// the tile are the rows where the bin changes, and whose outer edges at the
// tile's first and last row are fused_block_begin / fused_block_end. bins
// [rows] holds the tile's bins of this hash (sorted: bins grow with the
// position); first_begin and last_end are the blocks' edges (positions) of
// the tile's first and last valid rows. Returns row r's block.
PLSH_HD inline FusedBlock fused_block_of_row(const FusedArgs& a, const int64_t* bins, int rows, int r, int64_t row0_pos,
                                             int64_t first_begin, int64_t last_end) {
  const int64_t b = bins[r];
  // First and last rows with this bin (binary searches on the sorted bins).
  int lo = 0, hi = r;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (bins[mid] < b)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int first = lo;
  lo = r, hi = rows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (bins[mid] > b)
      hi = mid - 1;
    else
      lo = mid;
  }
  const int last = lo;
  const int64_t begin = first == 0 ? first_begin : row0_pos + first;
  const int64_t end = last == rows - 1 ? last_end : row0_pos + last + 1;
  return {fused_key_row(a, begin), fused_key_row(a, end)};
}

// How one hash meets a warp's rows [r0, r1] (their blocks, sorted) and a
// key tile's valid columns [c0, c1]: every pair in one bin, none, or mixed.
enum class HashMeet : int32_t { kNone = 0, kAll = 1, kMixed = 2 };
PLSH_HD inline HashMeet fused_hash_meet(FusedBlock first_row, FusedBlock last_row, int32_t c0, int32_t c1) {
  if (last_row.end <= c0 || first_row.begin > c1) return HashMeet::kNone;
  if (first_row.begin == last_row.begin && first_row.begin <= c0 && c1 < first_row.end) return HashMeet::kAll;
  return HashMeet::kMixed;
}

// ---- key ranges ---------------------------------------------------------------

// Key rows [begin, end) any row of query tile t may see (for lsh from the
// blocks of its first and last valid rows, blocks given), clamped to the keys.
struct KeyRange {
  int64_t begin, end;
};
PLSH_HD inline int64_t fused_tile_last_row(const FusedArgs& a, int64_t t) {
  const int64_t last = (t + 1) * kFusedRows - 1;
  return last < a.q_len - 1 ? last : a.q_len - 1;
}

PLSH_HD inline KeyRange fused_alibi_keys(const FusedArgs& a, const FusedHead& h, int64_t t) {
  const int64_t R0 = t * kFusedRows + a.qk_offset, R1 = fused_tile_last_row(a, t) + a.qk_offset;
  const bool bounded = h.window != kNoWindow && h.window < (int64_t{1} << 53);
  int64_t lo = bounded ? R0 - (h.window - 1) : 0;
  int64_t hi = a.causal ? R1 + 1 : bounded ? R1 + h.window : a.kv_len;
  lo = max64(lo, 0);
  hi = min64(hi, a.kv_len);
  if (hi < lo) hi = lo;
  return {lo, hi};
}

// lsh: the union of the tile rows' blocks, from the first valid row's
// earliest block start and the last valid row's latest block end over the
// hashes (positions), then causality and the keys.
PLSH_HD inline KeyRange fused_hash_keys(const FusedArgs& a, int64_t t, int64_t min_begin, int64_t max_end) {
  int64_t lo = min_begin - a.k_pos0, hi = max_end - a.k_pos0;
  if (a.causal) hi = min64(hi, fused_tile_last_row(a, t) + a.qk_offset + 1);
  lo = max64(lo, 0);
  hi = min64(hi, a.kv_len);
  if (hi < lo) hi = lo;
  return {lo, hi};
}

// The same range computed from the hashes directly (2 block edges per hash):
// what the backward's search over query tiles and the host planner use.
PLSH_HD inline KeyRange fused_key_range(const FusedArgs& a, const FusedHead& h, int64_t t) {
  if (h.rule == FusedRule::kAlibi) return fused_alibi_keys(a, h, t);
  const int64_t p0 = a.q_pos0 + t * kFusedRows, p1 = a.q_pos0 + fused_tile_last_row(a, t);
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (int k = 0; k < h.samples; ++k) {
    const FusedHash hh = fused_hash(a, h, k);
    lo = min64(lo, fused_block_begin(p0, hh, fused_search_lo(a, p0)));
    hi = max64(hi, fused_block_end(p1, hh, fused_search_hi(a, p1)));
  }
  return fused_hash_keys(a, t, lo, hi);
}

// Key tiles [begin, end) of a key range. An empty range keeps its place
// ({e, e}, e = its start rounded up to a tile) so that both ends stay
// monotone in the query tile, which fused_query_tiles relies on.
struct TileSpan {
  int64_t begin, end;
};
PLSH_HD inline TileSpan fused_key_tiles(const KeyRange& r) {
  if (r.end <= r.begin) {
    const int64_t e = (r.begin + kFusedKeys - 1) / kFusedKeys;
    return {e, e};
  }
  return {r.begin / kFusedKeys, (r.end + kFusedKeys - 1) / kFusedKeys};
}

// The query tiles whose key tiles include key tile kt: a contiguous range,
// since both ends of a tile's span grow with the tile (blocks, windows and
// the causal limit all move forward with the rows): from the first tile
// whose span ends after kt to the first whose span starts after it. spans:
// the head's [tiles][2] (fused_key_tiles of every tile, fused_spans).
PLSH_HD inline TileSpan fused_query_tiles(const int32_t* spans, int64_t tiles, int64_t kt) {
  int64_t lo = 0, hi = tiles;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (spans[2 * mid + 1] > kt)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int64_t first = lo;
  hi = tiles;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (spans[2 * mid] > kt)
      hi = mid;
    else
      lo = mid + 1;
  }
  return {first, lo > first ? lo : first};
}

// ---- the online softmax, base 2 -------------------------------------------------

// A row's running max m (of allowed logits in base 2) and, per thread, its
// share of the sum l; scale for the accumulators when m grows.
struct RowScale {
  float m_new;
  float alpha;  // multiplies the old l and accumulators
};
PLSH_HD inline RowScale fused_rescale(float m_old, float tile_max) {
  const float m_new = m_old > tile_max ? m_old : tile_max;
  if (m_new == -INFINITY) return {m_new, 1.0f};
  return {m_new, m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new)};
}

// p = 2^(x - m) for an allowed logit (m finite whenever one is allowed).
PLSH_HD inline float fused_prob(float x2, float m) { return exp2f(x2 - m); }

// lse in natural units of a finished row: (m + log2 l) ln 2 + offset -
// slope * nearest, in double; -inf for a row that saw no key.
PLSH_HD inline double fused_lse(float m, float l, const FusedHead& h, int64_t nearest) {
  if (!(l > 0.0f)) return -INFINITY;
  return (static_cast<double>(m) + log2(static_cast<double>(l))) * 0.6931471805599453 + h.lse_offset -
         h.slope * static_cast<double>(nearest);
}

// The backward's probabilities are 2^(x - lse2) with lse2 = lse' log2(e),
// lse' the logits' own log-sum-exp (m + log l in natural units, before the
// offset and the nearest key's bias): from the forward's lse, in double.
PLSH_HD inline float fused_lse2_from_lse(float lse, const FusedHead& h, int64_t nearest) {
  return static_cast<float>((static_cast<double>(lse) - h.lse_offset + h.slope * static_cast<double>(nearest)) *
                            1.4426950408889634);
}

}  // namespace plsh::cuda
