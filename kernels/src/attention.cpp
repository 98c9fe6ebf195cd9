#include "plsh/attention.h"

#include <algorithm>
#include <chrono>

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

StatusOr<AttentionResult> run_attention(Backend& backend, const Plan& plan, const ExecContext& ctx) {
  if (!plan.attempts.empty()) return run_targeted(backend, plan, ctx);
  const AttentionParams& p = plan.params;
  AttentionResult result;
  result.backend = backend.name();
  result.device = backend.device();
  result.mode = p.mode;
  result.samples = p.samples;
  result.seed = p.seed;
  result.sampling = p.sampling;
  result.scale = p.scale;
  result.q_pos0 = p.q_pos0;
  result.k_pos0 = p.k_pos0;

  ForwardStats stats;
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(backend.forward(plan, ctx, &stats));
  result.timings["compute"] = seconds_since(t0);
  result.flops = stats.flops;
  result.lsh_algorithm = stats.lsh_algorithm;
  result.dense_flops = dense_flops(p);

  if (p.mode != Mode::kExact) {
    const auto t1 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(compute_estimates(plan, ctx, &result));
    result.timings["estimates"] = seconds_since(t1);
  }
  return result;
}

StatusOr<AttentionResult> run_attention(Backend& backend, const AttentionParams& p, const PlanLimits& limits,
                                        const ExecContext& ctx) {
  ASSIGN_OR_RETURN(const Plan plan, plan_attention(backend, p, limits));
  return run_attention(backend, plan, ctx);
}

}  // namespace plsh
