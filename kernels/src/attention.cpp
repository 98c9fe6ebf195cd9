#include "plsh/attention.h"

#include <algorithm>
#include <chrono>
#include <new>
#include <vector>

#include "plsh/device_estimates.h"
#include "plsh/estimates.h"
#include "plsh/targeted.h"

namespace plsh {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Status ExecContext::check_stop() const {
  if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) return cancelled("request cancelled");
  if (deadline != std::chrono::steady_clock::time_point::max() && std::chrono::steady_clock::now() > deadline)
    return deadline_exceeded("deadline passed during compute");
  return Status::Ok();
}

double dense_flops(const AttentionParams& p) {
  // Allowed pairs per (b, h): all Nq * Nk, or under causal, for each query the
  // keys at positions <= its own.
  double pairs = 0;
  if (!p.causal) {
    pairs = static_cast<double>(p.q_len) * static_cast<double>(p.kv_len);
  } else {
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t last = p.q_pos0 + i - p.k_pos0;  // key row index of the query's own position
      pairs += static_cast<double>(std::clamp<int64_t>(last + 1, 0, p.kv_len));
    }
  }
  return 4.0 * static_cast<double>(p.batch) * static_cast<double>(p.heads) * static_cast<double>(p.head_dim) * pairs;
}

StatusOr<Plan> plan_attention(const Backend& backend, const AttentionParams& p, const PlanLimits& limits) {
  if (p.target_rel_err > 0) return plan_targeted(backend, p, limits);
  ASSIGN_OR_RETURN(Plan plan, backend.plan(p, limits));
  plan.estimates_workspace.host_bytes = estimates_host_bytes(p, plan.threads);
  return plan;
}

int64_t planning_host_bytes(const Backend& backend, const AttentionParams& p) {
  if (!(p.target_rel_err > 0)) return backend.planning_host_bytes(p);
  // Every attempt's plan is made (and kept) before any runs, and the ladder
  // itself is held meanwhile.
  const std::vector<TargetStep> ladder = target_ladder(p);
  int64_t bytes = static_cast<int64_t>(ladder.size() * sizeof(TargetStep));
  for (const TargetStep& step : ladder)
    bytes += backend.planning_host_bytes(step.params) + static_cast<int64_t>(sizeof(Plan));
  return bytes;
}

StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                        const ExecContext& ctx) {
  if (!plan.attempts.empty()) return run_targeted(backend, plan, workspace, ctx);
  const AttentionParams& p = plan.params;
  // What runs, as resolved (the estimates, FLOPs and timings follow).
  AttentionResult result{.backend = backend.name(),
                         .device = backend.device(),
                         .mode = p.mode,
                         .samples = p.samples,
                         .seed = p.seed,
                         .sampling = p.sampling,
                         .scale = p.scale,
                         .q_pos0 = p.q_pos0,
                         .k_pos0 = p.k_pos0};

  ForwardStats stats;
  if (p.mode != Mode::kExact && backend.probes_with_forward(plan)) {
    // Issue 19: the estimates where the work is (plsh/device_estimates.h).
    RETURN_IF_ERROR(forward_with_device_estimates(backend, plan, workspace, ctx, &stats, &result));
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(backend.forward(plan, workspace, ctx, &stats));
    result.timings["compute"] = seconds_since(t0);
    if (p.mode != Mode::kExact) {
      const auto t1 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(compute_estimates(plan, workspace, ctx, &result));
      result.timings["estimates"] = seconds_since(t1);
    }
  }
  result.flops = stats.flops;
  result.lsh_algorithm = stats.lsh_algorithm;
  result.dense_flops = dense_flops(p);
  return result;
}

StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const ExecContext& ctx) {
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.workspace().host_bytes));
  return run_attention(backend, plan, workspace.ref(), ctx);
}

StatusOr<AttentionResult> run_attention(Backend& backend, const AttentionParams& p, const PlanLimits& limits,
                                        const ExecContext& ctx) {
  ASSIGN_OR_RETURN(const Plan plan, plan_attention(backend, p, limits));
  return run_attention(backend, plan, ctx);
}

namespace {

StatusOr<BackwardResult> run_backward_params(Backend& backend, const Plan& plan, const BackwardParams& g,
                                             const WorkspaceRef& workspace, const ExecContext& ctx) {
  BackwardResult result;
  result.backend = backend.name();
  result.device = backend.device();
  BackwardStats stats;
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(backend.backward(plan, g, workspace, ctx, &stats));
  result.timings["backward"] = seconds_since(t0);
  result.flops = stats.flops;
  // The backward runs five GEMMs per pair where the forward runs two.
  result.dense_flops = 2.5 * dense_flops(plan.params);
  result.host_workspace_bytes = stats.workspace.host_bytes;
  result.device_workspace_bytes = stats.workspace.device_bytes;
  return result;
}

}  // namespace

StatusOr<BackwardResult> run_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                      const WorkspaceRef& workspace, const ExecContext& ctx) {
  ASSIGN_OR_RETURN(const BackwardParams g, make_backward_params(plan.params, grads));
  return run_backward_params(backend, plan, g, workspace, ctx);
}

StatusOr<BackwardResult> run_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                      const ExecContext& ctx) {
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.backward_workspace.host_bytes));
  return run_backward(backend, plan, grads, workspace.ref(), ctx);
}

StatusOr<ForwardBackwardResult> run_forward_backward(Backend& backend, const Plan& plan, const GradientRefs& grads,
                                                     const WorkspaceRef& workspace, const ExecContext& ctx) {
  if (grads.out != nullptr || grads.lse != nullptr)
    return invalid_argument(
        "grads.out and grads.lse must be null for run_forward_backward: the forward's own are used");
  if (plan.params.lse == nullptr)
    return invalid_argument("lse = null, expected the plan's lse bound: the backward reads the forward's lse");
  // The backward's tensors are checked before the forward runs: a bad dout
  // costs no forward.
  ASSIGN_OR_RETURN(const BackwardParams g, make_backward_params(plan.params, grads));
  ForwardBackwardResult result;
  ASSIGN_OR_RETURN(result.forward, run_attention(backend, plan, workspace, ctx));
  ASSIGN_OR_RETURN(result.backward, run_backward_params(backend, plan, g, workspace, ctx));
  return result;
}

StatusOr<ForwardBackwardResult> run_forward_backward(Backend& backend, const AttentionParams& p, PlanLimits limits,
                                                     const GradientRefs& grads, const ExecContext& ctx) {
  if (grads.out != nullptr || grads.lse != nullptr)
    return invalid_argument(
        "grads.out and grads.lse must be null for run_forward_backward: the forward's own are used");
  limits.backward = true;
  ASSIGN_OR_RETURN(Plan plan, plan_attention(backend, p, limits));
  std::vector<float> own_lse;
  if (plan.params.lse == nullptr) {
    if (p.memory != MemorySpace::kHost)
      return invalid_argument("lse = null, expected a device tensor [B, Nq, H] for a backward on device tensors");
    try {
      own_lse.resize(static_cast<size_t>(p.batch * p.q_len * p.heads));
    } catch (const std::bad_alloc&) {
      return resource_exhausted("the forward's lse (" + std::to_string(p.batch * p.q_len * p.heads) +
                                " floats) could not be allocated for the backward");
    }
    plan.params.lse = own_lse.data();
  }
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.workspace().host_bytes));
  return run_forward_backward(backend, plan, grads, workspace.ref(), ctx);
}

}  // namespace plsh
