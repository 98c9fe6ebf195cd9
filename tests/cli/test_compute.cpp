// `plsh compute` and `plsh demo` run as subprocesses of the built binary:
// the output must be the in-process run_attention result bit for bit (same
// backend, same thread count), the metadata must carry every documented key
// and the draws of SPEC section 5, and every bad input must end with exit
// code 2 and one line on stderr that names the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/npy.h"
#include "cli_test_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh::cli {
namespace {

using plsh::testing::shaped;
using testing::RunResult;
using testing::ScratchDir;

constexpr int kThreads = 2;  // the same in both processes, so the outputs can be compared bit for bit

struct Case {
  const char* name;
  AttentionOptions options;        // shapes and options; the flags below must say the same
  bool batched;                    // rank-4 files, or rank 3 (batch 1)
  std::vector<std::string> flags;  // besides --q --k --v --out --lse --meta --backend --threads
};

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&c](const char* name, const AttentionOptions& options, bool batched, std::vector<std::string> flags) {
    c.push_back({name, options, batched, std::move(flags)});
  };
  add("exact_gqa_causal", shaped({2, 33, 40, 4, 2, 16}, {.causal = true, .mode = Mode::kExact}), true,
      {"--mode", "exact", "--causal"});
  // A seed above 2^63 checks that uint64 seeds survive the flag and the JSON.
  add("lsh_gqa_causal_hashes",
      shaped({2, 48, 48, 4, 1, 8},
             {.causal = true, .mode = Mode::kLsh, .samples = 8, .seed = 12345678901234567890ULL, .return_draws = true}),
      true, {"--mode", "lsh", "--samples", "8", "--seed", "12345678901234567890", "--causal", "--return-draws"});
  // Rank 3, float16, a zero slope (sigma = inf), offsets, a window.
  add("window_rank3_f16_offsets",
      shaped({1, 20, 37, 4, 0, 8}, {.dtype = DType::kF16,
                                    .slopes = {0.5, 0.25, 0, 0.125},
                                    .q_pos0 = 100,
                                    .k_pos0 = 90,
                                    .mode = Mode::kWindow,
                                    .window_eps = 1e-3,
                                    .probe_rows = 5}),
      false,
      {"--mode", "window", "--window-eps", "1e-3", "--slopes", "0.5,0.25,0,0.125", "--q-pos0", "100", "--k-pos0", "90",
       "--probe-rows", "5"});
  add("lsh_per_sample_f16_to_f32",
      shaped({1, 17, 29, 2, 0, 12}, {.dtype = DType::kF16,
                                     .out_dtype = DType::kF32,
                                     .scale = 0.3,
                                     .mode = Mode::kLsh,
                                     .samples = 3,
                                     .seed = 7,
                                     .lsh_algorithm = LshAlgorithm::kPerSample,
                                     .return_draws = true}),
      true,
      {"--mode", "lsh", "--samples", "3", "--seed", "7", "--lsh-algorithm", "per_sample", "--scale", "0.3",
       "--out-dtype", "f32", "--return-draws"});
  // The ash sampler's draws come back in the metadata, recomputable.
  add("lsh_ash_draws",
      shaped({1, 64, 64, 2, 0, 8},
             {.mode = Mode::kLsh, .samples = 16, .seed = 5, .sampling = Sampling::kAsh, .return_draws = true}),
      true, {"--mode", "lsh", "--samples", "16", "--sampling", "ash", "--seed", "5", "--return-draws"});
  // The biased fixed-blocks baseline (SPEC section 4), labelled as itself.
  add("fixed_blocks_gqa_causal", shaped({2, 48, 48, 4, 2, 8}, {.causal = true, .mode = Mode::kFixedBlocks}), true,
      {"--mode", "fixed_blocks", "--causal"});
  // An error-targeted request without --mode searches windows.
  add("targeted_window",
      shaped({1, 200, 200, 2, 0, 16},
             {.causal = true, .slopes = {0.5, 0.25}, .mode = kDefaultTargetMode, .target_rel_err = 0.05}),
      true, {"--target-error", "0.05", "--causal", "--slopes", "0.5,0.25"});
  // bfloat16 travels as '<u2' bit patterns, in and out, with --bf16-bits.
  add("exact_bf16_bits",
      {.batch = 1, .q_len = 24, .kv_len = 24, .heads = 2, .head_dim = 16, .dtype = DType::kBF16, .mode = Mode::kExact},
      true, {"--mode", "exact", "--bf16-bits"});
  return c;
}

void expect_keys(const nlohmann::json& j, const std::vector<const char*>& keys, const std::string& where) {
  for (const char* k : keys) EXPECT_TRUE(j.contains(k)) << where << " lacks \"" << k << "\"";
}

class Compute : public ::testing::TestWithParam<Case> {};

TEST_P(Compute, MatchesInProcessRunAndWritesFullMetadata) {
  const Case& c = GetParam();
  ScratchDir dir;
  const AttentionOptions& o = c.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  // The inputs, and the params of the same request in this process.
  plsh::testing::Problem pr = plsh::testing::make_problem(o, 1234);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  ASSERT_TRUE(testing::write_qkv(dir, o, c.batched, pr.qkv).ok());

  std::vector<std::string> args = testing::command_line(
      "compute", dir, {"--q=q.npy", "--k=k.npy", "--v=v.npy", "--out=o.npy", "--lse=lse.npy", "--meta=meta.json"},
      {"--backend", "cpu", "--threads", std::to_string(kThreads)});
  args.insert(args.end(), c.flags.begin(), c.flags.end());
  const RunResult run = testing::run_plsh(args, dir);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.err, "");

  // The same request in this process.
  const std::vector<uint8_t>& out = pr.out;
  const std::vector<float>& lse = pr.lse;
  const AttentionParams& params = pr.params;
  auto backend = BackendRegistry::global().select("cpu", params);
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  PlanLimits limits;
  limits.threads = kThreads;
  auto expected = run_attention(**backend, params, limits, ExecContext{});
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();

  const NpyArray got_out = testing::read_npy_ok(dir.file("o.npy"));
  EXPECT_EQ(got_out.dtype, o.out_dtype.value_or(o.dtype));
  EXPECT_EQ(got_out.shape, testing::npy_shape(o, c.batched, o.q_len, o.heads));
  EXPECT_TRUE(got_out.data == out) << "output differs from the in-process run";
  const NpyArray got_lse = testing::read_npy_ok(dir.file("lse.npy"));
  EXPECT_EQ(got_lse.dtype, DType::kF32);
  EXPECT_EQ(got_lse.shape, testing::npy_shape(o, c.batched, o.q_len, o.heads, false));
  EXPECT_EQ(got_lse.data.size(), lse.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(got_lse.data.data(), lse.data(), std::min(got_lse.data.size(), lse.size() * sizeof(float))), 0)
      << "lse differs from the in-process run";

  const nlohmann::json meta = nlohmann::json::parse(testing::read_file(dir.file("meta.json")));
  expect_keys(meta,
              {"mode", "samples", "seed", "heads", "flops", "dense_flops", "timings", "backend", "device",
               "lsh_algorithm", "summary", "shape", "params"},
              "META");
  expect_keys(meta["timings"], {"compute", "load", "save"}, "timings");
  expect_keys(meta["summary"], {"mask_max_err", "mask_spectral_err", "probe"}, "summary");
  expect_keys(meta["shape"], {"batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim", "dtype", "out_dtype"},
              "shape");
  EXPECT_EQ(meta["mode"], mode_name(expected->mode));  // a targeted request's: the kept attempt's
  if (o.target_rel_err == 0) {
    EXPECT_EQ(expected->mode, o.mode);
  }
  EXPECT_EQ(meta["seed"].get<uint64_t>(), expected->seed);
  EXPECT_EQ(meta["samples"].get<int64_t>(), expected->samples);
  EXPECT_EQ(meta["backend"], "cpu");
  EXPECT_EQ(meta["flops"].get<double>(), expected->flops);
  EXPECT_EQ(meta["dense_flops"].get<double>(), expected->dense_flops);
  EXPECT_EQ(meta["lsh_algorithm"], lsh_algorithm_name(expected->lsh_algorithm));
  EXPECT_EQ(meta["sampling"], sampling_name(expected->sampling));
  EXPECT_EQ(meta.contains("target"), o.target_rel_err > 0);
  if (o.target_rel_err > 0) {
    const nlohmann::json& t = meta["target"];
    EXPECT_EQ(t["target_rel_err"].get<double>(), o.target_rel_err);
    EXPECT_TRUE(t["met"].get<bool>());
    EXPECT_EQ(t["chosen"].get<int64_t>(), expected->target.chosen);
    ASSERT_EQ(t["attempts"].size(), expected->target.attempts.size());
    for (size_t i = 0; i < expected->target.attempts.size(); ++i) {
      const TargetAttempt& a = expected->target.attempts[i];
      const nlohmann::json& ja = t["attempts"][i];
      EXPECT_EQ(ja["mode"], mode_name(a.mode));
      EXPECT_EQ(ja["flops"].get<double>(), a.flops);
      EXPECT_EQ(ja["met"].get<bool>(), a.met);
      expect_keys(ja, {"rel_err", "rel_err_upper", "seconds"}, "target.attempts");
    }
  }
  EXPECT_EQ(meta["shape"]["kv_heads"].get<int64_t>(), kv_heads);
  EXPECT_EQ(meta["shape"]["batched"].get<bool>(), c.batched);
  // The resolved defaults, as the library resolved them.
  EXPECT_EQ(expected->scale, params.scale);
  EXPECT_EQ(expected->q_pos0, params.q_pos0);
  EXPECT_EQ(expected->k_pos0, params.k_pos0);
  EXPECT_EQ(meta["params"]["scale"].get<double>(), params.scale);
  EXPECT_EQ(meta["params"]["q_pos0"].get<int64_t>(), params.q_pos0);
  EXPECT_EQ(meta["params"]["k_pos0"].get<int64_t>(), params.k_pos0);

  ASSERT_EQ(meta["heads"].size(), expected->heads.size());
  if (expected->mode != Mode::kExact) {
    ASSERT_EQ(static_cast<int64_t>(expected->heads.size()), o.heads);
  }
  for (size_t h = 0; h < expected->heads.size(); ++h) {
    const nlohmann::json& jh = meta["heads"][h];
    const HeadEstimate& eh = expected->heads[h];
    const std::string where = "heads[" + std::to_string(h) + "]";
    expect_keys(jh,
                {"head", "slope", "sigma", "window", "max_block", "mask_max_err", "mask_rows_checked",
                 "mask_rows_sampled", "mask_spectral_err", "spectral_iterations", "probe"},
                where);
    expect_keys(jh["probe"], {"rows", "rel_err", "rel_err_stderr", "max_abs_err", "bound_max", "rel_err_upper"},
                where + ".probe");
    EXPECT_EQ(jh["head"].get<int64_t>(), eh.head);
    if (std::isfinite(eh.sigma)) {
      EXPECT_EQ(jh["sigma"].get<double>(), eh.sigma) << where;
    } else {
      EXPECT_TRUE(jh["sigma"].is_null()) << where;
    }
    EXPECT_EQ(jh["max_block"].get<int64_t>(), eh.max_block) << where;
    EXPECT_EQ(jh["mask_max_err"].get<double>(), eh.mask_max_err) << where;
    EXPECT_EQ(jh["probe"]["rows"].get<int64_t>(), eh.probe.rows) << where;

    // The draws are SPEC section 5's, recomputable from (seed, head, sigma, samples, sampling).
    ASSERT_EQ(jh.contains("draws"), o.return_draws) << where;
    if (!o.return_draws) continue;
    const std::vector<Draw> draws =
        draw_hashes(o.seed, static_cast<int64_t>(h), params.sigma(static_cast<int64_t>(h)), o.samples, o.sampling);
    ASSERT_EQ(jh["draws"].size(), draws.size()) << where;
    for (size_t k = 0; k < draws.size(); ++k) {
      EXPECT_EQ(jh["draws"][k][0].get<double>(), draws[k].pitch) << where << " draw " << k;
      EXPECT_EQ(jh["draws"][k][1].get<double>(), draws[k].shift) << where << " draw " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Compute, ::testing::ValuesIn(cases()), plsh::testing::CaseName());

// Inputs for the bad-input table: q [1, 8, 4, 4] and k, v [1, 8, 2, 4].
struct BadInputs {
  ScratchDir dir;
  BadInputs() {
    const std::vector<float> q(1 * 8 * 4 * 4, 0.5f), kv(1 * 8 * 2 * 4, 0.25f);
    write(DType::kF32, "q.npy", {1, 8, 4, 4}, q.data());
    write(DType::kF32, "k.npy", {1, 8, 2, 4}, kv.data());
    write(DType::kF32, "v.npy", {1, 8, 2, 4}, kv.data());
    write(DType::kF32, "v_short.npy", {1, 7, 2, 4}, kv.data());
    write(DType::kF32, "k3.npy", {1, 8, 3, 4}, std::vector<float>(1 * 8 * 3 * 4, 0.25f).data());
    write(DType::kF32, "q_rank2.npy", {8, 16}, q.data());
    std::vector<float> q_nan = q;
    q_nan[(3 * 4 + 1) * 4 + 2] = std::numeric_limits<float>::quiet_NaN();  // [b=0, n=3, h=1, d=2]
    write(DType::kF32, "q_nan.npy", {1, 8, 4, 4}, q_nan.data());

    const std::string good = testing::read_file(dir.file("q.npy"));
    testing::write_file(dir.file("q_truncated.npy"), good.substr(0, good.size() - 5));
    std::string fortran = good;
    fortran.replace(fortran.find("False"), 5, "True ");
    testing::write_file(dir.file("q_fortran.npy"), fortran);
    std::string f64 = good;
    f64.replace(f64.find("<f4"), 3, "<f8");
    f64 += std::string(q.size() * 4, '\0');
    testing::write_file(dir.file("q_f64.npy"), f64);
  }
  void write(DType t, const char* name, const std::vector<int64_t>& shape, const void* data) {
    ASSERT_TRUE(write_npy(dir.file(name), t, shape, data).ok());
  }
  std::vector<std::string> args(const std::string& q, const std::string& k, const std::string& v) const {
    return {"compute", "--q", dir.file(q), "--k", dir.file(k), "--v", dir.file(v), "--out", dir.file("o.npy")};
  }
};

struct BadCase {
  const char* what;
  std::vector<std::string> args;
  int exit_code;
  std::string expected;  // in the one stderr line
};

TEST(ComputeErrors, EachBadInputExitsWithOneLineNamingTheProblem) {
  BadInputs in;
  auto with = [&](std::vector<std::string> base, std::vector<std::string> extra) {
    base.insert(base.end(), extra.begin(), extra.end());
    return base;
  };
  const auto plain = in.args("q.npy", "k.npy", "v.npy");
  std::vector<BadCase> cases = {
      {"missing file", in.args("nope.npy", "k.npy", "v.npy"), 2, "nope.npy: no such file"},
      {"wrong dtype", in.args("q_f64.npy", "k.npy", "v.npy"), 2, "q_f64.npy: dtype '<f8', expected '<f4'"},
      {"mismatched shapes", in.args("q.npy", "k.npy", "v_short.npy"), 2,
       "v_short.npy: shape [1, 7, 2, 4], expected the shape of k [1, 8, 2, 4]"},
      {"H % Hkv != 0", in.args("q.npy", "k3.npy", "k3.npy"), 2,
       "INVALID_ARGUMENT: kv_heads = 3, expected a divisor of heads = 4"},
      {"rank 2", in.args("q_rank2.npy", "k.npy", "v.npy"), 2, "has rank 2"},
      {"bad mode", with(plain, {"--mode", "fast"}), 2, "mode = 'fast', expected exact, lsh, window or fixed_blocks"},
      {"samples 0", with(plain, {"--samples", "0"}), 2, "samples = 0, expected in [1, "},
      {"negative slope", with(plain, {"--slopes", "0.5,-0.5,0.1,0.1"}), 2,
       "slopes[1] = -0.5, expected a finite number >= 0"},
      {"wrong slope count", with(plain, {"--slopes", "0.5,0.25"}), 2,
       "slopes = 2 values, expected one per query head (4)"},
      {"slope not a number", with(plain, {"--slopes", "0.5,x,1,1"}), 2, "('x') is not a number"},
      {"NaN in q", in.args("q_nan.npy", "k.npy", "v.npy"), 2, "q has a non-finite value (nan) at [b=0, n=3, h=1, d=2]"},
      {"fortran order", in.args("q_fortran.npy", "k.npy", "v.npy"), 2, "q_fortran.npy: fortran_order = True"},
      {"truncated file", in.args("q_truncated.npy", "k.npy", "v.npy"), 2, "q_truncated.npy: truncated"},
      {"causal with no key", with(plain, {"--causal", "--q-pos0", "-1"}), 2, "q_pos0 = -1, expected >= k_pos0 = 0"},
      {"bad window eps", with(plain, {"--mode", "window", "--window-eps", "2"}), 2, "window_eps = 2"},
      {"negative probe rows", with(plain, {"--probe-rows", "-3"}), 2, "probe_rows = -3"},
      {"samples not a number", with(plain, {"--samples", "many"}), 2, "--samples: 'many' is not a decimal integer"},
      {"unknown flag", with(plain, {"--bogus"}), 2, "--bogus"},
      {"no --out",
       {"compute", "--q", in.dir.file("q.npy"), "--k", in.dir.file("k.npy"), "--v", in.dir.file("v.npy")},
       2,
       "--out is required"},
      {"out directory missing", with(in.args("q.npy", "k.npy", "v.npy"), {"--lse", in.dir.file("no/such/dir/l.npy")}),
       2, "directory '" + in.dir.file("no/such/dir") + "' does not exist"},
      {"bad backend", with(plain, {"--backend", "tpu"}), 2, "backend = 'tpu', expected one of auto, cpu, cuda"},
  };
  if (!BackendRegistry::global().find("cuda").ok()) {
    // Not a usage error: the flag is fine, this machine cannot do it.
    cases.push_back({"cuda not available", with(plain, {"--backend", "cuda"}), 1, "backend = 'cuda' is not available"});
  }
  for (const BadCase& c : cases) {
    std::remove(in.dir.file("o.npy").c_str());
    const RunResult r = testing::run_plsh(c.args, in.dir);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.what << ": " << r.err;
    EXPECT_EQ(r.out, "") << c.what;
    ASSERT_FALSE(r.err.empty()) << c.what;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << c.what << ": not one line: " << r.err;
    EXPECT_EQ(r.err.rfind("plsh compute: ", 0), 0u) << c.what << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.what << ": " << r.err;
    EXPECT_FALSE(testing::file_exists(in.dir.file("o.npy"))) << c.what << ": wrote an output anyway";
  }
}

TEST(Cli, HelpListsSubcommandsAndUnknownOnesFail) {
  ScratchDir dir;
  const RunResult help = testing::run_plsh({"--help"}, dir);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("compute"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("demo"), std::string::npos) << help.out;
  const RunResult unknown = testing::run_plsh({"frobnicate"}, dir);
  EXPECT_EQ(unknown.exit_code, 2);
  // Other files add subcommands too; these two must be among them.
  EXPECT_EQ(unknown.err.rfind("plsh: unknown subcommand 'frobnicate', expected one of: ", 0), 0u) << unknown.err;
  EXPECT_NE(unknown.err.find(" compute"), std::string::npos) << unknown.err;
  EXPECT_NE(unknown.err.find(" demo"), std::string::npos) << unknown.err;
  EXPECT_EQ(unknown.err.find('\n'), unknown.err.size() - 1) << unknown.err;
  const RunResult none = testing::run_plsh({}, dir);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_EQ(none.err.find('\n'), none.err.size() - 1) << none.err;
}

TEST(Demo, PrintsOneRowPerModeWithExactAsItsOwnReference) {
  ScratchDir dir;
  const RunResult r = testing::run_plsh(
      {"demo", "--n", "96", "--heads", "2", "--head-dim", "8", "--samples", "4", "--threads", "2", "--per-head"}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  for (const char* row : {"\nexact ", "\nwindow ", "\nlsh iid ", "\nlsh ash ", "\ntarget 1.00e-02 "})
    EXPECT_NE(r.out.find(row), std::string::npos) << "no row '" << row + 1 << "' in:\n" << r.out;
  // exact against itself: relative error exactly 0.
  const size_t exact = r.out.find("\nexact ");
  ASSERT_NE(exact, std::string::npos);
  EXPECT_NE(r.out.substr(exact, r.out.find('\n', exact + 1) - exact).find("0.00e+00"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lsh, per head:"), std::string::npos) << r.out;
  // The targeted row lists its attempts and marks the one kept.
  EXPECT_NE(r.out.find("kept the first whose probe upper bound met it"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  * "), std::string::npos) << r.out;

  // Not causal by default, as plsh attend and compute.
  EXPECT_NE(r.out.find(", not causal,"), std::string::npos) << r.out;
  const RunResult masked = testing::run_plsh({"demo", "--n", "40", "--heads", "1", "--head-dim", "4", "--causal"}, dir);
  ASSERT_EQ(masked.exit_code, 0) << masked.err;
  EXPECT_NE(masked.out.find(", causal,"), std::string::npos) << masked.out;

  const RunResult bad = testing::run_plsh({"demo", "--head-dim", "5000"}, dir);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.err, "plsh demo: INVALID_ARGUMENT: head_dim = 5000, expected in [1, 1024]\n");
}

}  // namespace
}  // namespace plsh::cli
