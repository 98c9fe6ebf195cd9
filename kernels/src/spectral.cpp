// mask_spectral_err (SPEC section 6): ||L* - M~||_2 by Lanczos, with
// products by E in O((q_len + kv_len) * samples): L* through two
// first-order exponential recursions, M~ through block sums per hash.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <type_traits>

#include "estimates_internal.h"
#include "vector_clones.h"

namespace plsh {

using namespace estimates_detail;

namespace {

// Which source positions s a target position t sees.
enum class Allowed { kAll, kSourceNotAfter /* s <= t */, kSourceNotBefore /* s >= t */ };

// sum_s r^|t - s| x_s, r = exp(-1/sigma), split at t, over source positions
// s0 + [0, n): first-order recursions (left to right for the sources before
// a target, right to left for those after; only the sides a product reads),
// then O(1) per target, wherever the target lies.
// Buffers of one product, kept across the Lanczos iterations: allocating
// (and page-faulting) three vectors of n doubles per product cost as much
// as the product at n = 131072.
struct ProductScratch {
  std::vector<double> left, right, prefix;
  std::vector<int64_t> edges;
};

// f(std::true_type) or f(std::false_type): a run-time flag as a template's.
template <class F>
void with_flag(bool flag, F&& f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

class ExpSums {
 public:
  // With want_prefix, also scratch->prefix[j] = x_0 + ... + x_(j-1), j in
  // [0, n], in the same pass (the block sums' prefix, lsh only).
  ExpSums(const double* x, int64_t n, int64_t s0, double sigma, bool want_left, bool want_right, bool want_prefix,
          ProductScratch* scratch)
      : s0_(s0), last_(s0 + n - 1), sigma_(sigma), left_(scratch->left), right_(scratch->right) {
    const double r = std::exp(-1.0 / sigma);
    if (want_left) left_.resize(static_cast<size_t>(n));
    if (want_right) right_.resize(static_cast<size_t>(n));
    if (want_prefix) scratch->prefix.resize(static_cast<size_t>(n) + 1);
    double* prefix = want_prefix ? scratch->prefix.data() : nullptr;
    // The one loop for exactly the sums wanted.
    with_flag(want_left, [&](auto left) {
      with_flag(want_right, [&](auto right) {
        with_flag(want_prefix, [&](auto pre) {
          sweep<decltype(left)::value, decltype(right)::value, decltype(pre)::value>(x, n, r, prefix);
        });
      });
    });
  }
  // y[i] += c * sum over s <= t of r^(t - s) x_s at t = t0 + i, i in
  // [0, nt): a straight read where t lies among the sources.
  void add_up_to(double c, int64_t t0, int64_t nt, double* y) const {
    const int64_t inside = std::clamp<int64_t>(s0_ - t0, 0, nt);         // first i with t >= s0
    const int64_t beyond = std::clamp<int64_t>(last_ - t0, inside, nt);  // first i with t >= last
    const int64_t off = t0 - s0_;
    for (int64_t i = inside; i < beyond; ++i) y[i] += c * left_[static_cast<size_t>(off + i)];
    for (int64_t i = beyond; i < nt; ++i) y[i] += c * left_.back() * decay(t0 + i - last_, sigma_);
  }
  // y[i] += c * sum over s >= t of r^(s - t) x_s, t = t0 + i.
  void add_from(double c, int64_t t0, int64_t nt, double* y) const {
    const int64_t inside = std::clamp<int64_t>(s0_ + 1 - t0, 0, nt);         // first i with t > s0
    const int64_t beyond = std::clamp<int64_t>(last_ + 1 - t0, inside, nt);  // first i with t > last
    for (int64_t i = 0; i < inside; ++i) y[i] += c * right_.front() * decay(s0_ - (t0 + i), sigma_);
    const int64_t off = t0 - s0_;
    for (int64_t i = inside; i < beyond; ++i) y[i] += c * right_[static_cast<size_t>(off + i)];
  }

 private:
  // Each sum is a chain of dependent operations (a multiply and an add a
  // step for the recursions, an add for the prefix): side by side in one
  // loop they cost what the longest costs alone, not their total (the
  // Lanczos products at n = 32768, s = 16 ran them one after the other).
  // The same operations in the same order as one loop each.
  template <bool kLeft, bool kRight, bool kPrefix>
  void sweep(const double* x, int64_t n, double r, double* prefix) {
    double acc_l = 0, acc_r = 0, acc_p = 0;
    if (kPrefix) prefix[0] = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      if (kLeft) left_[static_cast<size_t>(j)] = acc_l = acc_l * r + x[j];
      if (kRight) right_[static_cast<size_t>(n - 1 - j)] = acc_r = acc_r * r + x[n - 1 - j];
      if (kPrefix) prefix[j + 1] = acc_p = acc_p + x[j];
    }
  }

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

// In vector lanes (the sum's order is the lanes', not the index's): three
// dots an iteration were 4 cycles an element each as one chain of adds.
PLSH_VECTOR_CLONES double dot(const std::vector<double>& x, const std::vector<double>& y) {
  double s = 0;
  const double* a = x.data();
  const double* b = y.data();
  const size_t n = x.size();
#pragma omp simd reduction(+ : s)
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Where source position x falls in prefix sums over sources s0 + [0, ns):
// clamped to [0, ns], without overflow at an infinite pitch's int64 limits.
int64_t source_index(int64_t x, int64_t s0, int64_t ns) { return x <= s0 ? 0 : x >= s0 + ns ? ns : x - s0; }

// Block edges over a range are kept while there are at most 8M block changes
// (13 bytes each, 104 MiB; s = 256 hashes of sigma = 2 over 65536 positions
// make 6.6M); else found again in every product, one hash at a time.
// Lanczos at sigma = 2, s = 256, n = 65536: 10 s -> 3 s.
constexpr size_t kEdgeCacheChanges = size_t{8} << 20;

// Block edges of every hash over one target range, kept across the Lanczos
// iterations as what the products read: finding them (block_end, three
// floor divisions a block) costs more than the product itself when blocks
// are short. Each BlockEdges serves one direction of product, so it knows
// its sources' range too, and stores every block change as the indices
// into the sources' prefix sums that the change moves between.
class BlockEdges {
 public:
  // Per hash: the begin of the block holding t0, then every block end up to
  // and including the first at or past t_end.
  static void of_hash(const Draw& d, int64_t t0, int64_t t_end, std::vector<int64_t>* edges) {
    edges->clear();
    edges->push_back(block_begin(t0, d));
    int64_t bin = bin_of(t0, d);
    int64_t e = block_end_in_bin(t0, bin, d, &bin);
    edges->push_back(e);
    while (e < t_end) {
      e = block_end_in_bin(e, bin, d, &bin);
      edges->push_back(e);
    }
  }
  // Targets t0 + [0, nt), sources s0 + [0, ns). Gives up (complete()
  // false, nothing kept) past max_events block changes.
  BlockEdges(std::span<const Draw> draws, int64_t t0, int64_t nt, int64_t s0, int64_t ns, size_t max_events)
      : t0_(t0), nt_(nt), s0_(s0), ns_(ns), hashes_(draws.size()) {
    auto at = [&](int64_t x) { return static_cast<int32_t>(source_index(x, s0, ns)); };
    if (ns > INT32_MAX) return;
    // First pass: how many blocks change at each target.
    std::vector<int64_t> one;
    event_start_.assign(static_cast<size_t>(nt) + 1, 0);
    size_t events = 0;
    for (const Draw& d : draws) {
      of_hash(d, t0, t0 + nt, &one);
      for (size_t i = 1; i < one.size(); ++i)
        if (one[i] < t0 + nt) {
          ++event_start_[static_cast<size_t>(one[i] - t0) + 1];
          ++events;
        }
      if (events > max_events) {
        std::vector<int64_t>().swap(event_start_);
        return;
      }
    }
    for (size_t n = 1; n < event_start_.size(); ++n) event_start_[n] += event_start_[n - 1];
    // Second pass, the edges found again hash by hash: at each change the
    // block [e_(c-1), e_c) gives way to [e_c, e_(c+1)); and, every
    // kResumEvery targets, each hash's block then (for the running sums'
    // fresh start).
    const size_t s = hashes_;
    const int64_t checkpoints = (nt + kResumEvery - 1) / kResumEvery;
    moves_.resize(events);
    slot_.resize(events);
    checkpoint_.resize(static_cast<size_t>(checkpoints) * s);
    std::vector<int64_t> fill(event_start_.begin(), event_start_.end() - 1);
    for (size_t k = 0; k < s; ++k) {
      of_hash(draws[k], t0, t0 + nt, &one);
      for (size_t i = 1; i + 1 < one.size() && one[i] < t0 + nt; ++i) {
        const size_t e = static_cast<size_t>(fill[static_cast<size_t>(one[i] - t0)]++);
        moves_[e] = {at(one[i - 1]), at(one[i]), at(one[i + 1])};
        slot_[e] = static_cast<uint8_t>((one[i] - t0) % kResumEvery);
      }
      // The block holding target t0 + n after the changes at n.
      size_t c = 1;
      for (int64_t q = 0; q < checkpoints; ++q) {
        const int64_t t = t0 + q * kResumEvery;
        while (one[c] <= t) ++c;
        checkpoint_[static_cast<size_t>(q) * s + k] = {at(one[c - 1]), at(one[c])};
      }
    }
    complete_ = true;
  }
  bool complete() const { return complete_; }
  size_t hashes() const { return hashes_; }
  bool covers(int64_t t0, int64_t nt, int64_t s0, int64_t ns) const {
    return complete_ && t0 == t0_ && nt == nt_ && s0 == s0_ && ns == ns_;
  }

  // A block change: the prefix-sum indices of the old block's begin, of
  // its end (the new block's begin) and of the new block's end.
  struct Move {
    int32_t old_begin, mid, new_end;
  };
  struct Block {
    int32_t begin, end;
  };
  static constexpr int64_t kResumEvery = 256;
  static_assert(kResumEvery <= 256, "a change's slot is a byte");
  // The changes at target n: [events(n), events(n + 1)).
  int64_t events(int64_t n) const { return event_start_[static_cast<size_t>(n)]; }
  const Move& move(int64_t e) const { return moves_[static_cast<size_t>(e)]; }
  // Change e's target, less the last checkpoint's (target % kResumEvery).
  int slot(int64_t e) const { return slot_[static_cast<size_t>(e)]; }
  // Hash k's block at target q * kResumEvery (after its changes there).
  const Block* checkpoint(int64_t q) const { return checkpoint_.data() + static_cast<size_t>(q) * hashes_; }

 private:
  int64_t t0_, nt_, s0_, ns_;
  size_t hashes_;
  bool complete_ = false;
  std::vector<int64_t> event_start_;  // [nt + 1]
  std::vector<Move> moves_;
  std::vector<uint8_t> slot_;
  std::vector<Block> checkpoint_;  // [ceil(nt / kResumEvery)][hashes]
};

// y[n] -= (M~ x)(t0 + n) from the cached block changes (see the caller),
// for the sides kLeft (sources <= t) and kRight (sources >= t) allowed. The
// changes at one target are summed first and then added to the running
// sums, so that the running sums' chain of dependent adds is one add a
// target, not one a change (four changes a target at sigma = 2, s = 16).
// The changes of a checkpoint's targets are summed in one flat loop, by
// their slots, and the running sums read the slots after: a loop over each
// target's changes ran a number of times that no branch predictor
// foresees (0 or 1 at sigma = 16, s = 16), a misprediction every few targets.
// The same sums in the same order either way.
template <bool kLeft, bool kRight>
void subtract_summed_blocks(const BlockEdges& cached, const double* pre, int64_t t0, int64_t nt, int64_t s0, int64_t ns,
                            double* y) {
  const size_t s = cached.hashes();
  const double ds = static_cast<double>(s), inv_s = 1.0 / ds;
  double step_b[BlockEdges::kResumEvery], step_e[BlockEdges::kResumEvery];
  for (int64_t c0 = 0; c0 < nt; c0 += BlockEdges::kResumEvery) {
    // Afresh at every checkpoint, so the running updates' rounding cannot drift.
    const BlockEdges::Block* blocks = cached.checkpoint(c0 / BlockEdges::kResumEvery);
    double sum_b = 0, sum_e = 0;
    for (size_t k = 0; k < s; ++k) {
      if (kLeft) sum_b += pre[blocks[k].begin];
      if (kRight) sum_e += pre[blocks[k].end];
    }
    const int64_t c1 = std::min(nt, c0 + BlockEdges::kResumEvery);
    // The changes at targets (c0, c1); those at c0 are in the checkpoint.
    std::fill(step_b, step_b + (c1 - c0), 0.0);
    std::fill(step_e, step_e + (c1 - c0), 0.0);
    if (c0 + 1 < c1) {
      for (int64_t ev = cached.events(c0 + 1); ev < cached.events(c1); ++ev) {
        const BlockEdges::Move& mv = cached.move(ev);
        const int at = cached.slot(ev);
        if (kLeft) step_b[at] += pre[mv.mid] - pre[mv.old_begin];
        if (kRight) step_e[at] += pre[mv.new_end] - pre[mv.mid];
      }
    }
    for (int64_t n = c0; n < c1; ++n) {
      if (n > c0) {
        sum_b += step_b[n - c0];
        sum_e += step_e[n - c0];
      }
      const int64_t t = t0 + n;
      double mx;
      if (kLeft && kRight)
        mx = sum_e - sum_b;
      else if (kLeft)
        mx = ds * pre[source_index(t + 1, s0, ns)] - sum_b;
      else
        mx = sum_e - ds * pre[source_index(t, s0, ns)];
      y[n] -= inv_s * mx;
    }
  }
}

void apply_mask_error_with(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose,
                           const BlockEdges* cached, ProductScratch* scratch) {
  // Source: the vector's side; target: the output's side.
  const int64_t s0 = transpose ? r.q_pos0 : r.k_pos0, ns = transpose ? r.q_len : r.kv_len;
  const int64_t t0 = transpose ? r.k_pos0 : r.q_pos0, nt = transpose ? r.kv_len : r.q_len;
  const Allowed allowed = !r.causal ? Allowed::kAll : transpose ? Allowed::kSourceNotBefore : Allowed::kSourceNotAfter;
  std::fill(y, y + nt, 0.0);
  if (mask_is_exact(m, r) || ns <= 0) return;

  const bool left = allowed != Allowed::kSourceNotBefore;  // sources before the target count
  const bool right = allowed != Allowed::kSourceNotAfter;  // sources after the target count
  if (m.mode == Mode::kWindow) {
    // L* 1[|d| >= W] directly: no cancellation against the band.
    const ExpSums sums(x, ns, s0, m.sigma, left, right, false, scratch);
    const double edge = decay(m.window, m.sigma);
    if (left) sums.add_up_to(edge, t0 - m.window, nt, y);
    if (right) sums.add_from(edge, t0 + m.window, nt, y);
    return;
  }

  // The source at t itself counts once whichever side is allowed.
  const ExpSums sums(x, ns, s0, m.sigma, left, right, true, scratch);
  if (left) sums.add_up_to(1.0, t0, nt, y);
  if (right) sums.add_from(left ? decay(1, m.sigma) : 1.0, left ? t0 + 1 : t0, nt, y);

  // M~ x: per hash and block, the sum of x over the block (clipped to the
  // allowed side), from prefix sums of x. Block by block, not target by
  // target: a constant for a whole block when both sides count, a running
  // prefix otherwise, in loops without branches (Lanczos at n = 131072, s =
  // 16: 3x faster than one range lookup per target and hash).
  // The prefix sums of x came with the exponential sums (ExpSums).
  const double* pre = scratch->prefix.data();
  // Sum of x over source positions < a.
  auto below = [&](int64_t a) { return pre[source_index(a, s0, ns)]; };
  const double inv_s = 1.0 / static_cast<double>(m.draws.size());
  if (cached != nullptr && !cached->covers(t0, nt, s0, ns)) cached = nullptr;
  if (cached != nullptr) {
    // Summed over the hashes at once: with B = sum_k below(begin_k) and
    // E = sum_k below(end_k) over the blocks holding target t, M~ x at t is
    // (E - B) / s (both sides), (s below(t + 1) - B) / s (sources <= t) or
    // (E - s below(t)) / s (sources >= t). B and E change only where a block
    // does: O(nt + edges) a product instead of O(nt s) (spectral error at
    // s = 256: most of the estimates' time), each change read as three
    // prefix indices the BlockEdges found once. Summed afresh every
    // kResumEvery targets, so the running updates' rounding cannot drift.
    if (left && right)
      subtract_summed_blocks<true, true>(*cached, pre, t0, nt, s0, ns, y);
    else if (left)
      subtract_summed_blocks<true, false>(*cached, pre, t0, nt, s0, ns, y);
    else
      subtract_summed_blocks<false, true>(*cached, pre, t0, nt, s0, ns, y);
    return;
  }
  for (size_t k = 0; k < m.draws.size(); ++k) {
    BlockEdges::of_hash(m.draws[k], t0, t0 + nt, &scratch->edges);
    const int64_t* edges = scratch->edges.data();
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
    const int64_t s0 = transpose ? r.q_pos0 : r.k_pos0, ns = transpose ? r.q_len : r.kv_len;
    edges = std::make_unique<BlockEdges>(m.draws, t0, nt, s0, ns, kEdgeCacheChanges);
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
  // Block edges over the query range (targets of E, sources the keys) and
  // the key range (targets of E^T, sources the queries), kEdgeCacheChanges.
  std::unique_ptr<BlockEdges> query_edges, key_edges;
  if (uses_draws(m.mode)) {
    query_edges = std::make_unique<BlockEdges>(m.draws, r.q_pos0, r.q_len, r.k_pos0, r.kv_len, kEdgeCacheChanges);
    // The same range (the usual self-attention case): one set serves both.
    if (r.k_pos0 != r.q_pos0 || r.kv_len != r.q_len)
      key_edges = std::make_unique<BlockEdges>(m.draws, r.k_pos0, r.kv_len, r.q_pos0, r.q_len, kEdgeCacheChanges);
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
