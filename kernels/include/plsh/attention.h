// The library's front door: plan one attention request on a backend, run it,
// and return the output's metadata with the error estimates of SPEC
// section 6; and its backward pass (SPEC section 8) on the same plan.
//
// The caller owns the memory: the runs on a plan take a workspace of at
// least plan.workspace() (plsh/workspace.h), which the forward, the
// estimates and the backward use one after the other. The overloads
// without one allocate a HostWorkspace of that size for callers that have
// no pool (plsh compute, plsh demo, tests); a server hands in what it
// reserved. (The CUDA backend still reserves its device bytes from its own
// pool: it reads no device workspace yet.)
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

// Host bytes plan_attention(backend, p) allocates at most on the way (every
// attempt's, for a targeted p): what a server holds against its budget
// while it plans (Backend::planning_host_bytes).
int64_t planning_host_bytes(const Backend& backend, const AttentionParams& p);

// forward + estimates + FLOP counts on a plan of plan_attention whose
// tensors are bound, in `workspace` (at least plan.workspace()); the whole
// of what the server needs (for a targeted plan, its attempts until one
// meets the target: run_targeted). Estimates need host tensors
// (params.memory == kHost).
StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                        const ExecContext& ctx);
// The same in a HostWorkspace of its own.
StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const ExecContext& ctx);

// plan_attention then run_attention in a workspace of its own, for callers
// that have the tensors at hand (plsh compute, plsh demo, tests).
StatusOr<AttentionResult> run_attention(Backend& backend, const AttentionParams& p, const PlanLimits& limits,
                                        const ExecContext& ctx);

// FLOPs of exact attention over the allowed (i, j) pairs: 4 * B * H * D * pairs.
double dense_flops(const AttentionParams& p);

// The backward of the forward `plan` computes: make_backward_params (out and
// lse default to the plan's own, i.e. what its forward wrote), then
// backend.backward. The plan must come from plan_attention (or
// Backend::plan) with PlanLimits::backward, with q, k, v bound; `workspace`
// at least plan.backward_workspace.
StatusOr<BackwardResult> run_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                      const WorkspaceRef& workspace, const ExecContext& ctx);
// The same in a HostWorkspace of its own.
StatusOr<BackwardResult> run_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                      const ExecContext& ctx);

struct ForwardBackwardResult {
  AttentionResult forward;
  BackwardResult backward;
};

// A plan made with PlanLimits::backward, its tensors (lse too) bound: its
// forward with the estimates into out and lse, then its backward, both in
// `workspace` (at least plan.workspace()). grads.out and grads.lse must be
// null (the forward's own are used).
StatusOr<ForwardBackwardResult> run_forward_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                                     const WorkspaceRef& workspace, const ExecContext& ctx);

// One plan (PlanLimits::backward set here), then the above in a workspace
// of its own: a training step in one process (plsh compute --dout). When
// p.lse is null a host buffer stands in.
StatusOr<ForwardBackwardResult> run_forward_backward(Backend& backend, const AttentionParams& p, PlanLimits limits,
                                                     const GradientRefs& grads, const ExecContext& ctx);

}  // namespace plsh
