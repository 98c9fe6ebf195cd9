#include "cpu/microkernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "cpu/exp.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The max loops below vectorise only if GCC may if-convert float compares,
// i.e. without trapping-math (we never unmask FP exceptions).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

namespace plsh::cpu {

namespace {

constexpr float kNegInfinity = -std::numeric_limits<float>::infinity();
// Query columns the softmax folds at once: its per-column state fits the stack.
constexpr int64_t kFoldColumns = 64;
// A logit may exceed the forward's lse by rounding (P a hair above 1),
// never by more unless the lse is not this forward's; the backward's
// probabilities clamp s - lse here, which keeps exp's exponent in range.
constexpr float kProbsClamp = 80.0f;

// ---- generic: plain loops, any CPU -----------------------------------------

void qk_generic(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
                int64_t ldst) {
  const int64_t panels = padded_rows(rows) / kQueryPanel;
  for (int64_t j = 0; j < keys; ++j) {
    const float* kj = k + j * ldk;
    for (int64_t p = 0; p < panels; ++p) {
      float c[kQueryPanel] = {};
      const float* qp = qt + p * dim * kQueryPanel;
      for (int64_t d = 0; d < dim; ++d)
        for (int64_t i = 0; i < kQueryPanel; ++i) c[i] += kj[d] * qp[d * kQueryPanel + i];
      std::memcpy(st + j * ldst + p * kQueryPanel, c, sizeof(c));
    }
  }
}

// The bias epilogue (BiasEpilogue) on keys [j_begin, j_end) and query
// columns [i_begin, i_end) of st, the columns' max into col_max if given.
void bias_generic(float* st, int64_t ldst, int64_t j_begin, int64_t j_end, int64_t i_begin, int64_t i_end,
                  const BiasEpilogue& e, float* col_max) {
  for (int64_t j = j_begin; j < j_end; ++j) {
    float* sj = st + j * ldst;
    const float jf = static_cast<float>(j), lo = e.lo[j], hi = e.hi[j];
    for (int64_t i = i_begin; i < i_end; ++i) {
      const float fi = static_cast<float>(i);
      const float distance = std::max(e.left[i] - jf, jf - e.right[i]);
      const float s = fi >= lo && fi < hi ? sj[i] + e.neg_slope * distance : kNegInfinity;
      sj[i] = s;
      if (col_max != nullptr) col_max[i] = std::max(col_max[i], s);
    }
  }
}

// Panel rows [i_begin, i_end) of pack_queries, columns [d_begin, dim); the
// panel's rows from i_end to the panel's end are zero.
void pack_generic(const float* q, int64_t ldq, int64_t i_begin, int64_t i_end, int64_t d_begin, int64_t dim,
                  float scale, float* qp) {
  for (int64_t i = i_begin; i < i_end; ++i)
    for (int64_t d = d_begin; d < dim; ++d) qp[d * kQueryPanel + i] = scale * q[i * ldq + d];
  for (int64_t i = i_end; i < kQueryPanel; ++i)
    for (int64_t d = d_begin; d < dim; ++d) qp[d * kQueryPanel + i] = 0.0f;
}

// c[r][x] += sum_{k < depth} a[r * a_row + k * a_depth] b[k][x] for r < m
// and columns [x_begin, x_end): pv_tile's product (a = P^T read down its
// columns: a_row 1, a_depth ldpt) and ab_tile's (a read along its rows).
void strided_generic(const float* a, int64_t a_row, int64_t a_depth, int64_t m, int64_t depth, const float* b,
                     int64_t ldb, int64_t x_begin, int64_t x_end, float* c, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r) {
    float* cr = c + r * ldc;
    for (int64_t k = 0; k < depth; ++k) {
      const float w = a[r * a_row + k * a_depth];
      const float* bk = b + k * ldb;
      for (int64_t x = x_begin; x < x_end; ++x) cr[x] += w * bk[x];
    }
  }
}

void pv_generic(const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows, int64_t d_begin,
                int64_t d_end, float* acc, int64_t ldacc) {
  strided_generic(pt, 1, ldpt, rows, keys, v, ldv, d_begin, d_end, acc, ldacc);
}

void ab_generic(const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t x_begin,
                int64_t x_end, float* c, int64_t ldc) {
  strided_generic(a, lda, 1, m, depth, b, ldb, x_begin, x_end, c, ldc);
}

void probs_generic(float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse) {
  for (int64_t j = 0; j < keys; ++j) {
    float* sj = st + j * ldst;
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) sj[i] = exp_nonpositive(std::min(sj[i] - lse[i], kProbsClamp));
  }
}

void dscores_generic(float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots) {
  for (int64_t j = 0; j < keys; ++j) {
    float* dj = dpt + j * ld;
    const float* pj = pt + j * ld;
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) dj[i] = pj[i] * (dj[i] - dots[i]);
  }
}

// Finishes a fold of columns [i0, i0 + n): new_max and sum are the
// columns' new running max and this tile's sum of probabilities.
void fold_finish(int64_t n, const float* new_max, const float* sum, float* acc, int64_t dim, float* row_max,
                 float* row_sum) {
  for (int64_t i = 0; i < n; ++i) {
    const float old_max = row_max[i];
    if (new_max[i] != old_max) {
      const float rescale = old_max == kNegInfinity ? 0.0f : std::exp(old_max - new_max[i]);
      float* ai = acc + i * dim;
      for (int64_t d = 0; d < dim; ++d) ai[d] *= rescale;
      row_sum[i] *= rescale;
      row_max[i] = new_max[i];
    }
    row_sum[i] += sum[i];
  }
}

void fold_generic(float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
                  float* row_sum, const float* tile_max) {
  for (int64_t i0 = 0; i0 < rows; i0 += kFoldColumns) {
    const int64_t n = std::min(kFoldColumns, rows - i0);
    float new_max[kFoldColumns], shift[kFoldColumns], sum[kFoldColumns];
    std::copy_n(row_max + i0, n, new_max);
    if (tile_max != nullptr) {
      for (int64_t i = 0; i < n; ++i) new_max[i] = std::max(new_max[i], tile_max[i0 + i]);
    } else {
      for (int64_t j = 0; j < keys; ++j) {
        const float* sj = st + j * ldst + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) new_max[i] = new_max[i] > sj[i] ? new_max[i] : sj[i];
      }
    }
    // A column with nothing allowed yet has max -inf: exp(-inf - 0) = 0.
    for (int64_t i = 0; i < n; ++i) shift[i] = new_max[i] == kNegInfinity ? 0.0f : new_max[i];
    std::fill_n(sum, n, 0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      float* sj = st + j * ldst + i0;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float e = exp_nonpositive(sj[i] - shift[i]);
        sj[i] = e;
        sum[i] += e;
      }
    }
    fold_finish(n, new_max, sum, acc + i0 * dim, dim, row_max + i0, row_sum + i0);
  }
}

// ---- AVX2 + FMA: 6 x 16 register blocks ------------------------------------
#if defined(__x86_64__) && defined(__GNUC__)
#define PLSH_AVX2 __attribute__((target("avx2,fma")))
constexpr int kBlockRows = 6;

// Calls block(std::integral_constant<int, m>{}) for m in [1, kBlockRows]: a
// partial register block's row count as the compile-time constant the
// blocks take.
template <typename Block>
void with_block_rows(int64_t m, Block&& block) {
  [&]<int... M>(std::integer_sequence<int, M...>) {
    (void)((m == M + 1 && (block(std::integral_constant<int, M + 1>{}), true)) || ...);
  }
  (std::make_integer_sequence<int, kBlockRows>{});
}

// c[r][0, 16) (+)= sum_d A[r][d] b[d][0, 16) for r < M: A's elements
// broadcast, b read 16 floats a step, ldb apart (the packed queries' 16, or
// the rows of a tensor's tile). A[r][d] is a[r * lda + d], or with
// ATransposed a[d * lda + r] (P^T, whose rows are keys).
template <int M, bool Accumulate, bool ATransposed = false>
PLSH_AVX2 void rows_block(const float* a, int64_t lda, int64_t depth, const float* b, int64_t ldb, float* c,
                          int64_t ldc) {
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    c0[r] = Accumulate ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    c1[r] = Accumulate ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t d = 0; d < depth; ++d) {
    if constexpr (ATransposed) {
      // The rows eight steps on: P^T's stride defeats the hardware prefetcher.
      _mm_prefetch(reinterpret_cast<const char*>(b + (d + 8) * ldb), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a + (d + 8) * lda), _MM_HINT_T0);
    }
    const __m256 b0 = _mm256_loadu_ps(b + d * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + d * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < M; ++r) {
      const __m256 x = _mm256_broadcast_ss(ATransposed ? a + d * lda + r : a + r * lda + d);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < M; ++r) {
    _mm256_storeu_ps(c + r * ldc, c0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, c1[r]);
  }
}

// Asks for a's six rows after the block at a (of `rows`), depth floats
// each, while the current six pass every strip of b.
PLSH_AVX2 void prefetch_next_block(const float* a, int64_t lda, int64_t depth, int64_t left) {
  for (int64_t r = kBlockRows; r < 2 * kBlockRows && r < left; ++r)
    for (int64_t d = 0; d < depth; d += 16) _mm_prefetch(reinterpret_cast<const char*>(a + r * lda + d), _MM_HINT_T0);
}

// The query rows that the m keys j .. of a register block allow: every key
// allows [every_lo, every_hi), some key allows rows within [some_lo,
// some_hi) only (empty: some_lo >= some_hi).
struct KeyBlockRows {
  float every_lo, every_hi, some_lo, some_hi;
};

KeyBlockRows key_block_rows(const BiasEpilogue& e, int64_t j, int64_t m) {
  KeyBlockRows b{0, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(), 0};
  for (int64_t r = 0; r < m; ++r) {
    const float lo = e.lo[j + r], hi = e.hi[j + r];
    b.every_lo = std::max(b.every_lo, lo);
    b.every_hi = std::min(b.every_hi, hi);
    if (lo < hi) {
      b.some_lo = std::min(b.some_lo, lo);
      b.some_hi = std::max(b.some_hi, hi);
    }
  }
  return b;
}

// The bias epilogue on the m x 16 block at s (keys j .., query columns i0
// ..), just stored by rows_block and still in L1; the columns' max into
// col_max if given. Most blocks of a tile lie wholly inside the allowed
// region and on one side of the diagonal: they take one subtraction and one
// FMA a vector, the others the masks and both sides.
PLSH_AVX2 void bias_block_avx2(float* s, int64_t ldst, int64_t j, int64_t m, int64_t i0, const BiasEpilogue& e,
                               const KeyBlockRows& rows, float* col_max) {
  const float first = static_cast<float>(i0), end = static_cast<float>(i0 + kQueryPanel);
  const bool all_in = rows.every_lo <= first && rows.every_hi >= end;
  const bool all_out = rows.some_lo >= rows.some_hi || rows.some_hi <= first || rows.some_lo >= end;
  const __m256 neg_inf = _mm256_set1_ps(kNegInfinity);
  if (all_out) {
    for (int64_t r = 0; r < m; ++r) {
      _mm256_storeu_ps(s + r * ldst, neg_inf);
      _mm256_storeu_ps(s + r * ldst + 8, neg_inf);
    }
    return;
  }
  const __m256 left0 = _mm256_loadu_ps(e.left + i0), left1 = _mm256_loadu_ps(e.left + i0 + 8);
  const __m256 right0 = _mm256_loadu_ps(e.right + i0), right1 = _mm256_loadu_ps(e.right + i0 + 8);
  const __m256 neg_slope = _mm256_set1_ps(e.neg_slope);
  __m256 max0 = neg_inf, max1 = neg_inf;
  // Every key at or before every query of the block, or every key after or at.
  const bool before = e.diagonal + i0 - (j + m - 1) >= 0, after = e.diagonal + i0 + kQueryPanel - 1 - j <= 0;
  if (all_in && (before || after)) {
    for (int64_t r = 0; r < m; ++r) {
      float* sr = s + r * ldst;
      const __m256 jf = _mm256_set1_ps(static_cast<float>(j + r));
      const __m256 d0 = before ? _mm256_sub_ps(left0, jf) : _mm256_sub_ps(jf, right0);
      const __m256 d1 = before ? _mm256_sub_ps(left1, jf) : _mm256_sub_ps(jf, right1);
      const __m256 s0 = _mm256_fmadd_ps(neg_slope, d0, _mm256_loadu_ps(sr));
      const __m256 s1 = _mm256_fmadd_ps(neg_slope, d1, _mm256_loadu_ps(sr + 8));
      _mm256_storeu_ps(sr, s0);
      _mm256_storeu_ps(sr + 8, s1);
      max0 = _mm256_max_ps(max0, s0);
      max1 = _mm256_max_ps(max1, s1);
    }
  } else {
    const __m256 idx0 = _mm256_add_ps(_mm256_set1_ps(first), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 idx1 = _mm256_add_ps(idx0, _mm256_set1_ps(8.0f));
    for (int64_t r = 0; r < m; ++r) {
      float* sr = s + r * ldst;
      const __m256 jf = _mm256_set1_ps(static_cast<float>(j + r));
      const __m256 lo = _mm256_broadcast_ss(e.lo + j + r), hi = _mm256_broadcast_ss(e.hi + j + r);
      const __m256 d0 = _mm256_max_ps(_mm256_sub_ps(left0, jf), _mm256_sub_ps(jf, right0));
      const __m256 d1 = _mm256_max_ps(_mm256_sub_ps(left1, jf), _mm256_sub_ps(jf, right1));
      const __m256 in0 = _mm256_and_ps(_mm256_cmp_ps(idx0, lo, _CMP_GE_OQ), _mm256_cmp_ps(idx0, hi, _CMP_LT_OQ));
      const __m256 in1 = _mm256_and_ps(_mm256_cmp_ps(idx1, lo, _CMP_GE_OQ), _mm256_cmp_ps(idx1, hi, _CMP_LT_OQ));
      const __m256 s0 = _mm256_blendv_ps(neg_inf, _mm256_fmadd_ps(neg_slope, d0, _mm256_loadu_ps(sr)), in0);
      const __m256 s1 = _mm256_blendv_ps(neg_inf, _mm256_fmadd_ps(neg_slope, d1, _mm256_loadu_ps(sr + 8)), in1);
      _mm256_storeu_ps(sr, s0);
      _mm256_storeu_ps(sr + 8, s1);
      max0 = _mm256_max_ps(max0, s0);
      max1 = _mm256_max_ps(max1, s1);
    }
  }
  if (col_max != nullptr) {
    _mm256_storeu_ps(col_max + i0, _mm256_max_ps(_mm256_loadu_ps(col_max + i0), max0));
    _mm256_storeu_ps(col_max + i0 + 8, _mm256_max_ps(_mm256_loadu_ps(col_max + i0 + 8), max1));
  }
}

// qk_tile, and with bias not null qk_bias_tile.
PLSH_AVX2 void qk_avx2(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
                       int64_t ldst, const BiasEpilogue* bias, float* col_max) {
  const int64_t panels = padded_rows(rows) / kQueryPanel;
  // Keys outer: six key rows stay in L1 while every query panel passes.
  for (int64_t j = 0; j < keys; j += kBlockRows) {
    const float* kj = k + j * ldk;
    float* sj = st + j * ldst;
    const int64_t m = std::min<int64_t>(kBlockRows, keys - j);
    prefetch_next_block(kj, ldk, dim, keys - j);
    const KeyBlockRows allowed = bias != nullptr ? key_block_rows(*bias, j, m) : KeyBlockRows{};
    for (int64_t p = 0; p < panels; ++p) {
      const float* qp = qt + p * dim * kQueryPanel;
      float* sp = sj + p * kQueryPanel;
      with_block_rows(m, [&](auto rows_c) { rows_block<rows_c(), false>(kj, ldk, dim, qp, kQueryPanel, sp, ldst); });
      if (bias != nullptr) bias_block_avx2(sp, ldst, j, m, p * kQueryPanel, *bias, allowed, col_max);
    }
  }
}

PLSH_AVX2 void ab_avx2(const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t dim,
                       float* c, int64_t ldc) {
  const int64_t full = dim / kQueryPanel * kQueryPanel;
  // a's rows outer, as in qk_avx2: six of them stay in L1 while every
  // 16-column strip of b passes.
  for (int64_t j = 0; j < m; j += kBlockRows) {
    const float* aj = a + j * lda;
    float* cj = c + j * ldc;
    const int64_t rows = std::min<int64_t>(kBlockRows, m - j);
    prefetch_next_block(aj, lda, depth, m - j);
    for (int64_t x = 0; x < full; x += kQueryPanel)
      with_block_rows(rows, [&](auto rows_c) { rows_block<rows_c(), true>(aj, lda, depth, b + x, ldb, cj + x, ldc); });
  }
  if (full < dim) ab_generic(a, lda, m, depth, b, ldb, full, dim, c, ldc);
}

PLSH_AVX2 void pv_avx2(const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows,
                       int64_t dim, float* acc, int64_t ldacc) {
  const int64_t full = dim / kQueryPanel * kQueryPanel;
  // Query rows outer: a group's six columns of P^T stay in L1 while every
  // 16-column strip of V passes.
  for (int64_t i = 0; i < rows; i += kBlockRows) {
    const float* pi = pt + i;
    const int64_t m = std::min<int64_t>(kBlockRows, rows - i);
    for (int64_t d0 = 0; d0 < full; d0 += kQueryPanel) {
      float* ai = acc + i * ldacc + d0;
      with_block_rows(m,
                      [&](auto rows_c) { rows_block<rows_c(), true, true>(pi, ldpt, keys, v + d0, ldv, ai, ldacc); });
    }
  }
  if (full < dim) pv_generic(pt, ldpt, keys, v, ldv, rows, full, dim, acc, ldacc);
}

// exp_nonpositive (cpu/exp.h) on eight lanes, the same steps with FMAs.
PLSH_AVX2 __m256 exp_nonpositive8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 shifter = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), shifter), shifter);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// The max, then exp(s - max) and its sum, of columns [0, 8 V) of st: V
// vectors a key row, so that each pass reads whole lines and keeps V
// exponentials in flight. max and sum hold 8 V floats; max comes in as the
// columns' running max.
// tile_max, when not null, is the columns' max over the keys.
template <int V>
PLSH_AVX2 void fold_columns(float* st, int64_t ldst, int64_t keys, float* max, float* sum, const float* tile_max) {
  __m256 m[V], shift[V], s[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) m[v] = _mm256_loadu_ps(max + 8 * v);
  if (tile_max != nullptr) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) m[v] = _mm256_max_ps(m[v], _mm256_loadu_ps(tile_max + 8 * v));
  } else {
    for (int64_t j = 0; j < keys; ++j) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) m[v] = _mm256_max_ps(m[v], _mm256_loadu_ps(st + j * ldst + 8 * v));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    _mm256_storeu_ps(max + 8 * v, m[v]);
    // A column with nothing allowed yet has max -inf: exp(-inf - 0) = 0.
    const __m256 none = _mm256_cmp_ps(m[v], _mm256_set1_ps(kNegInfinity), _CMP_EQ_OQ);
    shift[v] = _mm256_blendv_ps(m[v], _mm256_setzero_ps(), none);
    s[v] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < keys; ++j) {
    float* sj = st + j * ldst;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sj + 8 * v), shift[v]));
      _mm256_storeu_ps(sj + 8 * v, e);
      s[v] = _mm256_add_ps(s[v], e);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(sum + 8 * v, s[v]);
}

PLSH_AVX2 void fold_avx2(float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
                         float* row_sum, const float* tile_max) {
  constexpr int kVectors = 2;  // 16 columns, a line of a key row
  for (int64_t i0 = 0; i0 < rows; i0 += kFoldColumns) {
    const int64_t n = std::min(kFoldColumns, rows - i0);
    float new_max[kFoldColumns], sum[kFoldColumns];
    std::copy_n(row_max + i0, n, new_max);
    int64_t i = 0;
    const float* known = tile_max != nullptr ? tile_max + i0 : nullptr;
    for (; i + 8 * kVectors <= n; i += 8 * kVectors)
      fold_columns<kVectors>(st + i0 + i, ldst, keys, new_max + i, sum + i, known != nullptr ? known + i : nullptr);
    for (; i + 8 <= n; i += 8)
      fold_columns<1>(st + i0 + i, ldst, keys, new_max + i, sum + i, known != nullptr ? known + i : nullptr);
    for (; i < n; ++i) {
      float m = new_max[i];
      if (known != nullptr) {
        m = std::max(m, known[i]);
      } else {
        for (int64_t j = 0; j < keys; ++j) m = std::max(m, st[j * ldst + i0 + i]);
      }
      new_max[i] = m;
      const float shift = m == kNegInfinity ? 0.0f : m;
      float s = 0;
      for (int64_t j = 0; j < keys; ++j) {
        float* e = st + j * ldst + i0 + i;
        *e = exp_nonpositive(*e - shift);
        s += *e;
      }
      sum[i] = s;
    }
    fold_finish(n, new_max, sum, acc + i0 * dim, dim, row_max + i0, row_sum + i0);
  }
}

PLSH_AVX2 void probs_avx2(float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse) {
  const int64_t whole = rows / 8 * 8;
  const __m256 clamp = _mm256_set1_ps(kProbsClamp);
  for (int64_t j = 0; j < keys; ++j) {
    float* sj = st + j * ldst;
    int64_t i = 0;
    for (; i < whole; i += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sj + i), _mm256_loadu_ps(lse + i));
      _mm256_storeu_ps(sj + i, exp_nonpositive8(_mm256_min_ps(x, clamp)));
    }
    for (; i < rows; ++i) sj[i] = exp_nonpositive(std::min(sj[i] - lse[i], kProbsClamp));
  }
}

PLSH_AVX2 void dscores_avx2(float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots) {
  const int64_t whole = rows / 8 * 8;
  for (int64_t j = 0; j < keys; ++j) {
    float* dj = dpt + j * ld;
    const float* pj = pt + j * ld;
    int64_t i = 0;
    for (; i < whole; i += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(dj + i), _mm256_loadu_ps(dots + i));
      _mm256_storeu_ps(dj + i, _mm256_mul_ps(_mm256_loadu_ps(pj + i), x));
    }
    for (; i < rows; ++i) dj[i] = pj[i] * (dj[i] - dots[i]);
  }
}

// dst[c * ldd + r] = scale * src[r * lds + c] for an 8 x 8 block.
PLSH_AVX2 void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd, __m256 scale) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_mul_ps(_mm256_loadu_ps(src + k * lds), scale);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}

// pack_queries by 8 x 8 transposes where a panel has eight rows in a half.
PLSH_AVX2 void pack_avx2(const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt) {
  const __m256 s8 = _mm256_set1_ps(scale);
  const int64_t panels = padded_rows(rows) / kQueryPanel, dim8 = dim / 8 * 8;
  for (int64_t p = 0; p < panels; ++p) {
    const float* qp_rows = q + p * kQueryPanel * ldq;
    float* qp = qt + p * dim * kQueryPanel;
    const int64_t n = std::min(kQueryPanel, rows - p * kQueryPanel);
    const int64_t whole = n / 8 * 8;  // rows packed by transposes
    for (int64_t h = 0; h < whole; h += 8)
      for (int64_t d = 0; d < dim8; d += 8)
        transpose8x8(qp_rows + h * ldq + d, ldq, qp + d * kQueryPanel + h, kQueryPanel, s8);
    pack_generic(qp_rows, ldq, 0, whole, dim8, dim, scale, qp);  // the columns past the last eight
    pack_generic(qp_rows, ldq, whole, n, 0, dim, scale, qp);     // the rows past them, and the padding
  }
}

bool detect_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
bool detect_avx2() { return false; }
#endif

const bool kHaveAvx2 = detect_avx2();

}  // namespace

void pack_queries(const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt) {
  kernels_for_testing::pack_queries(kHaveAvx2, q, ldq, rows, dim, scale, qt);
}

bool have_avx2_kernels() { return kHaveAvx2; }

void prefetch_rows(const void* x, int64_t stride, int64_t n, int64_t row_bytes) {
#if defined(__x86_64__) && defined(__GNUC__)
  const char* base = static_cast<const char*>(x);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(base + r * stride + b, _MM_HINT_T1);
#else
  (void)x, (void)stride, (void)n, (void)row_bytes;
#endif
}

namespace kernels_for_testing {

bool have_avx2() { return kHaveAvx2; }

void pack_queries(bool avx2, const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return pack_avx2(q, ldq, rows, dim, scale, qt);
#endif
  const int64_t panels = padded_rows(rows) / kQueryPanel;
  for (int64_t p = 0; p < panels; ++p)
    pack_generic(q + p * kQueryPanel * ldq, ldq, 0, std::min(kQueryPanel, rows - p * kQueryPanel), 0, dim, scale,
                 qt + p * dim * kQueryPanel);
}

void qk_tile(bool avx2, const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows,
             float* st, int64_t ldst) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return qk_avx2(k, ldk, keys, dim, qt, rows, st, ldst, nullptr, nullptr);
#endif
  qk_generic(k, ldk, keys, dim, qt, rows, st, ldst);
}

void qk_bias_tile(bool avx2, const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows,
                  float* st, int64_t ldst, const BiasEpilogue& bias, float* col_max) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return qk_avx2(k, ldk, keys, dim, qt, rows, st, ldst, &bias, col_max);
#endif
  qk_generic(k, ldk, keys, dim, qt, rows, st, ldst);
  bias_generic(st, ldst, 0, keys, 0, padded_rows(rows), bias, col_max);
}

void pv_tile(bool avx2, const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows,
             int64_t dim, float* acc, int64_t ldacc) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return pv_avx2(pt, ldpt, keys, v, ldv, rows, dim, acc, ldacc);
#endif
  pv_generic(pt, ldpt, keys, v, ldv, rows, 0, dim, acc, ldacc);
}

void fold_tile(bool avx2, float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum, const float* tile_max) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return fold_avx2(st, ldst, keys, rows, acc, dim, row_max, row_sum, tile_max);
#endif
  fold_generic(st, ldst, keys, rows, acc, dim, row_max, row_sum, tile_max);
}

void ab_tile(bool avx2, const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t dim,
             float* c, int64_t ldc) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return ab_avx2(a, lda, m, depth, b, ldb, dim, c, ldc);
#endif
  ab_generic(a, lda, m, depth, b, ldb, 0, dim, c, ldc);
}

void probs_tile(bool avx2, float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return probs_avx2(st, ldst, keys, rows, lse);
#endif
  probs_generic(st, ldst, keys, rows, lse);
}

void dscores_tile(bool avx2, float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2) return dscores_avx2(dpt, pt, ld, keys, rows, dots);
#endif
  dscores_generic(dpt, pt, ld, keys, rows, dots);
}

}  // namespace kernels_for_testing

void qk_tile(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
             int64_t ldst) {
  kernels_for_testing::qk_tile(kHaveAvx2, k, ldk, keys, dim, qt, rows, st, ldst);
}

void pv_tile(const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows, int64_t dim,
             float* acc, int64_t ldacc) {
  kernels_for_testing::pv_tile(kHaveAvx2, pt, ldpt, keys, v, ldv, rows, dim, acc, ldacc);
}

void qk_bias_tile(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
                  int64_t ldst, const BiasEpilogue& bias, float* col_max) {
  kernels_for_testing::qk_bias_tile(kHaveAvx2, k, ldk, keys, dim, qt, rows, st, ldst, bias, col_max);
}

void fold_tile(float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum, const float* tile_max) {
  kernels_for_testing::fold_tile(kHaveAvx2, st, ldst, keys, rows, acc, dim, row_max, row_sum, tile_max);
}

void ab_tile(const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t dim, float* c,
             int64_t ldc) {
  kernels_for_testing::ab_tile(kHaveAvx2, a, lda, m, depth, b, ldb, dim, c, ldc);
}

void probs_tile(float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse) {
  kernels_for_testing::probs_tile(kHaveAvx2, st, ldst, keys, rows, lse);
}

void dscores_tile(float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots) {
  kernels_for_testing::dscores_tile(kHaveAvx2, dpt, pt, ld, keys, rows, dots);
}

}  // namespace plsh::cpu
