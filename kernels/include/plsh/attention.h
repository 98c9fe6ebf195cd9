// The library's front door: plan one attention request on a backend, run it,
// and return the output's metadata with the error estimates of SPEC
// section 6; and its backward pass (SPEC section 8) on the same plan.
#pragma once

#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/result.h"
#include "plsh/status.h"

namespace plsh {

// The backend's plan with the estimates' workspace added: what a server
// plans at the header (p may have no tensors yet) and charges to its budgets.
// With p.target_rel_err > 0, the plan of every attempt (plsh/targeted.h).
StatusOr<Plan> plan_attention(const Backend& backend, const AttentionParams& p, const PlanLimits& limits = {});

// forward + estimates + FLOP counts on a plan of plan_attention whose
// tensors are bound; the whole of what the server needs (for a targeted
// plan, its attempts until one meets the target: run_targeted). Estimates need host
// tensors (params.memory == kHost).
StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const ExecContext& ctx);

// plan_attention then run_attention, for callers that have the tensors at
// hand (plsh compute, plsh demo, tests).
StatusOr<AttentionResult> run_attention(Backend& backend, const AttentionParams& p, const PlanLimits& limits,
                                        const ExecContext& ctx);

// FLOPs of exact attention over the allowed (i, j) pairs: 4 * B * H * D * pairs.
double dense_flops(const AttentionParams& p);

// The backward of the forward `plan` computes: make_backward_params (out and
// lse default to the plan's own, i.e. what its forward wrote), then
// backend.backward. The plan must come from plan_attention (or
// Backend::plan) with PlanLimits::backward, with q, k, v bound.
StatusOr<BackwardResult> run_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                      const ExecContext& ctx);

struct ForwardBackwardResult {
  AttentionResult forward;
  BackwardResult backward;
};

// One plan (PlanLimits::backward set here), its forward with the estimates
// into p.out and p.lse, then its backward: a training step in one process
// (plsh compute --dout). grads.out and grads.lse must be null (the
// forward's own are used); when p.lse is null a host buffer stands in.
StatusOr<ForwardBackwardResult> run_forward_backward(Backend& backend, const AttentionParams& p, PlanLimits limits,
                                                     const GradientRefs& grads, const ExecContext& ctx);

}  // namespace plsh
