// Error estimates of SPEC section 6, shared by every backend: they depend on
// the plan's draws and positions (mask errors) and on host copies of q, k, v
// and the output (probe), never on how a backend computed the output.
// Implemented in kernels/src: mask_error.cpp (max |L* - M~|), spectral.cpp
// (||L* - M~||_2 by Lanczos), probe_sweep.cpp (exact probe rows and their
// bounds), probe.cpp (their statistics, the key statistics and reach),
// estimates.cpp (compute_estimates, which runs them per head).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/plan.h"

namespace plsh {

// The positions a head's estimates range over: query rows q_pos0 + [0, q_len),
// key rows k_pos0 + [0, kv_len), and whether keys after the query are masked.
struct PositionRange {
  int64_t q_pos0 = 0, q_len = 0;
  int64_t k_pos0 = 0, kv_len = 0;
  bool causal = false;
};

PositionRange position_range(const AttentionParams& p);

// Largest block (positions) of any of the draws within the union of the
// query and key positions.
int64_t max_block_size(std::span<const Draw> draws, const PositionRange& r);

// What E = L* - M~ is for one head: lsh and fixed_blocks (M~ the mean of
// the draws' bin indicators; for fixed_blocks E is its bias) or window
// (M~ = L* 1[|d| < window]). L* = exp(-|d| / sigma).
// A view: the draws stay the plan's.
struct HeadMask {
  Mode mode = Mode::kLsh;
  double sigma = 0;             // +inf for slope 0
  std::span<const Draw> draws;  // lsh, fixed_blocks: the plan's draws of this head
  int64_t window = kNoWindow;   // window
};

HeadMask head_mask(const Plan& plan, int64_t h);

// Sorted distinct indices in [0, n): all of them when count >= n, else a
// seeded stratified sample of `count` (one uniform pick in each of `count`
// equal strata), so that every part of the range is represented.
std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed);

struct MaskMaxError {
  double value = 0;  // max |L*_ij - M~_ij| over the rows checked
  int64_t rows_checked = 0;
  bool rows_sampled = false;
  bool stopped = false;  // ctx asked to stop before the rows were done
};

// Exact over all query rows up to row_budget rows, else over a seeded row
// sample of row_budget rows. ctx (may be null) is polled for a stop.
MaskMaxError mask_max_error(const HeadMask& m, const PositionRange& r, int64_t row_budget, uint64_t sample_seed,
                            const ExecContext* ctx = nullptr);

// y = E x (x over the keys [kv_len], y over the queries [q_len]) or, with
// transpose, y = E^T x (x [q_len], y [kv_len]), E = (L* - M~) restricted to
// the allowed (query, key) pairs. O((q_len + kv_len) * samples).
void apply_mask_error(const HeadMask& m, const PositionRange& r, const double* x, double* y, bool transpose);

struct SpectralError {
  double value = 0;  // ~ ||E||_2, a lower bound that converges from below
  int64_t iterations = 0;
  bool converged = false;  // relative change under the tolerance (or an exact invariant subspace)
  bool stopped = false;
};

// Lanczos on E^T E (or E E^T, whichever is smaller) from a seeded start.
SpectralError mask_spectral_error(const HeadMask& m, const PositionRange& r, uint64_t start_seed,
                                  int64_t max_iterations = 100, double tolerance = 1e-4,
                                  const ExecContext* ctx = nullptr);

// One probe row: a query row of batch item b, head h, computed exactly in
// float64 and compared with p.out (host memory).
struct ProbeRow {
  double err2 = 0;     // ||o~_i - o*_i||^2
  double ref2 = 0;     // ||o*_i||^2
  double max_abs = 0;  // max_d |o~_id - o*_id|
  double bound = 0;    // 2 max_j ||v_j|| sum_j a_ij |L*_ij - M~_ij| / sum_j a_ij M~_ij (+inf if the denominator is 0)
};
// What the probe knows of the keys of one (batch item, kv head), so that a
// row visits only the keys that can matter (probe_reach).
struct ProbeKeyStats {
  double max_k_norm = 0;              // max_j ||k_j||
  std::vector<double> v2_prefix_max;  // [kv_len]: max over key rows <= j of ||v||^2
};
ProbeKeyStats probe_key_stats(const AttentionParams& p, int64_t b, int64_t kv_head);
// Every (batch item, kv head) n with wanted[n] set (n = b * kv_heads + hk;
// the others stay empty) in one pass over k and v on `threads` threads:
// what compute_estimates runs. RESOURCE_EXHAUSTED if the prefix maxima do
// not fit in host memory.
Status probe_key_stats_all(const AttentionParams& p, const std::vector<char>& wanted, int threads,
                           std::vector<ProbeKeyStats>* out);

// Keys farther than this from a probe row's position weigh at most e^-40
// (~4e-18) of the row's total, whatever q.k: with |logit| <= a_max = scale
// ||q_i|| max_j ||k_j||, the row's total is at least exp(-a_max - d0 /
// sigma) (its nearest allowed key, at distance d0) and the keys at distance
// >= R on both sides sum to at most 2 (sigma + 1) exp(a_max - R / sigma);
// R = d0 + sigma (2 a_max + ln(2 sigma + 2) + 40). INT64_MAX: visit all.
int64_t probe_reach(double sigma, double a_max, int64_t nearest);

// Several query rows of one batch item in one pass over its keys (one
// probe task, swept alone; compute_estimates sweeps the tasks of several
// heads together, estimates_internal.h); out has rows.size() entries. With `keys`, each
// row visits only the keys within probe_reach (the dropped tail is added to
// the bound, which stays rigorous) and the bound's max ||v|| covers every
// allowed key; without, every allowed key. Returns early, with out
// unfinished, when ctx (may be null) asks to stop.
void probe_rows(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, const std::vector<int64_t>& rows,
                ProbeRow* out, const ExecContext* ctx = nullptr, const ProbeKeyStats* keys = nullptr);

// Fills result->heads (slope, sigma, window, max_block, draws on request) and,
// when plan.params.estimates, the error estimates per head and their
// summary, on plan.threads threads, in `workspace` (at least
// plan.estimates_workspace, else INVALID_ARGUMENT). Needs host tensors for
// the probe; plan.params.out must already hold the output.
Status compute_estimates(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                         AttentionResult* result);

// Host memory compute_estimates may hold at once on `threads` threads (the
// per-head tables, Lanczos vectors and probe buffers): what a plan's
// estimates_workspace says.
int64_t estimates_host_bytes(const AttentionParams& p, int threads);

}  // namespace plsh
