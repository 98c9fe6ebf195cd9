// Error estimates of SPEC section 6. Everything here works from positions and
// draws (mask errors) or from host copies of q, k, v and the output (probe);
// nothing depends on how a backend computed the output.
//
// Notation: E = L* - M~ on the allowed (query, key) pairs, L*_ij =
// exp(-|pos_i - pos_j| / sigma); M~ the mean of the draws' bin indicators
// (lsh) or L* 1[|d| < W] (window, whose E is then L* 1[|d| >= W]).
#include "plsh/estimates.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <random>

#include "plsh/numeric.h"

namespace plsh {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Salts that keep the row sample, the Lanczos start and the probe rows of
// one head independent of each other and of the draws.
constexpr uint64_t kMaskRowSalt = 0x6d61736b2d726f77ULL;
constexpr uint64_t kSpectralSalt = 0x737065637472616cULL;
constexpr uint64_t kProbeSalt = 0x70726f62652d726fULL;

uint64_t head_seed(uint64_t seed, int64_t h, uint64_t salt) {
  return mix64(mix64(seed ^ salt) + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(h + 1));
}

bool stop_requested(const ExecContext* ctx) { return ctx != nullptr && !ctx->check_stop().ok(); }

// exp(-gap / sigma) for a non-negative integer distance; 1 for sigma = +inf.
double decay(int64_t gap, double sigma) { return gap == 0 ? 1.0 : std::exp(-static_cast<double>(gap) / sigma); }

// exp(-d / sigma) for integer distances, tabulated up to 2^20 of them (8
// MiB): the mask max error reads 4 (s + 1) of them per row.
class DecayTable {
 public:
  DecayTable(double sigma, int64_t max_distance) : sigma_(sigma) {
    if (max_distance < 0 || max_distance >= (int64_t{1} << 20)) return;
    table_.resize(static_cast<size_t>(max_distance) + 1);
    for (size_t d = 0; d < table_.size(); ++d) table_[d] = decay(static_cast<int64_t>(d), sigma);
  }
  double operator()(int64_t d) const {
    return d < static_cast<int64_t>(table_.size()) ? table_[static_cast<size_t>(d)] : decay(d, sigma_);
  }

 private:
  double sigma_;
  std::vector<double> table_;
};

// Largest distance between any query and any key position of the range.
int64_t max_distance(const PositionRange& r) {
  const int64_t q_last = r.q_pos0 + r.q_len - 1, k_last = r.k_pos0 + r.kv_len - 1;
  return std::max(std::llabs(q_last - r.k_pos0), std::llabs(k_last - r.q_pos0));
}

// True when E is identically zero: a slope-0 head under lsh (L* = M~ = 1), or
// a window wider than every distance in the request.
bool mask_is_exact(const HeadMask& m, const PositionRange& r) {
  if (m.mode == Mode::kLsh) return !std::isfinite(m.sigma);
  return m.window == kNoWindow || m.window > max_distance(r);
}

// Which source positions s a target position t sees.
enum class Allowed { kAll, kSourceNotAfter /* s <= t */, kSourceNotBefore /* s >= t */ };

// sum_s r^|t - s| x_s, r = exp(-1/sigma), split at t, over source positions
// s0 + [0, n): two first-order recursions (one left to right, one right to
// left) then O(1) per target, wherever the target lies.
class ExpSums {
 public:
  ExpSums(const double* x, int64_t n, int64_t s0, double sigma)
      : s0_(s0), last_(s0 + n - 1), sigma_(sigma), left_(static_cast<size_t>(n)), right_(static_cast<size_t>(n)) {
    const double r = std::exp(-1.0 / sigma);
    double acc = 0;
    for (int64_t j = 0; j < n; ++j) left_[static_cast<size_t>(j)] = acc = acc * r + x[j];
    acc = 0;
    for (int64_t j = n - 1; j >= 0; --j) right_[static_cast<size_t>(j)] = acc = acc * r + x[j];
  }
  // sum over s <= t of r^(t - s) x_s
  double up_to(int64_t t) const {
    if (t < s0_) return 0;
    if (t >= last_) return left_.back() * decay(t - last_, sigma_);
    return left_[static_cast<size_t>(t - s0_)];
  }
  // sum over s >= t of r^(s - t) x_s
  double from(int64_t t) const {
    if (t > last_) return 0;
    if (t <= s0_) return right_.front() * decay(s0_ - t, sigma_);
    return right_[static_cast<size_t>(t - s0_)];
  }

 private:
  int64_t s0_, last_;
  double sigma_;
  std::vector<double> left_, right_;
};

// Largest eigenvalue of the symmetric tridiagonal matrix (diagonal a,
// off-diagonal b) by Sturm-count bisection: robust and O(n) per step, and n
// stays at the Lanczos iteration cap.
double largest_tridiagonal_eigenvalue(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = a.size();
  double lo = kInf, hi = -kInf;
  for (size_t i = 0; i < n; ++i) {
    const double radius = (i > 0 ? std::fabs(b[i - 1]) : 0.0) + (i + 1 < n ? std::fabs(b[i]) : 0.0);
    lo = std::min(lo, a[i] - radius);
    hi = std::max(hi, a[i] + radius);
  }
  // Eigenvalues below x = negative pivots of the LDL^T factorisation of T - x I.
  auto count_below = [&](double x) {
    size_t count = 0;
    double d = 1;
    for (size_t i = 0; i < n; ++i) {
      d = a[i] - x - (i > 0 ? b[i - 1] * b[i - 1] / d : 0.0);
      if (d == 0) d = -std::numeric_limits<double>::min();
      if (d < 0) ++count;
    }
    return count;
  };
  for (int step = 0; step < 200; ++step) {
    const double mid = 0.5 * (lo + hi);
    if (!(mid > lo && mid < hi)) break;
    if (count_below(mid) == n) hi = mid;
    else lo = mid;
  }
  return hi;
}

double dot(const std::vector<double>& x, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

MaskMaxError lsh_mask_max_error(const HeadMask& m, const PositionRange& r, int64_t row_budget, uint64_t seed,
                                const ExecContext* ctx) {
  MaskMaxError out;
  const std::vector<int64_t> rows = sample_indices(r.q_len, row_budget, seed);
  out.rows_checked = static_cast<int64_t>(rows.size());
  out.rows_sampled = out.rows_checked < r.q_len;
  if (mask_is_exact(m, r) || m.draws.empty()) return out;

  const size_t s = m.draws.size();
  const double inv_s = 1.0 / static_cast<double>(s);
  const DecayTable lstar(m.sigma, max_distance(r));
  std::vector<int64_t> begins(s), ends(s), sorted_begins(s), sorted_ends(s);
  struct Move {
    int64_t old_begin, old_end, new_begin, new_end;
  };
  std::vector<Move> moves;
  auto replace_sorted = [](std::vector<int64_t>& v, int64_t old_value, int64_t new_value) {
    v.erase(std::lower_bound(v.begin(), v.end(), old_value));
    v.insert(std::upper_bound(v.begin(), v.end(), new_value), new_value);
  };
  bool first = true;
  for (size_t n = 0; n < rows.size(); ++n) {
    if (n % 1024 == 0 && stop_requested(ctx)) {
      out.stopped = true;
      return out;
    }
    const int64_t pos = r.q_pos0 + rows[n];
    const int64_t k_lo = r.k_pos0;
    const int64_t k_hi = r.causal ? std::min(r.k_pos0 + r.kv_len - 1, pos) : r.k_pos0 + r.kv_len - 1;
    if (k_hi < k_lo) continue;
    // Rows ascend, so each hash's block only moves forward. The sorted
    // edges are kept up to date move by move while few blocks move (long
    // blocks, consecutive rows), else sorted afresh.
    moves.clear();
    for (size_t k = 0; k < s; ++k) {
      if (first || pos >= ends[k]) {
        const int64_t b = block_begin(pos, m.draws[k]), e = block_end(pos, m.draws[k]);
        moves.push_back({begins[k], ends[k], b, e});
        begins[k] = b;
        ends[k] = e;
      }
    }
    if (first || moves.size() * 8 > s) {
      sorted_begins = begins;
      sorted_ends = ends;
      std::sort(sorted_begins.begin(), sorted_begins.end());
      std::sort(sorted_ends.begin(), sorted_ends.end());
    } else {
      for (const Move& mv : moves) {
        replace_sorted(sorted_begins, mv.old_begin, mv.new_begin);
        replace_sorted(sorted_ends, mv.old_end, mv.new_end);
      }
    }
    first = false;
    // M~ is a step function of the key position x: left of pos it is k/s on
    // [begin_(k), begin_(k+1) - 1] (the sorted block starts), right of pos
    // (s - k)/s on [end_(k), end_(k+1) - 1]. L* is monotone on each side, so
    // |L* - M~| peaks at a piece's first or last allowed key.
    auto piece = [&](int64_t lo, int64_t hi, double mask) {
      lo = std::max(lo, k_lo);
      hi = std::min(hi, k_hi);
      if (lo > hi) return;
      out.value = std::max({out.value, std::fabs(lstar(std::llabs(pos - lo)) - mask),
                            std::fabs(lstar(std::llabs(pos - hi)) - mask)});
    };
    for (size_t k = 0; k <= s; ++k) {
      const int64_t lo = k == 0 ? INT64_MIN : sorted_begins[k - 1];
      const int64_t hi = k == s ? pos : sorted_begins[k] - 1;
      piece(lo, hi, static_cast<double>(k) * inv_s);
    }
    for (size_t k = 0; k <= s; ++k) {
      const int64_t lo = k == 0 ? pos : sorted_ends[k - 1];
      const int64_t hi = k == s ? INT64_MAX : sorted_ends[k] - 1;
      piece(lo, hi, static_cast<double>(s - k) * inv_s);
    }
  }
  return out;
}

// Window: the error sits on the excluded pairs, where it equals L*, so the
// maximum is L* at the smallest excluded distance present in the request.
MaskMaxError window_mask_max_error(const HeadMask& m, const PositionRange& r) {
  MaskMaxError out;
  out.rows_checked = r.q_len;
  if (mask_is_exact(m, r)) return out;
  const int64_t w = m.window;  // <= max_distance(r), so pos +- w cannot overflow
  int64_t nearest = INT64_MAX;
  for (int64_t i = 0; i < r.q_len; ++i) {
    const int64_t pos = r.q_pos0 + i;
    const int64_t k_lo = r.k_pos0;
    const int64_t k_hi = r.causal ? std::min(r.k_pos0 + r.kv_len - 1, pos) : r.k_pos0 + r.kv_len - 1;
    if (k_hi < k_lo) continue;
    const int64_t left = std::min(k_hi, pos - w);  // nearest key at or beyond distance w on the left
    if (left >= k_lo) nearest = std::min(nearest, pos - left);
    const int64_t right = std::max(k_lo, pos + w);
    if (right <= k_hi) nearest = std::min(nearest, right - pos);
  }
  if (nearest != INT64_MAX) out.value = decay(nearest, m.sigma);
  return out;
}

// Per-head sufficient statistics of the probe rows, pooled at the end.
struct ProbeStats {
  int64_t rows = 0;
  int64_t population = 0;  // B * Nq rows the sample was drawn from
  double se = 0, sn = 0;   // sums of err2 and ref2
  double see = 0, snn = 0, sen = 0;
  double max_abs = 0, bound_max = 0;
};

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

// The head's description and its mask estimates; the probe runs later, in
// tasks that spread each head's rows over the threads.
void estimate_head_masks(const AttentionParams& p, const PositionRange& range, int64_t h, const HeadMask& m,
                         const ExecContext& ctx, HeadEstimate* he) {
  he->head = h;
  he->slope = p.slopes[static_cast<size_t>(h)];
  he->sigma = m.sigma;
  if (p.mode == Mode::kWindow) he->window = m.window;
  if (p.mode == Mode::kLsh) {
    he->max_block = max_block_size(m.draws, range);
    if (p.return_draws) he->draws = m.draws;
  }
  if (!p.estimates) return;

  const MaskMaxError max_err = mask_max_error(m, range, p.mask_row_budget, head_seed(p.seed, h, kMaskRowSalt), &ctx);
  he->mask_max_err = max_err.value;
  he->mask_rows_checked = max_err.rows_checked;
  he->mask_rows_sampled = max_err.rows_sampled;
  if (max_err.stopped) return;

  const SpectralError spectral = mask_spectral_error(m, range, head_seed(p.seed, h, kSpectralSalt), 100, 1e-4, &ctx);
  he->mask_spectral_err = spectral.value;
  he->spectral_iterations = spectral.iterations;
}

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

}  // namespace

PositionRange position_range(const AttentionParams& p) {
  return PositionRange{p.q_pos0, p.q_len, p.k_pos0, p.kv_len, p.causal};
}

int64_t max_block_size(const std::vector<Draw>& draws, const PositionRange& r) {
  // The query and key ranges, merged when they touch: walking the hull of
  // two far-apart ranges (offsets reach 2^52) would never end.
  struct Span {
    int64_t lo, hi;  // [lo, hi)
  };
  Span spans[2] = {{r.q_pos0, r.q_pos0 + r.q_len}, {r.k_pos0, r.k_pos0 + r.kv_len}};
  if (spans[1].lo < spans[0].lo) std::swap(spans[0], spans[1]);
  int span_count = 2;
  if (spans[1].lo <= spans[0].hi) {
    spans[0].hi = std::max(spans[0].hi, spans[1].hi);
    span_count = 1;
  }
  int64_t best = 0;
  for (const Draw& d : draws) {
    if (!std::isfinite(d.pitch)) {
      int64_t all = 0;
      for (int i = 0; i < span_count; ++i) all += spans[i].hi - spans[i].lo;
      return all;
    }
    // A block reaching across the gap counts its positions in both spans.
    int64_t last_bin = 0, last_size = 0;
    bool any = false;
    for (int i = 0; i < span_count; ++i) {
      for (int64_t pos = spans[i].lo; pos < spans[i].hi;) {
        const int64_t end = std::min(block_end(pos, d), spans[i].hi);
        const int64_t bin = bin_of(pos, d);
        int64_t size = end - pos;
        if (any && bin == last_bin) size += last_size;
        best = std::max(best, size);
        last_bin = bin;
        last_size = size;
        any = true;
        pos = end;
      }
    }
  }
  return best;
}

HeadMask head_mask(const AttentionParams& p, int64_t h) {
  HeadMask m;
  m.mode = p.mode;
  m.sigma = p.sigma(h);
  if (p.mode == Mode::kLsh) m.draws = draw_hashes(p.seed, h, m.sigma, p.samples);
  if (p.mode == Mode::kWindow && !p.window.empty()) m.window = p.window[static_cast<size_t>(h)];
  return m;
}

std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> out;
  if (n <= 0 || count <= 0) return out;
  if (count >= n) {
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  out.reserve(static_cast<size_t>(count));
  using u128 = unsigned __int128;
  for (int64_t t = 0; t < count; ++t) {
    // Stratum t is [floor(t n / count), floor((t + 1) n / count)): never
    // empty since n > count, and disjoint from the others.
    const int64_t lo = static_cast<int64_t>(static_cast<u128>(t) * static_cast<u128>(n) / static_cast<u128>(count));
    const int64_t hi =
        static_cast<int64_t>(static_cast<u128>(t + 1) * static_cast<u128>(n) / static_cast<u128>(count));
    const double u = static_cast<double>(mix64(seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(t + 1)) >> 11) *
                     0x1.0p-53;
    const int64_t pick = lo + static_cast<int64_t>(u * static_cast<double>(hi - lo));
    out.push_back(std::min(pick, hi - 1));
  }
  return out;
}

MaskMaxError mask_max_error(const HeadMask& m, const PositionRange& r, int64_t row_budget, uint64_t sample_seed,
                            const ExecContext* ctx) {
  if (m.mode == Mode::kWindow) return window_mask_max_error(m, r);
  return lsh_mask_max_error(m, r, row_budget, sample_seed, ctx);
}

namespace {

// Block edges of every hash over one target range, kept across the Lanczos
// iterations: finding them (block_end, three floor divisions a block) costs
// more than the product itself when blocks are short.
class BlockEdges {
 public:
  // Per hash: the begin of the block holding t0, then every block end up to
  // and including the first at or past t_end.
  static void of_hash(const Draw& d, int64_t t0, int64_t t_end, std::vector<int64_t>* edges) {
    edges->clear();
    edges->push_back(block_begin(t0, d));
    int64_t e = block_end(t0, d);
    edges->push_back(e);
    while (e < t_end) {
      e = block_end(e, d);
      edges->push_back(e);
    }
  }
  // Gives up (complete() false, nothing kept) past max_entries edges.
  BlockEdges(const std::vector<Draw>& draws, int64_t t0, int64_t nt, size_t max_entries) : t0_(t0), nt_(nt) {
    std::vector<int64_t> one;
    for (const Draw& d : draws) {
      of_hash(d, t0, t0 + nt, &one);
      if (flat_.size() + one.size() > max_entries) {
        std::vector<int64_t>().swap(flat_);
        offsets_.clear();
        return;
      }
      offsets_.push_back(flat_.size());
      flat_.insert(flat_.end(), one.begin(), one.end());
    }
    complete_ = true;
  }
  bool complete() const { return complete_; }
  bool covers(int64_t t0, int64_t nt) const { return complete_ && t0 == t0_ && nt == nt_; }
  const int64_t* hash(size_t k) const { return flat_.data() + offsets_[k]; }

 private:
  int64_t t0_, nt_;
  bool complete_ = false;
  std::vector<int64_t> flat_;
  std::vector<size_t> offsets_;
};

void apply_mask_error_with(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose,
                           const BlockEdges* cached) {
  // Source: the vector's side; target: the output's side.
  const int64_t s0 = transpose ? r.q_pos0 : r.k_pos0, ns = transpose ? r.q_len : r.kv_len;
  const int64_t t0 = transpose ? r.k_pos0 : r.q_pos0, nt = transpose ? r.kv_len : r.q_len;
  const Allowed allowed = !r.causal ? Allowed::kAll : transpose ? Allowed::kSourceNotBefore : Allowed::kSourceNotAfter;
  std::fill(y, y + nt, 0.0);
  if (mask_is_exact(m, r) || ns <= 0) return;

  const ExpSums sums(x, ns, s0, m.sigma);
  const bool left = allowed != Allowed::kSourceNotBefore;   // sources before the target count
  const bool right = allowed != Allowed::kSourceNotAfter;   // sources after the target count
  if (m.mode == Mode::kWindow) {
    // L* 1[|d| >= W] directly: no cancellation against the band.
    const double edge = decay(m.window, m.sigma);
    for (int64_t n = 0; n < nt; ++n) {
      const int64_t t = t0 + n;
      y[n] = (left ? edge * sums.up_to(t - m.window) : 0.0) + (right ? edge * sums.from(t + m.window) : 0.0);
    }
    return;
  }

  const double step = decay(1, m.sigma);
  for (int64_t n = 0; n < nt; ++n) {
    const int64_t t = t0 + n;
    // The source at t itself counts once whichever side is allowed.
    y[n] = (left ? sums.up_to(t) : 0.0) + (right ? (left ? step * sums.from(t + 1) : sums.from(t)) : 0.0);
  }

  // M~ x: per hash, the sum of x over the target's block (clipped to the
  // allowed side) from prefix sums of x; blocks advance with the targets.
  std::vector<double> prefix(static_cast<size_t>(ns) + 1, 0.0);
  for (int64_t j = 0; j < ns; ++j) prefix[static_cast<size_t>(j) + 1] = prefix[static_cast<size_t>(j)] + x[j];
  const int64_t s_last = s0 + ns - 1;
  auto range_sum = [&](int64_t a, int64_t b) {  // positions [a, b], inclusive
    a = std::max(a, s0);
    b = std::min(b, s_last);
    return a > b ? 0.0 : prefix[static_cast<size_t>(b - s0) + 1] - prefix[static_cast<size_t>(a - s0)];
  };
  const double inv_s = 1.0 / static_cast<double>(m.draws.size());
  if (cached != nullptr && !cached->covers(t0, nt)) cached = nullptr;
  std::vector<int64_t> scratch;
  for (size_t k = 0; k < m.draws.size(); ++k) {
    const int64_t* edges;
    if (cached != nullptr) {
      edges = cached->hash(k);
    } else {
      BlockEdges::of_hash(m.draws[k], t0, t0 + nt, &scratch);
      edges = scratch.data();
    }
    int64_t begin = edges[0], end = edges[1];
    size_t next = 2;
    for (int64_t n = 0; n < nt; ++n) {
      const int64_t t = t0 + n;
      while (t >= end) {
        begin = end;
        end = edges[next++];
      }
      y[n] -= inv_s * range_sum(left ? begin : t, right ? end - 1 : t);
    }
  }
}

}  // namespace

void apply_mask_error(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose) {
  apply_mask_error_with(m, r, x, y, transpose, nullptr);
}

SpectralError mask_spectral_error(const HeadMask& m, const PositionRange& r, uint64_t start_seed,
                                  int64_t max_iterations, double tolerance, const ExecContext* ctx) {
  SpectralError out;
  if (r.q_len <= 0 || r.kv_len <= 0 || mask_is_exact(m, r)) {
    out.converged = true;
    return out;
  }
  // Lanczos on the smaller Gram matrix: ||E||_2^2 is its largest eigenvalue.
  const bool on_keys = r.kv_len <= r.q_len;
  const size_t n = static_cast<size_t>(on_keys ? r.kv_len : r.q_len);
  std::vector<double> between(static_cast<size_t>(on_keys ? r.q_len : r.kv_len));
  // Block edges over the query and the key range, kept while they fit in
  // 64 MiB each (8M edges: s = 256 hashes of sigma = 2 over 65536
  // positions take 6.6M); else found again in every product, one hash at a
  // time. Lanczos at sigma = 2, s = 256, n = 65536: 10 s -> 3 s.
  constexpr size_t kEdgeCacheEntries = 64 * 1024 * 1024 / sizeof(int64_t);
  std::unique_ptr<BlockEdges> query_edges, key_edges;
  if (m.mode == Mode::kLsh) {
    query_edges = std::make_unique<BlockEdges>(m.draws, r.q_pos0, r.q_len, kEdgeCacheEntries);
    // The same range (the usual self-attention case): one set serves both.
    if (r.k_pos0 != r.q_pos0 || r.kv_len != r.q_len)
      key_edges = std::make_unique<BlockEdges>(m.draws, r.k_pos0, r.kv_len, kEdgeCacheEntries);
  }
  const BlockEdges* to_queries = query_edges.get();
  const BlockEdges* to_keys = key_edges ? key_edges.get() : query_edges.get();
  auto gram = [&](const std::vector<double>& v, std::vector<double>& w) {
    apply_mask_error_with(m, r, v.data(), between.data(), !on_keys, on_keys ? to_queries : to_keys);
    apply_mask_error_with(m, r, between.data(), w.data(), on_keys, on_keys ? to_keys : to_queries);
  };

  std::vector<double> v(n), v_prev(n, 0.0), w(n);
  std::mt19937_64 rng(start_seed);
  std::normal_distribution<double> normal;
  for (double& x : v) x = normal(rng);
  const double norm0 = std::sqrt(dot(v, v));
  for (double& x : v) x /= norm0;

  // Plain three-term Lanczos without reorthogonalisation: lost orthogonality
  // only duplicates converged Ritz values, and the largest one never exceeds
  // lambda_max (Paige), which is all we read.
  std::vector<double> alphas, betas;
  double beta_prev = 0, previous = -1;
  int calm = 0;
  for (int64_t it = 1; it <= max_iterations; ++it) {
    if (stop_requested(ctx)) {
      out.stopped = true;
      return out;
    }
    gram(v, w);
    for (size_t i = 0; i < n; ++i) w[i] -= beta_prev * v_prev[i];
    const double alpha = dot(w, v);
    for (size_t i = 0; i < n; ++i) w[i] -= alpha * v[i];
    // A second pass against v costs O(n) and keeps w orthogonal to it in
    // floating point.
    const double again = dot(w, v);
    for (size_t i = 0; i < n; ++i) w[i] -= again * v[i];
    const double beta = std::sqrt(dot(w, w));
    alphas.push_back(alpha + again);

    const double lambda = std::max(0.0, largest_tridiagonal_eigenvalue(alphas, betas));
    const double estimate = std::sqrt(lambda);
    out.value = estimate;
    out.iterations = it;
    if (beta <= 1e-12 * std::max(lambda, std::numeric_limits<double>::min())) {
      out.converged = true;  // the Krylov space is invariant: the Ritz value is exact
      break;
    }
    // Twice in a row, so that one slow step is not mistaken for convergence.
    calm = previous >= 0 && std::fabs(estimate - previous) <= tolerance * estimate ? calm + 1 : 0;
    previous = estimate;
    if (calm >= 2) {
      out.converged = true;
      break;
    }
    betas.push_back(beta);
    beta_prev = beta;
    std::swap(v_prev, v);
    for (size_t i = 0; i < n; ++i) v[i] = w[i] / beta;
  }
  return out;
}

void probe_rows(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, const std::vector<int64_t>& rows,
                ProbeRow* out, const ExecContext* ctx) {
  const int64_t R = static_cast<int64_t>(rows.size());
  if (R == 0) return;
  const int64_t D = p.head_dim;
  const int64_t hk = h / p.head_group;
  const size_t s = m.draws.size();
  const double inv_s = m.mode == Mode::kLsh ? 1.0 / static_cast<double>(s) : 0.0;

  // Per row: online maxima (flash-attention style) for the exact weights
  // exp(logit - |d| / sigma) and for the bound's a_ij = exp(logit), so that
  // nothing overflows or vanishes whatever the logits, and the hash blocks
  // around the row's position for M~.
  struct RowState {
    int64_t pos = 0, keys = 0;  // allowed keys: rows [0, keys)
    double max_e = -kInf, sum_e = 0;
    double max_a = -kInf, bound_num = 0, bound_den = 0, max_v2 = 0;
    std::vector<int64_t> begins, ends;  // sorted
    size_t opened = 0, closed = 0;      // begins / ends at or before the current key
  };
  std::vector<RowState> st(static_cast<size_t>(R));
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

  // Keys in tiles converted to double once for all R rows; the products run
  // with the row index innermost (q transposed) and the head dimension
  // innermost, so both vectorise without reassociating a sum.
  constexpr int64_t kTile = 128;
  std::vector<float> buf(static_cast<size_t>(D));
  std::vector<double> qt(static_cast<size_t>(D * R)), acc(static_cast<size_t>(R * D), 0.0);
  std::vector<double> kt(static_cast<size_t>(kTile * D)), vt(static_cast<size_t>(kTile * D)), v2(kTile);
  std::vector<double> scores(static_cast<size_t>(kTile * R)), logit(kTile), logw(kTile);
  for (int64_t r = 0; r < R; ++r) {
    load_row(p.q, p.dtype, b * p.q_batch_stride + rows[static_cast<size_t>(r)] * p.q_row_stride + h * p.q_head_stride, D,
             buf.data());
    for (int64_t d = 0; d < D; ++d) qt[static_cast<size_t>(d * R + r)] = buf[static_cast<size_t>(d)];
  }

  for (int64_t j0 = 0; j0 < max_keys; j0 += kTile) {
    // Every 64 tiles (~8k keys): a task over a million keys still stops promptly.
    if (j0 % (64 * kTile) == 0 && j0 > 0 && stop_requested(ctx)) return;
    const int64_t tn = std::min(kTile, max_keys - j0);
    for (int64_t jj = 0; jj < tn; ++jj) {
      const int64_t j = j0 + jj;
      double* kj = &kt[static_cast<size_t>(jj * D)];
      double* vj = &vt[static_cast<size_t>(jj * D)];
      load_row(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride, D, buf.data());
      for (int64_t d = 0; d < D; ++d) kj[d] = buf[static_cast<size_t>(d)];
      load_row(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride, D, buf.data());
      double n2 = 0;
      for (int64_t d = 0; d < D; ++d) {
        vj[d] = buf[static_cast<size_t>(d)];
        n2 += vj[d] * vj[d];
      }
      v2[static_cast<size_t>(jj)] = n2;
    }
    std::fill(scores.begin(), scores.begin() + tn * R, 0.0);
    for (int64_t jj = 0; jj < tn; ++jj) {
      double* sj = &scores[static_cast<size_t>(jj * R)];
      for (int64_t d = 0; d < D; ++d) {
        const double kd = kt[static_cast<size_t>(jj * D + d)];
        const double* qd = &qt[static_cast<size_t>(d * R)];
        for (int64_t r = 0; r < R; ++r) sj[r] += qd[r] * kd;
      }
    }

    for (int64_t r = 0; r < R; ++r) {
      RowState& row = st[static_cast<size_t>(r)];
      const int64_t n = std::min(tn, row.keys - j0);
      if (n <= 0) continue;
      double tile_max_e = -kInf, tile_max_a = -kInf;
      for (int64_t jj = 0; jj < n; ++jj) {
        const double distance = static_cast<double>(std::llabs(row.pos - (p.k_pos0 + j0 + jj)));
        logit[static_cast<size_t>(jj)] = p.scale * scores[static_cast<size_t>(jj * R + r)];
        logw[static_cast<size_t>(jj)] = logit[static_cast<size_t>(jj)] - distance / m.sigma;
        tile_max_a = std::max(tile_max_a, logit[static_cast<size_t>(jj)]);
        tile_max_e = std::max(tile_max_e, logw[static_cast<size_t>(jj)]);
      }
      const double max_e = std::max(row.max_e, tile_max_e), max_a = std::max(row.max_a, tile_max_a);
      const double rescale_e = std::exp(row.max_e - max_e), rescale_a = std::exp(row.max_a - max_a);
      double* o = &acc[static_cast<size_t>(r * D)];
      for (int64_t d = 0; d < D; ++d) o[d] *= rescale_e;
      row.sum_e *= rescale_e;
      row.bound_num *= rescale_a;
      row.bound_den *= rescale_a;
      row.max_e = max_e;
      row.max_a = max_a;
      for (int64_t jj = 0; jj < n; ++jj) {
        const int64_t x = p.k_pos0 + j0 + jj;
        const double weight = std::exp(logw[static_cast<size_t>(jj)] - max_e);
        const double* vj = &vt[static_cast<size_t>(jj * D)];
        for (int64_t d = 0; d < D; ++d) o[d] += weight * vj[d];
        row.sum_e += weight;
        row.max_v2 = std::max(row.max_v2, v2[static_cast<size_t>(jj)]);

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
  }

  for (int64_t r = 0; r < R; ++r) {
    const RowState& row = st[static_cast<size_t>(r)];
    ProbeRow& pr = out[r];
    pr = ProbeRow{};
    if (row.keys <= 0) continue;  // no key at all: validation rules this out for causal requests
    const int64_t o_off = b * p.o_batch_stride + rows[static_cast<size_t>(r)] * p.o_row_stride + h * p.o_head_stride;
    for (int64_t d = 0; d < D; ++d) {
      const double o_star = acc[static_cast<size_t>(r * D + d)] / row.sum_e;
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

ProbeRow probe_row(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, int64_t i) {
  ProbeRow row;
  probe_rows(p, m, h, b, {i}, &row);
  return row;
}

Status compute_estimates(const AttentionParams& p, const ExecContext& ctx, AttentionResult* result) {
  if (result == nullptr) return internal_error("compute_estimates: result = null, expected an AttentionResult");
  if (p.mode == Mode::kExact) return Status::Ok();
  const PositionRange range = position_range(p);
  const int64_t heads = p.heads;
  result->heads.assign(static_cast<size_t>(heads), HeadEstimate{});
  std::vector<HeadMask> masks(static_cast<size_t>(heads));

  std::atomic<bool> failed{false};
  std::mutex failure_mutex;
  Status failure;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(failure_mutex);
    if (failure.ok()) failure = std::move(s);
    failed.store(true);
  };
  // Polled between units of work; nothing may escape an OpenMP region, and
  // memory is the one thing that can run out here.
  auto run = [&](const std::string& what, auto&& work) {
    if (failed.load()) return;
    Status s = ctx.check_stop();
    if (!s.ok()) return fail(std::move(s));
    try {
      work();
    } catch (const std::bad_alloc&) {
      return fail(resource_exhausted(what + " ran out of host memory"));
    }
    s = ctx.check_stop();
    if (!s.ok()) fail(std::move(s));
  };
  const int threads = ctx.threads > 0 ? ctx.threads : omp_get_max_threads();

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t h = 0; h < heads; ++h) {
    run("mask estimates for head " + std::to_string(h), [&] {
      masks[static_cast<size_t>(h)] = head_mask(p, h);
      estimate_head_masks(p, range, h, masks[static_cast<size_t>(h)], ctx, &result->heads[static_cast<size_t>(h)]);
    });
  }
  if (!failure.ok()) return failure;
  if (!p.estimates) return Status::Ok();
  for (const HeadEstimate& he : result->heads) {
    result->mask_max_err = std::max(result->mask_max_err, he.mask_max_err);
    result->mask_spectral_err = std::max(result->mask_spectral_err, he.mask_spectral_err);
  }

  // The probe reads q, k, v and the output: only where they are host memory.
  if (p.memory != MemorySpace::kHost || p.probe_rows <= 0 || p.out == nullptr) return Status::Ok();
  // Tasks of up to kRowsPerTask rows of one (head, batch item): one pass
  // over that item's keys serves them all, and even a single head's probe
  // spreads over the threads.
  constexpr size_t kRowsPerTask = 16;
  struct Task {
    int64_t head, batch;
    size_t first;                // into the head's sample
    std::vector<int64_t> rows;   // query rows of this batch item
  };
  const int64_t population = p.batch * p.q_len;
  std::vector<std::vector<int64_t>> samples(static_cast<size_t>(heads));
  std::vector<std::vector<ProbeRow>> probed(static_cast<size_t>(heads));
  std::vector<Task> tasks;
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<int64_t>& sample = samples[static_cast<size_t>(h)];
    sample = sample_indices(population, p.probe_rows, head_seed(p.seed, h, kProbeSalt));
    probed[static_cast<size_t>(h)].resize(sample.size());
    for (size_t n = 0; n < sample.size();) {  // sorted, so each batch item's rows are contiguous
      Task t{h, sample[n] / p.q_len, n, {}};
      while (n < sample.size() && sample[n] / p.q_len == t.batch && t.rows.size() < kRowsPerTask)
        t.rows.push_back(sample[n++] % p.q_len);
      tasks.push_back(std::move(t));
    }
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t n = 0; n < tasks.size(); ++n) {
    const Task& t = tasks[n];
    run("probe for head " + std::to_string(t.head), [&] {
      probe_rows(p, masks[static_cast<size_t>(t.head)], t.head, t.batch, t.rows,
                 &probed[static_cast<size_t>(t.head)][t.first], &ctx);
    });
  }
  if (!failure.ok()) return failure;

  std::vector<ProbeStats> stats(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    stats[static_cast<size_t>(h)] = probe_stats(probed[static_cast<size_t>(h)], population);
    result->heads[static_cast<size_t>(h)].probe = summarize_probe({stats[static_cast<size_t>(h)]});
  }
  result->probe = summarize_probe(stats);
  return Status::Ok();
}

}  // namespace plsh
