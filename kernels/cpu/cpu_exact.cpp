// Exact ALiBi attention (SPEC section 2) and its window restriction
// (section 4): one code path, the window being exact with |pos_i - pos_j| <
// W_h; only the key tiles inside the tile's band are touched.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/tiles.h"

namespace plsh::cpu {

namespace {

int64_t saturating_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
  return r;
}

}  // namespace

void AlibiBias::epilogue(int64_t jt, int64_t len, AlibiEpilogue* e) const {
  // Key c sits at distance d = e0 + r - c from query row r.
  const int64_t e0 = pos_first - (p.k_pos0 + jt);
  // |d| - nearest[r] is left[r] - c for keys at or before the query and
  // c - right[r] after it; both small by the choice of nearest.
  for (int64_t r = 0; r < rows; ++r) {
    e->left[r] = static_cast<float>(e0 + r - nearest[r]);
    e->right[r] = static_cast<float>(e0 + r + nearest[r]);
  }
  std::fill(e->left + rows, e->left + padded_rows(rows), 0.0f);
  std::fill(e->right + rows, e->right + padded_rows(rows), 0.0f);
  // The query rows [rmin, rmax) that key c may meet.
  for (int64_t c = 0; c < len; ++c) {
    const int64_t at_key = c - e0;  // the query row at distance 0
    int64_t rmin = 0, rmax = rows;
    if (width != kNoWindow) {
      rmin = std::max(rmin, saturating_add(at_key, -(width - 1)));
      rmax = std::min(rmax, saturating_add(at_key, width));
    }
    if (p.causal) rmin = std::max(rmin, at_key);
    if (rmin >= rmax) rmin = rmax = 0;
    e->lo[c] = static_cast<float>(rmin);
    e->hi[c] = static_cast<float>(rmax);
  }
  e->bias = {static_cast<float>(-slope), e0, e->left, e->right, e->lo, e->hi};
}

double exact_tile(const AttentionParams& p, const TileJob& job, Scratch& scratch) {
  const int64_t dim = p.head_dim;
  const SliceView qv = q_slice(p, job.b, job.h), kv = k_slice(p, job.b, job.h), vv = v_slice(p, job.b, job.h);
  const double slope = p.slopes[static_cast<size_t>(job.h)];
  const int64_t width = p.mode == Mode::kWindow ? p.window[static_cast<size_t>(job.h)] : kNoWindow;
  const int64_t pos_first = p.q_pos0 + job.i0;
  const int64_t pos_last = pos_first + job.rows - 1;

  // Key positions [lo, hi) that some row of the tile may see.
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  if (width != kNoWindow) {
    lo = saturating_add(pos_first, -(width - 1));
    hi = saturating_add(pos_last, width);
  }
  if (p.causal) hi = std::min(hi, pos_last + 1);
  int64_t j0 = 0, j1 = 0;
  key_rows_of(p, lo, hi, &j0, &j1);

  RowState state = fresh_state(scratch, job.rows, dim);
  double flops = 0;
  if (j0 < j1) {
    int64_t ldq = 0;
    const float* q = rows_as_f32(qv, job.i0, job.rows, scratch.q, &ldq);
    // Each row's logits are taken relative to the bias of its nearest key in
    // [j0, j1), and that constant goes back into lse in double: the float
    // logits stay small even when a query sits far from every key (a float
    // bias of -65536 would carry an absolute error of 0.004).
    const int64_t key_first = p.k_pos0 + j0, key_last = p.k_pos0 + j1 - 1;
    int64_t nearest[kMaxRowTile];
    for (int64_t r = 0; r < job.rows; ++r) {
      const int64_t pos = pos_first + r;
      nearest[r] = pos < key_first ? key_first - pos : pos > key_last ? pos - key_last : 0;
      scratch.lse_shift[static_cast<size_t>(r)] = -slope * static_cast<double>(nearest[r]);
    }
    const AlibiBias add_bias{p, width, slope, pos_first, job.rows, nearest};
    flops = attend(q, ldq, job.rows, kv, vv, j0, j1, static_cast<float>(p.scale), add_bias, scratch, state);
  }
  write_rows(p, job.b, job.h, job.i0, job.rows, state, scratch.lse_shift, scratch.out_row);
  return flops;
}

}  // namespace plsh::cpu
