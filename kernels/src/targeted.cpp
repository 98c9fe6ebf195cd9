// Error-targeted requests (plsh/targeted.h): the ladder of configurations,
// their plans, and the run that stops at the first one whose probe upper
// bound meets the target.
#include "plsh/targeted.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <new>
#include <string>

#include "plsh/attention.h"
#include "plsh/estimates.h"

namespace plsh {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Largest distance between a query and a key position of p.
int64_t largest_distance(const AttentionParams& p) {
  const int64_t q_last = p.q_pos0 + p.q_len - 1, k_last = p.k_pos0 + p.kv_len - 1;
  return std::max(std::llabs(q_last - p.k_pos0), std::llabs(k_last - p.q_pos0));
}

AttentionParams step_params(const AttentionParams& p, Mode mode) {
  AttentionParams s = p;
  s.target_rel_err = 0;
  s.mode = mode;
  s.samples = 0;
  s.sampling = Sampling::kIid;
  s.window.clear();
  return s;
}

}  // namespace

double window_flops(const AttentionParams& p, const std::vector<int64_t>& window) {
  double pairs = 0;
  const int64_t k_first = p.k_pos0, k_end = p.k_pos0 + p.kv_len;
  for (int64_t h = 0; h < p.heads; ++h) {
    const int64_t w = window[static_cast<size_t>(h)];
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t pos = p.q_pos0 + i;
      // Keys with |pos - key| < w: (pos - w, pos + w), and <= pos when causal.
      const int64_t lo = w >= (int64_t{1} << 60) ? k_first : std::max(k_first, pos - w + 1);
      int64_t hi = w >= (int64_t{1} << 60) ? k_end : std::min(k_end, pos + w);
      if (p.causal) hi = std::min(hi, pos + 1);
      pairs += static_cast<double>(std::max<int64_t>(0, hi - lo));
    }
  }
  return 4.0 * static_cast<double>(p.batch) * static_cast<double>(p.head_dim) * pairs;
}

std::vector<TargetStep> target_ladder(const AttentionParams& p) {
  std::vector<TargetStep> ladder;
  const double target = p.target_rel_err;
  if (p.mode == Mode::kWindow) {
    const double exact_flops = dense_flops(p);
    const int64_t reach = largest_distance(p);
    double c = std::max(1.0, std::log(4.0 / target));
    while (static_cast<int>(ladder.size()) + 1 < kTargetMaxAttempts) {
      TargetStep step{step_params(p, Mode::kWindow), c};
      step.params.window_eps = std::exp(-c);
      bool covers_all = true;
      for (int64_t h = 0; h < p.heads; ++h) {
        const double sigma = p.sigma(h);
        int64_t w = kNoWindow;
        if (std::isfinite(sigma)) {
          const double width = std::ceil(c * sigma);
          w = width >= 9.0e18 ? kNoWindow : std::max<int64_t>(1, static_cast<int64_t>(width));
        }
        step.params.window.push_back(w);
        covers_all = covers_all && w > reach;
      }
      if (covers_all || window_flops(step.params, step.params.window) >= kTargetExactShare * exact_flops) break;
      ladder.push_back(std::move(step));
      c *= kTargetWindowGrowth;
    }
  } else if (p.mode == Mode::kLsh) {
    for (int64_t s = std::max<int64_t>(1, p.samples); s <= std::max(p.samples, kTargetMaxSamples); s *= 4) {
      if (static_cast<int>(ladder.size()) + 1 >= kTargetMaxAttempts) break;
      TargetStep step{step_params(p, Mode::kLsh), 0};
      step.params.samples = s;
      step.params.sampling = p.sampling;
      ladder.push_back(std::move(step));
      if (s > kTargetMaxSamples / 4) break;
    }
  }
  ladder.push_back(TargetStep{step_params(p, Mode::kExact), 0});
  return ladder;
}

int64_t target_max_samples(const AttentionOptions& o) {
  if (o.mode != Mode::kLsh || !(o.target_rel_err > 0)) return o.samples;
  int64_t largest = o.samples;
  for (int64_t s = std::max<int64_t>(1, o.samples); s <= std::max(o.samples, kTargetMaxSamples); s *= 4) {
    largest = s;
    if (s > kTargetMaxSamples / 4) break;
  }
  return largest;
}

StatusOr<Plan> plan_targeted(const Backend& backend, const AttentionParams& p, const PlanLimits& limits) {
  if (!(p.target_rel_err > 0)) return internal_error("plan_targeted: target_rel_err = 0, expected > 0");
  Plan plan;
  plan.params = p;
  plan.backend = backend.name();
  plan.threads = plan_threads(limits.threads);
  std::vector<TargetStep> ladder;
  try {
    ladder = target_ladder(p);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("target_rel_err: the ladder of configurations could not be allocated");
  }
  for (TargetStep& step : ladder) {
    ASSIGN_OR_RETURN(Plan attempt, plan_attention(backend, step.params, limits));
    attempt.target_window_scale = step.window_scale;
    // Every attempt's draws live as long as the plan; the attempts run one
    // after another in one workspace.
    plan.own_host_bytes += attempt.own_host_bytes;
    plan.forward_workspace.host_bytes =
        std::max(plan.forward_workspace.host_bytes, attempt.forward_workspace.host_bytes);
    plan.forward_workspace.device_bytes =
        std::max(plan.forward_workspace.device_bytes, attempt.forward_workspace.device_bytes);
    plan.estimates_workspace.host_bytes =
        std::max(plan.estimates_workspace.host_bytes, attempt.estimates_workspace.host_bytes);
    plan.estimates_workspace.device_bytes =
        std::max(plan.estimates_workspace.device_bytes, attempt.estimates_workspace.device_bytes);
    plan.attempts.push_back(std::move(attempt));
  }
  return plan;
}

StatusOr<AttentionResult> run_targeted(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                       const ExecContext& ctx) {
  const AttentionParams& top = plan.params;
  if (plan.attempts.empty()) return internal_error("run_targeted: a plan without attempts, expected plan_targeted's");
  TargetReport report;
  report.target_rel_err = top.target_rel_err;
  double flops = 0;
  std::map<std::string, double> timings;
  for (size_t i = 0; i < plan.attempts.size(); ++i) {
    RETURN_IF_ERROR(ctx.check_stop());
    Plan attempt = plan.attempts[i];
    AttentionParams& a = attempt.params;
    // top's tensors were checked when they were bound.
    set_tensors(&a, tensors_of(top));
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(AttentionResult result, run_attention(backend, attempt, workspace, ctx));
    TargetAttempt t;
    t.mode = a.mode;
    t.samples = a.mode == Mode::kLsh ? a.samples : 0;
    t.window_scale = attempt.target_window_scale;
    if (a.mode == Mode::kWindow)
      for (int64_t w : a.window) t.window_max = std::max(t.window_max, w);
    t.flops = result.flops;
    t.seconds = seconds_since(t0);
    if (a.mode == Mode::kExact) {
      t.met = true;  // no approximation: error 0 up to rounding
    } else {
      t.rel_err = result.probe.rel_err;
      t.rel_err_upper = result.probe.rows > 0 ? result.probe.rel_err_upper : std::numeric_limits<double>::infinity();
      t.met = t.rel_err_upper <= top.target_rel_err;  // false for NaN and +inf
    }
    flops += result.flops;
    for (const auto& [name, seconds] : result.timings) timings[name] += seconds;
    report.attempts.push_back(t);
    if (t.met || i + 1 == plan.attempts.size()) {
      report.met = t.met;
      report.chosen = static_cast<int64_t>(i);
      result.flops = flops;
      result.timings = timings;
      result.target = std::move(report);
      return result;
    }
  }
  return internal_error("run_targeted: no attempt ran");
}

}  // namespace plsh
