#include "plsh/exact_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

// Four doubles in one vector (GCC's and Clang's vector extension; two SSE2
// halves in the baseline clone). The kernels below name their accumulators
// as such vectors: written as arrays of doubles, GCC kept the score's
// eight accumulators on the stack, every multiply-add a load and a store
// (the score loop unrolled by two), and split the weighted sums' sixteen
// into three vectors, a half and two scalars, four dependent chains a key.
typedef double Double4 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 4;

// Four doubles from or to any double's address. Through memcpy, which
// compilers turn into one unaligned vector move: a vector typedef with a
// lowered alignment is not enough for Clang, which kept the type's own
// (16-byte SSE moves on 8-byte-aligned rows faulted in the fuzz build). By
// reference, so that no vector crosses a call (the baseline clone's ABI
// has no 32-byte vector registers).
__attribute__((always_inline)) inline void load4(Double4& x, const double* p) { std::memcpy(&x, p, sizeof x); }
__attribute__((always_inline)) inline void store4(double* p, const Double4& x) { std::memcpy(p, &x, sizeof x); }

// Running sums of 32 consecutive doubles in eight named vectors (as an
// array, GCC spilled them): enough independent multiply-adds that none
// waits on its last one (four cycles each, two a cycle).
struct Sums32 {
  Double4 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};

  __attribute__((always_inline)) static Sums32 load(const double* p) {
    Sums32 s;
    load4(s.a0, p);
    load4(s.a1, p + 4);
    load4(s.a2, p + 8);
    load4(s.a3, p + 12);
    load4(s.a4, p + 16);
    load4(s.a5, p + 20);
    load4(s.a6, p + 24);
    load4(s.a7, p + 28);
    return s;
  }
  __attribute__((always_inline)) void store(double* p) const {
    store4(p, a0);
    store4(p + 4, a1);
    store4(p + 8, a2);
    store4(p + 12, a3);
    store4(p + 16, a4);
    store4(p + 20, a5);
    store4(p + 24, a6);
    store4(p + 28, a7);
  }
  // += x * p[0, 32).
  __attribute__((always_inline)) void add_scaled(double x, const double* p) {
    add_scaled4(a0, x, p);
    add_scaled4(a1, x, p + 4);
    add_scaled4(a2, x, p + 8);
    add_scaled4(a3, x, p + 12);
    add_scaled4(a4, x, p + 16);
    add_scaled4(a5, x, p + 20);
    add_scaled4(a6, x, p + 24);
    add_scaled4(a7, x, p + 28);
  }
  // a += x * p[0, 4).
  __attribute__((always_inline)) static void add_scaled4(Double4& a, double x, const double* p) {
    Double4 t;
    load4(t, p);
    a += x * t;
  }
};
constexpr int64_t kSumsWidth = 32;

// scores[jj * R + r] = q_r . k_jj for rows [r0, r1) and the tile's tn keys
// (kt in panels, panel_index). One row against a panel's keys in vector
// lanes, each key's sum over d in index order from 0.
PLSH_VECTOR_CLONES void score_tile(const double* qr, int64_t R, int64_t r0, int64_t r1, int64_t D, const double* kt,
                                   int64_t tn, double* scores) {
  static_assert(kScoreKeys == kSumsWidth, "one Sums32 a panel");
  double panel[kScoreKeys];
  for (int64_t r = r0; r < r1; ++r) {
    const double* q = qr + r * D;
    int64_t jj = 0;
    for (; jj + kScoreKeys <= tn; jj += kScoreKeys) {
      Sums32 acc;
      const double* kd = kt + panel_index(jj, 0, D);
      for (int64_t d = 0; d < D; ++d, kd += kScoreKeys) acc.add_scaled(q[d], kd);
      acc.store(panel);
      for (int64_t i = 0; i < kScoreKeys; ++i) scores[(jj + i) * R + r] = panel[i];
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
      buf_(static_cast<size_t>(kLanes * head_dim)),
      kt_(static_cast<size_t>(head_dim * kExactRowsKeyTile)),
      vt_(static_cast<size_t>(kExactRowsKeyTile * head_dim)) {}

namespace {

// dst[d * kScoreKeys + i] = rows[i][d] for i < 4, d < D: four keys' rows
// into their columns of a panel (panel_index), widened to double. Four
// elements of each row at a time, widened and transposed in registers: as
// one vector built from four scalars per d, GCC's code took 3.5
// instructions an element (callgrind).
typedef float Float4 __attribute__((vector_size(16)));

// Four floats of a row, widened to double.
__attribute__((always_inline)) inline void load_widened4(Double4& x, const float* p) {
  Float4 f;
  std::memcpy(&f, p, sizeof f);
  x = __builtin_convertvector(f, Double4);
}

PLSH_VECTOR_CLONES void panel_columns(const float* r0, const float* r1, const float* r2, const float* r3, int64_t D,
                                      double* dst) {
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    Double4 a, b, c, e;
    load_widened4(a, r0 + d);
    load_widened4(b, r1 + d);
    load_widened4(c, r2 + d);
    load_widened4(e, r3 + d);
    const Double4 ab_even = __builtin_shufflevector(a, b, 0, 4, 2, 6);  // a0 b0 a2 b2
    const Double4 ab_odd = __builtin_shufflevector(a, b, 1, 5, 3, 7);   // a1 b1 a3 b3
    const Double4 ce_even = __builtin_shufflevector(c, e, 0, 4, 2, 6);
    const Double4 ce_odd = __builtin_shufflevector(c, e, 1, 5, 3, 7);
    store4(dst + d * kScoreKeys, __builtin_shufflevector(ab_even, ce_even, 0, 1, 4, 5));
    store4(dst + (d + 1) * kScoreKeys, __builtin_shufflevector(ab_odd, ce_odd, 0, 1, 4, 5));
    store4(dst + (d + 2) * kScoreKeys, __builtin_shufflevector(ab_even, ce_even, 2, 3, 6, 7));
    store4(dst + (d + 3) * kScoreKeys, __builtin_shufflevector(ab_odd, ce_odd, 2, 3, 6, 7));
  }
  for (; d < D; ++d) store4(dst + d * kScoreKeys, Double4{r0[d], r1[d], r2[d], r3[d]});
}

// dst[d] = src[d]: a value row widened to double.
PLSH_VECTOR_CLONES void widen(const float* __restrict src, int64_t n, double* __restrict dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d];
}

}  // namespace

// Keys are converted to double once for every row scored against them and
// stored transposed in panels (panel_index), so that one row's products
// with kScoreKeys keys run in vector lanes across the keys while each key's
// sum still runs over d in index order from 0 (no reassociation). A probe
// group is often one to a few rows, so lanes across rows would stay empty;
// a row's sum over d alone is a chain of dependent adds. Four keys at a
// time fill a panel's columns a vector at a time: one key's D scattered
// scalar stores took seven instructions an element (callgrind, 2026-12-07).
void KeyTileBuffer::convert_rows(const AttentionParams& p, int64_t b, int64_t hk, int64_t j, int64_t rows) {
  const int64_t D = dim_;
  const int64_t jj = j - j0_;
  const float* k[kLanes];
  for (int64_t i = 0; i < rows; ++i)
    k[i] = row_as_f32(p.k, p.dtype, b * p.k_batch_stride + (j + i) * p.k_row_stride + hk * p.k_head_stride, D,
                      buf_.data() + i * D);
  if (rows == kLanes) {
    panel_columns(k[0], k[1], k[2], k[3], D, &kt_[panel_index(jj, 0, D)]);
  } else {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t d = 0; d < D; ++d) kt_[panel_index(jj + i, d, D)] = k[i][d];
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* v = row_as_f32(p.v, p.dtype, b * p.v_batch_stride + (j + i) * p.v_row_stride + hk * p.v_head_stride, D,
                                buf_.data());
    widen(v, D, &vt_[static_cast<size_t>((jj + i) * D)]);
  }
}

void KeyTileBuffer::load(const AttentionParams& p, int64_t b, int64_t hk, int64_t j0, int64_t count, int64_t next_hk,
                         int64_t next_j0) {
  const size_t bytes = dtype_bytes(p.dtype);
  j0_ = j0;
  count_ = count;
  static_assert(kScoreKeys % kLanes == 0, "four keys never straddle a panel");
  for (int64_t jj = 0; jj < count;) {
    const int64_t rows = jj + kLanes <= count ? kLanes : 1;
    for (int64_t i = 0; i < rows; ++i)
      if (next_hk >= 0 && next_j0 + jj + i < p.kv_len) prefetch_key_row(p, b, next_hk, next_j0 + jj + i, dim_, bytes);
    convert_rows(p, b, hk, j0 + jj, rows);
    jj += rows;
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
// fifth to a third of the probe's samples at n = 32768, perf, 2026-12-07).
// Eight vectors, so that the multiply-adds of a key do not wait on the last
// key's (four cycles each, two a cycle). Each acc[d] still adds its keys in
// key order.
constexpr int64_t kAccBlock = kSumsWidth;

PLSH_VECTOR_CLONES void accumulate_weighted(const double* logits, const double* w, int64_t n, const double* values,
                                            int64_t dim, double* acc, double* sum) {
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  double total = *sum;
  for (int64_t j = 0; j < n; ++j)
    if (logits[j] != kMinusInf) total += w[j];
  *sum = total;
  int64_t d0 = 0;
  for (; d0 + kAccBlock <= dim; d0 += kAccBlock) {
    Sums32 a = Sums32::load(acc + d0);
    for (int64_t j = 0; j < n; ++j)
      if (logits[j] != kMinusInf) a.add_scaled(w[j], values + j * dim + d0);
    a.store(acc + d0);
  }
  for (; d0 + kLanes <= dim; d0 += kLanes) {  // then four at a time (D = 16, 48, 80, ...)
    Double4 a;
    load4(a, acc + d0);
    for (int64_t j = 0; j < n; ++j)
      if (logits[j] != kMinusInf) Sums32::add_scaled4(a, w[j], values + j * dim + d0);
    store4(acc + d0, a);
  }
  for (int64_t j = 0; j < n && d0 < dim; ++j) {  // the last dim % kLanes elements
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
