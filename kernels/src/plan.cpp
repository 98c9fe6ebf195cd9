#include "plsh/plan.h"

#include <omp.h>

#include <algorithm>

namespace plsh {

std::vector<std::vector<Draw>> plan_draws(const AttentionParams& p) {
  std::vector<std::vector<Draw>> draws;
  if (p.mode != Mode::kLsh) return draws;
  draws.reserve(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) draws.push_back(draw_hashes(p.seed, h, p.sigma(h), p.samples));
  return draws;
}

int plan_threads(int requested) { return requested > 0 ? requested : std::max(1, omp_get_num_procs()); }

}  // namespace plsh
