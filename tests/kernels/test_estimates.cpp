// SPEC section 6: every estimate against a brute-force dense computation
// from the float64 reference (tests/kernels/reference.h); none of these
// tests needs a backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "plsh/attention.h"
#include "plsh/estimates.h"
#include "plsh/numeric.h"
#include "reference.h"
#include "shaped.h"
#include "src/estimates_internal.h"

namespace plsh {
namespace {

using plsh::testing::shaped;
using testing::reference_attention;
using testing::reference_weight;

// A plan as a backend would make it for these params: the estimates read
// only its params, threads and draws.
Plan plan_of(const AttentionParams& p) {
  Plan plan;
  plan.params = p;
  plan.backend = "test";
  plan.threads = plan_threads(0);
  plan.draws = plan_draws(p);
  plan.estimates_workspace.host_bytes = estimates_host_bytes(p, plan.threads);
  return plan;
}

// compute_estimates on plan_of(p), in a workspace of the size it plans.
Status estimate(const AttentionParams& p, const ExecContext& ctx, AttentionResult* result) {
  const Plan plan = plan_of(p);
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.estimates_workspace.host_bytes));
  return compute_estimates(plan, workspace.ref(), ctx, result);
}

// One probe row on its own.
ProbeRow probe_row(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, int64_t i) {
  ProbeRow row;
  probe_rows(p, m, h, b, {i}, &row);
  return row;
}

// Options, tensors and resolved params kept together (params point into the
// tensors).
struct EstimatesProblem {
  AttentionOptions options;
  testing::RandomTensors tensors;
  std::vector<uint8_t> out;
  AttentionParams params;
};

std::unique_ptr<EstimatesProblem> make_estimates_problem(const AttentionOptions& o, uint64_t seed = 1) {
  auto pr = std::make_unique<EstimatesProblem>();
  pr->options = o;
  pr->tensors = testing::random_qkv(o, seed);
  pr->out = testing::output_buffer(o);
  TensorRefs t;
  t.q = pr->tensors.q.data();
  t.k = pr->tensors.k.data();
  t.v = pr->tensors.v.data();
  t.out = pr->out.data();
  StatusOr<AttentionParams> p = make_params(o, t);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  pr->params = *p;
  return pr;
}

// Writes the reference output of p's own mode into p.out: the o~ a backend
// would return, so the probe sees the approximation error only.
void fill_output_with_reference(EstimatesProblem* pr) {
  const testing::ReferenceOutput ref = reference_attention(pr->params);
  for (size_t i = 0; i < ref.out.size(); ++i)
    store_element(pr->out.data(), pr->params.out_dtype, static_cast<int64_t>(i), static_cast<float>(ref.out[i]));
}

AttentionParams as_exact(const AttentionParams& p) {
  AttentionParams e = p;
  e.mode = Mode::kExact;
  return e;
}

double lstar(const AttentionParams& p, int64_t h, int64_t pos_q, int64_t pos_k) {
  return std::exp(-std::fabs(static_cast<double>(pos_q - pos_k)) / p.sigma(h));
}

bool allowed(const AttentionParams& p, int64_t pos_q, int64_t pos_k) { return !p.causal || pos_k <= pos_q; }

// E = L* - M~ on the allowed pairs, dense [q_len][kv_len].
std::vector<std::vector<double>> dense_error(const AttentionParams& p, int64_t h) {
  std::vector<std::vector<double>> e(static_cast<size_t>(p.q_len), std::vector<double>(static_cast<size_t>(p.kv_len)));
  for (int64_t i = 0; i < p.q_len; ++i) {
    for (int64_t j = 0; j < p.kv_len; ++j) {
      const int64_t pq = p.q_pos0 + i, pk = p.k_pos0 + j;
      e[i][j] = allowed(p, pq, pk) ? lstar(p, h, pq, pk) - reference_weight(p, h, pq, pk) : 0.0;
    }
  }
  return e;
}

double dense_max_abs(const std::vector<std::vector<double>>& e) {
  double m = 0;
  for (const auto& row : e)
    for (double x : row) m = std::max(m, std::fabs(x));
  return m;
}

// ||E||_2 by one-sided Jacobi (Hestenes): rotate pairs of columns until
// all are orthogonal; the singular values are then the column norms. An
// independent dense check on the Lanczos estimate, run to convergence, with
// every access contiguous.
double dense_spectral_norm(const std::vector<std::vector<double>>& e) {
  // Columns of E, or of E^T when that has fewer (same singular values).
  const size_t rows = e.size(), cols = e[0].size();
  const bool transpose = rows < cols;
  const size_t n = transpose ? rows : cols, len = transpose ? cols : rows;
  std::vector<std::vector<double>> u(n, std::vector<double>(len));
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) (transpose ? u[r][c] : u[c][r]) = e[r][c];
  auto dot = [&](const std::vector<double>& x, const std::vector<double>& y) {
    double s = 0;
    for (size_t k = 0; k < len; ++k) s += x[k] * y[k];
    return s;
  };
  std::vector<double> norm2(n);
  for (int sweep = 0; sweep < 60; ++sweep) {
    // Squared column norms, refreshed each sweep and updated exactly by
    // each rotation in between (alpha - t gamma, beta + t gamma).
    for (size_t p = 0; p < n; ++p) norm2[p] = dot(u[p], u[p]);
    bool rotated = false;
    for (size_t p = 0; p + 1 < n; ++p) {
      for (size_t q = p + 1; q < n; ++q) {
        const double alpha = norm2[p], beta = norm2[q], gamma = dot(u[p], u[q]);
        if (std::fabs(gamma) <= 1e-15 * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const double zeta = (beta - alpha) / (2 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::fabs(zeta) + std::sqrt(1 + zeta * zeta));
        const double c = 1 / std::sqrt(1 + t * t), s = c * t;
        for (size_t k = 0; k < len; ++k) {
          const double up = u[p][k], uq = u[q][k];
          u[p][k] = c * up - s * uq;
          u[q][k] = s * up + c * uq;
        }
        norm2[p] = alpha - t * gamma;
        norm2[q] = beta + t * gamma;
      }
    }
    if (!rotated) break;
  }
  double best = 0;
  for (const auto& col : u) best = std::max(best, std::sqrt(dot(col, col)));
  return best;
}

AttentionOptions mask_options(int64_t q_len, int64_t kv_len, bool causal, std::vector<double> slopes) {
  AttentionOptions o;
  o.q_len = q_len;
  o.kv_len = kv_len;
  o.heads = static_cast<int64_t>(slopes.size());
  o.head_dim = 2;
  o.causal = causal;
  o.slopes = std::move(slopes);
  o.probe_rows = 0;
  o.samples = 16;
  o.seed = 12345;
  return o;
}

// Shapes the mask tests sweep: square, causal, Nq != Nk either way, offsets.
struct Shape {
  int64_t q_len, kv_len;
  bool causal;
  std::optional<int64_t> q_pos0;
  int64_t k_pos0;
};
const Shape kShapes[] = {
    {160, 160, false, std::nullopt, 0},
    {160, 160, true, std::nullopt, 0},
    {48, 220, true, std::nullopt, 0},                            // queries at the end of the keys
    {90, 200, false, int64_t{40}, 0},                            // queries amid the keys
    {120, 257, false, int64_t{1000}, 900},                       // offsets, queries inside the keys
    {97, 150, true, (int64_t{1} << 40) + 53, int64_t{1} << 40},  // far from 0, the last keys
};
// sigma = 1, 8, 256 and 4000 (wider than every request), and slope 0.
const std::vector<double> kSlopes = {1.0, 1.0 / 8, 1.0 / 256, 1.0 / 4000, 0.0};

AttentionOptions shape_options(const Shape& s, Mode mode) {
  AttentionOptions o = mask_options(s.q_len, s.kv_len, s.causal, kSlopes);
  o.q_pos0 = s.q_pos0;
  o.k_pos0 = s.k_pos0;
  o.mode = mode;
  return o;
}

TEST(Estimates, LshMaskMaxErrorMatchesDense) {
  for (const Shape& shape : kShapes) {
    for (const int64_t samples : {1, 3, 16}) {
      AttentionOptions o = shape_options(shape, Mode::kLsh);
      o.samples = samples;
      const auto pr = make_estimates_problem(o);
      const AttentionParams& p = pr->params;
      AttentionResult result;
      ASSERT_TRUE(estimate(p, ExecContext{}, &result).ok());
      ASSERT_EQ(result.heads.size(), kSlopes.size());
      double overall = 0;
      for (int64_t h = 0; h < p.heads; ++h) {
        const double dense = dense_max_abs(dense_error(p, h));
        const HeadEstimate& he = result.heads[h];
        EXPECT_NEAR(he.mask_max_err, dense, 1e-12) << "q_len " << p.q_len << " kv_len " << p.kv_len << " causal "
                                                   << p.causal << " s " << samples << " h " << h;
        EXPECT_EQ(he.mask_rows_checked, p.q_len);
        EXPECT_FALSE(he.mask_rows_sampled);
        overall = std::max(overall, dense);
      }
      EXPECT_NEAR(result.mask_max_err, overall, 1e-12);
      EXPECT_EQ(result.heads[4].mask_max_err, 0.0) << "slope 0: L* = M~ = 1";
    }
  }
}

// Random ranges, offsets, slopes and hash counts, each against the dense
// maximum: the row walk's clipping of the blocks' hull to the allowed keys
// (k_lo, k_hi) at every kind of edge, which the six shapes above do not
// reach often enough (a check one key past k_hi went unnoticed by them).
TEST(Estimates, LshMaskMaxErrorMatchesDenseOnRandomRanges) {
  std::mt19937_64 rng(20261207);
  auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  for (int trial = 0; trial < 1000; ++trial) {
    const bool causal = below(2) == 0;
    const double sigma = std::pow(2.0, static_cast<double>(below(60)) / 10.0);  // 1 to 2^5.9
    // lsh keeps the queries among the keys: keys [q_pos0 - lead, q_pos0 + q_len + tail).
    const int64_t q_len = 1 + below(60), lead = below(40), tail = below(40);
    AttentionOptions o = mask_options(q_len, lead + q_len + tail, causal, {1.0 / sigma});
    o.samples = 1 + below(40);
    o.seed = rng();
    o.q_pos0 = lead + below(100);
    o.k_pos0 = *o.q_pos0 - lead;
    o.mode = Mode::kLsh;
    const auto pr = make_estimates_problem(o);
    const AttentionParams& p = pr->params;
    AttentionResult result;
    ASSERT_TRUE(estimate(p, ExecContext{}, &result).ok());
    EXPECT_NEAR(result.heads[0].mask_max_err, dense_max_abs(dense_error(p, 0)), 1e-12)
        << "trial " << trial << " q " << p.q_pos0 << "+" << p.q_len << " k " << p.k_pos0 << "+" << p.kv_len
        << " causal " << p.causal << " sigma " << sigma << " s " << p.samples;
  }
}

// fixed_blocks' mask errors are its bias, L* - M with M from SPEC section
// 4's floor(p / 2 sigma) (the reference's, not the plan's draws): never 0
// where slope > 0 and a block boundary falls inside the request.
TEST(Estimates, FixedBlocksMaskErrorsAreTheirBias) {
  for (const Shape& shape : kShapes) {
    const auto pr = make_estimates_problem(shape_options(shape, Mode::kFixedBlocks));
    const AttentionParams& p = pr->params;
    AttentionResult result;
    ASSERT_TRUE(estimate(p, ExecContext{}, &result).ok());
    ASSERT_EQ(result.heads.size(), kSlopes.size());
    for (int64_t h = 0; h < p.heads; ++h) {
      const std::vector<std::vector<double>> e = dense_error(p, h);
      EXPECT_NEAR(result.heads[h].mask_max_err, dense_max_abs(e), 1e-12) << "h " << h << " q_len " << p.q_len;
      if (p.slopes[h] > 0) {
        EXPECT_LE(result.heads[h].max_block, static_cast<int64_t>(std::ceil(2 / p.slopes[h])));
      }
    }
    EXPECT_EQ(result.heads[0].max_block, 2) << "sigma 1: blocks of 2 positions";
    EXPECT_GT(result.heads[0].mask_max_err, 0.3);
    EXPECT_EQ(result.heads[4].mask_max_err, 0.0) << "slope 0: L* = M = 1";
  }
  // The spectral estimate of the bias, against a dense eigen-solve.
  AttentionOptions o = mask_options(300, 300, true, {1.0 / 16});
  o.mode = Mode::kFixedBlocks;
  const auto pr = make_estimates_problem(o);
  AttentionResult result;
  ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
  const double dense = dense_spectral_norm(dense_error(pr->params, 0));
  EXPECT_NEAR(result.heads[0].mask_spectral_err, dense, 0.05 * dense);
}

TEST(Estimates, WindowMaskMaxErrorMatchesDense) {
  for (const Shape& shape : kShapes) {
    for (const int64_t width : {0, 1, 5, 40, 100000}) {  // 0: W from window_eps
      AttentionOptions o = shape_options(shape, Mode::kWindow);
      o.window_width = width;
      o.window_eps = 1e-2;
      const auto pr = make_estimates_problem(o);
      const AttentionParams& p = pr->params;
      AttentionResult result;
      ASSERT_TRUE(estimate(p, ExecContext{}, &result).ok());
      for (int64_t h = 0; h < p.heads; ++h) {
        const double dense = dense_max_abs(dense_error(p, h));
        EXPECT_NEAR(result.heads[h].mask_max_err, dense, 1e-12)
            << "q_len " << p.q_len << " kv_len " << p.kv_len << " causal " << p.causal << " W " << p.window[h];
        EXPECT_EQ(result.heads[h].window, p.window[h]);
      }
    }
  }
}

TEST(Estimates, RowSampleReportsItselfAndNeverExceedsTheExactMaximum) {
  AttentionOptions o = mask_options(3000, 3000, true, {1.0 / 4, 1.0 / 64});
  const auto full = make_estimates_problem(o);
  o.mask_row_budget = 250;
  const auto sampled = make_estimates_problem(o);
  AttentionResult exact_result, sampled_result;
  ASSERT_TRUE(estimate(full->params, ExecContext{}, &exact_result).ok());
  ASSERT_TRUE(estimate(sampled->params, ExecContext{}, &sampled_result).ok());
  for (size_t h = 0; h < 2; ++h) {
    const HeadEstimate& e = exact_result.heads[h];
    const HeadEstimate& s = sampled_result.heads[h];
    EXPECT_FALSE(e.mask_rows_sampled);
    EXPECT_EQ(e.mask_rows_checked, 3000);
    EXPECT_TRUE(s.mask_rows_sampled);
    EXPECT_EQ(s.mask_rows_checked, 250);
    EXPECT_LE(s.mask_max_err, e.mask_max_err);
    // 250 rows of a stationary mask see errors of the same size.
    EXPECT_GT(s.mask_max_err, 0.5 * e.mask_max_err);
  }
}

TEST(Estimates, SampleIndicesAreSortedDistinctAndSpread) {
  const std::vector<int64_t> all = sample_indices(10, 64, 3);
  ASSERT_EQ(all.size(), 10u);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(all[i], i);
  const std::vector<int64_t> some = sample_indices(1000, 64, 3);
  ASSERT_EQ(some.size(), 64u);
  for (size_t i = 0; i < some.size(); ++i) {
    EXPECT_GE(some[i], static_cast<int64_t>(i * 1000 / 64));
    EXPECT_LT(some[i], static_cast<int64_t>((i + 1) * 1000 / 64));
  }
  EXPECT_NE(sample_indices(1000, 64, 4), some) << "the seed must matter";
}

TEST(Estimates, MaskErrorProductMatchesDense) {
  for (const Shape& shape : kShapes) {
    for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
      AttentionOptions o = shape_options(shape, mode);
      o.window_width = 7;
      const auto pr = make_estimates_problem(o);
      const AttentionParams& p = pr->params;
      const PositionRange range = position_range(p);
      std::mt19937_64 rng(9);
      std::normal_distribution<double> normal;
      const Plan plan = plan_of(p);
      for (int64_t h = 0; h < p.heads; ++h) {
        const auto e = dense_error(p, h);
        const HeadMask m = head_mask(plan, h);
        std::vector<double> x(p.kv_len), y(p.q_len), xt(p.q_len), yt(p.kv_len);
        for (double& v : x) v = normal(rng);
        for (double& v : xt) v = normal(rng);
        // Both paths: summed over the hashes at once from cached block
        // edges (apply_mask_error), and one hash at a time.
        for (const bool per_hash : {false, true}) {
          if (per_hash) {
            estimates_detail::apply_mask_error_per_hash(m, range, x.data(), y.data(), false);
            estimates_detail::apply_mask_error_per_hash(m, range, xt.data(), yt.data(), true);
          } else {
            apply_mask_error(m, range, x.data(), y.data(), false);
            apply_mask_error(m, range, xt.data(), yt.data(), true);
          }
          for (int64_t i = 0; i < p.q_len; ++i) {
            double want = 0;
            for (int64_t j = 0; j < p.kv_len; ++j) want += e[i][j] * x[j];
            ASSERT_NEAR(y[i], want, 1e-10 * (1 + std::fabs(want)))
                << mode_name(mode) << " h " << h << " row " << i << (per_hash ? " per hash" : " cached");
          }
          for (int64_t j = 0; j < p.kv_len; ++j) {
            double want = 0;
            for (int64_t i = 0; i < p.q_len; ++i) want += e[i][j] * xt[i];
            ASSERT_NEAR(yt[j], want, 1e-10 * (1 + std::fabs(want)))
                << mode_name(mode) << " h " << h << " col " << j << (per_hash ? " per hash" : " cached");
          }
        }
      }
    }
  }
}

// The cached path sums the hashes' block sums incrementally: over a long
// range its running sums must not drift from the per-hash products.
TEST(Estimates, SummedMaskProductsDoNotDriftOverLongRanges) {
  for (const bool causal : {false, true}) {
    AttentionOptions o = mask_options(40000, 40000, causal, {1.0, 1.0 / 64});
    o.samples = 32;
    StatusOr<AttentionParams> p = resolve_params(o);
    ASSERT_TRUE(p.ok());
    const Plan plan = plan_of(*p);
    const PositionRange range = position_range(*p);
    std::mt19937_64 rng(5);
    std::normal_distribution<double> normal;
    std::vector<double> x(40000), cached(40000), per_hash(40000);
    for (double& v : x) v = normal(rng) / 200;  // unit norm
    for (int64_t h = 0; h < 2; ++h) {
      const HeadMask m = head_mask(plan, h);
      for (const bool transpose : {false, true}) {
        apply_mask_error(m, range, x.data(), cached.data(), transpose);
        estimates_detail::apply_mask_error_per_hash(m, range, x.data(), per_hash.data(), transpose);
        double diff = 0, norm = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          diff = std::max(diff, std::fabs(cached[i] - per_hash[i]));
          norm = std::max(norm, std::fabs(per_hash[i]));
        }
        EXPECT_LE(diff, 1e-12 * (1 + norm)) << "head " << h << (causal ? " causal" : "") << (transpose ? " E^T" : " E");
      }
    }
  }
}

TEST(Estimates, SpectralErrorWithinFivePercentOfDenseEigenSolve) {
  struct Case {
    Mode mode;
    int64_t q_len, kv_len;
    bool causal;
    double slope;
  };
  const Case cases[] = {
      {Mode::kLsh, 300, 300, false, 1.0 / 16},   {Mode::kLsh, 300, 300, true, 1.0 / 16},
      {Mode::kLsh, 300, 300, true, 1.0 / 2},     {Mode::kLsh, 200, 300, true, 1.0 / 64},
      {Mode::kLsh, 120, 300, false, 1.0 / 8},    {Mode::kWindow, 300, 300, true, 1.0 / 32},
      {Mode::kWindow, 300, 300, false, 1.0 / 8},
  };
  for (const Case& c : cases) {
    AttentionOptions o = mask_options(c.q_len, c.kv_len, c.causal, {c.slope});
    o.mode = c.mode;
    o.window_eps = 0.05;
    const auto pr = make_estimates_problem(o);
    AttentionResult result;
    ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
    const double dense = dense_spectral_norm(dense_error(pr->params, 0));
    const HeadEstimate& he = result.heads[0];
    ASSERT_GT(dense, 0);
    EXPECT_NEAR(he.mask_spectral_err, dense, 0.05 * dense) << mode_name(c.mode) << " causal " << c.causal;
    // Lanczos Ritz values approach the top eigenvalue from below.
    EXPECT_LE(he.mask_spectral_err, dense * (1 + 1e-9));
    EXPECT_GE(he.spectral_iterations, 3);
    EXPECT_LE(he.spectral_iterations, 100);
    EXPECT_DOUBLE_EQ(result.mask_spectral_err, he.mask_spectral_err);
    std::printf("%s %ldx%ld causal %d sigma %g: Lanczos %.6f in %ld iterations, dense %.6f\n", mode_name(c.mode),
                static_cast<long>(c.q_len), static_cast<long>(c.kv_len), c.causal, 1 / c.slope, he.mask_spectral_err,
                static_cast<long>(he.spectral_iterations), dense);
  }
}

TEST(Estimates, SpectralErrorIsZeroWhereTheMaskIsExact) {
  AttentionOptions o = mask_options(50, 50, true, {0.0});
  const auto lsh = make_estimates_problem(o);
  o.mode = Mode::kWindow;
  o.slopes = {0.25};
  o.window_width = 100;  // wider than every distance
  const auto window = make_estimates_problem(o);
  for (const auto* pr : {lsh.get(), window.get()}) {
    AttentionResult result;
    ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
    EXPECT_EQ(result.heads[0].mask_spectral_err, 0.0);
    EXPECT_EQ(result.heads[0].mask_max_err, 0.0);
  }
}

// The headline use: 64 probe rows tell the user the error of the whole
// output. n = 4096, s = 16, one head, D = 64, causal (SPEC's setting).
TEST(Estimates, ProbeErrorWithinFactorOneAndAHalfOfFullError) {
  AttentionOptions o;
  o.q_len = o.kv_len = 4096;
  o.heads = 1;
  o.head_dim = 64;
  o.causal = true;
  o.mode = Mode::kLsh;
  o.samples = 16;
  o.seed = 2024;
  const auto pr = make_estimates_problem(o, 77);
  fill_output_with_reference(pr.get());
  const testing::ReferenceOutput exact = reference_attention(as_exact(pr->params));
  const double full = testing::compare(pr->out.data(), DType::kF32, exact.out).rel_l2;

  AttentionResult result;
  ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
  const ProbeEstimate& probe = result.heads[0].probe;
  EXPECT_EQ(probe.rows, 64);
  EXPECT_GT(probe.rel_err, full / 1.5);
  EXPECT_LT(probe.rel_err, full * 1.5);
  EXPECT_GT(probe.rel_err_stderr, 0);
  EXPECT_LT(probe.rel_err_stderr, 0.5 * probe.rel_err);
  EXPECT_EQ(result.probe.rows, 64);
  EXPECT_DOUBLE_EQ(result.probe.rel_err, probe.rel_err);
  EXPECT_GE(probe.bound_max, probe.max_abs_err);
  std::printf("n=4096 s=16 causal: full rel err %.4f, probe %.4f +- %.4f, max abs %.4f, bound max %.3f\n", full,
              probe.rel_err, probe.rel_err_stderr, probe.max_abs_err, probe.bound_max);
}

// With every row probed the sample is a census: the probe is the full
// relative error and its standard error is 0. Pooled over heads and batch.
TEST(Estimates, ProbeOfEveryRowIsTheFullErrorPooledOverHeads) {
  struct Types {
    DType in, out;
  };
  for (const Types types : {Types{DType::kF32, DType::kF32}, Types{DType::kF16, DType::kBF16}}) {
    for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
      const AttentionOptions o = shaped({2, 40, 70, 4, 2, 24}, {.dtype = types.in,
                                                                .out_dtype = types.out,
                                                                .causal = true,
                                                                .slopes = {0.5, 0.1, 0.02, 0.0},
                                                                .mode = mode,
                                                                .samples = 8,
                                                                .window_eps = 0.02,
                                                                .probe_rows = 80});  // = batch * q_len
      const auto pr = make_estimates_problem(o, 5);
      fill_output_with_reference(pr.get());
      const testing::ReferenceOutput exact = reference_attention(as_exact(pr->params));
      const testing::ErrorStats full = testing::compare(pr->out.data(), types.out, exact.out);

      AttentionResult result;
      ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
      EXPECT_EQ(result.probe.rows, 4 * 80);
      EXPECT_NEAR(result.probe.rel_err, full.rel_l2, 1e-9 * full.rel_l2)
          << mode_name(mode) << " " << dtype_name(types.out);
      EXPECT_EQ(result.probe.rel_err_stderr, 0.0);
      double max_abs = 0;
      for (size_t i = 0; i < exact.out.size(); ++i)
        max_abs = std::max(max_abs, std::fabs(load_element(pr->out.data(), types.out, i) - exact.out[i]));
      EXPECT_NEAR(result.probe.max_abs_err, max_abs, 1e-12);
      for (const HeadEstimate& he : result.heads) EXPECT_EQ(he.probe.rows, 80);
    }
  }
}

// SPEC's rigorous bound really bounds each row's error, in both modes, for
// every row, head and batch item.
TEST(Estimates, BoundHoldsForEveryRow) {
  for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
    for (const bool causal : {false, true}) {
      const AttentionOptions o =
          shaped({2, 60, 90, 3, 0, 16},
                 {.causal = causal, .slopes = {1.0, 0.1, 0.01}, .mode = mode, .samples = 4, .window_eps = 0.1});
      const auto pr = make_estimates_problem(o, 11);
      fill_output_with_reference(pr.get());
      const AttentionParams& p = pr->params;
      const testing::ReferenceOutput exact = reference_attention(as_exact(p));
      int64_t tight = 0;
      const Plan plan = plan_of(p);
      for (int64_t h = 0; h < p.heads; ++h) {
        const HeadMask m = head_mask(plan, h);
        for (int64_t b = 0; b < p.batch; ++b) {
          for (int64_t i = 0; i < p.q_len; ++i) {
            const ProbeRow row = probe_row(p, m, h, b, i);
            double err2 = 0;
            for (int64_t d = 0; d < p.head_dim; ++d) {
              const int64_t idx = ((b * p.q_len + i) * p.heads + h) * p.head_dim + d;
              const double diff = load_element(p.out, DType::kF32, idx) - exact.out[static_cast<size_t>(idx)];
              err2 += diff * diff;
            }
            EXPECT_NEAR(row.err2, err2, 1e-9 * (err2 + 1e-12));
            // float32 storage of o~ adds up to ~1e-7 per element beyond the bound.
            EXPECT_LE(std::sqrt(err2), row.bound + 1e-6) << mode_name(mode) << " h " << h << " row " << i;
            if (std::sqrt(err2) > 0.1 * row.bound) ++tight;
          }
        }
      }
      // The bound is not vacuous: some rows come within a factor 10 of it.
      EXPECT_GT(tight, 0) << mode_name(mode) << " causal " << causal;
    }
  }
}

// compute_estimates probes several rows in one pass over the keys (tiles
// of 128 keys, rows of different causal lengths): the same figures as one
// row at a time.
TEST(Estimates, ProbeRowsInOnePassMatchOneRowAtATime) {
  for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
    const AttentionOptions o =
        shaped({2, 300, 300, 2, 1, 40}, {.causal = true, .slopes = {0.3, 0.01}, .mode = mode, .samples = 5});
    const auto pr = make_estimates_problem(o, 21);
    fill_output_with_reference(pr.get());
    const AttentionParams& p = pr->params;
    const std::vector<int64_t> rows = {0, 1, 127, 128, 129, 200, 255, 256, 299};
    const Plan plan = plan_of(p);
    for (int64_t h = 0; h < 2; ++h) {
      const HeadMask m = head_mask(plan, h);
      std::vector<ProbeRow> together(rows.size());
      probe_rows(p, m, h, 1, rows, together.data());
      for (size_t n = 0; n < rows.size(); ++n) {
        const ProbeRow alone = probe_row(p, m, h, 1, rows[n]);
        EXPECT_NEAR(together[n].err2, alone.err2, 1e-12 * alone.err2 + 1e-300) << "row " << rows[n];
        EXPECT_NEAR(together[n].ref2, alone.ref2, 1e-12 * alone.ref2);
        EXPECT_NEAR(together[n].bound, alone.bound, 1e-12 * alone.bound);
        EXPECT_EQ(together[n].max_abs, alone.max_abs);
      }
    }
  }
}

// compute_estimates sweeps the keys once for tasks of several heads
// (probe_sweep): each task's rows get the figures they get alone, to the
// bit, whichever tasks share the sweep (the key tiles sit on a fixed grid).
// Heads of one kv head (GQA), steep slopes whose rows form groups of their
// own, and reach-truncated rows.
TEST(Estimates, ProbeSweepSharedByHeadsMatchesEachTaskAlone) {
  for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
    const AttentionOptions o =
        shaped({2, 700, 700, 4, 2, 24},
               {.causal = true, .slopes = {3.0, 0.4, 0.04, 0.004}, .mode = mode, .samples = 5, .window_eps = 0.05});
    const auto pr = make_estimates_problem(o, 41);
    fill_output_with_reference(pr.get());
    const AttentionParams& p = pr->params;
    const Plan plan = plan_of(p);
    const std::vector<std::vector<int64_t>> rows = {{0, 40, 41, 300, 699}, {250, 260, 650}, {1, 2, 500}, {90, 333}};
    std::vector<HeadMask> masks;
    std::vector<ProbeKeyStats> keys;
    for (int64_t h = 0; h < p.heads; ++h) masks.push_back(head_mask(plan, h));
    for (int64_t hk = 0; hk < p.kv_heads; ++hk) keys.push_back(probe_key_stats(p, 1, hk));
    std::vector<estimates_detail::ProbeTask> tasks;
    for (int64_t h = 0; h < p.heads; ++h)
      tasks.emplace_back(p, masks[static_cast<size_t>(h)], h, 1, rows[static_cast<size_t>(h)],
                         &keys[static_cast<size_t>(h / p.head_group)]);
    std::vector<std::unique_ptr<estimates_detail::DecayTable>> tables;
    std::vector<const estimates_detail::DecayTable*> lstar;
    std::vector<estimates_detail::ProbeTask*> shared;
    for (int64_t h = 0; h < p.heads; ++h) {
      tables.push_back(std::make_unique<estimates_detail::DecayTable>(masks[static_cast<size_t>(h)].sigma, 1000));
      lstar.push_back(tables.back().get());
      shared.push_back(&tasks[static_cast<size_t>(3 - h)]);  // heads out of order
    }
    ASSERT_TRUE(estimates_detail::probe_sweep(p, shared, lstar, nullptr));
    for (int64_t h = 0; h < p.heads; ++h) {
      const std::vector<int64_t>& r = rows[static_cast<size_t>(h)];
      std::vector<ProbeRow> swept(r.size()), alone(r.size());
      tasks[static_cast<size_t>(h)].finish(swept.data());
      probe_rows(p, masks[static_cast<size_t>(h)], h, 1, r, alone.data(), nullptr,
                 &keys[static_cast<size_t>(h / p.head_group)]);
      for (size_t n = 0; n < r.size(); ++n) {
        SCOPED_TRACE(std::string(mode_name(mode)) + " head " + std::to_string(h) + " row " + std::to_string(r[n]));
        EXPECT_GT(alone[n].ref2, 0);
        EXPECT_EQ(swept[n].err2, alone[n].err2);
        EXPECT_EQ(swept[n].ref2, alone[n].ref2);
        EXPECT_EQ(swept[n].max_abs, alone[n].max_abs);
        EXPECT_EQ(swept[n].bound, alone[n].bound);
      }
    }
  }
}

// With the keys' statistics a probe row visits only the keys within
// probe_reach (plus its own blocks or window): the same figures as visiting
// every key, to 1e-12, and a bound that is never smaller.
TEST(Estimates, ProbeRowsVisitingTheirReachMatchVisitingEveryKey) {
  for (const Mode mode : {Mode::kLsh, Mode::kWindow}) {
    for (const bool causal : {false, true}) {
      AttentionOptions o;
      o.batch = 2;
      o.q_len = o.kv_len = 1200;
      o.heads = 3;
      o.head_dim = 16;
      o.causal = causal;
      o.mode = mode;
      o.samples = 6;
      o.window_eps = 0.05;
      o.slopes = {2.0, 0.5, 0.05};  // reach ~ 30, 110, 1100 keys: all truncate at n = 1200
      const auto pr = make_estimates_problem(o, 31);
      fill_output_with_reference(pr.get());
      const AttentionParams& p = pr->params;
      const Plan plan = plan_of(p);
      const std::vector<int64_t> rows = {0, 5, 300, 600, 601, 1199};
      for (int64_t h = 0; h < p.heads; ++h) {
        const HeadMask m = head_mask(plan, h);
        const ProbeKeyStats keys = probe_key_stats(p, 1, h);
        EXPECT_LT(probe_reach(m.sigma, 2.0, 0), 1200) << "head " << h << " must truncate";
        std::vector<ProbeRow> all(rows.size()), near(rows.size());
        probe_rows(p, m, h, 1, rows, all.data());
        probe_rows(p, m, h, 1, rows, near.data(), nullptr, &keys);
        for (size_t n = 0; n < rows.size(); ++n) {
          SCOPED_TRACE(std::string(mode_name(mode)) + (causal ? " causal" : "") + " head " + std::to_string(h) +
                       " row " + std::to_string(rows[n]));
          EXPECT_NEAR(near[n].err2, all[n].err2, 1e-12 * all[n].err2 + 1e-300);
          EXPECT_NEAR(near[n].ref2, all[n].ref2, 1e-12 * all[n].ref2);
          EXPECT_NEAR(near[n].max_abs, all[n].max_abs, 1e-12 * all[n].max_abs + 1e-300);
          EXPECT_GE(near[n].bound, all[n].bound * (1 - 1e-12));
          EXPECT_LE(near[n].bound, all[n].bound * (1 + 1e-9) + 1e-300);
        }
      }
    }
  }
}

// The one-pass key statistics (rows outer, heads inner, in chunks of 4096
// rows over the threads) against each (batch item, kv head) computed
// directly in float64: the same max ||k|| and running max ||v||^2, for the
// heads asked for and only those, across a chunk boundary, with GQA and
// float16 (widened rows).
TEST(Estimates, KeyStatisticsInOnePassMatchEachHeadAlone) {
  for (const DType dtype : {DType::kF32, DType::kF16}) {
    AttentionOptions o;
    o.batch = 2;
    o.q_len = 8;
    o.kv_len = 5000;  // two chunks, the second partial
    o.heads = 6;
    o.kv_heads = 3;
    o.head_dim = 24;
    o.dtype = dtype;
    const auto pr = make_estimates_problem(o, 17);
    const AttentionParams& p = pr->params;
    const std::vector<char> wanted = {1, 0, 1, 0, 1, 1};  // [b * kv_heads + hk]
    for (const int threads : {1, 2}) {
      std::vector<ProbeKeyStats> all;
      ASSERT_TRUE(probe_key_stats_all(p, wanted, threads, &all).ok());
      ASSERT_EQ(all.size(), wanted.size());
      for (int64_t b = 0; b < p.batch; ++b) {
        for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " threads " + std::to_string(threads) + " item " +
                       std::to_string(b) + " kv head " + std::to_string(hk));
          const ProbeKeyStats& got = all[static_cast<size_t>(b * p.kv_heads + hk)];
          if (!wanted[static_cast<size_t>(b * p.kv_heads + hk)]) {
            EXPECT_TRUE(got.v2_prefix_max.empty());
            continue;
          }
          ASSERT_EQ(got.v2_prefix_max.size(), static_cast<size_t>(p.kv_len));
          double max_k2 = 0, max_v2 = 0;
          for (int64_t j = 0; j < p.kv_len; ++j) {
            double k2 = 0, v2 = 0;
            for (int64_t d = 0; d < p.head_dim; ++d) {
              const double k =
                  load_element(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride + d);
              const double v =
                  load_element(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride + d);
              k2 += k * k;
              v2 += v * v;
            }
            max_k2 = std::max(max_k2, k2);
            max_v2 = std::max(max_v2, v2);
            ASSERT_NEAR(got.v2_prefix_max[static_cast<size_t>(j)], max_v2, 1e-13 * max_v2) << "key row " << j;
          }
          EXPECT_NEAR(got.max_k_norm, std::sqrt(max_k2), 1e-13 * std::sqrt(max_k2));
          const ProbeKeyStats alone = probe_key_stats(p, b, hk);
          EXPECT_NEAR(alone.max_k_norm, got.max_k_norm, 1e-13 * got.max_k_norm);
          EXPECT_EQ(alone.v2_prefix_max.size(), got.v2_prefix_max.size());
        }
      }
    }
  }
}

TEST(Estimates, DrawsReturnedEqualDrawHashes) {
  AttentionOptions o = mask_options(64, 64, true, {0.5, 0.125, 0.0});
  o.samples = 7;
  o.seed = 99;
  o.return_draws = true;
  const auto pr = make_estimates_problem(o);
  AttentionResult result;
  ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
  for (int64_t h = 0; h < 3; ++h) {
    const std::vector<Draw> want = draw_hashes(99, h, pr->params.sigma(h), 7);
    const HeadEstimate& he = result.heads[h];
    EXPECT_EQ(he.head, h);
    EXPECT_EQ(he.slope, o.slopes[h]);
    ASSERT_EQ(he.draws.size(), 7u);
    for (size_t k = 0; k < 7; ++k) {
      EXPECT_EQ(he.draws[k].pitch, want[k].pitch);
      EXPECT_EQ(he.draws[k].shift, want[k].shift);
    }
    EXPECT_EQ(he.max_block, max_block_size(want, position_range(pr->params)));
  }
  EXPECT_TRUE(std::isinf(result.heads[2].sigma));
  o.return_draws = false;
  const auto without = make_estimates_problem(o);
  ASSERT_TRUE(estimate(without->params, ExecContext{}, &result).ok());
  for (const HeadEstimate& he : result.heads) EXPECT_TRUE(he.draws.empty());
}

// max_block_size skips hashes and stops walks at a bound on any block's
// size: it must still find the largest block of every draw, by a count of
// every position's bin, with pitches at and next to whole numbers (where
// blocks of two sizes meet), positions near 2^45 (where the bound's
// rounding slack matters) and ranges apart, overlapping or touching.
TEST(Estimates, MaxBlockSizeIsTheLargestBinCount) {
  std::vector<std::vector<Draw>> draw_sets;
  for (const double sigma : {0.2, 1.0, 2.0, 3.0, 8.0, 40.0, 1000.0})
    for (uint64_t seed = 1; seed <= 4; ++seed) draw_sets.push_back(draw_hashes(seed, 0, sigma, 5));
  for (const double pitch : {0.5, 1.0, 3.0, 7.0})
    for (const double eps : {0.0, 1e-13, -1e-13, 1e-9, -1e-9})
      for (const double shift : {0.0, 0.5, 0.999})
        draw_sets.push_back({Draw{pitch + eps, shift * (pitch + eps)}, Draw{1.25, 0.3}});
  const int64_t big = int64_t{1} << 45;
  const std::vector<PositionRange> ranges = {{0, 300, 0, 300, true},
                                             {100, 50, 0, 70, false},
                                             {70, 30, 0, 70, false},
                                             {int64_t{1} << 40, 50, 0, 70, false},
                                             {big, 200, big + 150, 120, false},
                                             {big + 205, 40, big, 200, false}};
  for (const PositionRange& r : ranges) {
    for (const std::vector<Draw>& draws : draw_sets) {
      std::set<int64_t> positions;
      for (int64_t i = 0; i < r.q_len; ++i) positions.insert(r.q_pos0 + i);
      for (int64_t i = 0; i < r.kv_len; ++i) positions.insert(r.k_pos0 + i);
      int64_t want = 0;
      for (const Draw& d : draws) {
        std::map<int64_t, int64_t> count;
        for (const int64_t pos : positions) want = std::max(want, ++count[bin_of(pos, d)]);
      }
      ASSERT_EQ(max_block_size(draws, r), want)
          << "pitch " << draws[0].pitch << " shift " << draws[0].shift << " range at " << r.q_pos0;
    }
  }
}

TEST(Estimates, MaxBlockCountsPositionsInTheRequestOnly) {
  const std::vector<Draw> draws = draw_hashes(4, 0, 8.0, 5);
  // Two ranges 2^40 apart: only their own positions count (and it ends).
  PositionRange far{int64_t{1} << 40, 50, 0, 70, false};
  int64_t want = 0;
  for (const Draw& d : draws) {
    for (const auto& [lo, n] : {std::pair<int64_t, int64_t>{0, 70}, {int64_t{1} << 40, 50}}) {
      for (int64_t pos = lo; pos < lo + n;) {
        int64_t end = pos;
        while (end < lo + n && bin_of(end, d) == bin_of(pos, d)) ++end;
        want = std::max(want, end - pos);
        pos = end;
      }
    }
  }
  EXPECT_EQ(max_block_size(draws, far), want);
  // Overlapping ranges are one span.
  PositionRange overlap{30, 50, 0, 70, false};
  int64_t want_overlap = 0;
  for (const Draw& d : draws) {
    for (int64_t pos = 0; pos < 80;) {
      int64_t end = pos;
      while (end < 80 && bin_of(end, d) == bin_of(pos, d)) ++end;
      want_overlap = std::max(want_overlap, end - pos);
      pos = end;
    }
  }
  EXPECT_EQ(max_block_size(draws, overlap), want_overlap);
}

TEST(Estimates, DeviceMemoryGetsMaskEstimatesButNoProbe) {
  AttentionOptions o = mask_options(100, 100, true, {0.25, 0.05});
  o.probe_rows = 16;
  const auto host = make_estimates_problem(o);
  AttentionParams device = host->params;
  device.memory = MemorySpace::kDevice;
  device.q = device.k = device.v = nullptr;  // must not be read
  device.out = nullptr;
  AttentionResult on_host, on_device;
  ASSERT_TRUE(estimate(host->params, ExecContext{}, &on_host).ok());
  ASSERT_TRUE(estimate(device, ExecContext{}, &on_device).ok());
  EXPECT_EQ(on_host.probe.rows, 32);
  EXPECT_EQ(on_device.probe.rows, 0);
  for (size_t h = 0; h < 2; ++h) {
    EXPECT_EQ(on_device.heads[h].probe.rows, 0);
    EXPECT_EQ(on_device.heads[h].mask_max_err, on_host.heads[h].mask_max_err);
    EXPECT_EQ(on_device.heads[h].mask_spectral_err, on_host.heads[h].mask_spectral_err);
  }
}

TEST(Estimates, WithoutEstimatesOnlyTheHeadsAreDescribed) {
  AttentionOptions o = mask_options(100, 100, true, {0.25});
  o.estimates = false;
  o.probe_rows = 16;
  const auto pr = make_estimates_problem(o);
  AttentionResult result;
  ASSERT_TRUE(estimate(pr->params, ExecContext{}, &result).ok());
  ASSERT_EQ(result.heads.size(), 1u);
  EXPECT_EQ(result.heads[0].sigma, 4.0);
  EXPECT_GT(result.heads[0].max_block, 0);
  EXPECT_EQ(result.heads[0].mask_max_err, 0.0);
  EXPECT_EQ(result.heads[0].mask_rows_checked, 0);
  EXPECT_EQ(result.heads[0].probe.rows, 0);
  EXPECT_EQ(result.mask_spectral_err, 0.0);
}

TEST(Estimates, StopsOnCancelAndDeadline) {
  AttentionOptions o = mask_options(200, 200, true, {0.25, 0.5});
  const auto pr = make_estimates_problem(o);
  std::atomic<bool> cancel{true};
  ExecContext cancelled_ctx;
  cancelled_ctx.cancel = &cancel;
  AttentionResult result;
  EXPECT_EQ(estimate(pr->params, cancelled_ctx, &result).code(), StatusCode::kCancelled);
  ExecContext late;
  late.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  EXPECT_EQ(estimate(pr->params, late, &result).code(), StatusCode::kDeadlineExceeded);
}

// A deadline that passes while the estimates run (here well over 20 ms of
// work: 2 x 64 probe rows over 32k keys) stops them with DEADLINE_EXCEEDED.
TEST(Estimates, StopsWhenTheDeadlinePassesMidway) {
  AttentionOptions o = mask_options(32768, 32768, false, {0.25, 0.01});
  o.head_dim = 64;
  o.probe_rows = 64;
  const auto pr = make_estimates_problem(o);
  ExecContext ctx;
  ctx.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  AttentionResult result;
  EXPECT_EQ(estimate(pr->params, ctx, &result).code(), StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace plsh
