// The shared attention flags: parsing, and the checks that turn arrays and
// flags into AttentionOptions with messages naming what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cli/flags.h"
#include "plsh/backend.h"

namespace plsh::cli {
namespace {

NpyArray array(std::vector<int64_t> shape, DType t = DType::kF32) {
  NpyArray a;
  a.dtype = t;
  a.shape = std::move(shape);
  a.data.resize(static_cast<size_t>(a.elements()) * dtype_bytes(t));
  return a;
}

// Parses a command line against the attention flags.
AttentionCliArgs parse(std::vector<std::string> argv) {
  CLI::App app;
  AttentionCliArgs args;
  add_attention_flags(app, args);
  argv.insert(argv.begin(), {"--q", "q", "--k", "k", "--v", "v"});
  std::reverse(argv.begin(), argv.end());  // CLI11 takes a vector in reverse order
  app.parse(argv);
  return args;
}

TEST(Flags, IntegersAreDecimalAndSeedsTakeHex) {
  EXPECT_EQ(parse({"--samples", "010"}).options.samples, 10);
  EXPECT_EQ(parse({"--seed", "18446744073709551615"}).options.seed, 18446744073709551615ULL);
  EXPECT_EQ(parse({"--seed", "0x10"}).options.seed, 16u);
  EXPECT_EQ(parse({"--q-pos0", "-5"}).options.q_pos0, -5);
  EXPECT_THROW(parse({"--seed", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--samples", "1e3"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--samples", "0x10"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--samples", ""}), CLI::ValidationError);
  EXPECT_THROW(parse({"--samples", "+"}), CLI::ValidationError);
  EXPECT_EQ(parse({"--samples", "+7"}).options.samples, 7);
  EXPECT_EQ(parse({"--k-pos0", "-0009"}).options.k_pos0, -9);
  // Out of range is an error, not the type's maximum.
  EXPECT_THROW(parse({"--seed", "18446744073709551616"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--seed", "0x10000000000000000"}), CLI::ValidationError);
  EXPECT_EQ(parse({"--seed", "0xFFFFFFFFFFFFFFFF"}).options.seed, 18446744073709551615ULL);
  EXPECT_THROW(parse({"--samples", "9223372036854775808"}), CLI::ValidationError);
  EXPECT_EQ(parse({"--k-pos0", "-9223372036854775808"}).options.k_pos0, INT64_MIN);
}

TEST(Flags, OptionsFromArgs) {
  AttentionCliArgs a = parse({"--mode", "window", "--slopes", "0.5,0.25", "--scale", "0.125", "--causal",
                              "--no-estimates", "--return-draws", "--lsh-algorithm", "per_sample"});
  auto o = options_from_args(a);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->mode, Mode::kWindow);
  EXPECT_EQ(o->slopes, (std::vector<double>{0.5, 0.25}));
  EXPECT_EQ(o->scale, 0.125);
  EXPECT_TRUE(o->causal);
  EXPECT_FALSE(o->estimates);
  EXPECT_TRUE(o->return_draws);
  EXPECT_EQ(o->lsh_algorithm, LshAlgorithm::kPerSample);
  EXPECT_FALSE(o->q_pos0.has_value());

  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--mode", "fast"}, "mode = 'fast'"},
      {{"--lsh-algorithm", "x"}, "lsh_algorithm = 'x'"},
      {{"--slopes", "0.5,,1"}, "item 1"},
      {{"--slopes", "0.5,abc"}, "('abc') is not a number"},
      {{"--out-dtype", "f64"}, "dtype = 'f64'"},
      {{"--out-dtype", "bf16"}, "--bf16-bits"},
      {{"--backend", "tpu"}, "backend = 'tpu'"},
      {{"--threads", "-1"}, "threads = -1"},
      {{"--sampling", "sobol"}, "sampling = 'sobol'"},
      {{"--target-error", "nan"}, "target_rel_err = nan"},
  };
  for (const auto& [argv, expected] : bad) {
    auto r = options_from_args(parse(argv));
    ASSERT_FALSE(r.ok()) << argv[0];
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(expected), std::string::npos) << r.status().message();
  }
}

// --sampling and --target-error; a target without --mode searches windows,
// with --mode that mode's configurations.
TEST(Flags, SamplingAndTargetError) {
  auto o = options_from_args(parse({"--sampling", "ash", "--target-error", "0.02"}));
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->sampling, Sampling::kAsh);
  EXPECT_EQ(o->target_rel_err, 0.02);
  EXPECT_EQ(o->mode, kDefaultTargetMode);
  o = options_from_args(parse({"--mode", "lsh", "--target-error", "0.02"}));
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->mode, Mode::kLsh);
  o = options_from_args(parse({}));
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->target_rel_err, 0);
  EXPECT_EQ(o->sampling, kDefaultSampling);
  EXPECT_EQ(o->mode, AttentionOptions{}.mode);
}

// Unset flags are AttentionOptions' defaults (plsh/params.h), not the CLI's own.
TEST(Flags, DefaultsAreTheLibrarys) {
  auto o = options_from_args(parse({}));
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  const AttentionOptions defaults;
  EXPECT_EQ(o->mode, defaults.mode);
  EXPECT_EQ(o->samples, defaults.samples);
  EXPECT_EQ(o->lsh_algorithm, defaults.lsh_algorithm);
  EXPECT_EQ(o->window_eps, defaults.window_eps);
  EXPECT_EQ(o->probe_rows, defaults.probe_rows);
  EXPECT_EQ(o->mask_row_budget, defaults.mask_row_budget);
  EXPECT_EQ(o->estimates, defaults.estimates);
  EXPECT_EQ(o->return_draws, defaults.return_draws);
}

// --return-draws, and its former name --return-hashes, accepted but not
// shown by --help.
TEST(Flags, ReturnDrawsAndItsHiddenAlias) {
  EXPECT_TRUE(parse({"--return-draws"}).options.return_draws);
  EXPECT_TRUE(parse({"--return-hashes"}).options.return_draws);
  EXPECT_FALSE(parse({}).options.return_draws);
  CLI::App app;
  AttentionCliArgs args;
  add_attention_flags(app, args);
  const std::string help = app.help();
  EXPECT_NE(help.find("--return-draws"), std::string::npos) << help;
  EXPECT_EQ(help.find("--return-hashes"), std::string::npos) << help;
}

TEST(Flags, BackendNamesAreTheRegistrys) {
  EXPECT_EQ(backend_names_text(), "auto, cpu or cuda");
  for (const char* name : kBackendNames) EXPECT_TRUE(options_from_args(parse({"--backend", name})).ok()) << name;
}

TEST(Flags, ShapesFromArrays) {
  AttentionOptions o;
  bool batched = false;
  ASSERT_TRUE(
      apply_shapes(array({2, 5, 8, 16}), array({2, 7, 2, 16}), array({2, 7, 2, 16}), "q", "k", "v", &o, &batched).ok());
  EXPECT_TRUE(batched);
  EXPECT_EQ(o.batch, 2);
  EXPECT_EQ(o.q_len, 5);
  EXPECT_EQ(o.kv_len, 7);
  EXPECT_EQ(o.heads, 8);
  EXPECT_EQ(o.kv_heads, 2);
  EXPECT_EQ(o.head_dim, 16);
  EXPECT_EQ(output_shape(o, batched), (std::vector<int64_t>{2, 5, 8, 16}));
  EXPECT_EQ(lse_shape(o, batched), (std::vector<int64_t>{2, 5, 8}));

  ASSERT_TRUE(apply_shapes(array({5, 4, 8}, DType::kF16), array({6, 4, 8}, DType::kF16), array({6, 4, 8}, DType::kF16),
                           "q", "k", "v", &o, &batched)
                  .ok());
  EXPECT_FALSE(batched);
  EXPECT_EQ(o.batch, 1);
  EXPECT_EQ(o.dtype, DType::kF16);
  EXPECT_EQ(output_shape(o, batched), (std::vector<int64_t>{5, 4, 8}));
  EXPECT_EQ(lse_shape(o, batched), (std::vector<int64_t>{5, 4}));

  struct Bad {
    NpyArray q, k, v;
    std::string expected;
  };
  const std::vector<Bad> bad = {
      {array({5, 8}), array({5, 8}), array({5, 8}), "q: shape [5, 8] has rank 2"},
      {array({1, 5, 4, 8}), array({5, 4, 8}), array({5, 4, 8}), "k: shape [5, 4, 8], expected rank 4"},
      {array({5, 4, 8}), array({5, 4, 8}), array({6, 4, 8}), "v: shape [6, 4, 8], expected the shape of k [5, 4, 8]"},
      {array({2, 5, 4, 8}), array({3, 5, 4, 8}), array({3, 5, 4, 8}), "k: batch = 3"},
      {array({5, 4, 8}), array({5, 4, 16}), array({5, 4, 16}), "k: head_dim = 16"},
      // k alone wrong: k is named, not v (which once got "expected the shape of k").
      {array({5, 4, 8}), array({5, 4, 16}), array({5, 4, 8}), "k: head_dim = 16 (shape [5, 4, 16])"},
      {array({5, 4, 8}), array({5, 4, 8}), array({5, 4, 16}), "v: head_dim = 16"},
      {array({5, 4, 8}), array({5, 4, 8}, DType::kF16), array({5, 4, 8}, DType::kF16), "k: dtype f16"},
      {array({5, 4, 8}), array({5, 4, 8}), array({5, 4, 8}, DType::kF16), "v: dtype f16"},
      {array({5, 4, 8}), array({5, 0, 8}), array({5, 0, 8}), "kv_heads = 0"},
  };
  for (const Bad& b : bad) {
    Status s = apply_shapes(b.q, b.k, b.v, "q", "k", "v", &o, &batched);
    ASSERT_FALSE(s.ok()) << b.expected;
    EXPECT_NE(s.message().find(b.expected), std::string::npos) << s.message();
  }
}

TEST(Flags, ShapesInSdpaLayoutAndTheTranspositionCheck) {
  AttentionOptions o;
  bool batched = false;
  // bhnd: [B, H, N, D].
  ASSERT_TRUE(apply_shapes(array({2, 8, 5, 16}), array({2, 2, 7, 16}), array({2, 2, 7, 16}), "q", "k", "v", &o,
                           &batched, Layout::kBhnd)
                  .ok());
  EXPECT_EQ((std::vector<int64_t>{o.batch, o.q_len, o.heads, o.kv_len, o.kv_heads}),
            (std::vector<int64_t>{2, 5, 8, 7, 2}));
  EXPECT_EQ(in_layout(output_shape(o, batched), Layout::kBhnd), (std::vector<int64_t>{2, 8, 5, 16}));
  EXPECT_EQ(in_layout(lse_shape(o, batched), Layout::kBhnd, false), (std::vector<int64_t>{2, 8, 5}));
  std::string warning;
  EXPECT_TRUE(check_layout_plausible(o, {2, 8, 5, 16}, {2, 2, 7, 16}, "q", "k", "v", Layout::kBhnd, &warning).ok());
  EXPECT_EQ(warning, "");

  // q in bhnd, k and v in bnhd, read as bnhd: q's positions are k's heads.
  ASSERT_TRUE(
      apply_shapes(array({1, 4, 256, 32}), array({1, 256, 4, 32}), array({1, 256, 4, 32}), "q", "k", "v", &o, &batched)
          .ok());
  Status s = check_layout_plausible(o, {1, 4, 256, 32}, {1, 256, 4, 32}, "q", "k", "v", Layout::kBnhd, &warning);
  EXPECT_NE(s.message().find("so q is probably in the other layout (bhnd)"), std::string::npos) << s.message();
  o.slopes.assign(256, 0.5);  // one slope per declared head: the heads are meant
  EXPECT_TRUE(check_layout_plausible(o, {1, 4, 256, 32}, {1, 256, 4, 32}, "q", "k", "v", Layout::kBnhd, &warning).ok());

  // All three in bhnd read as bnhd: 1024 heads over 8 positions.
  ASSERT_TRUE(
      apply_shapes(array({2, 8, 1024, 4}), array({2, 8, 1024, 4}), array({2, 8, 1024, 4}), "q", "k", "v", &o, &batched)
          .ok());
  o.slopes.clear();
  s = check_layout_plausible(o, {2, 8, 1024, 4}, {2, 8, 1024, 4}, "q", "k", "v", Layout::kBnhd, &warning);
  EXPECT_NE(s.message().find("probably all in the other layout (bhnd)"), std::string::npos) << s.message();
  // A first decode step (one query, one key, 8 heads) cannot be decided: a warning.
  ASSERT_TRUE(
      apply_shapes(array({1, 1, 8, 4}), array({1, 1, 8, 4}), array({1, 1, 8, 4}), "q", "k", "v", &o, &batched).ok());
  EXPECT_TRUE(check_layout_plausible(o, {1, 1, 8, 4}, {1, 1, 8, 4}, "q", "k", "v", Layout::kBnhd, &warning).ok());
  EXPECT_NE(warning.find("more heads (8, 8) than positions (1, 1)"), std::string::npos) << warning;
}

TEST(Flags, SwapAxesTurnsBhndIntoBnhdAndBack) {
  NpyArray a = array({2, 3, 4, 2});
  for (size_t i = 0; i < a.data.size(); ++i) a.data[i] = static_cast<uint8_t>(i);
  const NpyArray t = swap_axes(a, 1);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 4, 3, 2}));
  const size_t e = dtype_bytes(a.dtype);
  // t[b][n][h][d] == a[b][h][n][d]
  EXPECT_EQ(
      std::memcmp(t.data.data() + ((1 * 4 + 2) * 3 + 1) * 2 * e, a.data.data() + ((1 * 3 + 1) * 4 + 2) * 2 * e, 2 * e),
      0);
  EXPECT_EQ(swap_axes(t, 1).data, a.data);
}

TEST(Flags, OutputPathsAreCheckedBeforeComputing) {
  OutputCliArgs a;
  a.out_path = "/nonexistent-dir/o.npy";
  Status s = check_output_paths(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'/nonexistent-dir' does not exist"), std::string::npos) << s.message();
  a.out_path = "o.npy";  // the working directory
  a.lse_path = ::testing::TempDir();
  s = check_output_paths(a);
  EXPECT_NE(s.message().find("lse = '" + a.lse_path + "' is a directory"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace plsh::cli
