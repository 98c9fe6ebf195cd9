// The probe (SPEC section 6): r seeded query rows per head computed
// exactly in float64 (plsh/exact_rows.h), compared with the output, with
// the rigorous per-row bound, and pooled into a relative error with its
// standard error.
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>

#include <omp.h>

#include "estimates_internal.h"
#include "plsh/exact_rows.h"
#include "plsh/numeric.h"
#include "vector_clones.h"

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
    st.err2.push_back(pr.err2);
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
    e.rel_err_upper = se > 0 ? kInf : 0;
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
  e.rel_err_upper = probe_rel_err_upper(heads, q, se_q);
  return e;
}

}  // namespace estimates_detail

using namespace estimates_detail;

namespace {

// ||row||^2 in double; float32 rows read in place. `omp simd` lets the
// sum run in vector lanes (the order differs from the sequential sum by
// ~64 ulp of double at most, far inside the (1 + 1e-12) that probe_rows
// allows the norms' rounding), built for AVX2+FMA too and picked at load
// time.
PLSH_VECTOR_CLONES double squared_norm_f32(const float* x, int64_t n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += static_cast<double>(x[d]) * x[d];
  return s;
}

double squared_norm(const void* data, DType t, int64_t offset, int64_t n, float* buf) {
  return squared_norm_f32(row_as_f32(data, t, offset, n, buf), n);
}

// Key rows [j0, j1) of batch item b, every kv head with wanted[hk] set:
// ||v_j||^2 into stats[hk].v2_prefix_max[j] (the running max comes later)
// and the largest ||k_j||^2 into max_k2[hk]. Rows outer, heads inner, so k
// and v are read in their memory order: one head's rows alone are a walk
// with a stride of H * D elements that touches a new page every row or two
// (probe key statistics at n = 32768, 8 heads: 83 ms of CPU that way).
void key_norms(const AttentionParams& p, int64_t b, int64_t j0, int64_t j1, const char* wanted, ProbeKeyStats* stats,
               double* max_k2, float* buf) {
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
      if (!wanted[hk]) continue;
      const double k2 =
          squared_norm(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride, p.head_dim, buf);
      max_k2[hk] = std::max(max_k2[hk], k2);
      stats[hk].v2_prefix_max[static_cast<size_t>(j)] =
          squared_norm(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride, p.head_dim, buf);
    }
  }
}

// ||v_j||^2 of a tile's float64 value row, summed in index order.
double squared_norm64(const double* v, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += v[d] * v[d];
  return s;
}

void running_max(std::vector<double>& x) {
  double m = 0;
  for (double& e : x) e = m = std::max(m, e);
}

}  // namespace

ProbeKeyStats probe_key_stats(const AttentionParams& p, int64_t b, int64_t kv_head) {
  const size_t n = static_cast<size_t>(b * p.kv_heads + kv_head);
  std::vector<char> wanted(static_cast<size_t>(p.batch * p.kv_heads), 0);
  wanted[n] = 1;
  std::vector<ProbeKeyStats> all;
  if (!probe_key_stats_all(p, wanted, 1, &all).ok()) throw std::bad_alloc();  // its one failure
  return std::move(all[n]);
}

Status probe_key_stats_all(const AttentionParams& p, const std::vector<char>& wanted, int threads,
                           std::vector<ProbeKeyStats>* out) {
  const int64_t heads = p.kv_heads;
  out->assign(static_cast<size_t>(p.batch * heads), ProbeKeyStats{});
  try {
    for (size_t n = 0; n < out->size(); ++n)
      if (wanted[n]) (*out)[n].v2_prefix_max.resize(static_cast<size_t>(p.kv_len));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("probe key statistics ran out of host memory");
  }
  // Chunks of 4096 rows of one batch item: enough work to spread over the
  // threads, each chunk's maxima kept apart and merged after.
  constexpr int64_t kChunk = 4096;
  const int64_t per_item = (p.kv_len + kChunk - 1) / kChunk;
  const int64_t chunks = p.batch * per_item;
  std::vector<double> chunk_max_k2(static_cast<size_t>(chunks * heads), 0.0);
  const int t = std::max(threads, 1);
  std::vector<float> bufs(static_cast<size_t>(t * p.head_dim));
#pragma omp parallel for schedule(dynamic, 1) num_threads(t)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c / per_item, j0 = (c % per_item) * kChunk;
    key_norms(p, b, j0, std::min(p.kv_len, j0 + kChunk), wanted.data() + b * heads, out->data() + b * heads,
              chunk_max_k2.data() + c * heads, bufs.data() + omp_get_thread_num() * p.head_dim);
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t hk = 0; hk < heads; ++hk) {
      const size_t n = static_cast<size_t>(b * heads + hk);
      if (!wanted[n]) continue;
      double max_k2 = 0;
      for (int64_t c = b * per_item; c < (b + 1) * per_item; ++c)
        max_k2 = std::max(max_k2, chunk_max_k2[static_cast<size_t>(c * heads + hk)]);
      (*out)[n].max_k_norm = std::sqrt(max_k2);
      running_max((*out)[n].v2_prefix_max);
    }
  }
  return Status::Ok();
}

int64_t probe_reach(double sigma, double a_max, int64_t nearest) {
  if (!std::isfinite(sigma) || !std::isfinite(a_max)) return INT64_MAX;
  const double reach = static_cast<double>(nearest) + sigma * (2 * a_max + std::log(2 * sigma + 2) + 40);
  return reach < 4e18 ? static_cast<int64_t>(std::ceil(reach)) : INT64_MAX;
}

void probe_rows(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, const std::vector<int64_t>& rows,
                ProbeRow* out, const ExecContext* ctx, const ProbeKeyStats* keys) {
  const int64_t R = static_cast<int64_t>(rows.size());
  if (R == 0) return;
  const int64_t D = p.head_dim;
  const size_t s = m.draws.size();
  const double inv_s = uses_draws(m.mode) ? 1.0 / static_cast<double>(s) : 0.0;

  // Per row: the exact output's online softmax (weights exp(logit - |d| /
  // sigma)), the bound's sums with their own online maximum (a_ij =
  // exp(logit)), and the hash blocks around the row's position for M~.
  struct RowState {
    int64_t pos = 0, keys = 0;  // allowed keys: rows [0, keys)
    int64_t lo = 0, hi = 0;     // the key rows visited: [lo, hi)
    double a_max = kInf;        // |logit| <= a_max (with keys)
    double tail = 0;            // keys dropped: their weight's bound, relative to exp(a_max)
    double max_a = -kInf, bound_num = 0, bound_den = 0, max_v2 = 0;
    // Window: the bound's sums over the keys outside and inside the window,
    // in the exact softmax's scale (see below).
    double out_w = 0, in_w = 0;
    std::vector<int64_t> begins, ends;  // sorted
    size_t opened = 0, closed = 0;      // begins / ends at or before the current key
  };
  std::vector<RowState> st(static_cast<size_t>(R));
  std::vector<SoftmaxRow64> exact(static_cast<size_t>(R), SoftmaxRow64(D));
  std::vector<float> qbuf(static_cast<size_t>(D));
  for (int64_t r = 0; r < R; ++r) {
    RowState& row = st[static_cast<size_t>(r)];
    row.pos = p.q_pos0 + rows[static_cast<size_t>(r)];
    row.keys = p.causal ? std::clamp<int64_t>(row.pos - p.k_pos0 + 1, 0, p.kv_len) : p.kv_len;
    row.lo = 0;
    row.hi = row.keys;
    if (keys != nullptr && row.keys > 0) {
      load_row(p.q, p.dtype, b * p.q_batch_stride + rows[static_cast<size_t>(r)] * p.q_row_stride + h * p.q_head_stride,
               D, qbuf.data());
      double q2 = 0;
      for (float x : qbuf) q2 += static_cast<double>(x) * x;
      // (1 + 1e-12): the norms' own rounding cannot make the bound too small.
      row.a_max = p.scale * std::sqrt(q2) * keys->max_k_norm * (1 + 1e-12);
      // The nearest allowed key (lsh and window keep queries among the keys: 0).
      const int64_t key_pos_last = p.k_pos0 + row.keys - 1;
      const int64_t nearest = row.pos < p.k_pos0       ? p.k_pos0 - row.pos
                              : row.pos > key_pos_last ? row.pos - key_pos_last
                                                       : 0;
      const int64_t reach = probe_reach(m.sigma, row.a_max, nearest);
      if (reach != INT64_MAX) {
        const int64_t at = row.pos - p.k_pos0;  // key row of the query's position
        row.lo = std::clamp<int64_t>(at - reach, 0, row.keys);
        row.hi = std::clamp<int64_t>(at + reach + 1, 0, row.keys);
        // Each side's dropped keys sum to at most (sigma + 1) exp(a_max - reach / sigma).
        const double side = (m.sigma + 1) * std::exp(-static_cast<double>(reach) / m.sigma);
        row.tail = (row.lo > 0 ? side : 0.0) + (row.hi < row.keys ? side : 0.0);
      }
      row.max_v2 = keys->v2_prefix_max[static_cast<size_t>(row.keys - 1)];
    }
    if (uses_draws(m.mode)) {
      for (const Draw& d : m.draws) {
        row.begins.push_back(block_begin(row.pos, d));
        row.ends.push_back(block_end(row.pos, d));
      }
      std::sort(row.begins.begin(), row.begins.end());
      std::sort(row.ends.begin(), row.ends.end());
    }
    // Every key where M~ > 0 is visited whatever the reach (a block longer
    // than the reach is possible, if rare): the dropped keys all have
    // M~ = 0, which the tail bound assumes.
    if (uses_draws(m.mode) && !row.begins.empty()) {
      row.lo = std::min(row.lo, std::clamp<int64_t>(row.begins.front() - p.k_pos0, 0, row.keys));
      row.hi = std::max(row.hi, std::clamp<int64_t>(row.ends.back() - p.k_pos0, 0, row.keys));
    } else if (m.mode == Mode::kWindow && m.window < (int64_t{1} << 60) && row.keys > 0) {
      const int64_t at = row.pos - p.k_pos0;
      row.lo = std::min(row.lo, std::clamp<int64_t>(at - (m.window - 1), 0, row.keys));
      row.hi = std::max(row.hi, std::clamp<int64_t>(at + m.window, 0, row.keys));
    } else if (m.mode == Mode::kWindow && row.keys > 0) {
      row.lo = 0;
      row.hi = row.keys;
    }
  }

  // L* by distance, tabulated once for the rows' farthest key (the same
  // values as decay(), one exp per distance instead of one per row and key).
  int64_t farthest = 0;
  for (const RowState& row : st)
    if (row.lo < row.hi)
      farthest = std::max<int64_t>(
          {farthest, std::llabs(row.pos - (p.k_pos0 + row.lo)), std::llabs(row.pos - (p.k_pos0 + row.hi - 1))});
  const DecayTable lstar_of(m.sigma, farthest);

  // Rows whose key ranges overlap are scored together, one pass over the
  // union of their ranges; rows whose ranges are apart (steep slopes, rows
  // far apart) in passes of their own, so no row is scored where it has
  // nothing to visit.
  std::vector<int64_t> order(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) order[static_cast<size_t>(r)] = r;
  std::sort(order.begin(), order.end(),
            [&](int64_t x, int64_t y) { return st[static_cast<size_t>(x)].lo < st[static_cast<size_t>(y)].lo; });
  std::vector<double> logit(kExactRowsKeyTile), logw(kExactRowsKeyTile), weight(kExactRowsKeyTile),
      a_of(kExactRowsKeyTile);
  std::vector<int64_t> group, group_rows;
  std::vector<KeyRange> windows;
  bool finished = true;
  for (size_t g = 0; g < order.size() && finished;) {
    group.clear();
    KeyRange span{st[static_cast<size_t>(order[g])].lo, st[static_cast<size_t>(order[g])].hi};
    while (g < order.size() && st[static_cast<size_t>(order[g])].lo <= span.end) {
      const RowState& row = st[static_cast<size_t>(order[g])];
      span.end = std::max(span.end, row.hi);
      if (row.lo < row.hi) group.push_back(order[g]);
      ++g;
    }
    if (group.empty()) continue;
    group_rows.clear();
    windows.clear();
    for (int64_t r : group) {
      group_rows.push_back(rows[static_cast<size_t>(r)]);
      windows.push_back({st[static_cast<size_t>(r)].lo, st[static_cast<size_t>(r)].hi});
    }
    const int64_t G = static_cast<int64_t>(group.size());
    finished = for_each_key_tile(
        p, h, b, group_rows, std::span<const KeyRange>(&span, 1),
        [&](const KeyTile& tile) {
          for (int64_t gr = 0; gr < G; ++gr) {
            RowState& row = st[static_cast<size_t>(group[static_cast<size_t>(gr)])];
            SoftmaxRow64& exact_row = exact[static_cast<size_t>(group[static_cast<size_t>(gr)])];
            const int64_t first = std::max<int64_t>(0, row.lo - tile.j0);
            const int64_t last = std::min(tile.count, row.hi - tile.j0);
            const int64_t n = last - first;
            if (n <= 0) continue;
            double tile_max_a = -kInf;
            for (int64_t jj = first; jj < last; ++jj) {
              const double distance = static_cast<double>(std::llabs(row.pos - (p.k_pos0 + tile.j0 + jj)));
              logit[static_cast<size_t>(jj - first)] = p.scale * tile.scores[jj * G + gr];
              logw[static_cast<size_t>(jj - first)] = logit[static_cast<size_t>(jj - first)] - distance / m.sigma;
              tile_max_a = std::max(tile_max_a, logit[static_cast<size_t>(jj - first)]);
            }
            const double old_max = exact_row.max;
            exact_row.fold(logw.data(), n, tile.values + first * D, weight.data());
            if (m.mode == Mode::kWindow) {
              if (exact_row.max == -kInf) continue;  // no allowed key yet: nothing to add
              // a_ij L*_ij = exp(logit - d / sigma) is the exact softmax's
              // weight times exp(its max), and the window's M~ is L* inside
              // the window and 0 outside: the bound's numerator sums the
              // weights outside, its denominator those inside, in one scale
              // that cancels. One exp a key instead of two.
              const double rescale = std::exp(old_max - exact_row.max);  // 0 on the first tile
              row.out_w *= rescale;
              row.in_w *= rescale;
              const int64_t x0 = p.k_pos0 + tile.j0 + first;
              double out_sum = 0, in_sum = 0;
              for (int64_t jj = 0; jj < n; ++jj) {
                const bool inside = m.window == kNoWindow || std::llabs(row.pos - (x0 + jj)) < m.window;
                (inside ? in_sum : out_sum) += weight[static_cast<size_t>(jj)];
              }
              row.out_w += out_sum;
              row.in_w += in_sum;
              if (keys == nullptr)
                for (int64_t jj = first; jj < last; ++jj)
                  row.max_v2 = std::max(row.max_v2, squared_norm64(tile.values + jj * D, D));
              continue;
            }

            const double max_a = std::max(row.max_a, tile_max_a);
            const double rescale_a = std::exp(row.max_a - max_a);
            row.bound_num *= rescale_a;
            row.bound_den *= rescale_a;
            row.max_a = max_a;
            exp_shifted(logit.data(), n, max_a, a_of.data());  // a_ij relative to the row's largest
            for (int64_t jj = first; jj < last; ++jj) {
              const int64_t x = p.k_pos0 + tile.j0 + jj;
              if (keys == nullptr) row.max_v2 = std::max(row.max_v2, squared_norm64(tile.values + jj * D, D));
              const int64_t distance = std::llabs(row.pos - x);
              const double lstar = lstar_of(distance);
              double mask;
              if (uses_draws(m.mode)) {
                // Hashes whose block holds x: begin <= x < end; x only grows.
                while (row.opened < s && row.begins[row.opened] <= x) ++row.opened;
                while (row.closed < s && row.ends[row.closed] <= x) ++row.closed;
                mask = static_cast<double>(row.opened - row.closed) * inv_s;
              } else {
                mask = m.window == kNoWindow || distance < m.window ? lstar : 0.0;
              }
              const double a = a_of[static_cast<size_t>(jj - first)];
              row.bound_num += a * std::fabs(lstar - mask);
              row.bound_den += a * mask;
            }
          }
        },
        ctx, windows);
  }
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
    // The dropped keys' share of sum_j a_ij |L* - M~| (where M~ = 0, at most
    // a_ij L*_ij) keeps the bound rigorous.
    // The window's sums are in the exact softmax's scale, exp(e.max).
    const bool window = m.mode == Mode::kWindow;
    const double scale_max = window ? e.max : row.max_a;
    const double num =
        (window ? row.out_w : row.bound_num) + (row.tail > 0 ? row.tail * std::exp(row.a_max - scale_max) : 0.0);
    const double den = window ? row.in_w : row.bound_den;
    // The bound holds for o~ in exact arithmetic; the stored output adds its
    // own rounding (float32 ~1e-7, bf16 ~4e-3 relative) on top.
    pr.bound = den > 0 ? 2 * std::sqrt(row.max_v2) * num / den : kInf;
  }
}

}  // namespace plsh
