#include "plsh/plan.h"

#include <omp.h>

#include <algorithm>
#include <new>
#include <string>

namespace plsh {

std::vector<std::vector<Draw>> plan_draws(const AttentionParams& p) {
  std::vector<std::vector<Draw>> draws;
  if (!uses_draws(p.mode)) return draws;
  draws.reserve(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) draws.push_back(head_draws(p, h));
  return draws;
}

int64_t draw_bytes(const AttentionParams& p) {
  if (!uses_draws(p.mode)) return 0;
  return p.heads * (static_cast<int64_t>(sizeof(std::vector<Draw>)) + p.samples * static_cast<int64_t>(sizeof(Draw)));
}

StatusOr<Plan> start_plan(const AttentionParams& p, const std::string& backend, const PlanLimits& limits) {
  Plan plan;
  plan.params = p;
  plan.backend = backend;
  plan.threads = plan_threads(limits.threads);
  try {
    plan.draws = plan_draws(p);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(backend + " backend: the draws for heads = " + std::to_string(p.heads) +
                              ", samples = " + std::to_string(p.samples) + " could not be allocated");
  }
  plan.own_host_bytes = draw_bytes(p);
  return plan;
}

int plan_threads(int requested) { return requested > 0 ? requested : std::max(1, omp_get_num_procs()); }

}  // namespace plsh
