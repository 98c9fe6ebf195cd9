// `plsh compute --dout --dq --dk --dv`: the forward and its backward in one
// process. The gradients must be the in-process run_forward_backward's bit
// for bit (one thread, so that dq's summation order is fixed), the forward's
// output that of a forward-only run, and the metadata must carry the
// backward's FLOPs and timings. Bad combinations exit 2 with one line.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/npy.h"
#include "cli_test_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/numeric.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh::cli {
namespace {

using plsh::testing::shaped;
using testing::RunResult;
using testing::ScratchDir;

struct BackwardCliCase {
  const char* name;
  AttentionOptions options;
  bool batched;
  std::vector<std::string> flags;   // attention flags matching options
  std::optional<DType> grad_dtype;  // --grad-dtype
};

// A table, one case a line or two: clang-format would put each field on a
// line of its own.
// clang-format off
std::vector<BackwardCliCase> backward_cases() {
  return {
      {"exact_gqa_causal_f32", shaped({2, 33, 40, 4, 2, 16}, {.causal = true, .mode = Mode::kExact}), true,
       {"--mode", "exact", "--causal"}, std::nullopt},
      {"lsh_rank3_f16_f32_grads", shaped({1, 48, 48, 2, 0, 8}, {.dtype = DType::kF16, .causal = true,
           .mode = Mode::kLsh, .samples = 6, .seed = 9, .lsh_algorithm = LshAlgorithm::kPerSample}), false,
       {"--mode", "lsh", "--samples", "6", "--seed", "9", "--lsh-algorithm", "per_sample", "--causal"}, DType::kF32},
      {"fixed_blocks_causal_f32", shaped({2, 40, 40, 4, 2, 16}, {.causal = true, .mode = Mode::kFixedBlocks}), true,
       {"--mode", "fixed_blocks", "--causal"}, std::nullopt},
      {"window_bf16_bits", shaped({1, 24, 24, 2, 0, 16}, {.dtype = DType::kBF16, .mode = Mode::kWindow,
           .window_width = 5}), true, {"--mode", "window", "--window-width", "5", "--bf16-bits"}, std::nullopt},
  };
}
// clang-format on

void PrintTo(const BackwardCliCase& c, std::ostream* os) { *os << c.name; }

class ComputeBackward : public ::testing::TestWithParam<BackwardCliCase> {};

TEST_P(ComputeBackward, MatchesInProcessForwardBackward) {
  const BackwardCliCase& c = GetParam();
  const AttentionOptions& o = c.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  const DType grad_dtype = c.grad_dtype.value_or(o.dtype);
  ScratchDir dir;
  // The inputs, and the forward+backward (with) and the forward alone
  // (alone) of the same request in this process.
  plsh::testing::Problem with = plsh::testing::make_problem(o, 99, false),
                         alone = plsh::testing::make_problem(o, 99, false);
  ASSERT_TRUE(with.status.ok() && alone.status.ok()) << with.status.to_string();
  plsh::testing::GradTensors grads = plsh::testing::grad_tensors(o, grad_dtype, 7);
  ASSERT_TRUE(testing::write_qkv(dir, o, c.batched, with.qkv).ok());
  ASSERT_TRUE(
      write_npy(dir.file("dout.npy"), o.dtype, testing::npy_shape(o, c.batched, o.q_len, o.heads), grads.dout.data())
          .ok());

  std::vector<std::string> args =
      testing::command_line("compute", dir,
                            {"--q=q.npy", "--k=k.npy", "--v=v.npy", "--out=o.npy", "--meta=meta.json",
                             "--dout=dout.npy", "--dq=dq.npy", "--dk=dk.npy", "--dv=dv.npy"},
                            {"--backend", "cpu", "--threads", "1"});
  args.insert(args.end(), c.flags.begin(), c.flags.end());
  if (c.grad_dtype) args.insert(args.end(), {"--grad-dtype", dtype_name(*c.grad_dtype)});
  const RunResult run = testing::run_plsh(args, dir);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.err, "");

  // The same in this process.
  auto backend = BackendRegistry::global().select("cpu", with.params, true);
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  PlanLimits limits;
  limits.threads = 1;
  auto expected = run_forward_backward(**backend, with.params, limits, grads.refs(), ExecContext{});
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  ASSERT_TRUE(run_attention(**backend, alone.params, limits, ExecContext{}).ok());
  EXPECT_EQ(with.out, alone.out) << "the forward of a forward+backward differs from a forward alone";

  EXPECT_EQ(testing::read_npy_ok(dir.file("o.npy")).data, with.out);
  const std::pair<const char*, const std::vector<uint8_t>*> grads_expected[] = {
      {"dq", &grads.dq}, {"dk", &grads.dk}, {"dv", &grads.dv}};
  for (const auto& [name, want] : grads_expected) {
    const NpyArray got = testing::read_npy_ok(dir.file(std::string(name) + ".npy"));
    EXPECT_EQ(got.dtype, grad_dtype) << name;
    EXPECT_EQ(got.shape, std::string(name) == "dq" ? testing::npy_shape(o, c.batched, o.q_len, o.heads)
                                                   : testing::npy_shape(o, c.batched, o.kv_len, kv_heads))
        << name;
    EXPECT_TRUE(got.data == *want) << name << " differs from the in-process run";
  }

  const nlohmann::json meta = nlohmann::json::parse(testing::read_file(dir.file("meta.json")));
  ASSERT_TRUE(meta.contains("backward")) << meta.dump(2);
  const nlohmann::json& b = meta["backward"];
  for (const char* key : {"backend", "device", "grad_dtype", "flops", "dense_flops", "host_workspace_bytes",
                          "device_workspace_bytes", "timings"})
    EXPECT_TRUE(b.contains(key)) << "backward lacks \"" << key << "\"";
  EXPECT_EQ(b["backend"], "cpu");
  EXPECT_EQ(b["grad_dtype"], dtype_name(grad_dtype));
  EXPECT_EQ(b["flops"].get<double>(), expected->backward.flops);
  EXPECT_EQ(b["dense_flops"].get<double>(), expected->backward.dense_flops);
  EXPECT_GT(b["flops"].get<double>(), 0);
  EXPECT_TRUE(b["timings"].contains("backward"));
  EXPECT_TRUE(b["timings"].contains("save"));
  EXPECT_EQ(meta["flops"].get<double>(), expected->forward.flops);
}

INSTANTIATE_TEST_SUITE_P(Cases, ComputeBackward, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<BackwardCliCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(ComputeBackwardErrors, EachBadCombinationExitsWithOneLineNamingTheProblem) {
  ScratchDir dir;
  const std::vector<float> q(1 * 8 * 4 * 4, 0.5f), kv(1 * 8 * 2 * 4, 0.25f);
  ASSERT_TRUE(write_npy(dir.file("q.npy"), DType::kF32, {1, 8, 4, 4}, q.data()).ok());
  ASSERT_TRUE(write_npy(dir.file("k.npy"), DType::kF32, {1, 8, 2, 4}, kv.data()).ok());
  ASSERT_TRUE(write_npy(dir.file("v.npy"), DType::kF32, {1, 8, 2, 4}, kv.data()).ok());
  ASSERT_TRUE(write_npy(dir.file("dout.npy"), DType::kF32, {1, 8, 4, 4}, q.data()).ok());
  ASSERT_TRUE(write_npy(dir.file("dout_short.npy"), DType::kF32, {1, 7, 4, 4}, q.data()).ok());
  const std::vector<uint16_t> half(q.size(), 0x3800);
  ASSERT_TRUE(write_npy(dir.file("dout_f16.npy"), DType::kF16, {1, 8, 4, 4}, half.data()).ok());
  std::vector<float> nan_dout = q;
  nan_dout[(2 * 4 + 3) * 4 + 1] = std::numeric_limits<float>::quiet_NaN();  // [b=0, n=2, h=3, d=1]
  ASSERT_TRUE(write_npy(dir.file("dout_nan.npy"), DType::kF32, {1, 8, 4, 4}, nan_dout.data()).ok());

  const std::vector<std::string> base = {"compute",         "--q",   dir.file("q.npy"), "--k", dir.file("k.npy"), "--v",
                                         dir.file("v.npy"), "--out", dir.file("o.npy")};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto all = [&](const std::string& dout, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = with(
        {"--dout", dir.file(dout), "--dq", dir.file("dq.npy"), "--dk", dir.file("dk.npy"), "--dv", dir.file("dv.npy")});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  struct Bad {
    const char* what;
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Bad> cases = {
      {"dout alone", with({"--dout", dir.file("dout.npy")}),
       "the backward needs --dout, --dq, --dk and --dv together: --dout given, --dq, --dk, --dv missing"},
      {"gradients without dout",
       with({"--dq", dir.file("dq.npy"), "--dk", dir.file("dk.npy"), "--dv", dir.file("dv.npy")}),
       "--dq, --dk, --dv given, --dout missing"},
      {"grad dtype alone", with({"--grad-dtype", "f32"}), "--grad-dtype = 'f32' without the backward"},
      {"bad grad dtype", all("dout.npy", {"--grad-dtype", "f64"}), "grad_dtype = 'f64', expected f32, f16 or bf16"},
      {"bf16 grads without bits", all("dout.npy", {"--grad-dtype", "bf16"}), "grad_dtype = bf16 needs --bf16-bits"},
      {"dout shape", all("dout_short.npy"), "dout shape [1, 7, 4, 4], expected the shape of out [1, 8, 4, 4]"},
      {"dout dtype", all("dout_f16.npy"), "dout dtype f16, expected the dtype of out (f32)"},
      {"dout not finite", all("dout_nan.npy"), "dout has a non-finite value (nan) at [b=0, n=2, h=3, d=1]"},
      {"dq directory missing",
       with({"--dout", dir.file("dout.npy"), "--dq", dir.file("no/dq.npy"), "--dk", dir.file("dk.npy"), "--dv",
             dir.file("dv.npy")}),
       "dq = '" + dir.file("no/dq.npy") + "': directory '" + dir.file("no") + "' does not exist"},
  };
  for (const Bad& c : cases) {
    for (const char* f : {"o.npy", "dq.npy", "dk.npy", "dv.npy"}) std::remove(dir.file(f).c_str());
    const RunResult r = testing::run_plsh(c.args, dir);
    EXPECT_EQ(r.exit_code, 2) << c.what << ": " << r.err;
    ASSERT_FALSE(r.err.empty()) << c.what;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << c.what << ": not one line: " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.what << ": " << r.err;
    for (const char* f : {"o.npy", "dq.npy", "dk.npy", "dv.npy"})
      EXPECT_FALSE(testing::file_exists(dir.file(f))) << c.what << ": wrote " << f << " anyway";
  }
}

}  // namespace
}  // namespace plsh::cli
