#include "cpu/tiles.h"

#include <cblas.h>

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

namespace {

struct ScratchSizes {
  int64_t widened_q, widened_kv, tile_rows_dim, banded_per_row;
};

ScratchSizes scratch_sizes(const AttentionParams& p, bool banded) {
  const bool widen = p.dtype != DType::kF32;
  ScratchSizes z{};
  z.widened_q = widen ? kRowTile * p.head_dim : 0;
  z.widened_kv = widen ? kKeyTile * p.head_dim : 0;
  z.tile_rows_dim = kRowTile * p.head_dim;
  z.banded_per_row = banded ? p.samples : 0;
  return z;
}

}  // namespace

int64_t scratch_bytes(const AttentionParams& p, bool banded) {
  const ScratchSizes z = scratch_sizes(p, banded);
  const int64_t floats = z.widened_q + 2 * z.widened_kv + kRowTile * kKeyTile + z.tile_rows_dim + 2 * kRowTile +
                         p.head_dim + kRowTile * 2 * z.banded_per_row + (z.banded_per_row + 1);
  const int64_t int64s = kRowTile * 4 * z.banded_per_row;
  return 4 * floats + 8 * int64s + 8 * kRowTile + 4 * kRowTile;
}

void size_scratch(const AttentionParams& p, bool banded, Scratch* s) {
  const ScratchSizes z = scratch_sizes(p, banded);
  s->q.resize(static_cast<size_t>(z.widened_q));
  s->k.resize(static_cast<size_t>(z.widened_kv));
  s->v.resize(static_cast<size_t>(z.widened_kv));
  s->s.resize(static_cast<size_t>(kRowTile * kKeyTile));
  s->acc.resize(static_cast<size_t>(z.tile_rows_dim));
  s->row_max.resize(kRowTile);
  s->row_sum.resize(kRowTile);
  s->lse_shift.resize(kRowTile);
  s->out_row.resize(static_cast<size_t>(p.head_dim));
  s->begins.resize(static_cast<size_t>(kRowTile * z.banded_per_row));
  s->ends.resize(static_cast<size_t>(kRowTile * z.banded_per_row));
  s->edges.resize(static_cast<size_t>(kRowTile * 2 * z.banded_per_row));
  s->edge_log_w.resize(static_cast<size_t>(kRowTile * 2 * z.banded_per_row));
  s->edge_count.resize(kRowTile);
  s->log_count.resize(static_cast<size_t>(z.banded_per_row + 1));
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
