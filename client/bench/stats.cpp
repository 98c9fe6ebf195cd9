#include "bench/stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace plsh::bench {

void Samples::merge(const Samples& other) {
  if (other.values_.empty()) return;
  values_.insert(values_.end(), other.values_.begin(), other.values_.end());
  sorted_ = false;
}

double Samples::percentile(double p) {
  if (values_.empty()) return 0;
  if (!sorted_) {
    std::sort(values_.begin(), values_.end());
    sorted_ = true;
  }
  if (p <= 0) return values_.front();
  const double n = static_cast<double>(values_.size());
  // Rank ceil(p/100 * n), 1-based. The product can land a hair above an
  // integer in floating point (0.95 * 100 = 95.00000000000001); a relative
  // nudge keeps p95 of 100 samples at rank 95, not 96.
  const double exact = p / 100.0 * n;
  const double rank = std::ceil(exact - 1e-9 * std::max(1.0, exact));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, n)) - 1;
  return values_[index];
}

Summary Samples::summary() {
  Summary s;
  if (values_.empty()) return s;
  s.count = count();
  s.avg = std::accumulate(values_.begin(), values_.end(), 0.0) / static_cast<double>(values_.size());
  s.min = percentile(0);
  s.p50 = percentile(50);
  s.p90 = percentile(90);
  s.p95 = percentile(95);
  s.p99 = percentile(99);
  s.max = values_.back();
  return s;
}

}  // namespace plsh::bench
