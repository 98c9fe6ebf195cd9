// The samplers other than iid (SPEC section 5, plsh/draws.h): each hash
// must stay a valid draw on its own (pitch marginally Gamma(2, sigma), shift
// uniform on [0, pitch) given the pitch), so that E[M~] = L* exactly; only
// the dependence between the s hashes of a head changes. Fixed seeds and
// bounds of 4 standard errors from each statistic's own variance, as in
// test_statistics.cpp: they cannot flake and cannot pass vacuously.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moments.h"
#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/plan.h"

namespace plsh {
namespace {

constexpr Sampling kSamplers[] = {Sampling::kStratified, Sampling::kAsh};

using testing::Moments;
using testing::moments;
using testing::variance_stderr;

// 1 - (1 + t) e^-t; below t = 1 as its series sum_{n>=2} (-1)^n (n-1) t^n / n!,
// which keeps full relative precision near 0.
double gamma2_cdf(double t) {
  if (t >= 1) return 1 - (1 + t) * std::exp(-t);
  double term = 1, sum = 0;  // term = t^n / n!
  for (int n = 1; n <= 40; ++n) {
    term *= t / n;
    if (n >= 2) sum += (n % 2 == 0 ? 1 : -1) * (n - 1) * term;
  }
  return sum;
}

TEST(Samplers, NamesParse) {
  for (Sampling s : {Sampling::kIid, Sampling::kStratified, Sampling::kAsh}) {
    StatusOr<Sampling> parsed = parse_sampling(sampling_name(s));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, s);
  }
  const StatusOr<Sampling> bad = parse_sampling("sobol");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "sampling = 'sobol', expected iid, stratified or ash");
}

// The quantile inverts 1 - (1 + t) e^-t to a few ulps in both tails.
TEST(Samplers, Gamma2QuantileInvertsTheCdf) {
  for (const double u : {0x1.0p-66, 1e-15, 1e-9, 1e-4, 0.01, 0.3, 0.5, 0.7, 0.99}) {
    const double t = gamma2_quantile(u, 1 - u);
    EXPECT_NEAR(gamma2_cdf(t), u, 1e-12 * u) << "u " << u << " t " << t;
  }
  for (const double tail : {0.01, 1e-6, 1e-12, 1e-18, 0x1.0p-60}) {
    const double t = gamma2_quantile(1 - tail, tail);
    EXPECT_NEAR((1 + t) * std::exp(-t), tail, 1e-12 * tail) << "tail " << tail << " t " << t;
  }
  // Monotone on a fine grid.
  double last = 0;
  for (int i = 1; i < 1000; ++i) {
    const double u = i / 1000.0;
    const double t = gamma2_quantile(u, 1 - u);
    EXPECT_GT(t, last) << "u " << u;
    last = t;
  }
}

TEST(Samplers, IidIsSpecSectionFiveBitForBit) {
  for (int64_t s : {1, 7, 64}) {
    const std::vector<Draw> a = draw_hashes(42, 3, 8.0, s);
    const std::vector<Draw> b = draw_hashes(42, 3, 8.0, s, Sampling::kIid);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].pitch, b[k].pitch);
      EXPECT_EQ(a[k].shift, b[k].shift);
    }
  }
}

TEST(Samplers, PermutationIsAPermutation) {
  for (int64_t n : {1, 2, 5, 64, 1000}) {
    std::vector<int64_t> p = draw_permutation(9, 4, n);
    std::sort(p.begin(), p.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(p[static_cast<size_t>(i)], i);
  }
}

TEST(Samplers, AshShiftsPerPitch) {
  EXPECT_EQ(ash_shifts_per_pitch(1), 1);
  EXPECT_EQ(ash_shifts_per_pitch(2), 1);
  EXPECT_EQ(ash_shifts_per_pitch(16), 2);
  EXPECT_EQ(ash_shifts_per_pitch(64), 4);
  EXPECT_EQ(ash_shifts_per_pitch(256), 8);
  EXPECT_EQ(ash_shifts_per_pitch(1024), 16);
}

// A pure function of (seed, head, sample, s): the same call gives the same
// draws; another head, seed or s gives others. Every shift lies in [0, pitch).
TEST(Samplers, PureAndValid) {
  for (Sampling sampling : kSamplers) {
    for (int64_t s : {1, 3, 16, 65, 256}) {
      const std::vector<Draw> a = draw_hashes(5, 2, 16.0, s, sampling);
      const std::vector<Draw> b = draw_hashes(5, 2, 16.0, s, sampling);
      const std::vector<Draw> other_head = draw_hashes(5, 3, 16.0, s, sampling);
      const std::vector<Draw> other_seed = draw_hashes(6, 2, 16.0, s, sampling);
      ASSERT_EQ(a.size(), static_cast<size_t>(s));
      for (size_t k = 0; k < a.size(); ++k) {
        EXPECT_EQ(a[k].pitch, b[k].pitch);
        EXPECT_EQ(a[k].shift, b[k].shift);
        EXPECT_NE(a[k].pitch, other_head[k].pitch);
        EXPECT_NE(a[k].pitch, other_seed[k].pitch);
        ASSERT_GT(a[k].pitch, 0) << sampling_name(sampling);
        ASSERT_GE(a[k].shift, 0) << sampling_name(sampling);
        ASSERT_LT(a[k].shift, a[k].pitch) << sampling_name(sampling);
      }
    }
    // Slope 0: every pitch +inf (one block), as under iid.
    for (const Draw& d : draw_hashes(1, 0, INFINITY, 8, sampling)) {
      EXPECT_TRUE(std::isinf(d.pitch));
      EXPECT_FALSE(std::isnan(d.shift));
    }
  }
}

// The structure that lowers the variance: stratified puts exactly one
// pitch quantile in each of the s strata; ash gives each of m strata one
// pitch shared by r hashes whose shifts are evenly spaced modulo the pitch.
TEST(Samplers, StrataAndSystematicShifts) {
  const double sigma = 10.0;
  for (int64_t s : {1, 16, 64, 100}) {
    const std::vector<Draw> d = draw_hashes(77, 1, sigma, s, Sampling::kStratified);
    std::vector<int64_t> count(static_cast<size_t>(s), 0);
    for (const Draw& x : d) {
      const double u = gamma2_cdf(x.pitch / sigma);
      ++count[std::min<size_t>(static_cast<size_t>(u * static_cast<double>(s)), static_cast<size_t>(s - 1))];
    }
    for (int64_t c : count) EXPECT_EQ(c, 1) << "s " << s;
  }
  for (int64_t s : {16, 64, 100, 256}) {
    const int64_t r = ash_shifts_per_pitch(s);
    const int64_t m = (s + r - 1) / r;
    const std::vector<Draw> d = draw_hashes(78, 1, sigma, s, Sampling::kAsh);
    std::vector<int64_t> count(static_cast<size_t>(m), 0);
    for (int64_t g = 0; g < m; ++g) {
      const int64_t first = g * r, size = std::min(r, s - first);
      const double pitch = d[static_cast<size_t>(first)].pitch;
      const double u = gamma2_cdf(pitch / sigma);
      ++count[std::min<size_t>(static_cast<size_t>(u * static_cast<double>(m)), static_cast<size_t>(m - 1))];
      std::vector<double> fractions;
      for (int64_t l = 0; l < size; ++l) {
        ASSERT_EQ(d[static_cast<size_t>(first + l)].pitch, pitch);
        fractions.push_back(d[static_cast<size_t>(first + l)].shift / pitch);
      }
      std::sort(fractions.begin(), fractions.end());
      for (size_t i = 1; i < fractions.size(); ++i)
        EXPECT_NEAR(fractions[i] - fractions[i - 1], 1.0 / static_cast<double>(size), 1e-12) << "s " << s << " g " << g;
    }
    for (int64_t c : count) EXPECT_EQ(c, 1) << "s " << s;
  }
}

// Each hash on its own: over many seeds, hash k of a head has pitch ~
// Gamma(2, sigma) (mean, variance, CDF at two points) and shift / pitch ~
// U[0, 1) uncorrelated with the pitch. Checked for a hash early, in the
// middle and last of the s, including ash's short last group (s = 65).
TEST(Samplers, EachHashIsAValidDraw) {
  constexpr int64_t kSeeds = 20000;
  for (Sampling sampling : kSamplers) {
    for (const double sigma : {0.9, 40.0}) {
      for (const int64_t s : {int64_t{16}, int64_t{65}}) {
        const int64_t picks[] = {0, s / 2, s - 1};
        std::vector<std::vector<double>> pitches(3, std::vector<double>(kSeeds)), fractions = pitches;
        for (int64_t seed = 0; seed < kSeeds; ++seed) {
          const std::vector<Draw> d = draw_hashes(static_cast<uint64_t>(seed) * 7919 + 3, 5, sigma, s, sampling);
          for (size_t i = 0; i < 3; ++i) {
            pitches[i][static_cast<size_t>(seed)] = d[static_cast<size_t>(picks[i])].pitch;
            fractions[i][static_cast<size_t>(seed)] =
                d[static_cast<size_t>(picks[i])].shift / d[static_cast<size_t>(picks[i])].pitch;
          }
        }
        for (size_t i = 0; i < 3; ++i) {
          const int64_t k = picks[i];
          const std::vector<double>& pitch = pitches[i];
          const std::vector<double>& fraction = fractions[i];
          const std::string what = std::string(sampling_name(sampling)) + " sigma " + std::to_string(sigma) + " s " +
                                   std::to_string(s) + " k " + std::to_string(k);
          const Moments mp = moments(pitch), mf = moments(fraction);
          const double mean = 2 * sigma, var = 2 * sigma * sigma, mu4 = 24 * std::pow(sigma, 4);
          EXPECT_LE(std::fabs(mp.mean - mean), 4 * std::sqrt(var / kSeeds)) << what;
          EXPECT_LE(std::fabs(mp.var - var), 4 * variance_stderr(var, mu4, kSeeds)) << what;
          for (const double t : {sigma, 4 * sigma}) {
            const double cdf = gamma2_cdf(t / sigma);
            int64_t below = 0;
            for (double v : pitch) below += v <= t ? 1 : 0;
            EXPECT_LE(std::fabs(static_cast<double>(below) / kSeeds - cdf), 4 * std::sqrt(cdf * (1 - cdf) / kSeeds))
                << what << " t " << t;
          }
          EXPECT_LE(std::fabs(mf.mean - 0.5), 4 * std::sqrt(1.0 / 12 / kSeeds)) << what;
          EXPECT_LE(std::fabs(mf.var - 1.0 / 12), 4 * variance_stderr(1.0 / 12, 1.0 / 80, kSeeds)) << what;
          double cov = 0;
          for (int64_t i = 0; i < kSeeds; ++i)
            cov += (fraction[static_cast<size_t>(i)] - mf.mean) * (pitch[static_cast<size_t>(i)] - mp.mean);
          cov /= static_cast<double>(kSeeds - 1);
          EXPECT_LE(std::fabs(cov / std::sqrt(mf.var * mp.var)), 4 / std::sqrt(static_cast<double>(kSeeds))) << what;
        }
      }
    }
  }
}

// E[M~_ij] = L*_ij: over G independent heads' worth of s hashes (seeds),
// the mean of M~ at distance x is exp(-x / sigma) within 4 standard errors
// of the mean, the standard error from the sample variance of M~ across the
// G groups (a t statistic with G - 1 degrees of freedom). The bound is also
// checked to be tight (under 0.01), so the test cannot pass vacuously.
// The variance itself is compared with iid's binomial p (1 - p) / s: what
// the samplers are for.
struct MaskStats {
  double mean = 0, var = 0;
};
MaskStats mask_stats(Sampling sampling, double sigma, int64_t s, int64_t pos, int64_t x, int64_t groups) {
  std::vector<double> m(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    const std::vector<Draw> d = draw_hashes(static_cast<uint64_t>(g) + 1000, 2, sigma, s, sampling);
    int64_t same = 0;
    for (const Draw& h : d) same += bin_of(pos, h) == bin_of(pos + x, h) ? 1 : 0;
    m[static_cast<size_t>(g)] = static_cast<double>(same) / static_cast<double>(s);
  }
  const Moments mo = moments(m);
  return {mo.mean, mo.var};
}

TEST(Samplers, MeanMaskIsExactAlibi) {
  constexpr int64_t kGroups = 3000;
  for (Sampling sampling : kSamplers) {
    for (const double sigma : {3.0, 64.0}) {
      for (const double ratio : {0.25, 1.0, 3.0}) {
        for (const int64_t s : {int64_t{16}, int64_t{64}}) {
          const int64_t x = std::max<int64_t>(1, std::llround(ratio * sigma));
          const int64_t pos = 123457;
          const double p = std::exp(-static_cast<double>(x) / sigma);
          const MaskStats st = mask_stats(sampling, sigma, s, pos, x, kGroups);
          const double se = std::sqrt(st.var / kGroups);
          const std::string what = std::string(sampling_name(sampling)) + " sigma " + std::to_string(sigma) + " x " +
                                   std::to_string(x) + " s " + std::to_string(s);
          EXPECT_LE(std::fabs(st.mean - p), 4 * se) << what << " mean " << st.mean << " L* " << p;
          EXPECT_LE(4 * se, 0.01) << what;
        }
      }
    }
  }
}

// The point of the samplers: at s = 64 and distances around sigma, M~'s
// variance is at most that of iid's binomial (stratified) and several
// times lower (ash). Each comparison leaves 4 standard errors of the
// sample variance (Var(s^2) ~ 2 var^2 / (G - 1) for a near-normal mean of
// 64 indicators) in the sampler's favour.
TEST(Samplers, VarianceBelowIid) {
  constexpr int64_t kGroups = 3000, s = 64;
  for (const double sigma : {8.0, 100.0}) {
    for (const double ratio : {0.5, 1.0, 2.0}) {
      const int64_t x = std::llround(ratio * sigma);
      const double p = std::exp(-static_cast<double>(x) / sigma);
      const double iid_var = p * (1 - p) / s;
      const double slack = 1 + 4 * std::sqrt(2.0 / (kGroups - 1));
      const MaskStats strat = mask_stats(Sampling::kStratified, sigma, s, 5000, x, kGroups);
      const MaskStats ash = mask_stats(Sampling::kAsh, sigma, s, 5000, x, kGroups);
      EXPECT_LE(strat.var, iid_var * slack) << "stratified sigma " << sigma << " x " << x;
      EXPECT_LE(ash.var * 3, iid_var * slack)
          << "ash sigma " << sigma << " x " << x << " var " << ash.var << " iid " << iid_var;
    }
  }
}

// plan_draws, the one place a request's draws are made, follows p.sampling.
TEST(Samplers, PlanDrawsFollowTheSampler) {
  AttentionOptions o{.q_len = 64, .kv_len = 64, .heads = 3, .head_dim = 8, .samples = 12, .seed = 17};
  for (Sampling sampling : {Sampling::kIid, Sampling::kStratified, Sampling::kAsh}) {
    o.sampling = sampling;
    StatusOr<AttentionParams> p = resolve_params(o);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const std::vector<std::vector<Draw>> draws = plan_draws(*p);
    ASSERT_EQ(draws.size(), 3u);
    for (int64_t h = 0; h < 3; ++h) {
      const std::vector<Draw> want = draw_hashes(17, h, p->sigma(h), 12, sampling);
      for (size_t k = 0; k < want.size(); ++k) {
        EXPECT_EQ(draws[static_cast<size_t>(h)][k].pitch, want[k].pitch);
        EXPECT_EQ(draws[static_cast<size_t>(h)][k].shift, want[k].shift);
      }
    }
  }
}

}  // namespace
}  // namespace plsh
