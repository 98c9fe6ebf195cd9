// The CPU backend's building blocks, shared by the exact/window and lsh
// paths: a view of one (batch, head) slice of a tensor, per-thread scratch,
// the online-softmax accumulator, and `attend`, which runs a block of query
// rows against a contiguous key range with BLAS GEMMs (S = scale Q K^T,
// bias and mask, row softmax, acc += P V).
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
#include <vector>

#include <omp.h>

#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"
#include "plsh/params.h"
#include "plsh/workspace.h"

namespace plsh::cpu {

// Query rows per work item, and keys per GEMM tile. Measured with bench_cpu
// at n = 8192, one thread, in CPU seconds: 128-row tiles make exact 13%
// cheaper than 64 (the K tiles are packed half as often), while lsh is
// 9-12% dearer with 128 (more work on the causal diagonal and, for the
// per-sample reduction, on blocks that straddle a tile); 32 rows costs
// exact 30% more. 512-key tiles were no better than 256, which keeps S
// (128 KiB at 128 rows) and a K or V tile (64 KiB at D = 64) within L2.
inline constexpr int64_t kMaxRowTile = 128;
inline int64_t row_tile(Mode mode) { return uses_draws(mode) ? 64 : kMaxRowTile; }
inline constexpr int64_t kKeyTile = 256;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One (batch, head) slice of a [B, N, H, D] tensor: row r starts at element
// offset + r * row_stride; the D elements of a row are contiguous.
struct SliceView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t offset = 0;
  int64_t row_stride = 0;
  int64_t dim = 0;
};

// Rows [r0, r0 + n) as float32 with leading dimension *ld. The one place
// where the input dtype is dispatched: float32 is read in place (the GEMMs
// take the tensor's row stride as their leading dimension); float16 and
// bfloat16 are widened into buf ([n, dim]).
inline const float* rows_as_f32(const SliceView& t, int64_t r0, int64_t n, float* buf, int64_t* ld) {
  if (t.dtype == DType::kF32) {
    *ld = t.row_stride;
    return static_cast<const float*>(t.data) + t.offset + r0 * t.row_stride;
  }
  for (int64_t r = 0; r < n; ++r) load_row(t.data, t.dtype, t.offset + (r0 + r) * t.row_stride, t.dim, buf + r * t.dim);
  *ld = t.dim;
  return buf;
}

// Folds one row of logits (sr[0, len), -inf where masked) into the row's
// online-softmax state: updates *row_max and *row_sum, rescales acc_row
// [dim] when the max grows, and leaves the probabilities exp(s - max) in sr
// for the P V GEMM. Built for AVX2+FMA too and picked at load time (the
// library's default flags target baseline x86-64): exp is most of the
// non-GEMM time.
void fold_row(float* sr, int64_t len, float* acc_row, int64_t dim, float* row_max, float* row_sum);

// C[m, n] = alpha A[m, k] B[n, k]^T (row-major, leading dimensions given).
void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
              float* c, int64_t ldc);
// C[m, n] += A[m, k] B[k, n].
void gemm_ab_acc(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                 int64_t ldc);
// C[m, n] = alpha A[m, k] B[k, n].
void gemm_ab(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
             float* c, int64_t ldc);
// C[m, n] += alpha A[k, m]^T B[k, n].
void gemm_atb_acc(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc);

// sr[c] = exp(sr[c] - lse) for a row of logits (-inf: 0): the backward's
// probabilities, recomputed from the forward's lse as FlashAttention's
// backward does. The same vectorised exp as fold_row.
void probs_from_lse(float* sr, int64_t len, float lse);

// One block of one hash met by a row tile: tile rows [row_begin, row_end)
// share the block of key positions [key_begin, key_end), clamped to the keys
// (empty when the block holds no key).
struct BlockRect {
  int64_t row_begin, row_end, key_begin, key_end;
};

// Per-thread buffers, carved from the caller's workspace once per forward
// call (carve_scratch).
struct Scratch {
  // Rows below are row_tile(mode).
  float* q = nullptr;           // [rows, D] widened query rows (f16/bf16 only)
  float* k = nullptr;           // [kKeyTile, D] widened key rows (f16/bf16 only)
  float* v = nullptr;           // [kKeyTile, D] widened value rows (f16/bf16 only)
  float* s = nullptr;           // [rows, kKeyTile] logits, then probabilities
  float* acc = nullptr;         // [rows, D] sum_j w_ij exp(s_ij - m_i) v_j
  float* row_max = nullptr;     // [rows] running max logit m_i
  float* row_sum = nullptr;     // [rows] sum_j w_ij exp(s_ij - m_i)
  double* lse_shift = nullptr;  // [rows] added to the row's lse at the end
  float* out_row = nullptr;     // [D]
  // Banded lsh (BandedWeights): the blocks of every hash that meet the
  // tile's rows, and per key tile the counts c_ij as a 2D difference array.
  BlockRect* rects = nullptr;  // [s * (rows + 1)] at most
  int32_t* counts = nullptr;   // [rows + 1, kKeyTile + 1]
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
// online softmax. add_bias(S, jt, len) adds the additive bias (log weight)
// to S ([rows, len], leading dimension len) for keys [jt, jt + len) and sets
// disallowed entries to -inf. Returns the GEMM FLOPs done.
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

// The exact and window log weight (SPEC sections 2 and 4) as an additive
// bias on S ([rows, len] logits for keys [jt, jt + len)): -slope * (|d| -
// nearest[r]) where the key is allowed, -inf outside the window and, under
// causality, after the query. Taking each row's logits relative to a
// distance nearest[r] that no allowed key undercuts keeps them small when a
// query sits far from every key; the caller puts -slope * nearest[r] back
// into lse in double. The forward (exact_tile) and the backward share it.
struct AlibiBias {
  const AttentionParams& p;
  int64_t width;      // the head's window W_h, or kNoWindow
  double slope;       // m_h
  int64_t pos_first;  // position of query row 0
  int64_t rows;
  const int64_t* nearest;  // [rows]
  void operator()(float* s, int64_t jt, int64_t len) const;
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
  double flops = 0;
  float* s = scratch.s;
  for (int64_t jt = j0; jt < j1; jt += kKeyTile) {
    const int64_t len = std::min(kKeyTile, j1 - jt);
    int64_t ldk = 0;
    const float* kt = rows_as_f32(k, jt, len, scratch.k, &ldk);
    gemm_abt(rows, len, dim, scale, q, ldq, kt, ldk, s, len);
    add_bias(s, jt, len);

    for (int64_t r = 0; r < rows; ++r)
      fold_row(s + r * len, len, state.acc + r * dim, dim, state.row_max + r, state.row_sum + r);

    int64_t ldv = 0;
    const float* vt = rows_as_f32(v, jt, len, scratch.v, &ldv);
    gemm_ab_acc(rows, dim, len, s, len, vt, ldv, state.acc, dim);
    flops += 4.0 * static_cast<double>(rows) * static_cast<double>(len) * static_cast<double>(dim);
  }
  return flops;
}

}  // namespace plsh::cpu
