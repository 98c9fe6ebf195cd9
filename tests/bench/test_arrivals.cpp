// Open-loop arrival schedules: constant spacing is exact; Poisson gaps are
// exponential with the asked-for rate (bounds of 4 standard errors, from
// the exponential's own variance, on fixed seeds).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <thread>
#include <vector>

#include "bench/arrivals.h"

namespace plsh::bench {
namespace {

TEST(Arrivals, ConstantIsIndexOverRate) {
  ArrivalSchedule s(Arrivals::kConstant, 40.0, 1);
  for (int64_t i = 0; i < 100000; ++i) {
    const ArrivalSchedule::Arrival a = s.next();
    ASSERT_EQ(a.index, i);
    // index / rate, not a running sum: no drift after 1e5 arrivals.
    ASSERT_DOUBLE_EQ(a.at, static_cast<double>(i) / 40.0);
  }
}

TEST(Arrivals, PoissonGapsAreExponentialWithTheRate) {
  const double rate = 250;
  const int n = 40000;
  ArrivalSchedule s(Arrivals::kPoisson, rate, 12345);
  std::vector<double> gaps;
  double previous = 0;
  for (int i = 0; i < n; ++i) {
    const double at = s.next().at;
    ASSERT_GT(at, previous);
    gaps.push_back(at - previous);
    previous = at;
  }
  // Mean gap 1/rate; the exponential's sd is also 1/rate, so the mean of n
  // gaps has standard error 1/(rate sqrt(n)).
  double mean = 0;
  for (double g : gaps) mean += g;
  mean /= n;
  EXPECT_NEAR(mean, 1 / rate, 4 / (rate * std::sqrt(n)));
  // P(gap > 1/rate) = e^-1 for an exponential (a constant schedule would
  // give 0 or 1): binomial standard error.
  const double p = std::exp(-1.0);
  const double above =
      static_cast<double>(std::count_if(gaps.begin(), gaps.end(), [&](double g) { return g > 1 / rate; })) / n;
  EXPECT_NEAR(above, p, 4 * std::sqrt(p * (1 - p) / n));
  // Variance 1/rate^2, i.e. coefficient of variation 1. The sample
  // variance of an exponential has variance (mu4 - sigma^4)/n = 8/(rate^4 n).
  double var = 0;
  for (double g : gaps) var += (g - mean) * (g - mean);
  var /= n - 1;
  EXPECT_NEAR(var * rate * rate, 1.0, 4 * std::sqrt(8.0 / n));
}

TEST(Arrivals, PoissonCountsPerSecondHaveVarianceEqualToMean) {
  // Arrivals in 400 disjoint one-second windows at rate 30: Poisson(30)
  // counts, mean 30 (standard error sqrt(30/400)) and variance 30 (the
  // sample variance of Poisson counts has variance ~ 2 lambda^2/(k-1) + lambda/k).
  const double rate = 30;
  const int windows = 400;
  ArrivalSchedule s(Arrivals::kPoisson, rate, 99);
  std::vector<int> counts(windows, 0);
  for (;;) {
    const double at = s.next().at;
    if (at >= windows) break;
    ++counts[static_cast<size_t>(at)];
  }
  double mean = 0;
  for (int c : counts) mean += c;
  mean /= windows;
  double var = 0;
  for (int c : counts) var += (c - mean) * (c - mean);
  var /= windows - 1;
  EXPECT_NEAR(mean, rate, 4 * std::sqrt(rate / windows));
  EXPECT_NEAR(var, rate, 4 * std::sqrt(2 * rate * rate / (windows - 1) + rate / windows));
}

TEST(Arrivals, SameSeedSameSchedule) {
  ArrivalSchedule a(Arrivals::kPoisson, 10, 5), b(Arrivals::kPoisson, 10, 5), c(Arrivals::kPoisson, 10, 6);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const double x = a.next().at;
    EXPECT_EQ(x, b.next().at);
    differs = differs || x != c.next().at;
  }
  EXPECT_TRUE(differs);
}

TEST(Arrivals, ThreadsGetEachArrivalOnceAndInOrder) {
  ArrivalSchedule s(Arrivals::kPoisson, 1000, 3);
  const int threads = 4, each = 5000;
  std::vector<std::vector<ArrivalSchedule::Arrival>> got(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = 0; i < each; ++i) got[static_cast<size_t>(t)].push_back(s.next());
    });
  for (std::thread& t : pool) t.join();
  std::vector<ArrivalSchedule::Arrival> all;
  for (const auto& g : got) {
    // Each thread sees increasing indices and times.
    for (size_t i = 1; i < g.size(); ++i) {
      EXPECT_GT(g[i].index, g[i - 1].index);
      EXPECT_GT(g[i].at, g[i - 1].at);
    }
    all.insert(all.end(), g.begin(), g.end());
  }
  std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) { return x.index < y.index; });
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(all[i].index, static_cast<int64_t>(i));
    if (i > 0) {
      ASSERT_GT(all[i].at, all[i - 1].at);
    }
  }
}

TEST(Arrivals, ParseNames) {
  EXPECT_EQ(*parse_arrivals("constant"), Arrivals::kConstant);
  EXPECT_EQ(*parse_arrivals("poisson"), Arrivals::kPoisson);
  const StatusOr<Arrivals> bad = parse_arrivals("uniform");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("uniform"), std::string::npos);
}

}  // namespace
}  // namespace plsh::bench
