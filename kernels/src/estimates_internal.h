// What the estimates' files share (kernels/src: mask_error.cpp,
// spectral.cpp, probe.cpp, probe_sweep.cpp, estimates.cpp). Internal to
// kernels/src.
//
// Notation: E = L* - M~ on the allowed (query, key) pairs, L*_ij =
// exp(-|pos_i - pos_j| / sigma); M~ the mean of the draws' bin indicators
// (lsh) or L* 1[|d| < W] (window, whose E is then L* 1[|d| >= W]).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "plsh/attention.h"
#include "plsh/draws.h"
#include "plsh/estimates.h"

namespace plsh::estimates_detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Salts that keep the row sample, the Lanczos start and the probe rows of
// one head independent of each other and of the draws.
inline constexpr uint64_t kMaskRowSalt = 0x6d61736b2d726f77ULL;
inline constexpr uint64_t kSpectralSalt = 0x737065637472616cULL;
inline constexpr uint64_t kProbeSalt = 0x70726f62652d726fULL;

inline uint64_t head_seed(uint64_t seed, int64_t h, uint64_t salt) {
  return mix64(mix64(seed ^ salt) + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(h + 1));
}

inline bool stop_requested(const ExecContext* ctx) { return ctx != nullptr && !ctx->check_stop().ok(); }

// exp(-gap / sigma) for a non-negative integer distance; 1 for sigma = +inf.
inline double decay(int64_t gap, double sigma) { return gap == 0 ? 1.0 : std::exp(-static_cast<double>(gap) / sigma); }

// exp(-d / sigma) for integer distances, tabulated up to 2^20 of them (8
// MiB): the mask max error reads 4 (s + 1) of them per row.
class DecayTable {
 public:
  static constexpr int64_t kMaxEntries = int64_t{1} << 20;
  // What the table holds for distances up to max_distance (beyond
  // kMaxEntries it tabulates nothing and computes each value).
  static int64_t bytes(int64_t max_distance) {
    return max_distance >= 0 && max_distance < kMaxEntries ? 8 * (max_distance + 1) : 0;
  }
  DecayTable(double sigma, int64_t max_distance) : sigma_(sigma) {
    if (max_distance < 0 || max_distance >= kMaxEntries) return;
    table_.resize(static_cast<size_t>(max_distance) + 1, 0.0);
    // exp(-d / sigma) only falls with d: past its underflow to 0 the rest
    // stay 0 (sigma = 2 over 32768 distances: 1.5k exps instead of 32k).
    for (size_t d = 0; d < table_.size(); ++d)
      if ((table_[d] = decay(static_cast<int64_t>(d), sigma)) == 0.0) break;
  }
  double operator()(int64_t d) const {
    return d < static_cast<int64_t>(table_.size()) ? table_[static_cast<size_t>(d)] : decay(d, sigma_);
  }

 private:
  double sigma_;
  std::vector<double> table_;
};

// Largest distance between any query and any key position of the range.
inline int64_t max_distance(const PositionRange& r) {
  const int64_t q_last = r.q_pos0 + r.q_len - 1, k_last = r.k_pos0 + r.kv_len - 1;
  return std::max(std::llabs(q_last - r.k_pos0), std::llabs(k_last - r.q_pos0));
}

// True when E is identically zero: a slope-0 head under lsh or fixed_blocks
// (L* = M~ = 1), or a window wider than every distance in the request.
inline bool mask_is_exact(const HeadMask& m, const PositionRange& r) {
  if (uses_draws(m.mode)) return !std::isfinite(m.sigma);
  return m.window == kNoWindow || m.window > max_distance(r);
}

// Per-head sufficient statistics of the probe rows, pooled at the end.
struct ProbeStats {
  int64_t rows = 0;
  int64_t population = 0;  // B * Nq rows the sample was drawn from
  double se = 0, sn = 0;   // sums of err2 and ref2
  double see = 0, snn = 0, sen = 0;
  double max_abs = 0, bound_max = 0;
  std::vector<double> err2;  // every row's err2: the upper bound reads the largest (probe_bound.cpp)
};

ProbeStats probe_stats(const std::vector<ProbeRow>& rows, int64_t population);
ProbeEstimate summarize_probe(const std::vector<ProbeStats>& heads);
// ProbeEstimate::rel_err_upper from the heads' rows, their pooled Q and its
// standard error (probe_bound.cpp, where the rule is written down).
double probe_rel_err_upper(const std::vector<ProbeStats>& heads, double q, double se_q);
// g(gamma, m) = m^(gamma-1) sum_{i=1}^{m} i^-gamma, the bound's tail factor.
double tail_growth(double gamma, double m);

// Host bytes the estimates of one head hold at once (tables, Lanczos
// vectors, block edges), a probe sweep's per thread, and what every probe
// row and head's L* table hold for the whole probe.
int64_t head_estimate_bytes(const AttentionParams& p);
int64_t probe_sweep_bytes(const AttentionParams& p);
int64_t probe_rows_bytes(const AttentionParams& p);

// E x (or E^T x) one hash at a time, without the block-edge cache that
// apply_mask_error builds (what runs when the cache would not fit): for
// tests of both paths.
void apply_mask_error_per_hash(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose);

// Per probe task: query rows of one (head, batch item), the unit in which
// compute_estimates spreads a head's rows over the sweeps when there are
// fewer kv heads than threads.
inline constexpr size_t kProbeRowsPerTask = 16;

// The probe's L* tables stop at this many distances (1 MiB a head, one
// table a head for the whole probe); a row reaching farther computes the
// rest.
inline constexpr int64_t kProbeDecayEntries = int64_t{1} << 17;

// One probe task: query rows of one (head, batch item) with their exact
// softmax and bound sums, taking their key tiles from a sweep (probe_sweep)
// that it may share with tasks of other heads. Built with the rows' reach
// (probe_rows' `keys`); finish() writes one ProbeRow a row.
class ProbeTask {
 public:
  ProbeTask(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, std::span<const int64_t> rows,
            const ProbeKeyStats* keys);
  ProbeTask(ProbeTask&&) noexcept;
  ProbeTask& operator=(ProbeTask&&) noexcept;
  ~ProbeTask();
  int64_t head() const;
  int64_t batch() const;
  int64_t farthest() const;  // the largest distance from a row to a key it visits
  int64_t pairs() const;     // (row, key) pairs it visits: what its work follows
  void finish(ProbeRow* out) const;

 private:
  friend bool probe_sweep(const AttentionParams&, std::span<ProbeTask* const>, std::span<const DecayTable* const>,
                          const ExecContext*);
  friend int64_t probe_sweep_cost(const AttentionParams&, std::span<ProbeTask* const>);
  struct State;
  std::unique_ptr<State> s_;
};

// One pass over the key rows in order for tasks of one batch item: each key
// tile is converted once per kv head for all the tasks that need it (not
// once a task), the kv heads of a tile one after another from the same key
// rows, each load asking for the next one's rows. The tiles sit on a grid
// fixed by the key rows, so a row's figures do not depend on which tasks
// share its sweep. lstar[h]: L* of head h by distance, up to its tasks'
// farthest at least. false: ctx asked to stop (polled every 8 tiles).
bool probe_sweep(const AttentionParams& p, std::span<ProbeTask* const> tasks, std::span<const DecayTable* const> lstar,
                 const ExecContext* ctx);
// What a sweep of these tasks costs, in (row, key) pairs: theirs, and the
// key rows it converts (per kv head, the union of its tasks' ranges)
// weighed as the pairs they take as long as. How compute_estimates
// balances the sweeps.
int64_t probe_sweep_cost(const AttentionParams& p, std::span<ProbeTask* const> tasks);

}  // namespace plsh::estimates_detail
