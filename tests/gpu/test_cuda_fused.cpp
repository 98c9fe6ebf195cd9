// The fused kernels on the device (label gpu; every test skips, saying
// why, without one): the cases of fused_cases.h through the CUDA backend,
// forward and backward, host and device tensors, against the float64
// reference, and against the host emulation of the same kernels
// (fused_host.h), which must agree to rounding: what the emulation tests
// (test_cuda_host_fused*.cpp) check everywhere then holds on the hardware.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/fused_host.h"
#include "cuda/fused_plan.h"
#include "cuda/workspace_slots.h"
#include "cuda_test_backend.h"
#include "fused_cases.h"
#include "log_reference.h"
#include "plsh/attention.h"
#include "plsh/numeric.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"
#include "status_assert.h"

namespace plsh {
namespace {

using plsh::testing::shaped;
using testing::AttentionCase;

bool plan_is_fused(const Plan& plan) {
  const auto* layout = dynamic_cast<const cuda::CudaLayout*>(plan.layout.get());
  return layout != nullptr && layout->fused != nullptr;
}

// The host emulation's out (as doubles) and lse for p's inputs.
std::pair<std::vector<double>, std::vector<float>> emulated(const AttentionParams& p) {
  const cuda::FusedTables t = cuda::fused_tables(p, plan_draws(p));
  std::vector<uint8_t> out(static_cast<size_t>(p.batch * p.q_len * p.heads * p.head_dim) * dtype_bytes(p.out_dtype));
  std::vector<float> lse(static_cast<size_t>(p.batch * p.q_len * p.heads));
  AttentionParams q = p;
  q.out = out.data();
  q.lse = lse.data();
  const cuda::FusedArgs a = cuda::fused_args(q, t, t.heads.data(), t.hashes.data());
  EXPECT_TRUE(cuda::fused_forward_on_host(p.dtype, p.head_dim, a, 0, cuda::fused_tiles(p.q_len, cuda::kFusedRows)));
  return {testing::to_doubles(out, p.out_dtype), std::move(lse)};
}

class FusedOnDevice : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(FusedOnDevice, ForwardMatchesReferenceAndHostEmulation) {
  REQUIRE_CUDA(cuda);
  const AttentionCase& c = GetParam();
  testing::Problem pr = testing::make_problem(testing::options_of(c, 99), 5);
  ASSERT_TRUE(pr.status.ok());
  std::fill(pr.out.begin(), pr.out.end(), 0xFF);
  ASSERT_OK_AND_ASSIGN(Plan plan, cuda->plan(pr.params, PlanLimits{}));
  ASSERT_TRUE(plan_is_fused(plan)) << "the fused path did not take " << c.name;
  ForwardStats stats;
  const Status s = testing::run_forward(*cuda, plan, ExecContext{}, &stats);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_GT(stats.flops, 0);

  const std::vector<double> out = testing::to_doubles(pr.out, pr.params.out_dtype);
  const testing::ReferenceOutput ref = testing::log_domain_reference(pr.params);
  const testing::FusedErrors vs_ref = testing::fused_errors(out, pr.lse, ref.out, ref.lse);
  const auto [emu_out, emu_lse] = emulated(pr.params);
  const std::vector<double> emu_lse_d(emu_lse.begin(), emu_lse.end());
  const testing::FusedErrors vs_emu = testing::fused_errors(out, pr.lse, emu_out, emu_lse_d);
  const testing::FusedTolerance tol = testing::fused_tolerance(pr.params.dtype, pr.params.out_dtype);
  std::printf("%s: %.3g FLOP; vs float64 max_rel %.3g lse %.3g; vs host emulation max_rel %.3g lse %.3g\n",
              c.name.c_str(), stats.flops, vs_ref.max_rel, vs_ref.lse, vs_emu.max_rel, vs_emu.lse);
  EXPECT_EQ(vs_ref.unwritten, 0);
  EXPECT_LE(vs_ref.max_rel, tol.out);
  EXPECT_LE(vs_ref.lse, tol.lse);
  // The same algorithm in the same order: only the tensor cores' sums (and
  // so an output's last bit) may differ from the emulation's.
  EXPECT_LE(vs_emu.max_rel, tol.out / 2) << "device vs host emulation";
  EXPECT_LE(vs_emu.lse, tol.lse / 2) << "device vs host emulation";
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedOnDevice, ::testing::ValuesIn(testing::fused_cases()), testing::CaseName());

class FusedBackwardOnDevice : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(FusedBackwardOnDevice, MatchesFloat64Autograd) {
  REQUIRE_CUDA(cuda);
  AttentionCase c = GetParam();
  if (c.out_dtype && *c.out_dtype != c.dtype) c.grad_dtype = DType::kF32, c.out_dtype = std::nullopt;
  const AttentionOptions o = testing::options_of(c, 99);
  testing::Problem pr = testing::make_problem(o, 5);
  ASSERT_TRUE(pr.status.ok());
  const DType grad_dtype = c.grad_dtype.value_or(o.dtype);
  testing::GradTensors g = testing::grad_tensors(o, grad_dtype, 6);
  PlanLimits limits;
  limits.backward = true;
  ASSERT_OK_AND_ASSIGN(Plan plan, plan_attention(*cuda, pr.params, limits));
  ASSERT_TRUE(plan_is_fused(plan));
  ASSERT_OK_AND_ASSIGN(AttentionResult fwd, run_attention(*cuda, plan, ExecContext{}));
  ASSERT_OK_AND_ASSIGN(BackwardResult bwd, run_backward(*cuda, plan, g.refs(), ExecContext{}));
  const testing::ReferenceGradients ref = testing::reference_backward(
      pr.params, testing::dense_inputs(pr.params), testing::reference_weights(pr.params), g.dout_values());
  const double eq = testing::compare(g.dq.data(), grad_dtype, ref.dq).max_rel;
  const double ek = testing::compare(g.dk.data(), grad_dtype, ref.dk).max_rel;
  const double ev = testing::compare(g.dv.data(), grad_dtype, ref.dv).max_rel;
  const double tol = testing::backward_tolerance(o.dtype, grad_dtype, 1e-4);
  std::printf("%s: backward %.3g FLOP; vs float64 max_rel dq %.2e dk %.2e dv %.2e; tolerance %.1e\n", c.name.c_str(),
              bwd.flops, eq, ek, ev, tol);
  EXPECT_LE(eq, tol) << "dq";
  EXPECT_LE(ek, tol) << "dk";
  EXPECT_LE(ev, tol) << "dv";
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedBackwardOnDevice, ::testing::ValuesIn(testing::fused_cases()),
                         testing::CaseName());

// Device tensors in and out, forward and backward: the host tensors' results.
TEST(FusedMemory, DeviceTensorsGiveTheHostResults) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o =
      shaped({1, 200, 200, 4, 2, 128},
             {.dtype = DType::kBF16, .causal = true, .mode = Mode::kLsh, .samples = 16, .estimates = false});
  testing::Problem host = testing::make_problem(o, 3);
  ASSERT_TRUE(host.status.ok());
  testing::GradTensors hg = testing::grad_tensors(o, DType::kBF16, 4);
  PlanLimits limits;
  limits.backward = true;
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult on_host,
                       run_forward_backward(*cuda, host.params, limits, hg.refs(), ExecContext{}));

  auto to_device = [](const std::vector<uint8_t>& h) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, h.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  };
  auto to_host = [](const void* d, size_t n) {
    std::vector<uint8_t> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  };
  const testing::RandomTensors& t = host.qkv;
  void* q = to_device(t.q);
  void* k = to_device(t.k);
  void* v = to_device(t.v);
  void* out = to_device(host.out);
  void* dout = to_device(hg.dout);
  void *dq = to_device(hg.dq), *dk = to_device(hg.dk), *dv = to_device(hg.dv);
  float* lse = nullptr;
  ASSERT_EQ(cudaMalloc(&lse, host.lse.size() * 4), cudaSuccess);
  StatusOr<AttentionParams> pd = make_params(o, {q, k, v, out, lse, MemorySpace::kDevice});
  ASSERT_TRUE(pd.ok());
  ASSERT_OK_AND_ASSIGN(Plan plan, cuda->plan(*pd, limits));
  ASSERT_TRUE(testing::run_forward(*cuda, plan, ExecContext{}, nullptr).ok());
  GradientRefs refs{.dout = dout, .dq = dq, .dk = dk, .dv = dv, .memory = MemorySpace::kDevice};
  ASSERT_OK_AND_ASSIGN(BackwardResult b, run_backward(*cuda, plan, refs, ExecContext{}));
  const std::vector<uint8_t> out_d = to_host(out, host.out.size()), dq_d = to_host(dq, hg.dq.size()),
                             dk_d = to_host(dk, hg.dk.size()), dv_d = to_host(dv, hg.dv.size());
  for (void* x : {q, k, v, out, dout, dq, dk, dv, static_cast<void*>(lse)}) cudaFree(x);
  // The same kernels on the same inputs: bit for bit but for dQ's atomics.
  EXPECT_EQ(out_d, host.out);
  EXPECT_EQ(dk_d, hg.dk);
  EXPECT_EQ(dv_d, hg.dv);
  EXPECT_LE(testing::compare(dq_d.data(), DType::kBF16, hg.values(hg.dq)).max_rel, 1e-2);
}

// Explicitly per-sample lsh stays on the cuBLAS pipeline; auto and banded
// take the fused kernel; both compute the same function.
TEST(FusedPlan, PerSampleAndBandedAgree) {
  REQUIRE_CUDA(cuda);
  AttentionOptions o =
      shaped({1, 300, 300, 4, 0, 64},
             {.dtype = DType::kF32, .causal = true, .mode = Mode::kLsh, .samples = 16, .estimates = false});
  testing::Problem banded = testing::make_problem(o, 9, false);
  o.lsh_algorithm = LshAlgorithm::kPerSample;
  testing::Problem per_sample = testing::make_problem(o, 9, false);
  StatusOr<Plan> a = cuda->plan(banded.params, PlanLimits{}), b = cuda->plan(per_sample.params, PlanLimits{});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(plan_is_fused(*a));
  EXPECT_EQ(a->lsh_algorithm, LshAlgorithm::kBanded);
  EXPECT_FALSE(plan_is_fused(*b));
  EXPECT_EQ(b->lsh_algorithm, LshAlgorithm::kPerSample);
  ASSERT_TRUE(testing::run_forward(*cuda, *a, ExecContext{}, nullptr).ok());
  ASSERT_TRUE(testing::run_forward(*cuda, *b, ExecContext{}, nullptr).ok());
  EXPECT_LE(testing::compare(banded.out.data(), o.dtype, testing::to_doubles(per_sample.out, o.dtype)).max_rel, 1e-4);
}

}  // namespace
}  // namespace plsh
