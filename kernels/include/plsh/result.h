// What a request returns besides its tensors: the error estimates of SPEC
// section 6 per head and in summary, FLOPs and timings. Plain data, shared
// by the kernels (which fill it), the wire conversions and the clients
// (which read it); header-only, so a thin client needs no maths library.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh {

struct ProbeEstimate {
  int64_t rows = 0;           // query rows computed exactly per head, seeded (batch item, row) pairs
  double rel_err = 0;         // ||o~ - o*||_2 / ||o*||_2 over those rows
  double rel_err_stderr = 0;  // standard error of rel_err from the per-row spread
  double max_abs_err = 0;     // max |o~ - o*| over those rows
  double bound_max = 0;       // max over rows of SPEC's rigorous per-row bound
  // Upper confidence bound on the whole output's relative L2 error (all
  // rows): rel_err plus a heavy-tail margin (estimates.h, probe_upper_bound);
  // its coverage is measured (bench/RESULTS.md). 0 without rows.
  double rel_err_upper = 0;
};

// One configuration an error-targeted request tried (plsh/targeted.h).
struct TargetAttempt {
  Mode mode = Mode::kExact;
  int64_t samples = 0;       // lsh
  double window_scale = 0;   // window: c in W_h = ceil(c sigma_h) (eps = e^-c)
  int64_t window_max = 0;    // window: the widest W_h
  double flops = 0;          // its forward pass
  double rel_err = 0;        // its probe's estimate
  double rel_err_upper = 0;  // its probe's upper bound; 0 for exact
  bool met = false;          // rel_err_upper <= target
  double seconds = 0;        // forward and estimates
};

struct TargetReport {
  double target_rel_err = 0;            // 0: not a targeted request
  bool met = false;                     // the kept attempt met the target
  int64_t chosen = -1;                  // index into attempts of the kept one
  std::vector<TargetAttempt> attempts;  // in the order tried
};

struct HeadEstimate {
  int64_t head = 0;
  double slope = 0;
  double sigma = 0;         // 1/slope; +inf for slope 0
  int64_t window = 0;       // window mode: W_h
  int64_t max_block = 0;    // lsh: largest block (positions) over the samples within the request
  double mask_max_err = 0;  // max_ij |L*_ij - M~_ij| over the request's positions
  int64_t mask_rows_checked = 0;
  bool mask_rows_sampled = false;  // true when a seeded row sample stood in for all rows
  double mask_spectral_err = 0;    // ~ ||L* - M~||_2
  int64_t spectral_iterations = 0;
  ProbeEstimate probe;
  std::vector<Draw> draws;  // only with return_draws
};

// Every member a designated initializer may leave out has an initializer
// (run_attention names only what runs), or -Wextra warns.
struct AttentionResult {
  std::string backend;
  std::string device;
  Mode mode = Mode::kExact;
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;  // used, for lsh
  int64_t samples = 0;
  uint64_t seed = 0;
  Sampling sampling = Sampling::kIid;  // lsh
  // Defaults as resolved (AttentionParams), so that a client reads them
  // instead of re-deriving them.
  double scale = 0;                   // softmax scale: options.scale or 1/sqrt(D)
  int64_t q_pos0 = 0;                 // absolute position of query row 0: options.q_pos0 or Nk - Nq
  int64_t k_pos0 = 0;                 // absolute position of key row 0
  std::vector<HeadEstimate> heads{};  // empty for exact
  double flops = 0;                   // done
  double dense_flops = 0;             // exact attention over the allowed pairs
  // Summary over heads: max mask errors, probe error pooled over heads.
  double mask_max_err = 0;
  double mask_spectral_err = 0;
  ProbeEstimate probe{};
  std::map<std::string, double> timings{};  // seconds: "compute", "estimates", ...
  TargetReport target{};                    // error-targeted requests: the attempts; flops above counts them all
};

// What a backward pass returns besides dq, dk, dv.
struct BackwardResult {
  std::string backend;
  std::string device;
  double flops = 0;        // done: the five GEMMs of SPEC section 8 over the pairs visited
  double dense_flops = 0;  // the same five GEMMs over every allowed pair of exact attention (2.5x the forward's)
  int64_t host_workspace_bytes = 0;  // extra memory used, by memory space
  int64_t device_workspace_bytes = 0;
  std::map<std::string, double> timings;  // seconds: "backward"
};

}  // namespace plsh
