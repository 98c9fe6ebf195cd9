#include "plsh/exact_rows.h"

#include <algorithm>
#include <cmath>

#include "exp64.h"
#include "plsh/numeric.h"
#include "vector_clones.h"

// The loops per (row, key) run in vector lanes (PLSH_VECTOR_CLONES): the
// scores, the probe's two exps (a scalar libm call each before) and the
// weighted sums. The exp's clamps are if-converted only without
// trapping-math (we never unmask FP exceptions), as in cpu/tiles.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "align-loops=64")
#endif

namespace plsh {

namespace {

// Keys scored together against one row: a key's sum over d is one chain of
// dependent multiply-adds, so the lanes need enough keys to keep the FMA
// units busy while each waits on its last add. 32 keys are eight AVX2
// accumulators: a window probe at n = 32768 spent 4.6% of the run's CPU in
// the scores with 8 keys, 0.8% with 32 (perf, 2026-12-06).
constexpr int64_t kScoreKeys = 32;

// Where key jj's element d lies in a tile's keys: panels of kScoreKeys keys,
// [jj / kScoreKeys][d][jj % kScoreKeys], so that a row's products with a
// panel's keys read one contiguous run, and the panel being written while
// the keys are converted (16 KiB at D = 64) stays in L1.
static_assert(kExactRowsKeyTile % kScoreKeys == 0, "a tile is whole panels");
inline size_t panel_index(int64_t jj, int64_t d, int64_t D) {
  return static_cast<size_t>((jj / kScoreKeys) * D * kScoreKeys + d * kScoreKeys + jj % kScoreKeys);
}

// scores[jj * R + r] = q_r . k_jj for rows [r0, r1) and the tile's tn keys
// (kt in panels, panel_index). One row against a panel's keys in vector
// lanes, each key's sum over d in index order from 0.
PLSH_VECTOR_CLONES void score_tile(const double* qr, int64_t R, int64_t r0, int64_t r1, int64_t D, const double* kt,
                                   int64_t tn, double* scores) {
  for (int64_t r = r0; r < r1; ++r) {
    const double* q = qr + r * D;
    int64_t jj = 0;
    for (; jj + kScoreKeys <= tn; jj += kScoreKeys) {
      double acc[kScoreKeys] = {};
      for (int64_t d = 0; d < D; ++d) {
        const double* kd = kt + panel_index(jj, d, D);
        for (int64_t i = 0; i < kScoreKeys; ++i) acc[i] += q[d] * kd[i];
      }
      for (int64_t i = 0; i < kScoreKeys; ++i) scores[(jj + i) * R + r] = acc[i];
    }
    for (; jj < tn; ++jj) {
      double acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += q[d] * kt[panel_index(jj, d, D)];
      scores[jj * R + r] = acc;
    }
  }
}

// Asks for row j's k and v (D elements of `bytes` each) of kv head hk to
// be brought into L2. One head's rows are H * D elements apart, a new page
// every row or two, so the hardware prefetcher does not follow them (the
// tile's conversion waited on memory for most of the probe's time at n =
// 32768). Always inlined: as a call, GCC finds the function free of side
// effects (a prefetch has none it counts) and deletes the call.
__attribute__((always_inline)) inline void prefetch_key_row(const AttentionParams& p, int64_t b, int64_t hk, int64_t j,
                                                            int64_t D, size_t bytes) {
  const char* k = static_cast<const char*>(p.k) +
                  static_cast<size_t>(b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride) * bytes;
  const char* v = static_cast<const char*>(p.v) +
                  static_cast<size_t>(b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride) * bytes;
  const size_t row = static_cast<size_t>(D) * bytes;
  for (size_t at = 0; at < row; at += 64) {
    __builtin_prefetch(k + at, 0, 2);
    __builtin_prefetch(v + at, 0, 2);
  }
}

}  // namespace

static_assert(kExactRowsKeyScoreAlign == kScoreKeys, "a score starts at a panel");

KeyTileBuffer::KeyTileBuffer(int64_t head_dim)
    : dim_(head_dim),
      buf_(static_cast<size_t>(head_dim)),
      kt_(static_cast<size_t>(head_dim * kExactRowsKeyTile)),
      vt_(static_cast<size_t>(kExactRowsKeyTile * head_dim)) {}

// Keys are converted to double once for every row scored against them and
// stored transposed in panels (panel_index), so that one row's products
// with kScoreKeys keys run in vector lanes across the keys while each key's
// sum still runs over d in index order from 0 (no reassociation). A probe
// group is often one to a few rows, so lanes across rows would stay empty;
// a row's sum over d alone is a chain of dependent adds.
void KeyTileBuffer::convert_row(const AttentionParams& p, int64_t b, int64_t hk, int64_t j) {
  const int64_t D = dim_;
  const int64_t jj = j - j0_;
  double* vj = &vt_[static_cast<size_t>(jj * D)];
  const float* k =
      row_as_f32(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride, D, buf_.data());
  for (int64_t d = 0; d < D; ++d) kt_[panel_index(jj, d, D)] = k[d];
  const float* v =
      row_as_f32(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride, D, buf_.data());
  for (int64_t d = 0; d < D; ++d) vj[d] = v[d];
}

void KeyTileBuffer::load(const AttentionParams& p, int64_t b, int64_t hk, int64_t j0, int64_t count, int64_t next_hk,
                         int64_t next_j0) {
  const size_t bytes = dtype_bytes(p.dtype);
  j0_ = j0;
  count_ = count;
  for (int64_t jj = 0; jj < count; ++jj) {
    if (next_hk >= 0 && next_j0 + jj < p.kv_len) prefetch_key_row(p, b, next_hk, next_j0 + jj, dim_, bytes);
    convert_row(p, b, hk, j0 + jj);
  }
}

void KeyTileBuffer::score(const double* q, int64_t R, int64_t r0, int64_t r1, int64_t first, int64_t n,
                          double* scores) const {
  const int64_t offset = first - j0_;  // a multiple of kScoreKeys: whole panels
  score_tile(q, R, r0, r1, dim_, kt_.data() + offset * dim_, n, scores);
}

PLSH_VECTOR_CLONES void exp_shifted(const double* x, int64_t n, double shift, double* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = exp_nonpositive64(x[j] - shift);
}

namespace {

// acc += sum_j w[j] v[j] and *sum += sum_j w[j] over the allowed keys, in
// key order. kAccBlock elements of acc at a time stay in registers over all
// the keys: with the keys outer and d inner, every key loaded and stored
// all of acc again, and each store waited for by the next key's load (a
// fifth to a third of the probe's samples at n = 32768, perf, 2026-12-07). Each
// acc[d] still adds its keys in key order.
constexpr int64_t kAccBlock = 16;

PLSH_VECTOR_CLONES void accumulate_weighted(const double* logits, const double* w, int64_t n, const double* values,
                                            int64_t dim, double* acc, double* sum) {
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  double total = *sum;
  for (int64_t j = 0; j < n; ++j)
    if (logits[j] != kMinusInf) total += w[j];
  *sum = total;
  int64_t d0 = 0;
  for (; d0 + kAccBlock <= dim; d0 += kAccBlock) {
    double a[kAccBlock];
    for (int64_t i = 0; i < kAccBlock; ++i) a[i] = acc[d0 + i];
    for (int64_t j = 0; j < n; ++j) {
      if (logits[j] == kMinusInf) continue;
      const double weight = w[j];
      const double* v = values + j * dim + d0;
      for (int64_t i = 0; i < kAccBlock; ++i) a[i] += weight * v[i];
    }
    for (int64_t i = 0; i < kAccBlock; ++i) acc[d0 + i] = a[i];
  }
  for (int64_t j = 0; j < n && d0 < dim; ++j) {  // the last dim % kAccBlock elements
    if (logits[j] == kMinusInf) continue;
    const double weight = w[j];
    const double* v = values + j * dim;
    for (int64_t d = d0; d < dim; ++d) acc[d] += weight * v[d];
  }
}

}  // namespace

void SoftmaxRow64::fold(const double* logits, int64_t n, const double* values, double* weights) {
  double tile_max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, logits[j]);
  const double new_max = std::max(max, tile_max);
  if (new_max == -std::numeric_limits<double>::infinity()) return;  // nothing allowed yet
  const double rescale = std::exp(max - new_max);
  const int64_t dim = static_cast<int64_t>(acc.size());
  for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] *= rescale;
  sum *= rescale;
  max = new_max;
  exp_shifted(logits, n, new_max, weights);
  accumulate_weighted(logits, weights, n, values, dim, acc.data(), &sum);
}

}  // namespace plsh
