// The CPU backend's building blocks, shared by the exact/window and lsh
// paths and the backward: a view of one (batch, head) slice of a tensor,
// per-thread scratch, the online-softmax accumulator, and `attend`, which
// runs a block of query rows against a contiguous key range on the
// microkernels (S = scale Q K^T, bias and mask, softmax, acc += P V).
//
// Internal to kernels/cpu; not a public header.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu/microkernels.h"
#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"
#include "plsh/params.h"
#include "plsh/workspace.h"

namespace plsh::cpu {

// Query rows per work item, and keys per tile. Measured with bench_cpu at
// n = 8192, two threads, with the microkernels (issue 23; the machine's
// speed wanders by 5-10% between runs, so each pair was run back to back):
// 128-key tiles gave exact 148-150 GFLOP/s, 256 137-149 (the V tile and a
// P^T strip stay in L1 at 128), 64 140-142 (twice the softmax rescales);
// 96- and 192-row tiles matched 128 within the noise. lsh keeps 64 rows:
// 128 is 20% slower in banded wall time (a wider band), 32 no faster.
inline constexpr int64_t kMaxRowTile = 128;
inline int64_t row_tile(Mode mode) { return uses_draws(mode) ? 64 : kMaxRowTile; }
inline constexpr int64_t kKeyTile = 128;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The V tile's row stride in scratch: the head dim plus one cache line,
// so that the P V product's walk down a 16-column strip of the tile meets
// every L1 set. Read in place, V's rows are H * D floats apart (2 KiB at
// H = 8, D = 64), which puts a strip's 128 rows in 2 of L1's 64 sets: the
// product ran at 85-95 GFLOP/s against 109 from a copy (one core).
inline int64_t value_stride(int64_t dim) { return dim + 16; }

// One (batch, head) slice of a [B, N, H, D] tensor: row r starts at element
// offset + r * row_stride; the D elements of a row are contiguous.
struct SliceView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t offset = 0;
  int64_t row_stride = 0;
  int64_t dim = 0;
};

// Rows [r0, r0 + n) as float32 into buf, leading dimension ld >= dim: a
// copy for float32, a widening for float16 and bfloat16 (load_row).
inline void rows_into_f32(const SliceView& t, int64_t r0, int64_t n, float* buf, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) load_row(t.data, t.dtype, t.offset + (r0 + r) * t.row_stride, t.dim, buf + r * ld);
}

// Rows [r0, r0 + n) as float32 with leading dimension *ld: float32 is read
// in place (the GEMMs take the tensor's row stride as their leading
// dimension); float16 and bfloat16 are widened into buf ([n, dim]).
inline const float* rows_as_f32(const SliceView& t, int64_t r0, int64_t n, float* buf, int64_t* ld) {
  if (t.dtype == DType::kF32) {
    *ld = t.row_stride;
    return static_cast<const float*>(t.data) + t.offset + r0 * t.row_stride;
  }
  rows_into_f32(t, r0, n, buf, t.dim);
  *ld = t.dim;
  return buf;
}

// lsh's log weight log(c_ij / s) on key-major logits st ([len, rows]; row
// c is the key at position key_pos + c) from key-major differences of c_ij
// down the keys, steps ([skip + len, width], width >= rows; step row skip +
// c belongs to st row c): prefix sums make them c_ij in place, then
// log_count[c_ij] is added (log_count[0] = -inf masks the pairs no hash put
// in one bin) and, under causality, keys after the query are set to -inf
// (pos_first: the position of query row 0). The banded forward and the
// backward share it.
void add_counted_log_weight(float* st, int64_t ld, int32_t* steps, int64_t width, int64_t rows, int64_t skip,
                            int64_t len, int64_t key_pos, int64_t pos_first, bool causal, const float* log_count);

// One block of one hash met by a row tile: tile rows [row_begin, row_end)
// share the block of key positions [key_begin, key_end), clamped to the keys
// (empty when the block holds no key).
struct BlockRect {
  int64_t row_begin, row_end, key_begin, key_end;
};

// The key-major logits' row stride for `rows` query rows: padded to the
// query panel, plus one panel so that the stride is not a power of two
// (at 128 rows, 512 bytes put the 256 rows of a key tile in 8 of L1's 64
// sets; the P V product reads down them).
constexpr int64_t logits_stride(int64_t rows) { return padded_rows(rows) + kQueryPanel; }

// Per-thread buffers, carved from the caller's workspace once per forward
// call (carve_scratch).
struct Scratch {
  // Rows below are row_tile(mode).
  float* q = nullptr;           // [rows, D] widened query rows (f16/bf16 only)
  float* qt = nullptr;          // [rows, D] the query rows, scaled and packed (pack_queries)
  float* k = nullptr;           // [kKeyTile, D] widened key rows (f16/bf16 only)
  float* v = nullptr;           // [kKeyTile, value_stride(D)] the V tile, copied (widened for f16/bf16)
  float* s = nullptr;           // [kKeyTile, logits_stride(rows)] logits, then probabilities, key-major
  float* acc = nullptr;         // [rows, D] sum_j w_ij exp(s_ij - m_i) v_j
  float* row_max = nullptr;     // [rows] running max logit m_i
  float* row_sum = nullptr;     // [rows] sum_j w_ij exp(s_ij - m_i)
  double* lse_shift = nullptr;  // [rows] added to the row's lse at the end
  float* out_row = nullptr;     // [D]
  // Banded lsh (BandedWeights): the blocks of every hash that meet the
  // tile's rows, and per key tile the counts c_ij (key-major, built as a
  // difference array down the keys).
  BlockRect* rects = nullptr;  // [s * (rows + 1)] at most
  int32_t* counts = nullptr;   // [kKeyTile + 1, rows]
  float* log_count = nullptr;  // [s + 1]: log(c / s), -inf for c = 0
};

// Carves one Scratch for these params (and the lsh algorithm in use) from
// c: the one layout that scratch_bytes counts and forward slices.
void carve_scratch(const AttentionParams& p, bool banded, Carver& c, Scratch* s);
// Bytes of one Scratch (carve_scratch counting).
int64_t scratch_bytes(const AttentionParams& p, bool banded);

// The online-softmax state of `rows` consecutive query rows of a tile.
struct RowState {
  float* acc = nullptr;      // [rows, D]
  float* row_max = nullptr;  // [rows]
  float* row_sum = nullptr;  // [rows]

  RowState offset(int64_t r, int64_t dim) const { return {acc + r * dim, row_max + r, row_sum + r}; }
};

inline RowState fresh_state(Scratch& s, int64_t rows, int64_t dim) {
  std::fill_n(s.acc, rows * dim, 0.0f);
  std::fill_n(s.row_max, rows, kNegInf);
  std::fill_n(s.row_sum, rows, 0.0f);
  std::fill_n(s.lse_shift, rows, 0.0);
  return {s.acc, s.row_max, s.row_sum};
}

// Runs `rows` query rows (q, leading dimension ldq, already float32) against
// keys [j0, j1) in tiles of kKeyTile, folding each tile into `state` with the
// online softmax. The logits are key-major (microkernels.h): add_bias(st,
// ld, jt, len) adds the additive bias (log weight) to st ([len, rows],
// st[c * ld + r] the logit of query row r and key jt + c) and sets
// disallowed entries to -inf; an AlibiBias runs as the product's epilogue
// instead, which also finds the softmax's max. Returns the GEMM FLOPs done.
template <typename AddBias>
double attend(const float* q, int64_t ldq, int64_t rows, const SliceView& k, const SliceView& v, int64_t j0, int64_t j1,
              float scale, AddBias&& add_bias, Scratch& scratch, RowState state);

// Writes rows [i0, i0 + rows) of head h, batch b: out = acc / sum and
// lse = max + log(sum) + lse_shift; a row that saw no allowed key (sum 0)
// gets out = 0 and lse = -inf rather than NaN.
void write_rows(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows, const RowState& state,
                const double* lse_shift, float* out_row);

// Views of q (head h), and k, v (the kv head h reads) for batch item b.
SliceView q_slice(const AttentionParams& p, int64_t b, int64_t h);
SliceView k_slice(const AttentionParams& p, int64_t b, int64_t h);
SliceView v_slice(const AttentionParams& p, int64_t b, int64_t h);

// Clamps a (possibly infinite-block) position range to the key rows:
// positions [pos_lo, pos_hi) -> key rows [*j0, *j1), maybe empty.
inline void key_rows_of(const AttentionParams& p, int64_t pos_lo, int64_t pos_hi, int64_t* j0, int64_t* j1) {
  const int64_t first = p.k_pos0, last = p.k_pos0 + p.kv_len;  // positions, last exclusive
  *j0 = std::clamp(pos_lo, first, last) - first;
  *j1 = std::clamp(pos_hi, first, last) - first;
}

// Keys in one AlibiBias epilogue: the forward's key tile, the backward's.
inline constexpr int64_t kMaxBiasKeys = 256;
static_assert(kKeyTile <= kMaxBiasKeys);

// One key tile's BiasEpilogue with the arrays it points into.
struct AlibiEpilogue {
  float left[padded_rows(kMaxRowTile)], right[padded_rows(kMaxRowTile)];
  float lo[kMaxBiasKeys], hi[kMaxBiasKeys];
  BiasEpilogue bias;
};

// The exact and window log weight (SPEC sections 2 and 4) as an additive
// bias on S (key-major logits of `rows` query rows and keys [jt, jt +
// len)): -slope * (|d| - nearest[r]) where the key is allowed, -inf outside
// the window and, under causality, after the query. Taking each row's
// logits relative to a distance nearest[r] that no allowed key undercuts
// keeps them small when a query sits far from every key; the caller puts
// -slope * nearest[r] back into lse in double. The forward (attend) and the
// backward share it as qk_bias_tile's epilogue.
struct AlibiBias {
  const AttentionParams& p;
  int64_t width;           // the head's window W_h, or kNoWindow
  double slope;            // m_h
  int64_t pos_first;       // position of query row 0
  int64_t rows;            // at most kMaxRowTile
  const int64_t* nearest;  // [rows]
  // Fills e for keys [jt, jt + len), len <= kMaxBiasKeys.
  void epilogue(int64_t jt, int64_t len, AlibiEpilogue* e) const;
};

// Work items of one forward call: a row tile of one (batch, head).
struct TileJob {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
};

// Per-tile kernels (return the GEMM FLOPs done). They read p and write
// p.out / p.lse for their rows only, so tiles run concurrently.
double exact_tile(const AttentionParams& p, const TileJob& job, Scratch& scratch);
double lsh_banded_tile(const AttentionParams& p, const TileJob& job, const std::vector<Draw>& draws, Scratch& scratch);
// Checks ctx between samples: a tile is s times the work of an exact
// tile's block, and s may be large. On a stop it returns early, leaving its
// rows unwritten; the caller then returns ctx's status.
double lsh_per_sample_tile(const AttentionParams& p, const TileJob& job, const std::vector<Draw>& draws,
                           const ExecContext& ctx, Scratch& scratch);

// Calls ctx.progress with done / total at most once per percent, so that a
// slow callback cannot serialise the tiles; `reported` holds the last
// percent reported.
void report_progress(const ExecContext& ctx, int64_t done, int64_t total, std::atomic<int>* reported);

// Runs jobs 0 .. total - 1 on `threads` OpenMP threads, each thread taking
// the next job when it finishes one (the forward's and the backward's tiles
// differ in cost): job(thread, n, &why) returns the FLOPs it did (an
// integer count) and sets why to stop the run; the other threads skip what
// is left. ctx.progress hears of finished jobs at most once per percent.
// Returns the first stop's status, or the FLOPs of every job. Allocates
// nothing (a template, not a std::function).
template <typename Job>
StatusOr<double> run_jobs(int threads, int64_t total, const ExecContext& ctx, Job&& job) {
  std::atomic<bool> stopped{false};
  Status stop_status;
  std::mutex stop_mutex;
  std::atomic<int64_t> done{0};
  std::atomic<int> reported_percent{-1};
  // FLOPs are whole numbers: summed as integers, in any order, exactly.
  int64_t flops = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : flops)
  for (int64_t n = 0; n < total; ++n) {
    if (stopped.load(std::memory_order_relaxed)) continue;
    Status why;
    flops += static_cast<int64_t>(job(omp_get_thread_num(), n, &why));
    if (!why.ok()) {
      std::lock_guard<std::mutex> lock(stop_mutex);
      if (!stopped.load()) stop_status = why;
      stopped.store(true);
      continue;
    }
    report_progress(ctx, ++done, total, &reported_percent);
  }
  if (stopped.load()) return stop_status;
  return static_cast<double>(flops);
}

// Which lsh algorithm kAuto picks, by SPEC section 3's cost models (see the
// definition for the constants).
LshAlgorithm choose_lsh_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws);

template <typename AddBias>
double attend(const float* q, int64_t ldq, int64_t rows, const SliceView& k, const SliceView& v, int64_t j0, int64_t j1,
              float scale, AddBias&& add_bias, Scratch& scratch, RowState state) {
  const int64_t dim = k.dim;
  const int64_t ldst = logits_stride(rows);
  double flops = 0;
  float* st = scratch.s;
  pack_queries(q, ldq, rows, dim, scale, scratch.qt);
  for (int64_t jt = j0; jt < j1; jt += kKeyTile) {
    const int64_t len = std::min(kKeyTile, j1 - jt);
    int64_t ldk = 0;
    const float* kt = rows_as_f32(k, jt, len, scratch.k, &ldk);
    // V's rows into L2 while Q K^T and the softmax run, then copied.
    const int64_t vb = static_cast<int64_t>(dtype_bytes(v.dtype));
    prefetch_rows(static_cast<const char*>(v.data) + (v.offset + jt * v.row_stride) * vb, v.row_stride * vb, len,
                  dim * vb);
    if constexpr (std::is_same_v<std::decay_t<AddBias>, AlibiBias>) {
      AlibiEpilogue bias;
      add_bias.epilogue(jt, len, &bias);
      float tile_max[padded_rows(kMaxRowTile)];
      std::fill_n(tile_max, padded_rows(rows), kNegInf);
      qk_bias_tile(kt, ldk, len, dim, scratch.qt, rows, st, ldst, bias.bias, tile_max);
      fold_tile(st, ldst, len, rows, state.acc, dim, state.row_max, state.row_sum, tile_max);
    } else {
      qk_tile(kt, ldk, len, dim, scratch.qt, rows, st, ldst);
      add_bias(st, ldst, jt, len);
      fold_tile(st, ldst, len, rows, state.acc, dim, state.row_max, state.row_sum, nullptr);
    }
    rows_into_f32(v, jt, len, scratch.v, value_stride(dim));
    pv_tile(st, ldst, len, scratch.v, value_stride(dim), rows, dim, state.acc, dim);
    flops += 4.0 * static_cast<double>(rows) * static_cast<double>(len) * static_cast<double>(dim);
  }
  return flops;
}

}  // namespace plsh::cpu
