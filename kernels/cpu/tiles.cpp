#include "cpu/tiles.h"

#include <cblas.h>
#include <omp.h>

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

namespace {

// exp(x) for x <= 0 (and -inf), written so that it vectorises:
// Cephes' expf polynomial (relative error ~2e-7), round-to-nearest by the
// 1.5 * 2^23 trick. Below -88 the exponent field reaches 0 and the result
// is 0, as exp(-inf) must be.
inline float exp_nonpositive(float x) {
  const float xc = x > -88.0f ? x : -88.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void fold_row(float* sr, int64_t len, float* acc_row, int64_t dim, float* row_max, float* row_sum) {
  float tile_max = kNegInf;
#pragma omp simd reduction(max : tile_max)
  for (int64_t c = 0; c < len; ++c) tile_max = tile_max > sr[c] ? tile_max : sr[c];  // std::max does not vectorise
  const float old_max = *row_max;
  const float new_max = std::max(old_max, tile_max);
  if (new_max == kNegInf) {  // nothing allowed in this row yet
    std::fill_n(sr, len, 0.0f);
    return;
  }
  float tile_sum = 0;
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t c = 0; c < len; ++c) {
    const float e = exp_nonpositive(sr[c] - new_max);
    sr[c] = e;
    tile_sum += e;
  }
  if (new_max != old_max) {
    const float rescale = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
    for (int64_t d = 0; d < dim; ++d) acc_row[d] *= rescale;
    *row_sum *= rescale;
    *row_max = new_max;
  }
  *row_sum += tile_sum;
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
  s->k = c.take<float>(widen ? kKeyTile * dim : 0);
  s->v = c.take<float>(widen ? kKeyTile * dim : 0);
  s->s = c.take<float>(rows * kKeyTile);
  s->acc = c.take<float>(rows * dim);
  s->row_max = c.take<float>(rows);
  s->row_sum = c.take<float>(rows);
  s->lse_shift = c.take<double>(rows);
  s->out_row = c.take<float>(dim);
  // Banded: a block rect per hash and tile row at most (and one more per
  // hash, the block that reaches past the last row), and the counts.
  s->rects = c.take<BlockRect>(samples * (rows + 1));
  s->counts = c.take<int32_t>(banded ? (rows + 1) * (kKeyTile + 1) : 0);
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
