// Sample moments and their standard errors, for the statistical tests
// (test_statistics.cpp, test_samplers.cpp) that bound each statistic by its
// own variance.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace plsh::testing {

// Mean and unbiased sample variance.
struct Moments {
  double mean = 0, var = 0;
};
inline Moments moments(const std::vector<double>& x) {
  Moments m;
  for (double v : x) m.mean += v;
  m.mean /= static_cast<double>(x.size());
  for (double v : x) m.var += (v - m.mean) * (v - m.mean);
  m.var /= static_cast<double>(x.size() - 1);
  return m;
}

// Standard error of the sample variance of n draws from a distribution with
// variance var and fourth central moment mu4:
// Var(s^2) = (mu4 - var^2 (n - 3) / (n - 1)) / n.
inline double variance_stderr(double var, double mu4, int64_t n) {
  const double nd = static_cast<double>(n);
  return std::sqrt((mu4 - var * var * (nd - 3) / (nd - 1)) / nd);
}

}  // namespace plsh::testing
