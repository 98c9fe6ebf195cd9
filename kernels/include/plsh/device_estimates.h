// The section-6 estimates for backends that compute the probe rows with
// their forward (issue 19, Backend::probes_with_forward): run_attention's
// path for them. While the backend's forward runs (on its device), the mask
// errors (compute_estimates without the probe) run on the host's threads;
// the probe's rows come back with the forward, exact in float32, and become
// the probe's err2, ref2, max_abs and bound here; a head whose measured
// error is within 20x of float32's reach (rel_err below 2e-4, where o*'s
// own ~1e-5 would show) is probed again in float64 on the host, as
// compute_estimates does. The result's timings say what each part cost:
// "compute" the forward with its probe rows, "estimates" what came after
// it, "estimates_masks" the mask errors (overlapped with the forward),
// "estimates_probe" the probe's statistics (and any float64 rows).
#pragma once

#include "plsh/backend.h"
#include "plsh/plan.h"
#include "plsh/result.h"
#include "plsh/status.h"

namespace plsh {

// Rows of a head's sample are trusted from the device down to this rel_err;
// below it they are recomputed in float64.
inline constexpr double kDeviceProbeFloor = 2e-4;

// forward + estimates for a plan of a backend with probes_with_forward(plan);
// fills result->timings, heads, mask errors and probe; stats as forward's;
// `workspace` at least plan.workspace() (forward's and the estimates').
Status forward_with_device_estimates(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                     const ExecContext& ctx, ForwardStats* stats, AttentionResult* result);

}  // namespace plsh
