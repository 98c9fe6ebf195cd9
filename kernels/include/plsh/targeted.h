// Error-targeted requests (AttentionParams::target_rel_err > 0): the user
// states the relative L2 error of the whole output they can accept, and the
// library picks the cheapest configuration whose probe upper bound
// (ProbeEstimate::rel_err_upper) promises it.
//
// How (the "ladder"), for the request's mode:
//   window: widths W_h = ceil(c sigma_h), c = max(1, ln(4 / target)) first
//           (eps = target / 4: on Gaussian inputs the error is about 1.7 eps,
//           on peaked ones up to 5 eps),
//           then c x 1.5 per attempt (each attempt costs about 1.5x the
//           last, so the attempts that fail cost at most ~2x the one kept);
//   lsh:    the request's samples, then x4 per attempt up to 1024
//           (kTargetMaxSamples), with its sampler;
//   exact:  exact alone.
// A window attempt whose FLOPs would reach 3/4 of exact attention's, or
// whose windows already cover every distance, gives way to exact; every
// ladder ends with exact, which needs no promise (error 0). Each attempt
// runs forward and the estimates; the first whose rel_err_upper <= target
// is kept (its output stays in the request's out and lse).
//
// Plan once: plan_targeted makes one plan per attempt, all at once, before
// any tensor arrives (so the server refuses what cannot fit at the header,
// as for any request), and returns a plan that holds them (Plan::attempts).
// Its workspace is the largest attempt's per memory space (attempts run one
// after another in the one workspace), its own_host_bytes the draws of
// every attempt (held by the plan throughout).
// run_attention on that plan runs run_targeted.
#pragma once

#include <cstdint>
#include <vector>

#include "plsh/backend.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/result.h"
#include "plsh/status.h"

namespace plsh {

// lsh attempts stop at 1024 samples: on the CPU, s = 4096 took 30x exact's
// time at n = 4096 (banded lsh's cost is in its FLOPs only up to s ~ 1024).
inline constexpr int64_t kTargetMaxSamples = 1024;
inline constexpr double kTargetWindowGrowth = 1.5;  // c grows by this per window attempt
inline constexpr double kTargetExactShare = 0.75;   // window FLOPs past this share of exact: exact instead
inline constexpr int kTargetMaxAttempts = 16;

// One configuration to try: resolved params (target_rel_err 0, no tensors).
struct TargetStep {
  AttentionParams params;
  double window_scale = 0;  // window: c in W_h = ceil(c sigma_h)
};

// The ladder for p (p.target_rel_err > 0), cheapest first, exact last.
std::vector<TargetStep> target_ladder(const AttentionParams& p);

// The most samples any attempt of options o may use: o.samples without a
// target or outside lsh, else the ladder's largest (for a server's
// --max-samples and its summary size).
int64_t target_max_samples(const AttentionOptions& o);

// FLOPs of window attention with widths `window` ([H]) over p's positions:
// 4 B D sum_h (allowed pairs with |pos_i - pos_j| < W_h).
double window_flops(const AttentionParams& p, const std::vector<int64_t>& window);

// Plans every attempt on `backend` (plan_attention calls this for targeted
// params).
StatusOr<Plan> plan_targeted(const Backend& backend, const AttentionParams& p, const PlanLimits& limits);

// Runs the attempts of a plan_targeted plan (tensors bound on plan.params)
// until one meets the target, each in `workspace` (at least
// plan.workspace()); the result is the kept attempt's, with flops and
// timings summed over all attempts and result.target filled in.
StatusOr<AttentionResult> run_targeted(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                       const ExecContext& ctx);

}  // namespace plsh
