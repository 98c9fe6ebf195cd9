// `plsh compute --dout --dq --dk --dv`: the forward and its backward in one
// process. The gradients must be the in-process run_forward_backward's bit
// for bit (one thread, so that dq's summation order is fixed), the forward's
// output that of a forward-only run, and the metadata must carry the
// backward's FLOPs and timings. Bad combinations exit 2 with one line.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/npy.h"
#include "cli_test_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/numeric.h"
#include "reference.h"

namespace plsh::cli {
namespace {

using testing::RunResult;
using testing::ScratchDir;

struct BackwardCliCase {
  const char* name;
  AttentionOptions options;
  bool batched;
  std::vector<std::string> flags;      // attention flags matching options
  std::optional<DType> grad_dtype;     // --grad-dtype
};

std::vector<BackwardCliCase> cases() {
  std::vector<BackwardCliCase> c;
  {
    BackwardCliCase e{"exact_gqa_causal_f32", {}, true, {"--mode", "exact", "--causal"}, std::nullopt};
    e.options.batch = 2;
    e.options.q_len = 33;
    e.options.kv_len = 40;
    e.options.heads = 4;
    e.options.kv_heads = 2;
    e.options.head_dim = 16;
    e.options.mode = Mode::kExact;
    e.options.causal = true;
    c.push_back(e);
  }
  {
    BackwardCliCase l{"lsh_rank3_f16_f32_grads",
                      {},
                      false,
                      {"--mode", "lsh", "--samples", "6", "--seed", "9", "--lsh-algorithm", "per_sample", "--causal"},
                      DType::kF32};
    l.options.q_len = l.options.kv_len = 48;
    l.options.heads = 2;
    l.options.head_dim = 8;
    l.options.dtype = DType::kF16;
    l.options.mode = Mode::kLsh;
    l.options.samples = 6;
    l.options.seed = 9;
    l.options.lsh_algorithm = LshAlgorithm::kPerSample;
    l.options.causal = true;
    c.push_back(l);
  }
  {
    BackwardCliCase w{"window_bf16_bits", {}, true, {"--mode", "window", "--window-width", "5", "--bf16-bits"},
                      std::nullopt};
    w.options.q_len = w.options.kv_len = 24;
    w.options.heads = 2;
    w.options.head_dim = 16;
    w.options.dtype = DType::kBF16;
    w.options.mode = Mode::kWindow;
    w.options.window_width = 5;
    c.push_back(w);
  }
  return c;
}

void PrintTo(const BackwardCliCase& c, std::ostream* os) { *os << c.name; }

std::vector<int64_t> shape(const AttentionOptions& o, bool batched, int64_t rows, int64_t heads) {
  std::vector<int64_t> s;
  if (batched) s.push_back(o.batch);
  s.insert(s.end(), {rows, heads, o.head_dim});
  return s;
}

NpyArray read_ok(const std::string& path) {
  auto a = read_npy(path, NpyReadOptions{true});
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return a.ok() ? std::move(a).value() : NpyArray{};
}

class ComputeBackward : public ::testing::TestWithParam<BackwardCliCase> {};

TEST_P(ComputeBackward, MatchesInProcessForwardBackward) {
  const BackwardCliCase& c = GetParam();
  const AttentionOptions& o = c.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  ScratchDir dir;
  const plsh::testing::RandomTensors t = plsh::testing::random_qkv(o, 99);
  std::vector<uint8_t> dout(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(o.dtype));
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < o.batch * o.q_len * o.heads * o.head_dim; ++i) store_element(dout.data(), o.dtype, i, normal(rng));
  ASSERT_TRUE(write_npy(dir.path("q.npy"), o.dtype, shape(o, c.batched, o.q_len, o.heads), t.q.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("k.npy"), o.dtype, shape(o, c.batched, o.kv_len, kv_heads), t.k.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("v.npy"), o.dtype, shape(o, c.batched, o.kv_len, kv_heads), t.v.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("dout.npy"), o.dtype, shape(o, c.batched, o.q_len, o.heads), dout.data()).ok());

  std::vector<std::string> args = {"compute", "--q", dir.path("q.npy"), "--k", dir.path("k.npy"), "--v",
                                   dir.path("v.npy"), "--out", dir.path("o.npy"), "--meta", dir.path("meta.json"),
                                   "--dout", dir.path("dout.npy"), "--dq", dir.path("dq.npy"), "--dk",
                                   dir.path("dk.npy"), "--dv", dir.path("dv.npy"), "--backend", "cpu", "--threads", "1"};
  args.insert(args.end(), c.flags.begin(), c.flags.end());
  if (c.grad_dtype) args.insert(args.end(), {"--grad-dtype", dtype_name(*c.grad_dtype)});
  const RunResult run = testing::run_plsh(args, dir);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.err, "");

  // The same in this process.
  const DType grad_dtype = c.grad_dtype.value_or(o.dtype);
  std::vector<uint8_t> out = plsh::testing::output_buffer(o), out_alone = plsh::testing::output_buffer(o);
  const size_t q_elems = static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim);
  const size_t kv_elems = static_cast<size_t>(o.batch * o.kv_len * kv_heads * o.head_dim);
  std::vector<uint8_t> dq(q_elems * dtype_bytes(grad_dtype)), dk(kv_elems * dtype_bytes(grad_dtype)), dv(dk.size());
  auto params = make_params(o, {t.q.data(), t.k.data(), t.v.data(), out.data(), nullptr, MemorySpace::kHost});
  ASSERT_TRUE(params.ok()) << params.status().to_string();
  auto backend = BackendRegistry::global().select("cpu", *params, true);
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  PlanLimits limits;
  limits.threads = 1;
  GradientRefs grads;
  grads.dout = dout.data();
  grads.dq = dq.data();
  grads.dk = dk.data();
  grads.dv = dv.data();
  grads.grad_dtype = grad_dtype;
  auto expected = run_forward_backward(**backend, *params, limits, grads, ExecContext{});
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  auto alone = make_params(o, {t.q.data(), t.k.data(), t.v.data(), out_alone.data(), nullptr, MemorySpace::kHost});
  ASSERT_TRUE(alone.ok());
  ASSERT_TRUE(run_attention(**backend, *alone, limits, ExecContext{}).ok());
  EXPECT_EQ(out, out_alone) << "the forward of a forward+backward differs from a forward alone";

  EXPECT_EQ(read_ok(dir.path("o.npy")).data, out);
  const std::pair<const char*, const std::vector<uint8_t>*> grads_expected[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  for (const auto& [name, want] : grads_expected) {
    const NpyArray got = read_ok(dir.path(std::string(name) + ".npy"));
    EXPECT_EQ(got.dtype, grad_dtype) << name;
    EXPECT_EQ(got.shape, std::string(name) == "dq" ? shape(o, c.batched, o.q_len, o.heads)
                                                   : shape(o, c.batched, o.kv_len, kv_heads))
        << name;
    EXPECT_TRUE(got.data == *want) << name << " differs from the in-process run";
  }

  const nlohmann::json meta = nlohmann::json::parse(testing::read_file(dir.path("meta.json")));
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

INSTANTIATE_TEST_SUITE_P(Cases, ComputeBackward, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<BackwardCliCase>& info) { return std::string(info.param.name); });

TEST(ComputeBackwardErrors, EachBadCombinationExitsWithOneLineNamingTheProblem) {
  ScratchDir dir;
  const std::vector<float> q(1 * 8 * 4 * 4, 0.5f), kv(1 * 8 * 2 * 4, 0.25f);
  ASSERT_TRUE(write_npy(dir.path("q.npy"), DType::kF32, {1, 8, 4, 4}, q.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("k.npy"), DType::kF32, {1, 8, 2, 4}, kv.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("v.npy"), DType::kF32, {1, 8, 2, 4}, kv.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("dout.npy"), DType::kF32, {1, 8, 4, 4}, q.data()).ok());
  ASSERT_TRUE(write_npy(dir.path("dout_short.npy"), DType::kF32, {1, 7, 4, 4}, q.data()).ok());
  const std::vector<uint16_t> half(q.size(), 0x3800);
  ASSERT_TRUE(write_npy(dir.path("dout_f16.npy"), DType::kF16, {1, 8, 4, 4}, half.data()).ok());
  std::vector<float> nan_dout = q;
  nan_dout[(2 * 4 + 3) * 4 + 1] = std::numeric_limits<float>::quiet_NaN();  // [b=0, n=2, h=3, d=1]
  ASSERT_TRUE(write_npy(dir.path("dout_nan.npy"), DType::kF32, {1, 8, 4, 4}, nan_dout.data()).ok());

  const std::vector<std::string> base = {"compute", "--q", dir.path("q.npy"), "--k", dir.path("k.npy"),
                                         "--v", dir.path("v.npy"), "--out", dir.path("o.npy")};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto all = [&](const std::string& dout, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = with({"--dout", dir.path(dout), "--dq", dir.path("dq.npy"), "--dk", dir.path("dk.npy"),
                                       "--dv", dir.path("dv.npy")});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  struct Bad {
    const char* what;
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Bad> cases = {
      {"dout alone", with({"--dout", dir.path("dout.npy")}),
       "the backward needs --dout, --dq, --dk and --dv together: --dout given, --dq, --dk, --dv missing"},
      {"gradients without dout", with({"--dq", dir.path("dq.npy"), "--dk", dir.path("dk.npy"), "--dv", dir.path("dv.npy")}),
       "--dq, --dk, --dv given, --dout missing"},
      {"grad dtype alone", with({"--grad-dtype", "f32"}), "--grad-dtype = 'f32' without the backward"},
      {"bad grad dtype", all("dout.npy", {"--grad-dtype", "f64"}), "grad_dtype = 'f64', expected f32, f16 or bf16"},
      {"bf16 grads without bits", all("dout.npy", {"--grad-dtype", "bf16"}), "grad_dtype = bf16 needs --bf16-bits"},
      {"dout shape", all("dout_short.npy"), "dout shape [1, 7, 4, 4], expected the shape of out [1, 8, 4, 4]"},
      {"dout dtype", all("dout_f16.npy"), "dout dtype f16, expected the dtype of out (f32)"},
      {"dout not finite", all("dout_nan.npy"), "dout has a non-finite value (nan) at [b=0, n=2, h=3, d=1]"},
      {"dq directory missing",
       with({"--dout", dir.path("dout.npy"), "--dq", dir.path("no/dq.npy"), "--dk", dir.path("dk.npy"), "--dv",
             dir.path("dv.npy")}),
       "dq = '" + dir.path("no/dq.npy") + "': directory '" + dir.path("no") + "' does not exist"},
  };
  for (const Bad& c : cases) {
    for (const char* f : {"o.npy", "dq.npy", "dk.npy", "dv.npy"}) std::remove(dir.path(f).c_str());
    const RunResult r = testing::run_plsh(c.args, dir);
    EXPECT_EQ(r.exit_code, 2) << c.what << ": " << r.err;
    ASSERT_FALSE(r.err.empty()) << c.what;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << c.what << ": not one line: " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.what << ": " << r.err;
    for (const char* f : {"o.npy", "dq.npy", "dk.npy", "dv.npy"})
      EXPECT_FALSE(testing::file_exists(dir.path(f))) << c.what << ": wrote " << f << " anyway";
  }
}

}  // namespace
}  // namespace plsh::cli
