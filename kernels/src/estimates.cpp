#include "plsh/estimates.h"

#include <algorithm>
#include <cmath>

namespace plsh {

PositionRange position_range(const AttentionParams& p) {
  return PositionRange{p.q_pos0, p.q_len, p.k_pos0, p.kv_len, p.causal};
}

int64_t max_block_size(const std::vector<Draw>& draws, const PositionRange& r) {
  const int64_t lo = std::min(r.q_pos0, r.k_pos0);
  const int64_t hi = std::max(r.q_pos0 + r.q_len, r.k_pos0 + r.kv_len);  // exclusive
  int64_t best = 0;
  for (const Draw& d : draws) {
    if (!std::isfinite(d.pitch)) return hi - lo;
    for (int64_t pos = lo; pos < hi;) {
      const int64_t end = std::min(block_end(pos, d), hi);
      best = std::max(best, end - pos);
      pos = end;
    }
  }
  return best;
}

}  // namespace plsh
