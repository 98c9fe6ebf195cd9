#include "cpu/tiles.h"

#include <cblas.h>
#include <omp.h>

#include "cpu/exp.h"

// The exp and max loops below vectorise only if GCC may if-convert float
// compares, i.e. without trapping-math (we never unmask FP exceptions).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

namespace plsh::cpu {

void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
              float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, c, static_cast<int>(ldc));
}

void gemm_ab_acc(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                 int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), 1.0f, c, static_cast<int>(ldc));
}

void gemm_ab(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
             float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, c, static_cast<int>(ldc));
}

void gemm_atb_acc(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), 1.0f, c, static_cast<int>(ldc));
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void probs_from_lse(float* sr, int64_t len, float lse) {
  // A logit may exceed lse by rounding (P a hair above 1), never by more
  // unless lse is not this forward's; the clamp keeps exp's exponent field
  // in range either way.
#pragma omp simd
  for (int64_t c = 0; c < len; ++c) {
    const float x = sr[c] - lse;
    sr[c] = exp_nonpositive(x < 80.0f ? x : 80.0f);
  }
}

void carve_scratch(const AttentionParams& p, bool banded, Carver& c, Scratch* s) {
  const bool widen = p.dtype != DType::kF32;
  const int64_t rows = row_tile(p.mode), dim = p.head_dim;
  const int64_t samples = banded ? p.samples : 0;
  s->q = c.take<float>(widen ? rows * dim : 0);
  s->qt = c.take<float>(rows * dim);
  s->k = c.take<float>(widen ? kKeyTile * dim : 0);
  s->v = c.take<float>(kKeyTile * value_stride(dim));
  s->s = c.take<float>(kKeyTile * logits_stride(rows));
  s->acc = c.take<float>(rows * dim);
  s->row_max = c.take<float>(rows);
  s->row_sum = c.take<float>(rows);
  s->lse_shift = c.take<double>(rows);
  s->out_row = c.take<float>(dim);
  // Banded: a block rect per hash and tile row at most (and one more per
  // hash, the block that reaches past the last row), and the counts.
  s->rects = c.take<BlockRect>(samples * (rows + 1));
  s->counts = c.take<int32_t>(banded ? (kKeyTile + 1) * rows : 0);
  s->log_count = c.take<float>(samples + 1);
}

int64_t scratch_bytes(const AttentionParams& p, bool banded) {
  Carver counting;
  Scratch s;
  carve_scratch(p, banded, counting, &s);
  return counting.used();
}

void write_rows(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows, const RowState& state,
                const double* lse_shift, float* out_row) {
  const int64_t dim = p.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = state.row_sum[r];
    const float* acc = state.acc + r * dim;
    double lse = -std::numeric_limits<double>::infinity();
    if (sum > 0) {
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < dim; ++d) out_row[d] = acc[d] * inv;
      lse = static_cast<double>(state.row_max[r]) + std::log(static_cast<double>(sum)) + lse_shift[r];
    } else {
      std::fill_n(out_row, dim, 0.0f);
    }
    const int64_t i = i0 + r;
    store_row(p.out, p.out_dtype, b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride, dim, out_row);
    if (p.lse != nullptr) p.lse[b * p.lse_batch_stride + i * p.lse_row_stride + h] = static_cast<float>(lse);
  }
}

void report_progress(const ExecContext& ctx, int64_t done, int64_t total, std::atomic<int>* reported) {
  if (!ctx.progress) return;
  const int percent = static_cast<int>(100 * done / total);
  int last = reported->load(std::memory_order_relaxed);
  while (percent > last) {
    if (reported->compare_exchange_weak(last, percent)) {
      ctx.progress(static_cast<double>(done) / static_cast<double>(total));
      return;
    }
  }
}

SliceView q_slice(const AttentionParams& p, int64_t b, int64_t h) {
  return {p.q, p.dtype, b * p.q_batch_stride + h * p.q_head_stride, p.q_row_stride, p.head_dim};
}

SliceView k_slice(const AttentionParams& p, int64_t b, int64_t h) {
  const int64_t hk = h / p.head_group;
  return {p.k, p.dtype, b * p.k_batch_stride + hk * p.k_head_stride, p.k_row_stride, p.head_dim};
}

SliceView v_slice(const AttentionParams& p, int64_t b, int64_t h) {
  const int64_t hk = h / p.head_group;
  return {p.v, p.dtype, b * p.v_batch_stride + hk * p.v_head_stride, p.v_row_stride, p.head_dim};
}

}  // namespace plsh::cpu
