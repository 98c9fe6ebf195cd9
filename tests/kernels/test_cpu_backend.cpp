// The CPU backend against the float64 reference (tests/kernels/reference.h)
// on fresh random inputs: every mode and lsh algorithm, odd sizes, GQA,
// causal and not, offsets, fp16/bf16, padded strides, and its contract
// (cancellation, deadlines, host memory only, progress, FLOP counts).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/tiles.h"
#include "plsh/numeric.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh {
namespace {

using plsh::testing::shaped;
using testing::make_problem;
using testing::Problem;
using testing::ReferenceOutput;

// Unit roundoff of the output dtype: storing a value v rounds it by at most
// u |v| <= u max|ref|, on top of the float32 arithmetic's error.
double unit_roundoff(DType t) {
  switch (t) {
    case DType::kF32:
      return 0x1.0p-24;
    case DType::kF16:
      return 0x1.0p-11;
    case DType::kBF16:
      return 0x1.0p-8;
  }
  return 1;
}

// float32 accumulation over ~1e3 keys with a 2e-7 exp: observed ~1e-6.
constexpr double kF32Tolerance = 1e-5;

double output_tolerance(DType t) { return kF32Tolerance + unit_roundoff(t); }

// A case of the shared shape (problem.h) and whether some of its rows reach
// no key (see compare_rows).
struct Case : testing::AttentionCase {
  bool has_empty_rows = false;
};
void PrintTo(const Case& c, std::ostream* os) { testing::PrintTo(c, os); }

AttentionOptions options_of(const Case& c) { return testing::options_of(c, 1234); }

// max |a - e| / max(1, |e|) over the lse entries.
double lse_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = actual[i];
    const double diff = std::isfinite(a) ? std::fabs(a - expected[i]) : std::numeric_limits<double>::infinity();
    worst = std::max(worst, diff / std::max(1.0, std::fabs(expected[i])));
  }
  return worst;
}

// A backend output against the reference, row by row. Rows that no key may
// reach (lsh with a query position whose blocks hold no key row; window
// rows far from the keys) are NaN in the reference; the backend must give
// out = 0 and lse = -inf there, and they are left out of the error figures.
struct Comparison {
  double max_rel = 0;  // max |a - e| / max |e| over the other rows
  double lse_err = 0;  // lse_error over the other rows
  int64_t empty_rows = 0;
  int64_t bad_empty_rows = 0;  // empty rows with a nonzero output or a finite lse
};

Comparison compare_rows(const Problem& pr, const ReferenceOutput& ref) {
  const AttentionParams& p = pr.params;
  const int64_t dim = p.head_dim;
  const int64_t rows = static_cast<int64_t>(ref.lse.size());
  std::vector<double> expected, expected_lse;
  std::vector<float> actual, actual_lse;
  Comparison c;
  for (int64_t row = 0; row < rows; ++row) {  // row = (b * Nq + i) * H + h, as in the dense layout
    const bool empty = !std::isfinite(ref.lse[static_cast<size_t>(row)]);
    if (empty) {
      ++c.empty_rows;
      bool ok = pr.lse[static_cast<size_t>(row)] == -std::numeric_limits<float>::infinity();
      for (int64_t d = 0; d < dim; ++d) ok = ok && load_element(pr.out.data(), p.out_dtype, row * dim + d) == 0.0;
      if (!ok) ++c.bad_empty_rows;
      continue;
    }
    for (int64_t d = 0; d < dim; ++d) {
      expected.push_back(ref.out[static_cast<size_t>(row * dim + d)]);
      actual.push_back(static_cast<float>(load_element(pr.out.data(), p.out_dtype, row * dim + d)));
    }
    expected_lse.push_back(ref.lse[static_cast<size_t>(row)]);
    actual_lse.push_back(pr.lse[static_cast<size_t>(row)]);
  }
  // Outputs rounded to f16/bf16 were exact in float; compare as float32.
  c.max_rel = testing::compare(actual.data(), DType::kF32, expected).max_rel;
  c.lse_err = lse_error(actual_lse, expected_lse);
  return c;
}

class CpuVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(CpuVsReference, MatchesFloat64Reference) {
  const Case& c = GetParam();
  const AttentionOptions o = options_of(c);
  Problem pr = make_problem(o, std::hash<std::string>{}(c.name));
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ForwardStats stats;
  ASSERT_TRUE(testing::plan_and_forward(*cpu, pr.params, ExecContext{}, &stats).ok());
  const ReferenceOutput ref = testing::reference_attention(pr.params);

  const Comparison cmp = compare_rows(pr, ref);
  EXPECT_LE(cmp.max_rel, output_tolerance(pr.params.out_dtype));
  EXPECT_LE(cmp.lse_err, kF32Tolerance);
  EXPECT_EQ(cmp.bad_empty_rows, 0) << "of " << cmp.empty_rows << " rows without keys";
  EXPECT_EQ(cmp.empty_rows > 0, c.has_empty_rows) << cmp.empty_rows << " rows without keys";
  EXPECT_GT(stats.flops, 0);
  if (uses_draws(c.mode)) {
    EXPECT_NE(stats.lsh_algorithm, LshAlgorithm::kAuto);
    if (c.algorithm != LshAlgorithm::kAuto) {
      EXPECT_EQ(stats.lsh_algorithm, c.algorithm);
    }
  }
}

Case make(std::string name, Mode mode, int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t dim,
          bool causal, DType dtype = DType::kF32) {
  return Case{{std::move(name), 1, q_len, kv_len, heads, kv_heads, dim, dtype, mode, causal}};
}

Case with_offsets(Case c, int64_t q_pos0, int64_t k_pos0) {
  c.q_pos0 = q_pos0;
  c.k_pos0 = k_pos0;
  return c;
}

Case lsh(Case c, LshAlgorithm a, int64_t samples = 16) {
  c.algorithm = a;
  c.samples = samples;
  return c;
}

Case with_batch(Case c, int64_t batch) {
  c.batch = batch;
  return c;
}

// Every value of every axis at least once; n = 1025 only with few heads
// (the float64 reference is O(n^2 d H)).
std::vector<Case> cases() {
  const Mode E = Mode::kExact, W = Mode::kWindow, L = Mode::kLsh;
  const LshAlgorithm PS = LshAlgorithm::kPerSample, BA = LshAlgorithm::kBanded, AU = LshAlgorithm::kAuto;
  std::vector<Case> v;
  // exact
  v.push_back(make("exact_n1_d40_h1", E, 1, 1, 1, 1, 40, false));
  v.push_back(with_batch(make("exact_n2_d59_h8g2_causal_b2", E, 2, 2, 8, 2, 59, true), 2));
  v.push_back(make("exact_n97_d128_h12_causal", E, 97, 97, 12, 12, 128, true));
  v.push_back(make("exact_n1025_d40_h1_causal", E, 1025, 1025, 1, 1, 40, true));
  v.push_back(make("exact_n1025_d59_h1", E, 1025, 1025, 1, 1, 59, false));
  v.push_back(with_offsets(make("exact_nq97_nk150_d59_h8g2_offsets", E, 97, 150, 8, 2, 59, false), 1000, 900));
  v.push_back(with_offsets(make("exact_nq50_nk97_d40_h8g2_causal_offsets", E, 50, 97, 8, 2, 40, true), 60, 0));
  v.push_back(make("exact_n97_d40_h12_causal_bf16", E, 97, 97, 12, 12, 40, true, DType::kBF16));
  v.push_back(make("exact_n97_d128_h8g2_f16", E, 97, 97, 8, 2, 128, false, DType::kF16));
  // Queries 1e5 positions after the keys (biases near -390).
  Case far = with_offsets(make("exact_nq20_nk97_d40_h2_far_queries", E, 20, 97, 2, 2, 40, false), 100000, 0);
  far.slopes = {1.0 / 256, 1.0 / 512};
  v.push_back(far);
  Case widened = make("exact_n97_d59_h1_causal_bf16_in_f32_out", E, 97, 97, 1, 1, 59, true, DType::kBF16);
  widened.out_dtype = DType::kF32;  // the f32 tolerance then applies
  v.push_back(widened);
  // window: eps-derived widths (19 .. 2358 positions for 8 heads), a fixed
  // narrow width, a width beyond n
  v.push_back(make("window_n1025_d59_h8g2_causal", W, 1025, 1025, 8, 2, 59, true));
  Case w5 = make("window_n97_d40_h1_width5", W, 97, 97, 1, 1, 40, false);
  w5.window_width = 5;
  v.push_back(w5);
  v.push_back(make("window_n2_d128_h12_f16", W, 2, 2, 12, 12, 128, false, DType::kF16));
  Case w17 = with_offsets(
      make("window_nq64_nk97_d59_h8g2_causal_offsets_bf16", W, 64, 97, 8, 2, 59, true, DType::kBF16), 30, 3);
  w17.window_width = 17;
  v.push_back(w17);
  Case wide = make("window_n97_d40_h8g2_width_beyond_n", W, 97, 97, 8, 2, 40, true);
  wide.window_width = 5000;
  v.push_back(wide);
  // lsh, both algorithms on the same shapes, and the automatic choice
  for (auto [a, tag] : {std::pair{PS, "per_sample"}, std::pair{BA, "banded"}}) {
    const std::string t = tag;
    v.push_back(lsh(make("lsh_" + t + "_n1_d59_h1", L, 1, 1, 1, 1, 59, true), a));
    v.push_back(lsh(make("lsh_" + t + "_n97_d59_h8g2_causal", L, 97, 97, 8, 2, 59, true), a));
    v.push_back(lsh(make("lsh_" + t + "_n1025_d40_h1_causal", L, 1025, 1025, 1, 1, 40, true), a));
    v.push_back(lsh(make("lsh_" + t + "_n2_d128_h12", L, 2, 2, 12, 12, 128, false), a));
    v.push_back(
        lsh(with_offsets(make("lsh_" + t + "_nq60_nk97_d40_h8g2_offsets", L, 60, 97, 8, 2, 40, false), 10, 0), a));
    // Queries at 280..339 amid keys at 250..346: blocks cut by the key
    // range's ends and by causality.
    v.push_back(
        lsh(with_offsets(make("lsh_" + t + "_nq60_nk97_d59_h12_causal_offsets", L, 60, 97, 12, 12, 59, true), 280, 250),
            a, 7));
    v.push_back(lsh(make("lsh_" + t + "_n97_d40_h8g2_causal_bf16", L, 97, 97, 8, 2, 40, true, DType::kBF16), a));
    v.push_back(lsh(make("lsh_" + t + "_n97_d128_h12_f16", L, 97, 97, 12, 12, 128, false, DType::kF16), a));
  }
  v.push_back(with_batch(lsh(make("lsh_auto_n97_d59_h8g2_causal_b2", L, 97, 97, 8, 2, 59, true), AU, 64), 2));
  // fixed_blocks (SPEC section 4) against the reference's own floor(p /
  // 2 sigma): both algorithms, GQA, causal and not, offsets that put the
  // queries mid-block, 16-bit inputs; standard slopes give widths 4 .. 1024.
  const Mode F = Mode::kFixedBlocks;
  for (auto [a, tag] : {std::pair{PS, "per_sample"}, std::pair{BA, "banded"}}) {
    const std::string t = tag;
    v.push_back(lsh(make("fixed_blocks_" + t + "_n1025_d40_h8g2_causal", F, 1025, 1025, 8, 2, 40, true), a));
    v.push_back(
        lsh(with_offsets(make("fixed_blocks_" + t + "_nq60_nk97_d59_h12_causal_offsets", F, 60, 97, 12, 12, 59, true),
                         280, 250),
            a));
    v.push_back(lsh(make("fixed_blocks_" + t + "_n97_d128_h8g2_bf16", F, 97, 97, 8, 2, 128, false, DType::kBF16), a));
  }
  // slope 0 heads: no bias (exact, window) and one bin (lsh, fixed_blocks)
  for (auto [m, tag] :
       {std::pair{E, "exact"}, std::pair{W, "window"}, std::pair{L, "lsh"}, std::pair{F, "fixed_blocks"}}) {
    Case z = make(std::string(tag) + "_slope0_n97_d40_h2_causal", m, 97, 97, 2, 2, 40, true);
    z.slopes = {0.0, 0.25};
    v.push_back(z);
  }
  // No bias at all (the experiments' baseline: every slope 0).
  Case none = make("exact_no_bias_n300_d40_h4_causal", E, 300, 300, 4, 4, 40, true);
  none.slopes = {0.0, 0.0, 0.0, 0.0};
  v.push_back(none);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuVsReference, ::testing::ValuesIn(cases()), testing::CaseName());

// Padded q/k/v (head stride > D, row stride > H * head stride): the backend
// must follow the strides, not assume a dense layout.
TEST(CpuBackend, FollowsPaddedStrides) {
  for (Mode mode : {Mode::kExact, Mode::kLsh}) {
    for (LshAlgorithm a : {LshAlgorithm::kPerSample, LshAlgorithm::kBanded}) {
      AttentionOptions o = options_of(make("padded", mode, 70, 90, 4, 2, 24, true));
      o.lsh_algorithm = a;
      o.batch = 2;
      Problem pr = make_problem(o, 99);
      const int64_t pad = 5, dim = o.head_dim;
      // [B, N, heads, dim + pad] with 3 spare elements after each row.
      auto padded = [&](const std::vector<uint8_t>& dense, int64_t rows, int64_t heads, std::vector<float>* buf,
                        int64_t* batch_stride, int64_t* row_stride, int64_t* head_stride) {
        *head_stride = dim + pad;
        *row_stride = heads * (dim + pad) + 3;
        *batch_stride = rows * *row_stride;
        buf->assign(static_cast<size_t>(o.batch * *batch_stride), std::nanf(""));
        for (int64_t b = 0; b < o.batch; ++b)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t h = 0; h < heads; ++h)
              for (int64_t d = 0; d < dim; ++d)
                (*buf)[static_cast<size_t>(b * *batch_stride + r * *row_stride + h * *head_stride + d)] =
                    static_cast<float>(load_element(dense.data(), DType::kF32, ((b * rows + r) * heads + h) * dim + d));
      };
      std::vector<float> q, k, v;
      AttentionParams& p = pr.params;
      padded(pr.qkv.q, o.q_len, o.heads, &q, &p.q_batch_stride, &p.q_row_stride, &p.q_head_stride);
      padded(pr.qkv.k, o.kv_len, o.kv_heads, &k, &p.k_batch_stride, &p.k_row_stride, &p.k_head_stride);
      padded(pr.qkv.v, o.kv_len, o.kv_heads, &v, &p.v_batch_stride, &p.v_row_stride, &p.v_head_stride);
      p.q = q.data();
      p.k = k.data();
      p.v = v.data();
      ASSERT_TRUE(testing::plan_and_forward(*make_cpu_backend(), p, ExecContext{}, nullptr).ok());
      const ReferenceOutput ref = testing::reference_attention(p);
      EXPECT_LE(testing::compare(pr.out.data(), DType::kF32, ref.out).max_rel, kF32Tolerance) << mode_name(mode);
      EXPECT_LE(lse_error(pr.lse, ref.lse), kF32Tolerance);
      if (mode == Mode::kExact) break;
    }
  }
}

// The two lsh algorithms compute the same o~ and lse~ (SPEC section 3).
TEST(CpuBackend, LshAlgorithmsAgree) {
  struct Shape {
    int64_t q_len, kv_len, heads, kv_heads, dim;
    bool causal;
    int64_t samples;
  };
  const Shape shapes[] = {{700, 700, 8, 8, 64, true, 16},
                          {700, 700, 8, 4, 32, false, 16},
                          {300, 500, 4, 1, 48, true, 33},
                          {200, 500, 2, 2, 16, false, 5},
                          {129, 129, 16, 4, 64, true, 128}};
  for (const Shape& s : shapes) {
    AttentionOptions o = options_of(make("agree", Mode::kLsh, s.q_len, s.kv_len, s.heads, s.kv_heads, s.dim, s.causal));
    o.samples = s.samples;
    if (!s.causal) o.q_pos0 = (s.kv_len - s.q_len) / 2;  // queries amid the keys, not at their end
    o.lsh_algorithm = LshAlgorithm::kPerSample;
    Problem per_sample = make_problem(o, 5);
    o.lsh_algorithm = LshAlgorithm::kBanded;
    Problem banded = make_problem(o, 5);
    std::unique_ptr<Backend> cpu = make_cpu_backend();
    ASSERT_TRUE(testing::plan_and_forward(*cpu, per_sample.params, ExecContext{}, nullptr).ok());
    ASSERT_TRUE(testing::plan_and_forward(*cpu, banded.params, ExecContext{}, nullptr).ok());
    const std::vector<double> expected = testing::to_doubles(per_sample.out, DType::kF32);
    EXPECT_LE(testing::compare(banded.out.data(), DType::kF32, expected).max_rel, 1e-5)
        << "n " << s.q_len << "x" << s.kv_len << " causal " << s.causal;
    std::vector<double> expected_lse(per_sample.lse.begin(), per_sample.lse.end());
    EXPECT_LE(lse_error(banded.lse, expected_lse), 1e-5);
  }
}

// Relative L2 error of lsh against exact falls as 1/sqrt(s): s = 256 gives
// a quarter of s = 16's error in expectation; half leaves room for the
// spread of one draw pooled over 8 heads x 512 rows.
TEST(CpuBackend, LshErrorFallsWithSamples) {
  AttentionOptions o = options_of(make("decay", Mode::kExact, 512, 512, 8, 8, 64, true));
  Problem exact = make_problem(o, 21);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(testing::plan_and_forward(*cpu, exact.params, ExecContext{}, nullptr).ok());
  const std::vector<double> reference = testing::to_doubles(exact.out, DType::kF32);

  auto lsh_error = [&](int64_t samples) {
    o.mode = Mode::kLsh;
    o.samples = samples;
    o.seed = 77;
    Problem pr = make_problem(o, 21);
    EXPECT_TRUE(testing::plan_and_forward(*cpu, pr.params, ExecContext{}, nullptr).ok());
    return testing::compare(pr.out.data(), DType::kF32, reference).rel_l2;
  };
  const double err16 = lsh_error(16), err256 = lsh_error(256);
  EXPECT_GT(err16, 0.01);  // not vacuous: s = 16 is visibly approximate
  EXPECT_LT(err256, 0.5 * err16) << "s=16: " << err16 << ", s=256: " << err256;
}

// Non-causal window or lsh whose queries sit far from every key: make_params
// refuses them (a row would have no key to weigh); a backend handed such
// params anyway (validation bypassed) gives out = 0 and lse = -inf, never NaN.
TEST(CpuBackend, RowsWithoutKeysGiveZeroNotNaN) {
  for (Mode mode : {Mode::kWindow, Mode::kLsh}) {
    Case c = make("disjoint", mode, 20, 30, 2, 2, 16, false);
    c.window_width = 8;
    c.slopes = {0.5, 0.25};
    Problem pr = make_problem(options_of(c), 3);
    AttentionOptions far = options_of(with_offsets(c, 10000, 0));
    EXPECT_EQ(validate_options(far).code(), StatusCode::kInvalidArgument);
    pr.params.q_pos0 = 10000;  // what validation would have refused
    ASSERT_TRUE(testing::plan_and_forward(*make_cpu_backend(), pr.params, ExecContext{}, nullptr).ok());
    for (size_t i = 0; i < pr.out.size() / 4; ++i) EXPECT_EQ(load_element(pr.out.data(), DType::kF32, i), 0.0);
    for (float l : pr.lse) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
  }
}

// kAuto follows SPEC's cost models: one hash of a wide pitch is cheapest
// block by block (s * E[delta] < 2 max delta); sixteen are cheaper banded.
TEST(CpuBackend, AutoPicksTheCheaperLshAlgorithm) {
  for (auto [samples, expected] :
       {std::pair{int64_t{1}, LshAlgorithm::kPerSample}, std::pair{int64_t{16}, LshAlgorithm::kBanded}}) {
    Case c = lsh(make("auto", Mode::kLsh, 2048, 2048, 1, 1, 32, true), LshAlgorithm::kAuto, samples);
    c.slopes = {1.0 / 256};
    Problem pr = make_problem(options_of(c), 1);
    ForwardStats stats;
    ASSERT_TRUE(testing::plan_and_forward(*make_cpu_backend(), pr.params, ExecContext{}, &stats).ok());
    EXPECT_EQ(stats.lsh_algorithm, expected) << "samples " << samples;
  }
}

// Queries that all sit after all keys: moving them further away adds the
// same -slope * shift to every logit of a row, so the output must not move
// and lse must fall by exactly slope * shift. At a shift of 4e6 the bias is
// near -15600, whose float ulp (0.001) would show if the backend added it
// to float logits as is (the float64 reference underflows there).
TEST(CpuBackend, ExactIsShiftInvariantFarFromKeys) {
  Case c = with_offsets(make("shift", Mode::kExact, 20, 97, 2, 2, 40, false), 200, 0);
  c.slopes = {1.0 / 256, 1.0 / 512};
  Problem near = make_problem(options_of(c), 8);
  const int64_t shift = 4000000;
  c.q_pos0 = 200 + shift;
  Problem far = make_problem(options_of(c), 8);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(testing::plan_and_forward(*cpu, near.params, ExecContext{}, nullptr).ok());
  ASSERT_TRUE(testing::plan_and_forward(*cpu, far.params, ExecContext{}, nullptr).ok());
  const std::vector<double> expected = testing::to_doubles(near.out, DType::kF32);
  EXPECT_LE(testing::compare(far.out.data(), DType::kF32, expected).max_rel, 1e-6);
  std::vector<double> expected_lse(near.lse.size());
  for (size_t i = 0; i < expected_lse.size(); ++i)
    expected_lse[i] = near.lse[i] - c.slopes[i % 2] * static_cast<double>(shift);  // lse is [B, Nq, H]
  EXPECT_LE(lse_error(far.lse, expected_lse), 1e-6);
}

TEST(CpuBackend, ExactFlopsAreTheDenseCount) {
  Case c = make("flops", Mode::kExact, 200, 300, 4, 2, 32, false);
  Problem pr = make_problem(options_of(c), 1);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (int threads : {1, 3}) {
    PlanLimits limits;
    limits.threads = threads;
    StatusOr<Plan> plan = cpu->plan(pr.params, limits);
    ASSERT_TRUE(plan.ok());
    ForwardStats stats;
    ASSERT_TRUE(testing::run_forward(*cpu, *plan, ExecContext{}, &stats).ok());
    EXPECT_EQ(stats.flops, 4.0 * 4 * 32 * 200 * 300);
    // What the forward carved is what the plan sized, and it holds each
    // thread's float32 logits tile (kKeyTile keys x 128 rows, padded) at
    // the least.
    EXPECT_EQ(stats.workspace.host_bytes, plan->forward_workspace.host_bytes);
    EXPECT_GE(stats.workspace.host_bytes, threads * cpu::kKeyTile * cpu::logits_stride(128) * 4);
    EXPECT_EQ(stats.workspace.device_bytes, 0);
  }
}

TEST(CpuBackend, PresetCancelReturnsCancelled) {
  Problem pr = make_problem(options_of(make("cancel", Mode::kExact, 300, 300, 4, 4, 32, true)), 1);
  std::atomic<bool> cancel{true};
  ExecContext ctx;
  ctx.cancel = &cancel;
  EXPECT_EQ(testing::plan_and_forward(*make_cpu_backend(), pr.params, ctx, nullptr).code(), StatusCode::kCancelled);
}

TEST(CpuBackend, PassedDeadlineReturnsDeadlineExceeded) {
  Problem pr = make_problem(options_of(make("deadline", Mode::kLsh, 300, 300, 4, 4, 32, true)), 1);
  ExecContext ctx;
  ctx.deadline = std::chrono::steady_clock::now() - std::chrono::milliseconds(1);
  EXPECT_EQ(testing::plan_and_forward(*make_cpu_backend(), pr.params, ctx, nullptr).code(),
            StatusCode::kDeadlineExceeded);
}

// A cancel raised while tiles run stops the rest: the progress callback
// sets it after the first report, and no report follows far behind.
TEST(CpuBackend, CancelDuringRunStopsPromptly) {
  Problem pr = make_problem(options_of(make("midway", Mode::kExact, 2048, 2048, 8, 8, 32, true)), 1);
  std::atomic<bool> cancel{false};
  std::atomic<double> last{0};
  ExecContext ctx;
  ctx.cancel = &cancel;
  ctx.progress = [&](double f) {
    last = f;
    cancel = true;
  };
  EXPECT_EQ(testing::plan_and_forward(*make_cpu_backend(), pr.params, ctx, nullptr, 2).code(), StatusCode::kCancelled);
  EXPECT_GT(last.load(), 0.0);
  EXPECT_LT(last.load(), 0.1);  // 256 tiles; at most a few finish after the cancel
}

TEST(CpuBackend, ProgressReachesOne) {
  Problem pr = make_problem(options_of(make("progress", Mode::kExact, 500, 500, 2, 2, 32, false)), 1);
  std::atomic<double> last{0};
  ExecContext ctx;
  // Callbacks come from any thread and may interleave: keep the maximum
  // with a compare-exchange, not a load then a store.
  ctx.progress = [&](double f) {
    double seen = last.load();
    while (f > seen && !last.compare_exchange_weak(seen, f)) {
    }
  };
  ASSERT_TRUE(testing::plan_and_forward(*make_cpu_backend(), pr.params, ctx, nullptr).ok());
  EXPECT_EQ(last.load(), 1.0);
}

TEST(CpuBackend, RefusesDeviceMemory) {
  Problem pr = make_problem(options_of(make("device", Mode::kExact, 4, 4, 1, 1, 8, false)), 1);
  pr.params.memory = MemorySpace::kDevice;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const Status s = cpu->supports(pr.params);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("host"), std::string::npos) << s.message();
  EXPECT_EQ(testing::plan_and_forward(*cpu, pr.params, ExecContext{}, nullptr).code(), StatusCode::kFailedPrecondition);
}

TEST(CpuBackend, NamesItself) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  EXPECT_EQ(cpu->name(), "cpu");
  EXPECT_NE(cpu->device().find("threads"), std::string::npos) << cpu->device();
  Problem pr = make_problem(options_of(make("ws", Mode::kLsh, 100, 100, 2, 2, 16, false)), 1);
  const StatusOr<Plan> plan = cpu->plan(pr.params, PlanLimits{});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_GT(plan->forward_workspace.host_bytes, 0);
}

}  // namespace
}  // namespace plsh

namespace plsh {
namespace {

// The steepest slope make_params allows, at positions near 2^52: lsh must
// finish (blocks are single positions) and match the float64 reference.
TEST(CpuBackend, SteepSlopeFarFromZeroFinishesAndMatches) {
  for (LshAlgorithm a : {LshAlgorithm::kPerSample, LshAlgorithm::kBanded}) {
    const int64_t near_2_52 = (int64_t{1} << 52) - 40;
    const AttentionOptions o = shaped({1, 40, 40, 2, 2, 16}, {.slopes = {1024.0, 0.5},
                                                              .q_pos0 = near_2_52,
                                                              .k_pos0 = near_2_52,
                                                              .mode = Mode::kLsh,
                                                              .samples = 16,
                                                              .lsh_algorithm = a});
    Problem pr = make_problem(o, 21, false);
    ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
    ASSERT_TRUE(testing::plan_and_forward(*make_cpu_backend(), pr.params, ExecContext{}, nullptr).ok());
    const testing::ErrorStats e =
        testing::compare(pr.out.data(), DType::kF32, testing::reference_attention(pr.params).out);
    EXPECT_LT(e.max_rel, 1e-5) << lsh_algorithm_name(a);
  }
}

}  // namespace
}  // namespace plsh
