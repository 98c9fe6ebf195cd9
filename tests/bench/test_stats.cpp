// Percentiles of plsh bench: nearest rank, exact, ordered.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "bench/stats.h"

namespace plsh::bench {
namespace {

TEST(Samples, NearestRankOnOneToHundred) {
  Samples s;
  // Shuffled, so the sort is exercised.
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  std::shuffle(v.begin(), v.end(), std::mt19937_64(7));
  for (double x : v) s.add(x);
  const Summary m = s.summary();
  EXPECT_EQ(m.count, 100);
  EXPECT_DOUBLE_EQ(m.min, 1);
  EXPECT_DOUBLE_EQ(m.p50, 50);
  EXPECT_DOUBLE_EQ(m.p90, 90);
  EXPECT_DOUBLE_EQ(m.p95, 95);  // 0.95 * 100 is 95.00000000000001 in floating point: still rank 95
  EXPECT_DOUBLE_EQ(m.p99, 99);
  EXPECT_DOUBLE_EQ(m.max, 100);
  EXPECT_DOUBLE_EQ(m.avg, 50.5);
}

TEST(Samples, NearestRankRoundsTheRankUp) {
  Samples s;
  for (double x : {10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0}) s.add(x);
  // rank = ceil(p/100 * 7): p50 -> 4, p90 -> 7 (6.3 up), p10 -> 1 (0.7 up).
  EXPECT_DOUBLE_EQ(s.percentile(50), 40);
  EXPECT_DOUBLE_EQ(s.percentile(90), 70);
  EXPECT_DOUBLE_EQ(s.percentile(10), 10);
  EXPECT_DOUBLE_EQ(s.percentile(100), 70);
  EXPECT_DOUBLE_EQ(s.percentile(0), 10);
  EXPECT_DOUBLE_EQ(s.percentile(1e-9), 10);
}

TEST(Samples, EverySampleAtLeastPPercentBelow) {
  // The defining property, on random data with ties: at least p% of the
  // samples are <= the p-th percentile, and fewer than p% are below it.
  std::mt19937_64 rng(11);
  std::exponential_distribution<double> latency(100.0);
  Samples s;
  std::vector<double> v;
  for (int i = 0; i < 1237; ++i) {
    const double x = std::round(latency(rng) * 1e4) / 1e4;  // ties
    v.push_back(x);
    s.add(x);
  }
  for (double p : {1.0, 25.0, 50.0, 90.0, 95.0, 99.0, 99.9}) {
    const double q = s.percentile(p);
    const auto at_most = std::count_if(v.begin(), v.end(), [q](double x) { return x <= q; });
    const auto below = std::count_if(v.begin(), v.end(), [q](double x) { return x < q; });
    EXPECT_GE(100.0 * static_cast<double>(at_most), p * static_cast<double>(v.size())) << "p" << p;
    EXPECT_LT(100.0 * static_cast<double>(below), p * static_cast<double>(v.size())) << "p" << p;
  }
}

TEST(Samples, SummaryIsOrdered) {
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> latency(-4, 1);
  for (int n : {1, 2, 3, 17, 100, 5000}) {
    Samples s;
    for (int i = 0; i < n; ++i) s.add(latency(rng));
    const Summary m = s.summary();
    EXPECT_LE(m.min, m.p50) << n;
    EXPECT_LE(m.p50, m.p90) << n;
    EXPECT_LE(m.p90, m.p95) << n;
    EXPECT_LE(m.p95, m.p99) << n;
    EXPECT_LE(m.p99, m.max) << n;
    EXPECT_LE(m.min, m.avg) << n;
    EXPECT_LE(m.avg, m.max) << n;
  }
}

TEST(Samples, OneSampleIsEveryPercentile) {
  Samples s;
  s.add(0.25);
  const Summary m = s.summary();
  EXPECT_EQ(m.count, 1);
  for (double v : {m.min, m.p50, m.p90, m.p95, m.p99, m.max, m.avg}) EXPECT_DOUBLE_EQ(v, 0.25);
}

TEST(Samples, EmptyIsAllZero) {
  Samples s;
  const Summary m = s.summary();
  EXPECT_EQ(m.count, 0);
  EXPECT_EQ(m.max, 0);
  EXPECT_EQ(s.percentile(99), 0);
}

TEST(Samples, MergeEqualsAddingEverything) {
  Samples a, b, all;
  for (int i = 0; i < 50; ++i) {
    a.add(i * 3 % 17);
    all.add(i * 3 % 17);
    b.add(i * 7 % 23 + 0.5);
    all.add(i * 7 % 23 + 0.5);
  }
  a.summary();  // sorted before the merge: the merge must unsort it
  a.merge(b);
  const Summary x = a.summary(), y = all.summary();
  EXPECT_EQ(x.count, 100);
  EXPECT_DOUBLE_EQ(x.p50, y.p50);
  EXPECT_DOUBLE_EQ(x.p99, y.p99);
  EXPECT_DOUBLE_EQ(x.max, y.max);
  EXPECT_DOUBLE_EQ(x.avg, y.avg);
}

TEST(Samples, AddAfterSummaryResorts) {
  Samples s;
  s.add(5);
  s.add(1);
  EXPECT_DOUBLE_EQ(s.percentile(100), 5);
  s.add(0.5);
  EXPECT_DOUBLE_EQ(s.percentile(0), 0.5);
  EXPECT_DOUBLE_EQ(s.percentile(50), 1);
}

}  // namespace
}  // namespace plsh::bench
