#include "cpu/tiles.h"

#include <omp.h>

#include "cpu/exp.h"
#include "src/vector_clones.h"

// The exp and max loops below vectorise only if GCC may if-convert float
// compares, i.e. without trapping-math (we never unmask FP exceptions).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

namespace plsh::cpu {

namespace {

// s[i] += log_count[count[i]]: a gather, which AVX2 does in vector lanes.
PLSH_VECTOR_CLONES void add_log_counts(float* s, const int32_t* count, int64_t n, const float* log_count) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] += log_count[count[i]];
}

}  // namespace

void add_counted_log_weight(float* st, int64_t ld, int32_t* steps, int64_t width, int64_t rows, int64_t skip,
                            int64_t len, int64_t key_pos, int64_t pos_first, bool causal, const float* log_count) {
  for (int64_t c = 1; c < skip + len; ++c)
    for (int64_t i = 0; i < rows; ++i) steps[c * width + i] += steps[(c - 1) * width + i];
  const int32_t* counts = steps + skip * width;
  for (int64_t c = 0; c < len; ++c) {
    float* sc = st + c * ld;
    const int64_t first_allowed = causal ? std::clamp<int64_t>(key_pos + c - pos_first, 0, rows) : 0;
    std::fill_n(sc, first_allowed, kNegInf);
    // log_count[0] is -inf: a pair no hash put in one bin is masked.
    add_log_counts(sc + first_allowed, counts + c * width + first_allowed, rows - first_allowed, log_count);
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
