// The fused backward (kernels/cuda/fused_backward.h and its steps,
// fused_steps.h) run on the host by HostExec, after the emulated fused
// forward: spans, row terms, the statistics pass far from the keys, the
// per-key-tile CTAs with their dK/dV accumulation and dQ atomics, against
// float64 autograd of the reference (SPEC section 8) and the CPU backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/fused_host.h"
#include "cuda/fused_plan.h"
#include "fused_cases.h"
#include "plsh/attention.h"
#include "plsh/numeric.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"

namespace plsh::cuda {
namespace {

struct Gradients {
  std::vector<uint8_t> dq, dk, dv;
  unsigned long long tiles = 0;
};

// The emulated forward into p.out and p.lse, then the emulated backward of
// dout; with stats_pass false, the far rows keep the lse2 the float32 lse
// gives them (what the backward did before the statistics pass).
Gradients emulate_backward(const AttentionParams& p, const std::vector<uint8_t>& dout, DType grad_dtype,
                           bool stats_pass = true) {
  const FusedTables t = fused_tables(p, plan_draws(p));
  FusedArgs a = fused_args(p, t, t.heads.data(), t.hashes.data());
  const int64_t tiles = fused_tiles(p.q_len, kFusedRows);
  EXPECT_TRUE(fused_forward_on_host(p.dtype, p.head_dim, a, 0, tiles));
  const int64_t rows = p.batch * p.heads * p.q_len, gsz = static_cast<int64_t>(dtype_bytes(grad_dtype));
  const int64_t dq_elems = p.batch * p.q_len * p.heads * p.head_dim,
                dkv_elems = p.batch * p.kv_len * p.kv_heads * p.head_dim;
  std::vector<float> row_d(static_cast<size_t>(rows)), row_lse2(static_cast<size_t>(rows)),
      dq_acc(static_cast<size_t>(dq_elems));
  std::vector<int32_t> spans(static_cast<size_t>(2 * p.heads * tiles));
  Gradients g;
  g.dq.assign(static_cast<size_t>(dq_elems * gsz), 0xFF);
  g.dk.assign(static_cast<size_t>(dkv_elems * gsz), 0xFF);
  g.dv.assign(g.dk.size(), 0xFF);
  a.dout = dout.data();
  a.do_bs = p.o_batch_stride, a.do_rs = p.o_row_stride, a.do_hs = p.o_head_stride;
  a.row_d = row_d.data();
  a.row_lse2_in = row_lse2.data();
  a.dq_acc = dq_acc.data();
  a.dk = g.dk.data();
  a.dv = g.dv.data();
  a.kv_heads = p.kv_heads;
  a.grad_dtype = static_cast<int32_t>(grad_dtype);
  a.spans = spans.data();
  a.tiles_done = &g.tiles;
  FusedRowTermsArgs terms;
  terms.out = p.out;
  terms.out_dtype = static_cast<int32_t>(p.out_dtype);
  terms.o_bs = p.o_batch_stride, terms.o_rs = p.o_row_stride, terms.o_hs = p.o_head_stride;
  terms.lse = p.lse;
  terms.lse_bs = p.lse_batch_stride, terms.lse_rs = p.lse_row_stride;
  terms.head_dim = p.head_dim;
  terms.row_d = row_d.data();
  terms.row_lse2 = row_lse2.data();
  HostBackwardSteps steps{p.dtype, p.head_dim, a, terms, g.dq.data()};
  if (stats_pass) {
    EXPECT_TRUE(fused_backward_steps(steps, a, spans.data(), 3));  // key tiles in 3 launches, as the device may
  } else {
    EXPECT_TRUE(steps.spans(spans.data()) && steps.row_terms() && steps.zero_dq() &&
                steps.main(0, fused_tiles(p.kv_len, kFusedKeys)) && steps.dq_out());
  }
  return g;
}

struct GradErrors {
  double dq, dk, dv;
};
GradErrors grad_errors(const Gradients& g, DType t, const std::vector<double>& dq, const std::vector<double>& dk,
                       const std::vector<double>& dv) {
  return {testing::compare(g.dq.data(), t, dq).max_rel, testing::compare(g.dk.data(), t, dk).max_rel,
          testing::compare(g.dv.data(), t, dv).max_rel};
}

std::vector<testing::AttentionCase> backward_cases() {
  std::vector<testing::AttentionCase> v;
  for (testing::AttentionCase c : testing::fused_cases()) {
    if (c.out_dtype && *c.out_dtype != c.dtype) c.grad_dtype = DType::kF32, c.out_dtype = std::nullopt;
    v.push_back(c);
  }
  return v;
}

class FusedBackwardOnHost : public ::testing::TestWithParam<testing::AttentionCase> {};

TEST_P(FusedBackwardOnHost, MatchesFloat64AutogradAndCpuBackend) {
  const testing::AttentionCase& c = GetParam();
  const AttentionOptions o = testing::fused_options(c);
  testing::Problem pr = testing::make_problem(o, 5);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  const AttentionParams& p = pr.params;
  const DType grad_dtype = c.grad_dtype.value_or(o.dtype);
  testing::GradTensors cpu_grads = testing::grad_tensors(o, grad_dtype, 6);
  const Gradients e = emulate_backward(p, cpu_grads.dout, grad_dtype);

  const testing::ReferenceGradients ref =
      testing::reference_backward(p, testing::dense_inputs(p), testing::reference_weights(p), cpu_grads.dout_values());
  const GradErrors vs_ref = grad_errors(e, grad_dtype, ref.dq, ref.dk, ref.dv);
  // The CPU backend's forward and backward on the same inputs and draws.
  testing::Problem on_cpu = testing::make_problem(testing::fused_options(c, true), 5);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  PlanLimits limits;
  limits.threads = 1;
  StatusOr<ForwardBackwardResult> run =
      run_forward_backward(*cpu, on_cpu.params, limits, cpu_grads.refs(), ExecContext{});
  ASSERT_TRUE(run.ok()) << run.status().to_string();
  const GradErrors vs_cpu = grad_errors(e, grad_dtype, cpu_grads.values(cpu_grads.dq), cpu_grads.values(cpu_grads.dk),
                                        cpu_grads.values(cpu_grads.dv));
  const double tol = testing::backward_tolerance(o.dtype, grad_dtype, 1e-5);
  std::printf(
      "%s: %llu tile products; vs float64 max_rel dq %.2e dk %.2e dv %.2e; vs cpu %.2e %.2e %.2e; tolerance %.1e\n",
      c.name.c_str(), e.tiles, vs_ref.dq, vs_ref.dk, vs_ref.dv, vs_cpu.dq, vs_cpu.dk, vs_cpu.dv, tol);
  EXPECT_LE(vs_ref.dq, tol) << "dq";
  EXPECT_LE(vs_ref.dk, tol) << "dk";
  EXPECT_LE(vs_ref.dv, tol) << "dv";
  // The CPU backend's own error far from the keys is the float32 lse's
  // (its backward reads it as given): compare with it only near the keys.
  const bool far = p.q_pos0 < p.k_pos0 || p.q_pos0 + p.q_len > p.k_pos0 + p.kv_len;
  if (!far) {
    EXPECT_LE(vs_cpu.dq, 2 * tol) << "dq vs cpu";
    EXPECT_LE(vs_cpu.dk, 2 * tol) << "dk vs cpu";
    EXPECT_LE(vs_cpu.dv, 2 * tol) << "dv vs cpu";
  }
  EXPECT_GT(e.tiles, 0u);
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedBackwardOnHost, ::testing::ValuesIn(backward_cases()), testing::CaseName());

// Queries 1e6 positions after every key, slope 0.5: their float32 lse
// (~ -5e5) is off by up to 2^-5 in its last bit, which every P of the row
// carries. With lse2 from it the gradients miss by percents; the
// statistics pass recomputes it and they meet float32's 1e-5.
TEST(FusedBackwardFar, StatisticsPassRecoversTheFloat32Accuracy) {
  const testing::AttentionCase c{
      "exact_far_f32",     1,         70, 90, 2, 1, 64, DType::kF32, Mode::kExact, false, int64_t{1000000}, 0, 0,
      LshAlgorithm::kAuto, {0.5, 0.5}};
  const AttentionOptions o = testing::options_of(c, 3);
  testing::Problem pr = testing::make_problem(o, 7);
  ASSERT_TRUE(pr.status.ok());
  const testing::GradTensors g = testing::grad_tensors(o, DType::kF32, 8);
  const testing::ReferenceGradients ref = testing::reference_backward(
      pr.params, testing::dense_inputs(pr.params), testing::reference_weights(pr.params), g.dout_values());
  const GradErrors with =
      grad_errors(emulate_backward(pr.params, g.dout, DType::kF32), DType::kF32, ref.dq, ref.dk, ref.dv);
  const GradErrors without =
      grad_errors(emulate_backward(pr.params, g.dout, DType::kF32, false), DType::kF32, ref.dq, ref.dk, ref.dv);
  std::printf("far rows: max_rel dq dk dv with the statistics pass %.2e %.2e %.2e, without %.2e %.2e %.2e\n", with.dq,
              with.dk, with.dv, without.dq, without.dk, without.dv);
  EXPECT_LE(std::max({with.dq, with.dk, with.dv}), 1e-5);
  EXPECT_GT(std::max({without.dq, without.dk, without.dv}), 1e-3) << "the far rows did not lose lse's precision";
}

}  // namespace
}  // namespace plsh::cuda
