// The attention tiles' products and softmax, in a transposed layout that
// needs no packing of K or V (issue 23). The forward:
//
//   st[j][i]   = sum_d k[j][d] qt[i][d]     keys x queries, Q pre-scaled
//   acc[i][d] += sum_j st[j][i] v[j][d]     after the softmax made st P^T
//
// The backward (cpu_backward.cpp) runs its five products on the same two
// kernels and a third, ab_tile (dV += P^T dO, dK += dS^T Q), whose block is
// qk_tile's with the rows of a tensor in place of the packed queries.
//
// Each product broadcasts single elements from rows of one operand (K's and
// P^T's rows, as the tensors lay them out) against 16 contiguous floats of
// the other (the packed queries, V's rows), so only the query tile is
// packed, once per tile, instead of OpenBLAS packing a K, a V and a P tile
// on every call (packing was a fifth of the exact forward's profile). The
// register block is 6 x 16 floats, 12 AVX2 accumulators: 12 FMAs a step
// against 2 loads and 6 broadcasts, FMA-bound on two FMA pipes.
//
// The AVX2+FMA kernels are chosen at load time when the CPU has them; the
// generic ones (plain loops, the library's baseline x86-64 or any other
// architecture) compute the same sums. The tests run both against float64
// (tests/kernels/test_microkernels.cpp); bench/RESULTS.md has the figures.
//
// Internal to kernels/cpu; not a public header.
#pragma once

#include <cstdint>

namespace plsh::cpu {

// Queries per packed panel, the width of the products' register block.
inline constexpr int64_t kQueryPanel = 16;

constexpr int64_t padded_rows(int64_t rows) { return (rows + kQueryPanel - 1) / kQueryPanel * kQueryPanel; }

// qt[panel][d][16] = scale * q[panel * 16 + i][d] for the `rows` rows of q
// (leading dimension ldq), zero for the padding up to padded_rows(rows).
// qt holds padded_rows(rows) * dim floats.
void pack_queries(const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt);

// st[j][i] = sum_d k[j][d] qt[i][d] for keys j < keys and every padded query
// i < padded_rows(rows) (ldst >= padded_rows(rows)).
void qk_tile(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
             int64_t ldst);

// The exact and window bias as qk_tile's epilogue, applied to each register
// block while it is in L1 (AlibiBias, tiles.h, fills it for a key tile):
// the logit of query row i and key j becomes s + neg_slope * max(left[i] -
// j, j - right[i]) where lo[j] <= i < hi[j], and -inf elsewhere (the
// padding rows included: hi[j] <= rows). max(...) is |distance| less the
// row's reference distance: left[i] - j for keys at or before the query
// (j <= i + diagonal), j - right[i] after it; at j = i + diagonal the two
// agree.
struct BiasEpilogue {
  float neg_slope = 0;
  int64_t diagonal = 0;          // key j sits at distance i + diagonal - j from query row i
  const float* left = nullptr;   // [padded_rows(rows)]
  const float* right = nullptr;  // [padded_rows(rows)]
  const float* lo = nullptr;     // [keys] the first query row key j may meet
  const float* hi = nullptr;     // [keys] one past the last
};

// qk_tile, then the bias: a pass over the logits fewer. col_max, when not
// null ([padded_rows(rows)], coming in as -inf or a running max), takes
// each query column's max over the tile's keys, which fold_tile then need
// not find.
void qk_bias_tile(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
                  int64_t ldst, const BiasEpilogue& bias, float* col_max);

// acc[i][d] += sum_{j < keys} pt[j][i] v[j][d] for i < rows, d < dim.
void pv_tile(const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows, int64_t dim,
             float* acc, int64_t ldacc);

// Folds a tile of logits st[j][i] (keys x rows, -inf where masked) into the
// rows' online-softmax state: row_max[i] and row_sum[i] are updated, acc's
// row i ([dim], leading dimension dim) rescaled when its max grows, and st
// left holding the probabilities exp(s - max) that pv_tile multiplies by V.
// tile_max, when not null, is each row's max over the tile (qk_bias_tile's
// col_max), and saves the pass that finds it.
void fold_tile(float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum, const float* tile_max);

// c[j][x] += sum_{i < depth} a[j][i] b[i][x] for j < m, x < dim: a's
// elements broadcast from its rows (leading dimension lda), b's rows (ldb)
// read 16 floats at a time.
void ab_tile(const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t dim, float* c,
             int64_t ldc);

// The backward's probabilities from the forward's lse, key-major:
// st[j][i] = exp(st[j][i] - lse[i]) for j < keys, i < rows (-inf: 0).
// s - lse is clamped at 80: rounding may put it a hair above 0, never more
// unless lse is not this forward's.
void probs_tile(float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse);

// dS = P * (dP - D), key-major: dpt[j][i] = pt[j][i] * (dpt[j][i] - dots[i]).
void dscores_tile(float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots);

// Asks for n rows of row_bytes each, stride bytes apart from x, to be
// brought into L2: the V tile, read from memory for every row tile, while
// Q K^T and the softmax run.
void prefetch_rows(const void* x, int64_t stride, int64_t n, int64_t row_bytes);

// Whether the AVX2+FMA kernels run here (else the generic ones).
bool have_avx2_kernels();

// The same, each forced onto one implementation, for the tests.
namespace kernels_for_testing {
bool have_avx2();
void pack_queries(bool avx2, const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt);
void qk_tile(bool avx2, const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows,
             float* st, int64_t ldst);
void pv_tile(bool avx2, const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows,
             int64_t dim, float* acc, int64_t ldacc);
void qk_bias_tile(bool avx2, const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows,
                  float* st, int64_t ldst, const BiasEpilogue& bias, float* col_max);
void fold_tile(bool avx2, float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum, const float* tile_max);
void ab_tile(bool avx2, const float* a, int64_t lda, int64_t m, int64_t depth, const float* b, int64_t ldb, int64_t dim,
             float* c, int64_t ldc);
void probs_tile(bool avx2, float* st, int64_t ldst, int64_t keys, int64_t rows, const float* lse);
void dscores_tile(bool avx2, float* dpt, const float* pt, int64_t ld, int64_t keys, int64_t rows, const float* dots);
}  // namespace kernels_for_testing

}  // namespace plsh::cpu
