#include "plsh/exact_rows.h"

#include <algorithm>
#include <cmath>

#include "plsh/numeric.h"

namespace plsh {

bool for_each_key_tile(const AttentionParams& p, int64_t h, int64_t b, std::span<const int64_t> rows,
                       std::span<const KeyRange> ranges, const std::function<void(const KeyTile&)>& visit,
                       const ExecContext* ctx, std::span<const KeyRange> row_windows) {
  const int64_t R = static_cast<int64_t>(rows.size());
  const int64_t D = p.head_dim;
  const int64_t hk = h / p.head_group;
  constexpr int64_t kTile = kExactRowsKeyTile;
  constexpr int64_t kScoreKeys = 8;
  // Keys are converted to double once for all R rows and stored transposed
  // ([d][key]), so that one row's products with kScoreKeys keys run in
  // vector lanes across the keys while each key's sum still runs over d in
  // index order from 0 (no reassociation). A probe group is often one to a
  // few rows, so lanes across rows would stay empty; a row's sum over d
  // alone is a chain of dependent adds.
  std::vector<float> buf(static_cast<size_t>(D));
  std::vector<double> qr(static_cast<size_t>(R * D));
  std::vector<double> kt(static_cast<size_t>(D * kTile)), vt(static_cast<size_t>(kTile * D));
  std::vector<double> scores(static_cast<size_t>(kTile * R));
  for (int64_t r = 0; r < R; ++r) {
    load_row(p.q, p.dtype, b * p.q_batch_stride + rows[static_cast<size_t>(r)] * p.q_row_stride + h * p.q_head_stride,
             D, buf.data());
    for (int64_t d = 0; d < D; ++d) qr[static_cast<size_t>(r * D + d)] = buf[static_cast<size_t>(d)];
  }
  int64_t tiles = 0;
  for (const KeyRange& range : ranges) {
    for (int64_t j0 = range.begin; j0 < range.end; j0 += kTile) {
      if (++tiles % 64 == 0 && ctx != nullptr && !ctx->check_stop().ok()) return false;
      const int64_t tn = std::min(kTile, range.end - j0);
      for (int64_t jj = 0; jj < tn; ++jj) {
        const int64_t j = j0 + jj;
        double* vj = &vt[static_cast<size_t>(jj * D)];
        const float* k =
            row_as_f32(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride, D, buf.data());
        for (int64_t d = 0; d < D; ++d) kt[static_cast<size_t>(d * kTile + jj)] = k[d];
        const float* v =
            row_as_f32(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride, D, buf.data());
        for (int64_t d = 0; d < D; ++d) vj[d] = v[d];
      }
      int64_t r0 = 0, r1 = R;
      if (!row_windows.empty()) {
        while (r0 < R && row_windows[static_cast<size_t>(r0)].end <= j0) ++r0;
        while (r1 > r0 && row_windows[static_cast<size_t>(r1 - 1)].begin >= j0 + tn) --r1;
      }
      for (int64_t r = r0; r < r1; ++r) {
        const double* q = &qr[static_cast<size_t>(r * D)];
        int64_t jj = 0;
        for (; jj + kScoreKeys <= tn; jj += kScoreKeys) {
          double acc[kScoreKeys] = {};
          for (int64_t d = 0; d < D; ++d) {
            const double* kd = &kt[static_cast<size_t>(d * kTile + jj)];
            for (int64_t i = 0; i < kScoreKeys; ++i) acc[i] += q[d] * kd[i];
          }
          for (int64_t i = 0; i < kScoreKeys; ++i) scores[static_cast<size_t>((jj + i) * R + r)] = acc[i];
        }
        for (; jj < tn; ++jj) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += q[d] * kt[static_cast<size_t>(d * kTile + jj)];
          scores[static_cast<size_t>(jj * R + r)] = acc;
        }
      }
      KeyTile tile;
      tile.j0 = j0;
      tile.count = tn;
      tile.rows = R;
      tile.row_begin = r0;
      tile.row_end = r1;
      tile.scores = scores.data();
      tile.values = vt.data();
      visit(tile);
    }
  }
  return true;
}

void SoftmaxRow64::fold(const double* logits, int64_t n, const double* values) {
  double tile_max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, logits[j]);
  const double new_max = std::max(max, tile_max);
  if (new_max == -std::numeric_limits<double>::infinity()) return;  // nothing allowed yet
  const double rescale = std::exp(max - new_max);
  const int64_t dim = static_cast<int64_t>(acc.size());
  for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] *= rescale;
  sum *= rescale;
  max = new_max;
  for (int64_t j = 0; j < n; ++j) {
    if (logits[j] == -std::numeric_limits<double>::infinity()) continue;
    const double weight = std::exp(logits[j] - new_max);
    const double* v = values + j * dim;
    for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += weight * v[d];
    sum += weight;
  }
}

}  // namespace plsh
