// The CUDA backend's backward on the device, against the float64 reference
// gradients and the CPU backend's backward; its refusals, its stop on
// cancel and deadline, and that it reads the plan's draws. Every test skips,
// saying why, without a device (the host emulation in
// test_cuda_host_backward.cpp runs the same rounds everywhere).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/backward_plan.h"
#include "cuda/cuda_backend.h"
#include "cuda/workspace_slots.h"
#include "cuda_test_backend.h"
#include "fused_cases.h"
#include "gpu_cases.h"
#include "plsh/attention.h"
#include "plsh/backward.h"
#include "plsh/numeric.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh {
namespace {

using testing::AttentionCase;
using testing::grad_tensors;
using testing::GradTensors;
using testing::kAuto;
using testing::make_problem;
using testing::options_of;
using testing::Problem;

class CudaBackwardVsCpu : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CudaBackwardVsCpu, MatchesCpuBackendAndReference) {
  REQUIRE_CUDA(cuda);
  const AttentionCase& c = GetParam();
  const AttentionOptions o = options_of(c, 4321);
  const DType grad_dtype = c.grad_dtype.value_or(c.dtype);
  // The same inputs twice: one run on each backend.
  Problem on_gpu = make_problem(o, 78), on_cpu = make_problem(o, 78);
  ASSERT_TRUE(on_gpu.status.ok() && on_cpu.status.ok());
  GradTensors gpu = grad_tensors(o, grad_dtype, 79), cpu_grads = grad_tensors(o, grad_dtype, 79);
  StatusOr<ForwardBackwardResult> r =
      run_forward_backward(*cuda, on_gpu.params, PlanLimits{}, gpu.refs(), ExecContext{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->backward.backend, "cuda");
  EXPECT_GT(r->backward.flops, 0);
  EXPECT_GT(r->backward.device_workspace_bytes, 0);

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(run_forward_backward(*cpu, on_cpu.params, PlanLimits{}, cpu_grads.refs(), ExecContext{}).ok());

  const AttentionParams& p = on_gpu.params;
  const testing::ReferenceGradients ref =
      testing::reference_backward(p, testing::dense_inputs(p), testing::reference_weights(p), gpu.dout_values());
  double tol = testing::backward_tolerance(c.dtype, grad_dtype, 1e-4);
  // A query far from every key: lse's float32 rounding (test_backward.cpp).
  double max_lse = 0;
  for (float l : on_cpu.lse) max_lse = std::max(max_lse, std::fabs(static_cast<double>(l)));
  tol += 2 * max_lse * 0x1.0p-24;
  const std::pair<const char*, std::pair<const std::vector<uint8_t>*, const std::vector<double>*>> tensors[] = {
      {"dq", {&gpu.dq, &ref.dq}}, {"dk", {&gpu.dk, &ref.dk}}, {"dv", {&gpu.dv, &ref.dv}}};
  const std::vector<uint8_t>* cpu_of[] = {&cpu_grads.dq, &cpu_grads.dk, &cpu_grads.dv};
  for (int x = 0; x < 3; ++x) {
    const auto& [name, pair] = tensors[x];
    const testing::ErrorStats vs_ref = testing::compare(pair.first->data(), grad_dtype, *pair.second);
    const testing::ErrorStats vs_cpu = testing::compare(pair.first->data(), grad_dtype, cpu_grads.values(*cpu_of[x]));
    std::printf("%s %s: vs float64 max_rel %.2e, vs cpu %.2e (tolerance %.1e)\n", c.name.c_str(), name, vs_ref.max_rel,
                vs_cpu.max_rel, tol);
    EXPECT_LE(vs_ref.max_rel, tol) << name << " vs float64";
    EXPECT_LE(vs_cpu.max_rel, 2 * tol) << name << " vs cpu";
  }
}

std::vector<AttentionCase> backward_cases() {
  std::vector<AttentionCase> v = testing::every_dtype_cases("exact_causal_gqa_");
  const DType f = DType::kF32;
  v.push_back(
      {"exact_noncausal_offsets_1025_f32", 1, 97, 1025, 2, 1, 128, f, Mode::kExact, false, int64_t{5000}, 4100});
  v.push_back({"exact_decode_f32", 2, 1, 1025, 4, 4, 59, f, Mode::kExact, true});
  v.push_back({"lsh_noncausal_f32", 2, 97, 97, 8, 2, 40, f, Mode::kLsh, false, std::nullopt, 0, 7});
  v.push_back({"lsh_tail_positions_f32", 1, 70, 700, 4, 1, 64, f, Mode::kLsh, true, int64_t{123456 + 630}, 123456, 16,
               kAuto, testing::head_slopes(1.0 / 300, 0.8, 0.2, 0.04)});
  v.push_back({"exact_bf16_f32_grads", 1, 257, 257, 2, 1, 64, DType::kBF16, Mode::kExact, true, std::nullopt, 0, 16,
               kAuto, testing::head_slopes(), 0, std::nullopt, f});
  v.push_back({"exact_far_queries_f32", 1, 40, 300, 2, 1, 40, f, Mode::kExact, false, int64_t{5000}, 0, 16, kAuto,
               testing::head_slopes(0.5, 1.0 / 64)});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardVsCpu, ::testing::ValuesIn(backward_cases()), testing::CaseName());

// Under a tight budget the backward is cut into chunks too; the gradients
// do not change beyond rounding.
TEST(CudaBackwardControl, TightBudgetChunksAndStillMatches) {
  REQUIRE_CUDA_BUDGET(small, 3 << 20);
  const AttentionOptions o = options_of({"tight", 1, 300, 300, 4, 2, 64, DType::kF32, Mode::kLsh, true, std::nullopt, 0,
                                         8, LshAlgorithm::kPerSample, testing::head_slopes(0.9, 0.2, 0.03, 0.0)},
                                        4321);
  Problem on_gpu = make_problem(o, 8, false), on_cpu = make_problem(o, 8, false);
  ASSERT_TRUE(on_gpu.status.ok() && on_cpu.status.ok());
  GradTensors a = grad_tensors(o, DType::kF32, 9), b = grad_tensors(o, DType::kF32, 9);
  PlanLimits limits;
  limits.backward = true;
  StatusOr<Plan> plan = small->plan(on_gpu.params, limits);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const auto* layout = dynamic_cast<const cuda::CudaLayout*>(plan->layout.get());
  ASSERT_NE(layout, nullptr);
  ASSERT_TRUE(layout->has_backward);
  EXPECT_LT(layout->backward.work.slots, o.heads * cuda::tile_count(cuda::span_shape(on_gpu.params))) << "not chunked";
  ASSERT_TRUE(run_forward_backward(*small, on_gpu.params, PlanLimits{}, a.refs(), ExecContext{}).ok());
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(run_forward_backward(*cpu, on_cpu.params, PlanLimits{}, b.refs(), ExecContext{}).ok());
  EXPECT_LE(testing::compare(a.dq.data(), DType::kF32, b.values(b.dq)).max_rel, 2e-4);
  EXPECT_LE(testing::compare(a.dk.data(), DType::kF32, b.values(b.dk)).max_rel, 2e-4);
  EXPECT_LE(testing::compare(a.dv.data(), DType::kF32, b.values(b.dv)).max_rel, 2e-4);
}

// What the cuda backward refuses, each with a reason: device tensors,
// out_dtype != dtype (UNIMPLEMENTED, so "auto" picks the CPU), a plan made
// without PlanLimits::backward, another backend's plan.
TEST(CudaBackwardControl, RefusalsNameTheReason) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o = testing::shaped({1, 64, 64, 2, 0, 16}, {.mode = Mode::kExact, .estimates = false});
  StatusOr<AttentionParams> p = resolve_params(o);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(cuda->supports_backward(*p).ok()) << cuda->supports_backward(*p).to_string();
  AttentionParams device = *p;
  device.memory = MemorySpace::kDevice;
  EXPECT_EQ(cuda->supports_backward(device).code(), StatusCode::kUnimplemented);
  AttentionOptions mixed = o;
  mixed.dtype = DType::kBF16;
  mixed.out_dtype = DType::kF32;
  StatusOr<AttentionParams> pm = resolve_params(mixed);
  ASSERT_TRUE(pm.ok());
  const Status s = cuda->supports_backward(*pm);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("cpu"), std::string::npos) << s.message();
  PlanLimits limits;
  limits.backward = true;
  EXPECT_EQ(cuda->plan(*pm, limits).status().code(), StatusCode::kUnimplemented);

  Problem bound = make_problem(o, 1);
  ASSERT_TRUE(bound.status.ok());
  GradTensors g = grad_tensors(o, DType::kF32, 2);
  StatusOr<Plan> forward_only = cuda->plan(bound.params, PlanLimits{});
  ASSERT_TRUE(forward_only.ok());
  ASSERT_TRUE(testing::run_forward(*cuda, *forward_only, ExecContext{}, nullptr).ok());
  EXPECT_EQ(run_backward(*cuda, *forward_only, g.refs(), ExecContext{}).status().code(),
            StatusCode::kFailedPrecondition);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<Plan> cpu_plan = cpu->plan(bound.params, limits);
  ASSERT_TRUE(cpu_plan.ok());
  EXPECT_EQ(run_backward(*cuda, *cpu_plan, g.refs(), ExecContext{}).status().code(), StatusCode::kInvalidArgument);
}

// Cancel and deadline act while the GPU works through the rounds.
TEST(CudaBackwardControl, CancelAndDeadlineStopTheBackward) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o = testing::shaped(
      {1, 8192, 8192, 8, 0, 64}, {.dtype = DType::kBF16, .causal = true, .mode = Mode::kExact, .estimates = false});
  Problem pr = make_problem(o, 3);
  ASSERT_TRUE(pr.status.ok());
  PlanLimits limits;
  limits.backward = true;
  StatusOr<Plan> plan = cuda->plan(pr.params, limits);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_TRUE(testing::run_forward(*cuda, *plan, ExecContext{}, nullptr).ok());
  GradTensors g = grad_tensors(o, DType::kBF16, 4);

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_backward(*cuda, *plan, g.refs(), ExecContext{}).ok());
  const double full_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::atomic<bool> cancel{false};
  ExecContext ctx;
  ctx.cancel = &cancel;
  ctx.progress = [&](double) { cancel = true; };
  EXPECT_EQ(run_backward(*cuda, *plan, g.refs(), ctx).status().code(), StatusCode::kCancelled);

  ExecContext late;
  late.deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(full_s * 1e6 / 4));
  const auto t1 = std::chrono::steady_clock::now();
  const Status s = run_backward(*cuda, *plan, g.refs(), late).status();
  const double stopped_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::printf("backward %.3f s; a deadline at a quarter stopped it after %.3f s (%s)\n", full_s, stopped_s,
              s.to_string().c_str());
  if (full_s > 0.02) {
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  }
}

// The backward reads the plan's draws: tampered alike in a cuda and a cpu
// plan, the gradients still agree (and differ from the seed's).
TEST(CudaBackwardControl, ReadsThePlanDraws) {
  REQUIRE_CUDA(cuda);
  const AttentionCase c{"tamper", 1, 97, 97, 4, 4, 32, DType::kF32, Mode::kLsh, true, std::nullopt, 0, 6};
  const AttentionOptions o = options_of(c, 4321);
  // The same inputs three times: tampered on the GPU and the CPU, and as seeded.
  Problem pa = make_problem(o, 11), pb = make_problem(o, 11), ps = make_problem(o, 11);
  ASSERT_TRUE(pa.status.ok() && pb.status.ok() && ps.status.ok());
  GradTensors a = grad_tensors(o, DType::kF32, 12), b = grad_tensors(o, DType::kF32, 12),
              seeded = grad_tensors(o, DType::kF32, 12);
  PlanLimits limits;
  limits.backward = true;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<Plan> gpu_plan = cuda->plan(pa.params, limits), cpu_plan = cpu->plan(pb.params, limits),
                 seed_plan = cuda->plan(ps.params, limits);
  ASSERT_TRUE(gpu_plan.ok() && cpu_plan.ok() && seed_plan.ok());
  for (Plan* plan : {&*gpu_plan, &*cpu_plan})
    for (Draw& d : plan->draws[2]) d = Draw{d.pitch * 3, d.shift};
  // The cuda layout holds the passes made from the draws at plan time:
  // re-plan it from the tampered draws, as a server would never do but a
  // test of "the plan's draws" must.
  {
    StatusOr<cuda::CudaLayout> l = cuda::plan_layout(gpu_plan->params, gpu_plan->draws, int64_t{1} << 30);
    ASSERT_TRUE(l.ok());
    StatusOr<cuda::CudaBackwardLayout> bl = cuda::plan_backward_layout(gpu_plan->params, *l, int64_t{1} << 30);
    ASSERT_TRUE(bl.ok());
    l->backward = *bl;
    l->has_backward = true;
    gpu_plan->forward_workspace.device_bytes = l->device_bytes();
    gpu_plan->backward_workspace.device_bytes = bl->device_bytes();
    gpu_plan->layout = std::make_shared<const cuda::CudaLayout>(std::move(*l));
  }
  for (auto [backend, plan, g] : {std::tuple{cuda, &*gpu_plan, &a}, std::tuple{cpu.get(), &*cpu_plan, &b},
                                  std::tuple{cuda, &*seed_plan, &seeded}}) {
    ASSERT_TRUE(testing::run_forward(*backend, *plan, ExecContext{}, nullptr).ok());
    ASSERT_TRUE(run_backward(*backend, *plan, g->refs(), ExecContext{}).ok());
  }
  EXPECT_LE(testing::compare(a.dq.data(), DType::kF32, b.values(b.dq)).max_rel, 1e-4);
  EXPECT_LE(testing::compare(a.dk.data(), DType::kF32, b.values(b.dk)).max_rel, 1e-4);
  EXPECT_GT(testing::compare(a.dq.data(), DType::kF32, seeded.values(seeded.dq)).max_rel, 1e-3);
}

}  // namespace
}  // namespace plsh
