// Statistical properties of the draws (SPEC sections 3 and 5) with fixed
// seeds and bounds of 4 standard errors derived from each statistic's own
// variance: they cannot flake (the seeds are fixed) and cannot pass
// vacuously (each bound is a few percent of the quantity tested).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moments.h"
#include "plsh/draws.h"

namespace plsh {
namespace {

constexpr int64_t kHashes = 20000;

using testing::Moments;
using testing::moments;
using testing::variance_stderr;

// E[M(h)_ij] = L*_ij: the fraction of hashes that put two positions x apart
// in one bin is exp(-x / sigma), within 4 Bernoulli standard errors
// sqrt(p (1 - p) / N), at several distances, sigmas and absolute positions.
TEST(Statistics, MeanMaskIsExactAlibi) {
  const double sigmas[] = {0.7, 4.0, 64.0, 1000.0};
  const double ratios[] = {0.1, 0.5, 1.0, 2.0, 4.0};  // x / sigma
  int64_t checked = 0;
  for (const double sigma : sigmas) {
    for (const double ratio : ratios) {
      const int64_t x = std::max<int64_t>(1, std::llround(ratio * sigma));
      const double p = std::exp(-static_cast<double>(x) / sigma);
      for (const int64_t pos : {int64_t{0}, int64_t{-77}, int64_t{123457}, int64_t{1} << 44}) {
        int64_t same = 0;
        for (int64_t k = 0; k < kHashes; ++k) {
          const Draw d = draw_hash(31337, 6, k, sigma);
          same += bin_of(pos, d) == bin_of(pos + x, d) ? 1 : 0;
        }
        const double mean = static_cast<double>(same) / kHashes;
        const double se = std::sqrt(p * (1 - p) / kHashes);
        EXPECT_LE(std::fabs(mean - p), 4 * se) << "sigma " << sigma << " x " << x << " pos " << pos;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * 5 * 4);
}

// Samples are independent: the mean M~ of s = 16 hashes has variance
// p (1 - p) / s. Over G groups of 16, the sample variance of M~ is within 4
// of its standard errors (Binomial(s, p) / s has mu4 = p q (1 + 3 (s - 2) p q) / s^3).
TEST(Statistics, MaskOfSHashesHasBinomialVariance) {
  constexpr int64_t s = 16, groups = 2000;
  for (const double sigma : {2.0, 50.0}) {
    const int64_t x = std::llround(sigma);
    const double p = std::exp(-static_cast<double>(x) / sigma), q = 1 - p;
    std::vector<double> masks(groups);
    for (int64_t g = 0; g < groups; ++g) {
      int64_t same = 0;
      for (int64_t k = g * s; k < (g + 1) * s; ++k) {
        const Draw d = draw_hash(8, 2, k, sigma);
        same += bin_of(1000, d) == bin_of(1000 + x, d) ? 1 : 0;
      }
      masks[static_cast<size_t>(g)] = static_cast<double>(same) / s;
    }
    const Moments m = moments(masks);
    const double var = p * q / s;
    const double mu4 = p * q * (1 + 3 * (s - 2) * p * q) / (s * s * s);
    EXPECT_LE(std::fabs(m.mean - p), 4 * std::sqrt(var / groups)) << "sigma " << sigma;
    EXPECT_LE(std::fabs(m.var - var), 4 * variance_stderr(var, mu4, groups)) << "sigma " << sigma;
  }
}

// Pitch ~ Gamma(shape 2, scale sigma): mean 2 sigma, variance 2 sigma^2,
// fourth central moment 24 sigma^4 (excess kurtosis 6 / shape = 3), and the
// CDF 1 - (1 + t / sigma) exp(-t / sigma) at two points.
TEST(Statistics, PitchIsGammaTwoSigma) {
  for (const double sigma : {0.5, 3.0, 100.0, 5000.0}) {
    std::vector<double> pitch(kHashes);
    for (int64_t k = 0; k < kHashes; ++k) pitch[static_cast<size_t>(k)] = draw_hash(424242, 9, k, sigma).pitch;
    const Moments m = moments(pitch);
    const double mean = 2 * sigma, var = 2 * sigma * sigma, mu4 = 24 * std::pow(sigma, 4);
    EXPECT_LE(std::fabs(m.mean - mean), 4 * std::sqrt(var / kHashes)) << "sigma " << sigma;
    EXPECT_LE(std::fabs(m.var - var), 4 * variance_stderr(var, mu4, kHashes)) << "sigma " << sigma;
    for (const double t : {sigma, 4 * sigma}) {
      const double cdf = 1 - (1 + t / sigma) * std::exp(-t / sigma);
      int64_t below = 0;
      for (double v : pitch) below += v <= t ? 1 : 0;
      EXPECT_LE(std::fabs(static_cast<double>(below) / kHashes - cdf), 4 * std::sqrt(cdf * (1 - cdf) / kHashes))
          << "sigma " << sigma << " t " << t;
    }
  }
}

// Shift ~ Uniform[0, pitch): shift / pitch has mean 1/2, variance 1/12
// (mu4 = 1/80), and is uncorrelated with the pitch (correlation within 4 /
// sqrt(N)).
TEST(Statistics, ShiftIsUniformWithinThePitch) {
  for (const double sigma : {0.9, 40.0}) {
    std::vector<double> fraction(kHashes), pitch(kHashes);
    for (int64_t k = 0; k < kHashes; ++k) {
      const Draw d = draw_hash(777, 1, k, sigma);
      ASSERT_GE(d.shift, 0);
      ASSERT_LT(d.shift, d.pitch);
      fraction[static_cast<size_t>(k)] = d.shift / d.pitch;
      pitch[static_cast<size_t>(k)] = d.pitch;
    }
    const Moments f = moments(fraction), p = moments(pitch);
    EXPECT_LE(std::fabs(f.mean - 0.5), 4 * std::sqrt(1.0 / 12 / kHashes)) << "sigma " << sigma;
    EXPECT_LE(std::fabs(f.var - 1.0 / 12), 4 * variance_stderr(1.0 / 12, 1.0 / 80, kHashes)) << "sigma " << sigma;
    double cov = 0;
    for (int64_t k = 0; k < kHashes; ++k)
      cov += (fraction[static_cast<size_t>(k)] - f.mean) * (pitch[static_cast<size_t>(k)] - p.mean);
    cov /= static_cast<double>(kHashes - 1);
    EXPECT_LE(std::fabs(cov / std::sqrt(f.var * p.var)), 4 / std::sqrt(static_cast<double>(kHashes)));
  }
}

// Heads draw independently: the same (seed, sample) on two heads gives
// uncorrelated pitch fractions.
TEST(Statistics, HeadsDrawIndependently) {
  std::vector<double> a(kHashes), b(kHashes);
  for (int64_t k = 0; k < kHashes; ++k) {
    a[static_cast<size_t>(k)] = draw_uniform(5, 0, k, 0);
    b[static_cast<size_t>(k)] = draw_uniform(5, 1, k, 0);
  }
  const Moments ma = moments(a), mb = moments(b);
  double cov = 0;
  for (int64_t k = 0; k < kHashes; ++k)
    cov += (a[static_cast<size_t>(k)] - ma.mean) * (b[static_cast<size_t>(k)] - mb.mean);
  cov /= static_cast<double>(kHashes - 1);
  EXPECT_LE(std::fabs(cov / std::sqrt(ma.var * mb.var)), 4 / std::sqrt(static_cast<double>(kHashes)));
}

}  // namespace
}  // namespace plsh
