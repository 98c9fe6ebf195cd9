// kernels/src/params.cpp: every validation error is INVALID_ARGUMENT and
// names the field, the value and what was expected (SPEC section 7); every
// default of SPEC section 1 and 4 is resolved as written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "plsh/numeric.h"
#include "plsh/params.h"

namespace plsh {
namespace {

AttentionOptions valid_options() { return {.batch = 2, .q_len = 30, .kv_len = 100, .heads = 8, .head_dim = 64}; }

// Tensors big enough for any options used below.
struct Buffers {
  std::vector<float> q, k, v, out;
  explicit Buffers(const AttentionOptions& o) {
    const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
    q.assign(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim), 0.5f);
    k.assign(static_cast<size_t>(o.batch * o.kv_len * kv_heads * o.head_dim), 0.25f);
    v.assign(static_cast<size_t>(o.batch * o.kv_len * kv_heads * o.head_dim), 1.0f);
    out.assign(q.size(), 0.0f);
  }
  TensorRefs refs() { return {.q = q.data(), .k = k.data(), .v = v.data(), .out = out.data()}; }
};

// An INVALID_ARGUMENT whose message contains every one of `parts`.
void expect_invalid(const Status& s, const std::vector<std::string>& parts) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  for (const std::string& part : parts)
    EXPECT_NE(s.message().find(part), std::string::npos) << s.message() << " lacks '" << part << "'";
}

// Both entry points must refuse the options alike.
void expect_refused(const AttentionOptions& o, const std::vector<std::string>& parts) {
  expect_invalid(validate_options(o), parts);
  Buffers b(valid_options());
  const StatusOr<AttentionParams> p = make_params(o, b.refs());
  ASSERT_FALSE(p.ok());
  expect_invalid(p.status(), parts);
}

TEST(Params, ValidOptionsPass) {
  EXPECT_TRUE(validate_options(valid_options()).ok());
  Buffers b(valid_options());
  EXPECT_TRUE(make_params(valid_options(), b.refs()).ok());
}

TEST(Params, ShapeErrorsNameFieldAndValue) {
  AttentionOptions o = valid_options();
  o.batch = 0;
  expect_refused(o, {"batch = 0", ">= 1"});
  o = valid_options();
  o.q_len = 0;
  expect_refused(o, {"q_len = 0", ">= 1"});
  o = valid_options();
  o.kv_len = -3;
  expect_refused(o, {"kv_len = -3", ">= 1"});
  o = valid_options();
  o.heads = 0;
  expect_refused(o, {"heads = 0", "[1, 1048576]"});
  o.heads = kMaxHeads + 1;
  expect_refused(o, {"heads = 1048577", "[1, 1048576]"});
  o = valid_options();
  o.kv_heads = -1;
  expect_refused(o, {"kv_heads = -1", ">= 1"});
  o.kv_heads = 3;
  expect_refused(o, {"kv_heads = 3", "divisor of heads = 8"});
  o.kv_heads = 16;
  expect_refused(o, {"kv_heads = 16", "divisor of heads = 8"});
  o = valid_options();
  o.head_dim = 0;
  expect_refused(o, {"head_dim = 0", "[1, 1024]"});
  o.head_dim = 1025;
  expect_refused(o, {"head_dim = 1025", "[1, 1024]"});
}

TEST(Params, ElementCountLimitNamesTheTensorThatIsTooLarge) {
  AttentionOptions o = valid_options();
  o.mode = Mode::kExact;       // lsh would also refuse queries past the keys
  o.q_len = int64_t{1} << 40;  // 2 * 2^40 * 8 * 64 = 2^50 elements: the limit itself
  EXPECT_TRUE(validate_options(o).ok());
  o.q_len = int64_t{1} << 41;
  expect_refused(o, {"q_len = 2199023255552", "2^50"});
  o = valid_options();
  o.kv_len = int64_t{1} << 41;
  o.q_pos0 = 0;
  expect_refused(o, {"kv_len = 2199023255552", "2^50"});
  o = valid_options();
  o.q_len = int64_t{1} << 62;  // overflows int64 on the way
  expect_refused(o, {"q_len = 4611686018427387904", "2^50"});
}

TEST(Params, ScaleMustBeFinitePositiveAndFitFloat32) {
  // 1e308 used to pass and give NaN outputs and estimates (float(1e308) = inf).
  for (const double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e308, 1e39}) {
    AttentionOptions o = valid_options();
    o.scale = bad;
    std::ostringstream value;
    value.precision(17);  // as the message prints it
    value << "scale = " << bad;
    expect_refused(o, {value.str(), "(0, 1e38]"});
  }
  AttentionOptions o = valid_options();
  o.scale = 1e38;
  EXPECT_TRUE(validate_options(o).ok());
}

// Scores are float32: inputs whose scores could overflow are refused with
// the bound, whatever the scale alone.
TEST(Params, ScoresThatCouldOverflowFloat32AreRefused) {
  AttentionOptions o = valid_options();
  Buffers b(o);
  b.q[17] = -0x1p60f;  // max|q| = 2^60 ~ 1.15e18, max|k| = 0.25: 64 * 2^60 * 0.25 * scale
  o.scale = 1e19;      // bound 1.8e38
  const StatusOr<AttentionParams> refused = make_params(o, b.refs());
  ASSERT_FALSE(refused.ok());
  expect_invalid(refused.status(),
                 {"scale * head_dim * max|q| * max|k|", "1.152921504606847e+18", "0.25", "expected <= 1e38"});
  o.scale = 1e18;  // bound 1.8e37: fine
  EXPECT_TRUE(make_params(o, b.refs()).ok());
  o.scale = 1e19;
  o.check_finite = false;  // the scan that finds the bound is the finiteness scan
  EXPECT_TRUE(make_params(o, b.refs()).ok());
}

TEST(Params, EchoedValuesAreCutAndEscaped) {
  EXPECT_EQ(echo_value("cuda"), "cuda");
  EXPECT_EQ(echo_value(std::string("a\nb\x01'\\", 6)), "a\\x0ab\\x01\\x27\\x5c");
  EXPECT_EQ(echo_value(std::string(1 << 20, 'x'), 8), "xxxxxxxx...(1048576 bytes)");
  EXPECT_EQ(echo_value("\xff\xfe"), "\\xff\\xfe");
}

TEST(Params, SlopeErrorsNameTheHead) {
  AttentionOptions o = valid_options();
  o.slopes = {0.5, 0.25, 0.125};
  expect_refused(o, {"slopes = 3 values", "one per query head (8)"});
  o.slopes.assign(8, 0.5);
  o.slopes[5] = -0.5;
  expect_refused(o, {"slopes[5] = -0.5", "finite number >= 0"});
  o.slopes[5] = std::nan("");
  expect_refused(o, {"slopes[5] = nan", "finite number >= 0"});
  o.slopes[5] = std::numeric_limits<double>::infinity();
  expect_refused(o, {"slopes[5] = inf", "finite number >= 0"});
  // Outside [2^-32, 2^10] the draws cannot represent the blocks.
  o.slopes[5] = 1e-300;
  expect_refused(o, {"slopes[5] = 1e-300", "0 or a number in [2^-32, 2^10]"});
  o.slopes[5] = 2048;
  expect_refused(o, {"slopes[5] = 2048", "0 or a number in [2^-32, 2^10]"});
  // The edges and 0 are fine.
  o.slopes[5] = 0x1.0p-32;
  o.slopes[6] = 1024;
  o.slopes[7] = 0;
  EXPECT_TRUE(validate_options(o).ok());
}

TEST(Params, PositionErrors) {
  AttentionOptions o = valid_options();
  o.q_pos0 = (int64_t{1} << 52) + 1;
  expect_refused(o, {"q_pos0 = 4503599627370497", "[-2^52, 2^52]"});
  o.q_pos0 = -(int64_t{1} << 52) - 1;
  expect_refused(o, {"q_pos0 = -4503599627370497", "[-2^52, 2^52]"});
  o = valid_options();
  o.k_pos0 = -(int64_t{1} << 52) - 1;
  expect_refused(o, {"k_pos0 = -4503599627370497", "[-2^52, 2^52]"});
  o.k_pos0 = int64_t{1} << 53;
  expect_refused(o, {"k_pos0 = 9007199254740992", "[-2^52, 2^52]"});
  o.k_pos0 = int64_t{1} << 52;  // the edge is fine
  o.q_pos0 = 0;
  o.mode = Mode::kExact;  // lsh and window also want the queries among the keys
  EXPECT_TRUE(validate_options(o).ok());
}

TEST(Params, CausalNeedsAKeyForTheFirstQuery) {
  AttentionOptions o = valid_options();
  o.causal = true;
  o.q_pos0 = 3;
  o.k_pos0 = 10;
  expect_refused(o, {"q_pos0 = 3", "k_pos0 = 10", "causal"});
  // The default q_pos0 = Nk - Nq is negative when there are more queries than keys.
  o = valid_options();
  o.causal = true;
  o.q_len = 105;  // said in the caller's terms: q_len and kv_len, not a q_pos0 never set
  expect_refused(o, {"q_len = 105 > kv_len = 100", "q_pos0 = kv_len - q_len = -5", "causal", "explicit q_pos0"});
  o.q_pos0 = -5;  // set: the field's own message
  expect_refused(o, {"q_pos0 = -5", "k_pos0 = 0", "causal"});
  o.q_pos0.reset();
  o.causal = false;  // without causal every query sees every key
  o.mode = Mode::kExact;
  EXPECT_TRUE(validate_options(o).ok());
}

// lsh and window weigh only keys in the query's block or window: a query
// position that is no key position could have none, so both modes want
// every query position among the key positions; exact does not.
TEST(Params, LshAndWindowWantQueriesAmongTheKeys) {
  for (Mode mode : {Mode::kLsh, Mode::kWindow}) {
    AttentionOptions o = valid_options();
    o.mode = mode;
    o.q_len = 105;  // default q_pos0 = -5
    expect_refused(o, {"q_len = 105 > kv_len = 100", "q_pos0 = kv_len - q_len = -5", mode_name(mode)});
    o.q_pos0 = -5;
    expect_refused(o, {"q_pos0 = -5", "[-5, 100)", "[0, 100)", mode_name(mode)});
    o.q_pos0.reset();
    o.q_len = 20;
    o.q_pos0 = 90;  // [90, 110) runs past the last key
    expect_refused(o, {"q_pos0 = 90", "[90, 110)", "[0, 100)"});
    o.q_pos0 = 80;  // [80, 100): the last keys
    EXPECT_TRUE(validate_options(o).ok()) << mode_name(mode);
    o.k_pos0 = 50;
    o.q_pos0 = 50;  // [50, 70) inside [50, 150)
    EXPECT_TRUE(validate_options(o).ok()) << mode_name(mode);
    o.mode = Mode::kExact;
    o.q_pos0 = 1000;
    EXPECT_TRUE(validate_options(o).ok());
  }
}

TEST(Params, ModeSpecificErrors) {
  AttentionOptions o = valid_options();
  o.mode = Mode::kLsh;
  o.samples = 0;
  expect_refused(o, {"samples = 0", "[1, 16777216]"});
  o.samples = kMaxSamples + 1;
  expect_refused(o, {"samples = 16777217", "[1, 16777216]"});
  o.mode = Mode::kExact;  // samples are ignored outside lsh
  EXPECT_TRUE(validate_options(o).ok());

  o = valid_options();
  o.mode = Mode::kWindow;
  o.window_width = -1;
  expect_refused(o, {"window_width = -1", ">= 0"});
  o.window_width = 0;
  for (const double eps : {0.0, 1.0, -0.5, std::nan("")}) {
    o.window_eps = eps;
    std::ostringstream value;
    value << "window_eps = " << eps;
    expect_refused(o, {value.str(), "in (0, 1)"});
  }
  o.window_width = 5;  // eps is not used when the width is given
  EXPECT_TRUE(validate_options(o).ok());

  // fixed_blocks reads no samples (its one hash is fixed) and has nothing
  // for a target to search.
  o = valid_options();
  o.mode = Mode::kFixedBlocks;
  o.samples = 0;
  EXPECT_TRUE(validate_options(o).ok());
  o.target_rel_err = 0.1;
  expect_refused(o, {"target_rel_err = 0.1", "fixed_blocks"});
}

// SPEC section 4's fixed-blocks baseline resolves to one hash per head,
// pitch 2 sigma_h and shift 0, whatever samples, seed and sampling say.
TEST(Params, FixedBlocksResolveToOneFixedHashPerHead) {
  AttentionOptions o = valid_options();
  o.mode = Mode::kFixedBlocks;
  o.heads = o.kv_heads = 3;
  o.slopes = {0.5, 1.0 / 48, 0.0};
  o.samples = 64;
  o.seed = 77;
  o.sampling = Sampling::kAsh;
  StatusOr<AttentionParams> p = resolve_params(o);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->samples, 1);
  EXPECT_EQ(p->sampling, Sampling::kIid);
  for (int64_t h = 0; h < 3; ++h) {
    const std::vector<Draw> d = head_draws(*p, h);
    ASSERT_EQ(d.size(), 1u);
    EXPECT_EQ(d[0].pitch, 2 * p->sigma(h));
    EXPECT_EQ(d[0].shift, 0.0);
  }
  EXPECT_EQ(head_draws(*p, 1)[0].pitch, 96.0);
  EXPECT_TRUE(std::isinf(head_draws(*p, 2)[0].pitch));  // slope 0: one block
  // Other seeds draw the same: the hash is not random.
  o.seed = 78;
  StatusOr<AttentionParams> q = resolve_params(o);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(head_draws(*q, 0)[0].pitch, head_draws(*p, 0)[0].pitch);
}

TEST(Params, EstimateOptionErrors) {
  AttentionOptions o = valid_options();
  o.probe_rows = -1;
  expect_refused(o, {"probe_rows = -1", "[0, 4096]"});
  o.probe_rows = kMaxProbeRows + 1;
  expect_refused(o, {"probe_rows = 4097", "[0, 4096]"});
  o = valid_options();
  o.mask_row_budget = 0;
  expect_refused(o, {"mask_row_budget = 0", ">= 1"});
}

TEST(Params, NullTensorsAreRefused) {
  const AttentionOptions o = valid_options();
  Buffers b(o);
  const char* names[] = {"q = null", "k = null", "v = null", "out = null"};
  for (int which = 0; which < 4; ++which) {
    TensorRefs t = b.refs();
    if (which == 0) t.q = nullptr;
    if (which == 1) t.k = nullptr;
    if (which == 2) t.v = nullptr;
    if (which == 3) t.out = nullptr;
    const StatusOr<AttentionParams> p = make_params(o, t);
    ASSERT_FALSE(p.ok());
    expect_invalid(p.status(), {names[which], "expected a tensor"});
  }
  TensorRefs t = b.refs();
  t.lse = nullptr;  // lse is optional
  EXPECT_TRUE(make_params(o, t).ok());
}

TEST(Params, ParseErrorsNameTheValue) {
  expect_invalid(parse_dtype("f64").status(), {"dtype = 'f64'", "f32, f16 or bf16"});
  expect_invalid(parse_mode("dense").status(), {"mode = 'dense'", "exact, lsh, window or fixed_blocks"});
  expect_invalid(parse_lsh_algorithm("fast").status(), {"lsh_algorithm = 'fast'", "auto, per_sample or banded"});
  EXPECT_EQ(*parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(*parse_dtype("float16"), DType::kF16);
  EXPECT_EQ(*parse_mode("window"), Mode::kWindow);
  EXPECT_EQ(*parse_mode("fixed_blocks"), Mode::kFixedBlocks);
  EXPECT_EQ(*parse_lsh_algorithm("per-sample"), LshAlgorithm::kPerSample);
}

// A non-finite value anywhere in q, k or v is reported with its tensor,
// value and [b, n, h, d] position, in every dtype.
TEST(Params, NonFiniteInputsReportTheirPosition) {
  AttentionOptions o = valid_options();
  o.kv_heads = 2;
  o.head_dim = 5;
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    o.dtype = dtype;
    const size_t bytes = dtype_bytes(dtype);
    std::vector<uint8_t> q(static_cast<size_t>(2 * 30 * 8 * 5) * bytes),
        k(static_cast<size_t>(2 * 100 * 2 * 5) * bytes), v(k.size()), out(static_cast<size_t>(2 * 30 * 8 * 5) * 4);
    TensorRefs t;
    t.q = q.data();
    t.k = k.data();
    t.v = v.data();
    t.out = out.data();
    ASSERT_TRUE(make_params(o, t).ok()) << dtype_name(dtype);

    struct Bad {
      std::vector<uint8_t>* tensor;
      int64_t b, n, h, d, rows, heads;
      float value;
      const char* expected;
    };
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    const Bad cases[] = {
        {&q, 1, 17, 3, 4, 30, 8, nan, "q has a non-finite value (nan) at [b=1, n=17, h=3, d=4]"},
        {&k, 0, 99, 1, 0, 100, 2, inf, "k has a non-finite value (inf) at [b=0, n=99, h=1, d=0]"},
        {&v, 1, 0, 0, 2, 100, 2, -inf, "v has a non-finite value (-inf) at [b=1, n=0, h=0, d=2]"},
    };
    for (const Bad& bad : cases) {
      const int64_t index = ((bad.b * bad.rows + bad.n) * bad.heads + bad.h) * 5 + bad.d;
      store_element(bad.tensor->data(), dtype, index, bad.value);
      const StatusOr<AttentionParams> p = make_params(o, t);
      ASSERT_FALSE(p.ok()) << dtype_name(dtype);
      expect_invalid(p.status(), {bad.expected, "expected finite values"});

      // Off by request, or when the tensors live on a device the host cannot read.
      AttentionOptions unchecked = o;
      unchecked.check_finite = false;
      EXPECT_TRUE(make_params(unchecked, t).ok());
      TensorRefs device = t;
      device.memory = MemorySpace::kDevice;
      EXPECT_TRUE(make_params(o, device).ok());

      store_element(bad.tensor->data(), dtype, index, 0.0f);
    }
    EXPECT_TRUE(make_params(o, t).ok());
  }
}

TEST(Params, CheckFiniteInputsAloneFindsTheFirstBadValue) {
  AttentionOptions o = valid_options();
  o.check_finite = false;
  Buffers b(o);
  b.q[7] = std::numeric_limits<float>::quiet_NaN();
  b.q[9] = std::numeric_limits<float>::infinity();
  StatusOr<AttentionParams> p = make_params(o, b.refs());
  ASSERT_TRUE(p.ok());
  expect_invalid(check_finite_inputs(*p), {"q has a non-finite value (nan) at [b=0, n=0, h=0, d=7]"});
}

TEST(Params, DefaultsAreResolved) {
  AttentionOptions o = valid_options();
  Buffers b(o);
  StatusOr<AttentionParams> p = make_params(o, b.refs());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->scale, 1.0 / 8);  // 1 / sqrt(64)
  EXPECT_EQ(p->q_pos0, 70);             // Nk - Nq
  EXPECT_EQ(p->k_pos0, 0);
  EXPECT_EQ(p->kv_heads, 8);  // 0 means H
  EXPECT_EQ(p->head_group, 1);
  EXPECT_EQ(p->slopes, standard_slopes(8));
  EXPECT_EQ(p->out_dtype, DType::kF32);
  EXPECT_EQ(p->mode, Mode::kLsh);
  EXPECT_EQ(p->samples, 16);
  EXPECT_TRUE(p->window.empty());
  EXPECT_EQ(p->probe_rows, 64);
  EXPECT_EQ(p->mask_row_budget, 65536);
  EXPECT_DOUBLE_EQ(p->sigma(0), 2.0);  // slope 1/2 for head 0 of 8
  // Strides of [B, N, H, D] and lse [B, Nq, H].
  EXPECT_EQ(p->q_row_stride, 8 * 64);
  EXPECT_EQ(p->q_batch_stride, 30 * 8 * 64);
  EXPECT_EQ(p->k_row_stride, 8 * 64);
  EXPECT_EQ(p->k_batch_stride, 100 * 8 * 64);
  EXPECT_EQ(p->o_batch_stride, 30 * 8 * 64);
  EXPECT_EQ(p->lse_row_stride, 8);
  EXPECT_EQ(p->lse_batch_stride, 30 * 8);

  // Given values are kept.
  o.scale = 0.3;
  o.q_pos0 = 5;
  o.k_pos0 = 2;
  o.kv_heads = 2;
  o.slopes = {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7};
  o.out_dtype = DType::kBF16;
  o.mode = Mode::kExact;
  Buffers b2(o);
  p = make_params(o, b2.refs());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->scale, 0.3);
  EXPECT_EQ(p->q_pos0, 5);
  EXPECT_EQ(p->k_pos0, 2);
  EXPECT_EQ(p->kv_heads, 2);
  EXPECT_EQ(p->head_group, 4);
  EXPECT_EQ(p->k_row_stride, 2 * 64);
  EXPECT_EQ(p->slopes, o.slopes);
  EXPECT_TRUE(std::isinf(p->sigma(0)));
  EXPECT_EQ(p->out_dtype, DType::kBF16);
  EXPECT_EQ(p->samples, 0) << "samples only mean something for lsh";

  // More queries than keys: q_pos0 = Nk - Nq < 0 without causal (exact
  // only: lsh and window want the queries among the keys).
  o = valid_options();
  o.mode = Mode::kExact;
  o.q_len = 130;
  Buffers b3(o);
  p = make_params(o, b3.refs());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->q_pos0, -30);
}

TEST(Params, WindowWidthsFollowSigmaAndEps) {
  AttentionOptions o = valid_options();
  o.heads = 4;
  o.mode = Mode::kWindow;
  o.slopes = {0.5, 1.0 / 64, 0.0, 1024.0};
  Buffers b(o);
  StatusOr<AttentionParams> p = make_params(o, b.refs());
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->window.size(), 4u);
  // W = ceil(sigma ln(1 / eps)), eps = 1e-4 by default.
  EXPECT_EQ(p->window[0], static_cast<int64_t>(std::ceil(2.0 * std::log(1e4))));
  EXPECT_EQ(p->window[0], 19);
  EXPECT_EQ(p->window[1], static_cast<int64_t>(std::ceil(64.0 * std::log(1e4))));
  EXPECT_EQ(p->window[2], kNoWindow) << "slope 0: no positional decay, no window";
  EXPECT_EQ(p->window[3], 1) << "never narrower than the query's own position";
  o.window_eps = 0.5;
  Buffers b2(o);
  p = make_params(o, b2.refs());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->window[0], static_cast<int64_t>(std::ceil(2.0 * std::log(2.0))));
  o.window_width = 7;  // one width for every head, slope 0 included
  Buffers b3(o);
  p = make_params(o, b3.refs());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->window, std::vector<int64_t>(4, 7));
}

}  // namespace
}  // namespace plsh
