// Latency statistics for plsh bench: every sample is kept and percentiles
// are exact (nearest rank). A level holds at most a few million requests,
// so exact beats a bucketed histogram: no bucket-width error to explain
// next to a p99.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace plsh::bench {

// avg, min, max and the percentiles of a set of samples, in the samples'
// unit. count == 0: every field is 0 (the report prints null).
struct Summary {
  int64_t count = 0;
  double avg = 0, min = 0, p50 = 0, p90 = 0, p95 = 0, p99 = 0, max = 0;
};

class Samples {
 public:
  void add(double value) {
    values_.push_back(value);
    sorted_ = false;
  }
  void reserve(size_t n) { values_.reserve(n); }
  int64_t count() const { return static_cast<int64_t>(values_.size()); }
  bool empty() const { return values_.empty(); }
  // Appends another set (per-thread sets are merged once at the end).
  void merge(const Samples& other);
  // Nearest-rank percentile: the smallest sample x with at least p% of the
  // samples <= x (p in (0, 100]); p <= 0 gives the minimum. Sorts on
  // first use after an add. 0 for an empty set.
  double percentile(double p);
  Summary summary();

 private:
  std::vector<double> values_;
  bool sorted_ = true;
};

}  // namespace plsh::bench
