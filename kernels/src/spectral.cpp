// mask_spectral_err (SPEC section 6): ||L* - M~||_2 by Lanczos, with
// products by E in O((q_len + kv_len) * samples): L* through two
// first-order exponential recursions, M~ through block sums per hash.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>

#include "estimates_internal.h"

namespace plsh {

using namespace estimates_detail;

namespace {

// Which source positions s a target position t sees.
enum class Allowed { kAll, kSourceNotAfter /* s <= t */, kSourceNotBefore /* s >= t */ };

// sum_s r^|t - s| x_s, r = exp(-1/sigma), split at t, over source positions
// s0 + [0, n): two first-order recursions (one left to right, one right to
// left) then O(1) per target, wherever the target lies.
// Buffers of one product, kept across the Lanczos iterations: allocating
// (and page-faulting) three vectors of n doubles per product cost as much
// as the product at n = 131072.
struct ProductScratch {
  std::vector<double> left, right, prefix;
  std::vector<int64_t> edges;
};

class ExpSums {
 public:
  ExpSums(const double* x, int64_t n, int64_t s0, double sigma, ProductScratch* scratch)
      : s0_(s0), last_(s0 + n - 1), sigma_(sigma), left_(scratch->left), right_(scratch->right) {
    left_.resize(static_cast<size_t>(n));
    right_.resize(static_cast<size_t>(n));
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
  std::vector<double>& left_;
  std::vector<double>& right_;
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
    if (count_below(mid) == n)
      hi = mid;
    else
      lo = mid;
  }
  return hi;
}

double dot(const std::vector<double>& x, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Block edges over a range are kept while they fit in 64 MiB (8M edges: s =
// 256 hashes of sigma = 2 over 65536 positions take 6.6M); else found again
// in every product, one hash at a time. Lanczos at sigma = 2, s = 256, n =
// 65536: 10 s -> 3 s.
constexpr size_t kEdgeCacheEntries = 64 * 1024 * 1024 / sizeof(int64_t);

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
  BlockEdges(std::span<const Draw> draws, int64_t t0, int64_t nt, size_t max_entries) : t0_(t0), nt_(nt) {
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
    offsets_.push_back(flat_.size());
    // Every block change in target order: at target n, the hashes whose
    // block starts there (their edges 1, 2, ... inside the range).
    event_start_.assign(static_cast<size_t>(nt) + 1, 0);
    for (size_t k = 0; k + 1 < offsets_.size(); ++k)
      for (size_t i = offsets_[k] + 1; i < offsets_[k + 1]; ++i)
        if (flat_[i] < t0 + nt) ++event_start_[static_cast<size_t>(flat_[i] - t0) + 1];
    for (size_t n = 1; n < event_start_.size(); ++n) event_start_[n] += event_start_[n - 1];
    event_hash_.resize(static_cast<size_t>(event_start_.back()));
    std::vector<int64_t> fill(event_start_.begin(), event_start_.end() - 1);
    for (size_t k = 0; k + 1 < offsets_.size(); ++k)
      for (size_t i = offsets_[k] + 1; i < offsets_[k + 1]; ++i)
        if (flat_[i] < t0 + nt)
          event_hash_[static_cast<size_t>(fill[static_cast<size_t>(flat_[i] - t0)]++)] = static_cast<int32_t>(k);
    complete_ = true;
  }
  bool complete() const { return complete_; }
  bool covers(int64_t t0, int64_t nt) const { return complete_ && t0 == t0_ && nt == nt_; }
  const int64_t* hash(size_t k) const { return flat_.data() + offsets_[k]; }
  // The hashes whose block changes at target n: [events(n), events(n + 1)).
  int64_t events(int64_t n) const { return event_start_[static_cast<size_t>(n)]; }
  int32_t event_hash(int64_t e) const { return event_hash_[static_cast<size_t>(e)]; }

 private:
  int64_t t0_, nt_;
  bool complete_ = false;
  std::vector<int64_t> event_start_;  // [nt + 1]
  std::vector<int32_t> event_hash_;
  std::vector<int64_t> flat_;
  std::vector<size_t> offsets_;
};

void apply_mask_error_with(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose,
                           const BlockEdges* cached, ProductScratch* scratch) {
  // Source: the vector's side; target: the output's side.
  const int64_t s0 = transpose ? r.q_pos0 : r.k_pos0, ns = transpose ? r.q_len : r.kv_len;
  const int64_t t0 = transpose ? r.k_pos0 : r.q_pos0, nt = transpose ? r.kv_len : r.q_len;
  const Allowed allowed = !r.causal ? Allowed::kAll : transpose ? Allowed::kSourceNotBefore : Allowed::kSourceNotAfter;
  std::fill(y, y + nt, 0.0);
  if (mask_is_exact(m, r) || ns <= 0) return;

  const ExpSums sums(x, ns, s0, m.sigma, scratch);
  const bool left = allowed != Allowed::kSourceNotBefore;  // sources before the target count
  const bool right = allowed != Allowed::kSourceNotAfter;  // sources after the target count
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

  // M~ x: per hash and block, the sum of x over the block (clipped to the
  // allowed side), from prefix sums of x. Block by block, not target by
  // target: a constant for a whole block when both sides count, a running
  // prefix otherwise, in loops without branches (Lanczos at n = 131072, s =
  // 16: 3x faster than one range lookup per target and hash).
  std::vector<double>& prefix = scratch->prefix;
  prefix.resize(static_cast<size_t>(ns) + 1);
  prefix[0] = 0.0;
  for (int64_t j = 0; j < ns; ++j) prefix[static_cast<size_t>(j) + 1] = prefix[static_cast<size_t>(j)] + x[j];
  const double* pre = prefix.data();
  // Sum of x over source positions < a.
  auto below = [&](int64_t a) { return pre[std::clamp<int64_t>(a - s0, 0, ns)]; };
  const double inv_s = 1.0 / static_cast<double>(m.draws.size());
  if (cached != nullptr && !cached->covers(t0, nt)) cached = nullptr;
  if (cached != nullptr) {
    // Summed over the hashes at once: with B = sum_k below(begin_k) and
    // E = sum_k below(end_k) over the blocks holding target t, M~ x at t is
    // (E - B) / s (both sides), (s below(t + 1) - B) / s (sources <= t) or
    // (E - s below(t)) / s (sources >= t). B and E change only where a block
    // does: O(nt + edges) a product instead of O(nt s) (spectral error at
    // s = 256: most of the estimates' time). Summed afresh every 256
    // targets, so the running updates' rounding cannot drift.
    const size_t s = m.draws.size();
    const double ds = static_cast<double>(s);
    std::vector<int64_t>& cursor = scratch->edges;  // per hash: index of the current block's end
    cursor.assign(s, 1);
    auto resum = [&](double* b, double* e) {
      *b = 0;
      *e = 0;
      for (size_t k = 0; k < s; ++k) {
        const int64_t* edges = cached->hash(k);
        *b += below(edges[cursor[k] - 1]);
        *e += below(edges[cursor[k]]);
      }
    };
    double sum_b = 0, sum_e = 0;
    for (int64_t n = 0; n < nt; ++n) {
      const int64_t t = t0 + n;
      for (int64_t ev = cached->events(n); ev < cached->events(n + 1); ++ev) {
        const size_t k = static_cast<size_t>(cached->event_hash(ev));
        const int64_t* edges = cached->hash(k);
        // The block [edges[c - 1], edges[c]) ends at t; [t, edges[c + 1]) begins.
        const int64_t c = cursor[k];
        sum_b += below(edges[c]) - below(edges[c - 1]);
        sum_e += below(edges[c + 1]) - below(edges[c]);
        cursor[k] = c + 1;
      }
      if (n % 256 == 0) resum(&sum_b, &sum_e);
      const double mx = left && right ? sum_e - sum_b : left ? ds * below(t + 1) - sum_b : sum_e - ds * below(t);
      y[n] -= inv_s * mx;
    }
    return;
  }
  for (size_t k = 0; k < m.draws.size(); ++k) {
    const int64_t* edges;
    if (cached != nullptr) {
      edges = cached->hash(k);
    } else {
      BlockEdges::of_hash(m.draws[k], t0, t0 + nt, &scratch->edges);
      edges = scratch->edges.data();
    }
    int64_t begin = edges[0], end = edges[1];
    size_t next = 2;
    for (int64_t n = 0; n < nt;) {
      while (t0 + n >= end) {
        begin = end;
        end = edges[next++];
      }
      const int64_t n_end = std::min(nt, end - t0);  // this block's targets: [n, n_end)
      if (left && right) {
        const double c = inv_s * (below(end) - below(begin));
        for (int64_t i = n; i < n_end; ++i) y[i] -= c;
      } else if (left) {  // sources [begin, t]
        const double base = below(begin);
        for (int64_t i = n; i < n_end; ++i) y[i] -= inv_s * (below(t0 + i + 1) - base);
      } else {  // sources [t, end)
        const double top = below(end);
        for (int64_t i = n; i < n_end; ++i) y[i] -= inv_s * (top - below(t0 + i));
      }
      n = n_end;
    }
  }
}

}  // namespace

void apply_mask_error(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose) {
  ProductScratch scratch;
  std::unique_ptr<BlockEdges> edges;
  if (uses_draws(m.mode)) {
    const int64_t t0 = transpose ? r.k_pos0 : r.q_pos0, nt = transpose ? r.kv_len : r.q_len;
    edges = std::make_unique<BlockEdges>(m.draws, t0, nt, kEdgeCacheEntries);
  }
  apply_mask_error_with(m, r, x, y, transpose, edges.get(), &scratch);
}

namespace estimates_detail {

void apply_mask_error_per_hash(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose) {
  ProductScratch scratch;
  apply_mask_error_with(m, r, x, y, transpose, nullptr, &scratch);
}

}  // namespace estimates_detail

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
  // Block edges over the query and the key range (kEdgeCacheEntries).
  std::unique_ptr<BlockEdges> query_edges, key_edges;
  if (uses_draws(m.mode)) {
    query_edges = std::make_unique<BlockEdges>(m.draws, r.q_pos0, r.q_len, kEdgeCacheEntries);
    // The same range (the usual self-attention case): one set serves both.
    if (r.k_pos0 != r.q_pos0 || r.kv_len != r.q_len)
      key_edges = std::make_unique<BlockEdges>(m.draws, r.k_pos0, r.kv_len, kEdgeCacheEntries);
  }
  const BlockEdges* to_queries = query_edges.get();
  const BlockEdges* to_keys = key_edges ? key_edges.get() : query_edges.get();
  ProductScratch scratch;
  auto gram = [&](const std::vector<double>& v, std::vector<double>& w) {
    apply_mask_error_with(m, r, v.data(), between.data(), !on_keys, on_keys ? to_queries : to_keys, &scratch);
    apply_mask_error_with(m, r, between.data(), w.data(), on_keys, on_keys ? to_keys : to_queries, &scratch);
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

}  // namespace plsh
