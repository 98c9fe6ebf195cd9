// The forward tile's two products and its softmax, in a transposed layout
// that needs no packing of K or V (issue 23):
//
//   st[j][i]   = sum_d k[j][d] qt[i][d]     keys x queries, Q pre-scaled
//   acc[i][d] += sum_j st[j][i] v[j][d]     after the softmax made st P^T
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

inline int64_t padded_rows(int64_t rows) { return (rows + kQueryPanel - 1) / kQueryPanel * kQueryPanel; }

// qt[panel][d][16] = scale * q[panel * 16 + i][d] for the `rows` rows of q
// (leading dimension ldq), zero for the padding up to padded_rows(rows).
// qt holds padded_rows(rows) * dim floats.
void pack_queries(const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt);

// st[j][i] = sum_d k[j][d] qt[i][d] for keys j < keys and every padded query
// i < padded_rows(rows) (ldst >= padded_rows(rows)).
void qk_tile(const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
             int64_t ldst);

// acc[i][d] += sum_{j < keys} pt[j][i] v[j][d] for i < rows, d < dim.
void pv_tile(const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows, int64_t dim,
             float* acc, int64_t ldacc);

// Folds a tile of logits st[j][i] (keys x rows, -inf where masked) into the
// rows' online-softmax state: row_max[i] and row_sum[i] are updated, acc's
// row i ([dim], leading dimension dim) rescaled when its max grows, and st
// left holding the probabilities exp(s - max) that pv_tile multiplies by V.
void fold_tile(float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum);

// Asks for n rows of row_bytes each, stride bytes apart from x, to be
// brought into L2: the V tile, read from memory for every row tile, while
// Q K^T and the softmax run.
void prefetch_rows(const void* x, int64_t stride, int64_t n, int64_t row_bytes);

// The same, each forced onto one implementation, for the tests.
namespace kernels_for_testing {
bool have_avx2();
void pack_queries(bool avx2, const float* q, int64_t ldq, int64_t rows, int64_t dim, float scale, float* qt);
void qk_tile(bool avx2, const float* k, int64_t ldk, int64_t keys, int64_t dim, const float* qt, int64_t rows,
             float* st, int64_t ldst);
void pv_tile(bool avx2, const float* pt, int64_t ldpt, int64_t keys, const float* v, int64_t ldv, int64_t rows,
             int64_t dim, float* acc, int64_t ldacc);
void fold_tile(bool avx2, float* st, int64_t ldst, int64_t keys, int64_t rows, float* acc, int64_t dim, float* row_max,
               float* row_sum);
}  // namespace kernels_for_testing

}  // namespace plsh::cpu
