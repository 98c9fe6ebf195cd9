// The probe (SPEC section 6): r seeded query rows per head computed
// exactly in float64 (plsh/exact_rows.h), compared with the output, with
// the rigorous per-row bound, and pooled into a relative error with its
// standard error.
#include <algorithm>
#include <cmath>
#include <limits>

#include "estimates_internal.h"
#include "plsh/exact_rows.h"
#include "plsh/numeric.h"

namespace plsh {

namespace estimates_detail {

ProbeStats probe_stats(const std::vector<ProbeRow>& rows, int64_t population) {
  ProbeStats st;
  st.population = population;
  for (const ProbeRow& pr : rows) {
    ++st.rows;
    st.se += pr.err2;
    st.sn += pr.ref2;
    st.see += pr.err2 * pr.err2;
    st.snn += pr.ref2 * pr.ref2;
    st.sen += pr.err2 * pr.ref2;
    st.max_abs = std::max(st.max_abs, pr.max_abs);
    st.bound_max = std::max(st.bound_max, pr.bound);
  }
  return st;
}

// rel_err = sqrt(Q), Q = sum err2 / sum ref2 over the probe rows (pooled over
// heads). Its standard error is the delta method for a ratio of sample means:
// Q - Q_true ~ sum_i z_i / sum_i ref2_i with z_i = err2_i - Q ref2_i, whose
// variance per head is r s_z^2 (1 - r/N) (simple random sampling without
// replacement of r of the head's N rows; our stratified sample is at least
// as precise, so this errs on the safe side), summed over heads; then
// d sqrt(Q) = dQ / (2 sqrt(Q)).
ProbeEstimate summarize_probe(const std::vector<ProbeStats>& heads) {
  ProbeEstimate e;
  double se = 0, sn = 0;
  for (const ProbeStats& h : heads) {
    e.rows += h.rows;
    se += h.se;
    sn += h.sn;
    e.max_abs_err = std::max(e.max_abs_err, h.max_abs);
    e.bound_max = std::max(e.bound_max, h.bound_max);
  }
  if (e.rows == 0) return e;
  if (sn <= 0) {
    e.rel_err = se > 0 ? kInf : 0;
    e.rel_err_stderr = se > 0 ? kInf : 0;
    return e;
  }
  const double q = se / sn;
  e.rel_err = std::sqrt(q);
  double var = 0;
  for (const ProbeStats& h : heads) {
    if (h.rows == 0 || h.rows == h.population) continue;  // a full census has no sampling error
    if (h.rows < 2) {
      var = kInf;  // one row of many says nothing about the spread
      break;
    }
    const double r = static_cast<double>(h.rows);
    const double sum_z = h.se - q * h.sn;
    const double sum_z2 = std::max(0.0, h.see - 2 * q * h.sen + q * q * h.snn);
    const double s2 = std::max(0.0, (sum_z2 - sum_z * sum_z / r) / (r - 1));
    var += r * s2 * (1 - r / static_cast<double>(h.population));
  }
  const double se_q = std::sqrt(var) / sn;
  e.rel_err_stderr = q > 0 ? se_q / (2 * std::sqrt(q)) : 0;
  return e;
}

}  // namespace estimates_detail

using namespace estimates_detail;

void probe_rows(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, const std::vector<int64_t>& rows,
                ProbeRow* out, const ExecContext* ctx) {
  const int64_t R = static_cast<int64_t>(rows.size());
  if (R == 0) return;
  const int64_t D = p.head_dim;
  const size_t s = m.draws.size();
  const double inv_s = m.mode == Mode::kLsh ? 1.0 / static_cast<double>(s) : 0.0;

  // Per row: the exact output's online softmax (weights exp(logit - |d| /
  // sigma)), the bound's sums with their own online maximum (a_ij =
  // exp(logit)), and the hash blocks around the row's position for M~.
  struct RowState {
    int64_t pos = 0, keys = 0;  // allowed keys: rows [0, keys)
    double max_a = -kInf, bound_num = 0, bound_den = 0, max_v2 = 0;
    std::vector<int64_t> begins, ends;  // sorted
    size_t opened = 0, closed = 0;      // begins / ends at or before the current key
  };
  std::vector<RowState> st(static_cast<size_t>(R));
  std::vector<SoftmaxRow64> exact(static_cast<size_t>(R), SoftmaxRow64(D));
  int64_t max_keys = 0;
  for (int64_t r = 0; r < R; ++r) {
    RowState& row = st[static_cast<size_t>(r)];
    row.pos = p.q_pos0 + rows[static_cast<size_t>(r)];
    row.keys = p.causal ? std::clamp<int64_t>(row.pos - p.k_pos0 + 1, 0, p.kv_len) : p.kv_len;
    max_keys = std::max(max_keys, row.keys);
    if (m.mode == Mode::kLsh) {
      for (const Draw& d : m.draws) {
        row.begins.push_back(block_begin(row.pos, d));
        row.ends.push_back(block_end(row.pos, d));
      }
      std::sort(row.begins.begin(), row.begins.end());
      std::sort(row.ends.begin(), row.ends.end());
    }
  }

  std::vector<double> logit(kExactRowsKeyTile), logw(kExactRowsKeyTile);
  const bool finished = for_each_key_tile(p, h, b, rows, max_keys, [&](const KeyTile& tile) {
    for (int64_t r = 0; r < R; ++r) {
      RowState& row = st[static_cast<size_t>(r)];
      const int64_t n = std::min(tile.count, row.keys - tile.j0);
      if (n <= 0) continue;
      double tile_max_a = -kInf;
      for (int64_t jj = 0; jj < n; ++jj) {
        const double distance = static_cast<double>(std::llabs(row.pos - (p.k_pos0 + tile.j0 + jj)));
        logit[static_cast<size_t>(jj)] = p.scale * tile.scores[jj * R + r];
        logw[static_cast<size_t>(jj)] = logit[static_cast<size_t>(jj)] - distance / m.sigma;
        tile_max_a = std::max(tile_max_a, logit[static_cast<size_t>(jj)]);
      }
      exact[static_cast<size_t>(r)].fold(logw.data(), n, tile.values);

      const double max_a = std::max(row.max_a, tile_max_a);
      const double rescale_a = std::exp(row.max_a - max_a);
      row.bound_num *= rescale_a;
      row.bound_den *= rescale_a;
      row.max_a = max_a;
      for (int64_t jj = 0; jj < n; ++jj) {
        const int64_t x = p.k_pos0 + tile.j0 + jj;
        row.max_v2 = std::max(row.max_v2, tile.value_norm2[jj]);
        const int64_t distance = std::llabs(row.pos - x);
        const double lstar = decay(distance, m.sigma);
        double mask;
        if (m.mode == Mode::kLsh) {
          // Hashes whose block holds x: begin <= x < end; x only grows.
          while (row.opened < s && row.begins[row.opened] <= x) ++row.opened;
          while (row.closed < s && row.ends[row.closed] <= x) ++row.closed;
          mask = static_cast<double>(row.opened - row.closed) * inv_s;
        } else {
          mask = m.window == kNoWindow || distance < m.window ? lstar : 0.0;
        }
        const double a = std::exp(logit[static_cast<size_t>(jj)] - max_a);
        row.bound_num += a * std::fabs(lstar - mask);
        row.bound_den += a * mask;
      }
    }
  }, ctx);
  if (!finished) return;

  for (int64_t r = 0; r < R; ++r) {
    const RowState& row = st[static_cast<size_t>(r)];
    const SoftmaxRow64& e = exact[static_cast<size_t>(r)];
    ProbeRow& pr = out[r];
    pr = ProbeRow{};
    if (row.keys <= 0) continue;  // no key at all: validation rules this out for causal requests
    const int64_t o_off = b * p.o_batch_stride + rows[static_cast<size_t>(r)] * p.o_row_stride + h * p.o_head_stride;
    for (int64_t d = 0; d < D; ++d) {
      const double o_star = e.acc[static_cast<size_t>(d)] / e.sum;
      const double o_tilde = load_element(p.out, p.out_dtype, o_off + d);
      const double diff = std::fabs(o_tilde - o_star);
      pr.err2 += diff * diff;
      pr.ref2 += o_star * o_star;
      pr.max_abs = std::max(pr.max_abs, std::isnan(diff) ? kInf : diff);
    }
    if (std::isnan(pr.err2)) pr.err2 = kInf;
    // The bound holds for o~ in exact arithmetic; the stored output adds its
    // own rounding (float32 ~1e-7, bf16 ~4e-3 relative) on top.
    pr.bound = row.bound_den > 0 ? 2 * std::sqrt(row.max_v2) * row.bound_num / row.bound_den : kInf;
  }
}

}  // namespace plsh
