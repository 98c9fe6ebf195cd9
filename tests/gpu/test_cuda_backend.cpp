// The CUDA backend against the CPU backend and the float64 reference on the
// same random inputs: every mode, f32 / bf16 / f16, odd sizes, GQA, causal
// and not, position offsets, host and device memory. Label `gpu`; without a
// device every test skips and says why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda_test_backend.h"
#include "gpu_cases.h"
#include "log_reference.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"
#include "plsh/params.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"
#include "status_assert.h"

namespace plsh {
namespace {

using testing::AttentionCase;
using testing::compare;
using testing::ErrorStats;
using testing::kAuto;
using testing::make_problem;
using testing::options_of;
using testing::Problem;

// Tolerances on max |a - b| / max |b| and relative L2, by dtype. f32: fp32
// GEMMs (no TF32) and expf leave ~1e-6; 1e-4 leaves room for long sums.
// bf16 / f16: the inputs are equal on both sides, but the probabilities fed
// to the second GEMM and the output are each rounded once to 8 (11)
// significant bits, at most 2^-9 (2^-12) relative each: two roundings of at
// most 3.9e-3 (4.9e-4) against the largest output, so 1e-2 (2e-3) with
// room for the sums.
double tolerance(DType t) { return t == DType::kF32 ? 1e-4 : t == DType::kBF16 ? 1e-2 : 2e-3; }

// lse = m + log(sum of rounded probabilities): a relative error of at most
// one rounding (2^-9 bf16, 2^-12 f16) in the sum is that much, absolute, in
// the log.
double lse_tolerance(DType t) { return t == DType::kF32 ? 1e-5 : t == DType::kBF16 ? 4e-3 : 5e-4; }

class CudaVsCpu : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CudaVsCpu, MatchesCpuBackendAndReference) {
  REQUIRE_CUDA(cuda);
  const AttentionCase& c = GetParam();
  // The same inputs twice: one run on each backend.
  Problem gpu = make_problem(options_of(c, 1234), 77), on_cpu = make_problem(options_of(c, 1234), 77);
  ASSERT_TRUE(gpu.status.ok() && on_cpu.status.ok());
  const std::vector<float>& lse_gpu = gpu.lse;
  const std::vector<float>& lse_cpu = on_cpu.lse;
  const size_t rows = lse_gpu.size();
  // Poison: every element must be written.
  std::fill(gpu.out.begin(), gpu.out.end(), 0xFF);

  ForwardStats stats;
  const Status s = testing::plan_and_forward(*cuda, gpu.params, ExecContext{}, &stats);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_GT(stats.flops, 0);

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(testing::plan_and_forward(*cpu, on_cpu.params, ExecContext{}, nullptr).ok());

  // The bias in the log domain: exact for queries far from every key too.
  const testing::ReferenceOutput ref = testing::log_domain_reference(gpu.params);
  const double tol = tolerance(c.dtype);
  const ErrorStats vs_ref = compare(gpu.out.data(), c.dtype, ref.out);
  const ErrorStats cpu_vs_ref = compare(on_cpu.out.data(), c.dtype, ref.out);
  const ErrorStats vs_cpu = compare(gpu.out.data(), c.dtype, testing::to_doubles(on_cpu.out, c.dtype));
  EXPECT_LE(vs_ref.max_rel, tol) << "cuda vs float64 reference (cpu backend: " << cpu_vs_ref.max_rel << ")";
  EXPECT_LE(vs_cpu.max_rel, c.dtype == DType::kF32 ? tol : 2 * tol) << "cuda vs cpu backend";
  EXPECT_LE(vs_ref.rel_l2, tol);

  double lse_err = 0;
  for (size_t i = 0; i < rows; ++i) {
    ASSERT_TRUE(std::isfinite(lse_gpu[i])) << "lse row " << i;
    lse_err = std::max(lse_err, std::fabs(lse_gpu[i] - ref.lse[i]) / std::max(1.0, std::fabs(ref.lse[i])));
    EXPECT_NEAR(lse_gpu[i], lse_cpu[i],
                2 * lse_tolerance(c.dtype) * std::max(1.0, std::fabs(static_cast<double>(lse_cpu[i]))))
        << "row " << i;
  }
  EXPECT_LE(lse_err, lse_tolerance(c.dtype));
}

std::vector<AttentionCase> forward_cases() {
  std::vector<AttentionCase> v = testing::every_dtype_cases("exact_causal_");
  const std::vector<double> mixed = {0.9, 0.31, 0.05, 0.0};  // sigma 1.1 .. 20, and no bias
  // f32: odd sizes, offsets, non-causal, multi-chunk spans, decode-like tails.
  const DType f = DType::kF32;
  v.push_back({"exact_noncausal_offsets_f32", 1, 33, 1025, 2, 1, 128, f, Mode::kExact, false, int64_t{5000}, 4100});
  v.push_back({"exact_causal_decode_f32", 2, 1, 1025, 4, 4, 59, f, Mode::kExact, true});
  v.push_back({"exact_one_row_f32", 1, 1, 1, 1, 1, 40, f, Mode::kExact, true});
  v.push_back({"lsh_noncausal_f32", 2, 97, 97, 8, 2, 40, f, Mode::kLsh, false, std::nullopt, 0, 7});
  v.push_back({"lsh_tail_positions_f32", 1, 70, 700, 4, 1, 64, f, Mode::kLsh, true, int64_t{123456 + 630}, 123456, 16,
               kAuto, testing::head_slopes(1.0 / 300, 0.8, 0.2, 0.04)});
  // The backend reads plan.draws, whichever sampler made them.
  v.push_back({"lsh_ash_causal_f32", 1, 300, 300, 4, 2, 64, f, Mode::kLsh, true, std::nullopt, 0, 64, kAuto,
               testing::head_slopes(), 0, std::nullopt, std::nullopt, Sampling::kAsh});
  v.push_back({"lsh_stratified_noncausal_f32", 1, 97, 97, 4, 4, 40, f, Mode::kLsh, false, std::nullopt, 0, 16, kAuto,
               testing::head_slopes(), 0, std::nullopt, std::nullopt, Sampling::kStratified});
  v.push_back({"lsh_wide_pitch_f32", 1, 600, 600, 2, 2, 128, f, Mode::kLsh, false, std::nullopt, 0, 4, kAuto,
               testing::head_slopes(1.0 / 400, 1.0 / 150)});
  v.push_back(
      {"window_fixed_width_f32", 1, 257, 300, 2, 1, 64, f, Mode::kWindow, false, std::nullopt, 0, 0, kAuto, {}, 17});
  v.push_back({"window_wide_f32", 1, 200, 1100, 2, 2, 40, f, Mode::kWindow, true, std::nullopt, 0, 0, kAuto, {}, 700});
  // Head rows that are not 16-byte multiples (bf16/f16 D = 20: 40 bytes;
  // f32 D = 59): host tensors are staged with padded rows (issue 15).
  v.push_back({"exact_causal_d20_bf16", 2, 97, 97, 4, 2, 20, DType::kBF16, Mode::kExact, true});
  v.push_back(
      {"lsh_causal_d20_f16", 1, 130, 130, 4, 4, 20, DType::kF16, Mode::kLsh, true, std::nullopt, 0, 8, kAuto, mixed});
  v.push_back({"window_d59_f32", 1, 129, 129, 3, 1, 59, f, Mode::kWindow, false});
  // Queries far from every key (shards of a long sequence): the logits are
  // relative to the nearest key and lse adds the offset back (issue 15).
  v.push_back({"exact_far_queries_causal_f32", 1, 40, 300, 2, 1, 40, f, Mode::kExact, true, int64_t{1000000}, 0, 0,
               kAuto, testing::head_slopes(0.5, 1.0 / 64)});
  v.push_back({"exact_queries_before_keys_f32", 1, 40, 300, 2, 2, 64, f, Mode::kExact, false, int64_t{-200000}, 0, 0,
               kAuto, testing::head_slopes(0.5, 0.125)});
  v.push_back({"exact_shard_at_65536_f32", 1, 64, 4096, 2, 1, 64, f, Mode::kExact, true, int64_t{65536}, 0, 0, kAuto,
               testing::head_slopes(0.5, 1.0 / 16)});
  v.push_back({"exact_shard_at_65536_bf16", 1, 64, 4096, 2, 1, 64, DType::kBF16, Mode::kExact, true, int64_t{65536}, 0,
               0, kAuto, testing::head_slopes(0.5, 1.0 / 16)});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaVsCpu, ::testing::ValuesIn(forward_cases()), testing::CaseName());

// The lsh masks on the device put every position in the same bin as
// bin_of on the host: the same draws, bit for bit.
TEST(CudaBins, DeviceBinsEqualHostBinOf) {
  REQUIRE_CUDA(cuda);
  (void)cuda;
  std::mt19937_64 rng(5);
  std::vector<int64_t> positions;
  for (int i = 0; i < 4096; ++i) positions.push_back(static_cast<int64_t>(rng() % 2000000) - 1000000);
  for (int i = 0; i < 256; ++i) positions.push_back((int64_t{1} << 50) + static_cast<int64_t>(rng() % 100000));
  for (int64_t k = 0; k < 48; ++k) {
    const Draw d = draw_hash(2024, k % 5, k, k % 3 == 0 ? 1.19 : k % 3 == 1 ? 16.0 : 256.0);
    ASSERT_OK_AND_ASSIGN(std::vector<int64_t> bins, cuda::device_bins(d, positions));
    for (size_t i = 0; i < positions.size(); ++i)
      ASSERT_EQ(bins[i], bin_of(positions[i], d)) << "position " << positions[i] << " pitch " << d.pitch;
  }
}

// Device tensors in, device tensors out: the same output as host tensors.
TEST(CudaMemory, DeviceTensorsGiveTheHostResult) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o =
      testing::shaped({1, 150, 150, 4, 2, 64},
                      {.dtype = DType::kBF16, .causal = true, .mode = Mode::kLsh, .samples = 8, .estimates = false});
  Problem host = make_problem(o, 3, false);
  ASSERT_TRUE(host.status.ok());
  ASSERT_TRUE(testing::plan_and_forward(*cuda, host.params, ExecContext{}, nullptr).ok());
  const testing::RandomTensors& t = host.qkv;
  const std::vector<uint8_t>& out_host = host.out;

  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dq, t.q.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dk, t.k.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dv, t.v.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, out_host.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dq, t.q.data(), t.q.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk, t.k.data(), t.k.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv, t.v.data(), t.v.size(), cudaMemcpyHostToDevice), cudaSuccess);
  StatusOr<AttentionParams> pd = make_params(o, {dq, dk, dv, dout, nullptr, MemorySpace::kDevice});
  ASSERT_TRUE(pd.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ExecContext ctx;
  ctx.stream = stream;
  const Status s = testing::plan_and_forward(*cuda, *pd, ctx, nullptr);
  std::vector<uint8_t> out_dev(out_host.size());
  ASSERT_EQ(cudaMemcpy(out_dev.data(), dout, out_dev.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaStreamDestroy(stream);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  ASSERT_TRUE(s.ok()) << s.to_string();
  // Same plan and kernels; only cuBLAS's choice of algorithm could differ.
  EXPECT_LE(compare(out_dev.data(), o.dtype, testing::to_doubles(out_host, o.dtype)).max_rel, tolerance(o.dtype) / 4);

  // Host pointers under memory = device are refused, not dereferenced.
  StatusOr<AttentionParams> bad =
      make_params(o, {t.q.data(), t.k.data(), t.v.data(), host.out.data(), nullptr, MemorySpace::kDevice});
  ASSERT_TRUE(bad.ok());
  const Status refused = testing::plan_and_forward(*cuda, *bad, ExecContext{}, nullptr);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
}

TEST(CudaControl, CancelStopsTheWork) {
  REQUIRE_CUDA(cuda);
  Problem pr = make_problem(
      {.q_len = 256, .kv_len = 256, .heads = 2, .head_dim = 64, .mode = Mode::kExact, .estimates = false}, 4, false);
  ASSERT_TRUE(pr.status.ok());
  std::atomic<bool> cancel{true};
  ExecContext ctx;
  ctx.cancel = &cancel;
  EXPECT_EQ(testing::plan_and_forward(*cuda, pr.params, ctx, nullptr).code(), StatusCode::kCancelled);
}

// Banded lsh runs on the fused kernel (test_cuda_fused.cpp); a shape it is
// not built for (head_dim 8) is refused, saying why, not sent elsewhere.
TEST(CudaControl, BandedOutsideTheFusedKernelIsRefusedWithAReason) {
  REQUIRE_CUDA(cuda);
  Problem pr =
      make_problem(testing::shaped({1, 16, 16, 1, 0, 8},
                                   {.mode = Mode::kLsh, .lsh_algorithm = LshAlgorithm::kBanded, .estimates = false}),
                   4, false);
  ASSERT_TRUE(pr.status.ok());
  const Status s = cuda->supports(pr.params);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("lsh_algorithm"), std::string::npos);
  EXPECT_NE(s.message().find("head_dim"), std::string::npos) << s.message();
}

// Under a tight budget the cuBLAS pipeline's work is cut into chunks of
// lanes and tiles; the output must not change beyond rounding.
TEST(CudaControl, TightBudgetChunksAndStillMatches) {
  const int64_t budget = 1536 * 1024;  // staging ~0.6 MB; leaves room for about 5 tile slots
  REQUIRE_CUDA_BUDGET(small, budget);
  Problem pr = make_problem(testing::shaped({1, 300, 300, 4, 2, 64}, {.dtype = DType::kBF16,
                                                                      .causal = true,
                                                                      .slopes = {0.9, 0.2, 0.03, 0.0},
                                                                      .mode = Mode::kLsh,
                                                                      .samples = 8,
                                                                      .lsh_algorithm = LshAlgorithm::kPerSample,
                                                                      .estimates = false}),
                            8, false);
  ASSERT_TRUE(pr.status.ok());
  ForwardStats stats;
  const Status s = testing::plan_and_forward(*small, pr.params, ExecContext{}, &stats);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_LE(stats.workspace.device_bytes, budget);
  const testing::ReferenceOutput ref = testing::reference_attention(pr.params);
  EXPECT_LE(compare(pr.out.data(), pr.params.dtype, ref.out).max_rel, tolerance(pr.params.dtype));
}

// The workspace tests' request: exact, causal, bf16, without estimates.
AttentionOptions exact_bf16(int64_t n, int64_t heads, int64_t head_dim) {
  return testing::shaped({1, n, n, heads, 0, head_dim},
                         {.dtype = DType::kBF16, .causal = true, .mode = Mode::kExact, .estimates = false});
}

// o's plan on the backend, within limits.
StatusOr<Plan> plan_of(Backend& backend, const AttentionOptions& o, const PlanLimits& limits) {
  StatusOr<AttentionParams> p = resolve_params(o);
  if (!p.ok()) return p.status();
  return backend.plan(*p, limits);
}

// Without a share from the caller a request plans for at most half the pool,
// so a second one can run beside it; with a share, at most that; and the
// bytes forward reports are what the plan charged (issue 15). head_dim 40:
// the cuBLAS pipeline, whose work buffer grows into its share.
TEST(CudaWorkspace, DefaultShareIsHalfThePool) {
  const int64_t budget = int64_t{256} << 20;
  REQUIRE_CUDA_BUDGET(backend, budget);
  const AttentionOptions o = exact_bf16(8192, 8, 40);
  ASSERT_OK_AND_ASSIGN(Plan half, plan_of(*backend, o, PlanLimits{}));
  EXPECT_LE(half.forward_workspace.device_bytes, budget / 2);
  EXPECT_GT(half.forward_workspace.device_bytes, budget / 4) << "the work buffer fills its share";
  PlanLimits share;
  share.device_bytes = int64_t{64} << 20;
  ASSERT_OK_AND_ASSIGN(Plan shared, plan_of(*backend, o, share));
  EXPECT_LE(shared.forward_workspace.device_bytes, share.device_bytes);

  const testing::RandomTensors t = testing::random_qkv(o, 12);
  std::vector<uint8_t> out = testing::output_buffer(o);
  Plan run = half;
  ASSERT_TRUE(
      bind_tensors(&run.params, {t.q.data(), t.k.data(), t.v.data(), out.data(), nullptr, MemorySpace::kHost}).ok());
  ForwardStats stats;
  const Status s = testing::run_forward(*backend, run, ExecContext{}, &stats);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(stats.workspace.device_bytes, half.forward_workspace.device_bytes);
  const std::optional<DeviceMemory> mem = backend->device_memory();
  ASSERT_TRUE(mem.has_value());
  EXPECT_EQ(mem->budget_bytes, budget);
}

// The admission's device bytes (Backend::allocate_device) are held against
// the pool's budget from the header on: a second hold past the budget is
// RESOURCE_EXHAUSTED, the bytes come back when the hold goes, and a forward
// given the hold runs inside it without reserving again (issue 22).
TEST(CudaWorkspace, AllocateDeviceHoldsThePoolForTheRequest) {
  const int64_t budget = int64_t{64} << 20;
  REQUIRE_CUDA_BUDGET(backend, budget);
  const AttentionOptions o = exact_bf16(512, 4, 64);
  ASSERT_OK_AND_ASSIGN(Plan plan, plan_of(*backend, o, PlanLimits{}));
  const int64_t bytes = plan.workspace().device_bytes;
  ASSERT_GT(bytes, 0);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<void> hold, backend->allocate_device(bytes));
  EXPECT_EQ(backend->allocate_device(budget - bytes + 1).status().code(), StatusCode::kResourceExhausted);

  const testing::RandomTensors t = testing::random_qkv(o, 21);
  std::vector<uint8_t> out = testing::output_buffer(o);
  Plan run = plan;
  ASSERT_TRUE(
      bind_tensors(&run.params, {t.q.data(), t.k.data(), t.v.data(), out.data(), nullptr, MemorySpace::kHost}).ok());
  StatusOr<HostWorkspace> host = HostWorkspace::allocate(run.workspace().host_bytes);
  ASSERT_TRUE(host.ok());
  // The rest of the pool held elsewhere: a forward that reserved again
  // would be refused; this one runs in the caller's hold.
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<void> rest, backend->allocate_device(budget - bytes));
  WorkspaceRef w = host->ref();
  w.device = hold.get();
  w.device_bytes = bytes;
  const Status s = backend->forward(run, w, ExecContext{}, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const testing::ReferenceOutput ref = testing::reference_attention(run.params);
  EXPECT_LE(compare(out.data(), o.dtype, ref.out).max_rel, tolerance(o.dtype));
  rest.reset();
  hold.reset();
  EXPECT_TRUE(backend->allocate_device(budget).ok()) << "every hold given back";
}

// Device tensors whose rows are not 16-byte multiples are refused before
// any GEMM sees them (a misaligned access would lose the context).
TEST(CudaMemory, UnalignedDeviceTensorsAreRefused) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o =
      testing::shaped({1, 64, 64, 4, 0, 20}, {.dtype = DType::kBF16, .mode = Mode::kExact, .estimates = false});
  const size_t bytes = static_cast<size_t>(o.q_len * o.heads * o.head_dim * 2);
  void* d[4] = {};
  for (void*& b : d) ASSERT_EQ(cudaMalloc(&b, bytes), cudaSuccess);
  StatusOr<AttentionParams> p = make_params(o, {d[0], d[1], d[2], d[3], nullptr, MemorySpace::kDevice});
  ASSERT_TRUE(p.ok());
  const Status s = testing::plan_and_forward(*cuda, *p, ExecContext{}, nullptr);
  for (void* b : d) cudaFree(b);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.to_string();
  EXPECT_NE(s.message().find("16"), std::string::npos) << s.message();
  EXPECT_TRUE(cuda->supports(*p).code() == StatusCode::kUnimplemented);
}

// Rounds of more than 65535 slots (64 heads x 1024 tiles) go to cuBLAS as
// several batched calls; the result is the CPU backend's.
TEST(CudaLarge, RoundsAbove65535SlotsMatchTheCpu) {
  REQUIRE_CUDA(cuda);
  const AttentionOptions o = testing::shaped({1, 65536, 32, 64, 8, 8}, {.dtype = DType::kF32,
                                                                        .causal = false,
                                                                        .q_pos0 = 0,
                                                                        .mode = Mode::kExact,
                                                                        .estimates = false,
                                                                        .check_finite = false});
  Problem gpu = make_problem(o, 21, false), on_cpu = make_problem(o, 21, false);
  ASSERT_TRUE(gpu.status.ok() && on_cpu.status.ok());
  ASSERT_OK_AND_ASSIGN(Plan plan, cuda->plan(gpu.params, PlanLimits{}));
  ASSERT_TRUE(testing::run_forward(*cuda, plan, ExecContext{}, nullptr).ok());
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(testing::plan_and_forward(*cpu, on_cpu.params, ExecContext{}, nullptr).ok());
  EXPECT_LE(compare(gpu.out.data(), o.dtype, testing::to_doubles(on_cpu.out, o.dtype)).max_rel, 1e-4);
}

// Cancel, deadline and progress follow the GPU (issue 15): a request of
// about a second on an H200 is stopped a quarter of the way in and returns
// within another quarter, and no progress report runs ahead of the clock by
// more than a factor of two. Before, the host queued everything in
// milliseconds, checked the stop only while queueing, reported progress as
// it queued, and the request ran to the end with OK.
struct TimedRun {
  Status status;
  double seconds = 0;
  std::vector<std::pair<double, double>> progress;  // (seconds, fraction)
};

TimedRun timed_forward(Backend& cuda, const Plan& plan, const std::atomic<bool>* cancel,
                       std::chrono::steady_clock::time_point deadline) {
  TimedRun run;
  std::mutex mu;
  const auto t0 = std::chrono::steady_clock::now();
  ExecContext ctx;
  ctx.cancel = cancel;
  ctx.deadline = deadline;
  ctx.progress = [&](double f) {
    std::lock_guard<std::mutex> lock(mu);
    run.progress.emplace_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), f);
  };
  run.status = testing::run_forward(cuda, plan, ctx, nullptr);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

TEST(CudaControl, CancelAndDeadlineActWhileTheGpuWorks) {
  REQUIRE_CUDA(cuda);
  // fp32 GEMMs without TF32: the slow path, about 9 TFLOP here.
  Problem pr = make_problem(
      testing::shaped(
          {1, 32768, 32768, 32, 0, 128},
          {.dtype = DType::kF32, .causal = true, .mode = Mode::kExact, .estimates = false, .check_finite = false}),
      13, false);
  ASSERT_TRUE(pr.status.ok());
  ASSERT_OK_AND_ASSIGN(Plan plan, cuda->plan(pr.params, PlanLimits{}));

  const TimedRun full = timed_forward(*cuda, plan, nullptr, std::chrono::steady_clock::time_point::max());
  ASSERT_TRUE(full.status.ok()) << full.status.to_string();
  std::printf("uncancelled: %.3f s, %zu progress reports\n", full.seconds, full.progress.size());
  ASSERT_GT(full.seconds, 0.1) << "too fast to measure a cancel against";
  ASSERT_FALSE(full.progress.empty());
  EXPECT_DOUBLE_EQ(full.progress.back().second, 1.0);
  for (const auto& [at, f] : full.progress)
    EXPECT_LE(f, 2.0 * at / full.seconds + 0.05)
        << "progress " << f << " reported at " << at << " s of " << full.seconds;

  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(full.seconds / 4));
    cancel.store(true);
  });
  const TimedRun cancelled = timed_forward(*cuda, plan, &cancel, std::chrono::steady_clock::time_point::max());
  canceller.join();
  EXPECT_EQ(cancelled.status.code(), StatusCode::kCancelled) << cancelled.status.to_string();
  EXPECT_LT(cancelled.seconds, full.seconds / 2) << "cancelled at " << full.seconds / 4 << " s";

  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(full.seconds / 4));
  const TimedRun late = timed_forward(*cuda, plan, nullptr, deadline);
  EXPECT_EQ(late.status.code(), StatusCode::kDeadlineExceeded) << late.status.to_string();
  EXPECT_LT(late.seconds, full.seconds / 2);

  // The backend serves again after a stop.
  EXPECT_TRUE(timed_forward(*cuda, plan, nullptr, std::chrono::steady_clock::time_point::max()).status.ok());
}

// A budget too small for one tile is refused before any memory is touched.
TEST(CudaControl, TinyBudgetIsResourceExhausted) {
  REQUIRE_CUDA_BUDGET(small, 4096);
  Problem pr = make_problem(
      {.q_len = 128, .kv_len = 128, .heads = 1, .head_dim = 64, .mode = Mode::kExact, .estimates = false}, 4, false);
  ASSERT_TRUE(pr.status.ok());
  EXPECT_EQ(testing::plan_and_forward(*small, pr.params, ExecContext{}, nullptr).code(),
            StatusCode::kResourceExhausted);
}

// A recoverable error an earlier call left on the worker thread (here an
// allocation far beyond the device) must not fail the next request: the
// runtime keeps it as the thread's last error, which the first launch check
// used to read as its own (issue 15).
TEST(CudaErrors, StaleRecoverableErrorDoesNotFailTheNextRequest) {
  REQUIRE_CUDA(cuda);
  void* huge = nullptr;
  ASSERT_EQ(cudaMalloc(&huge, size_t{1} << 60), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaPeekAtLastError(), cudaErrorMemoryAllocation) << "the runtime keeps it as the last error";
  Problem pr = make_problem(
      testing::shaped({1, 100, 100, 2, 0, 64}, {.causal = true, .mode = Mode::kExact, .estimates = false}), 6, false);
  ASSERT_TRUE(pr.status.ok());
  const Status s = testing::plan_and_forward(*cuda, pr.params, ExecContext{}, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(cuda->supports(pr.params).ok());
  EXPECT_LE(compare(pr.out.data(), pr.params.dtype, testing::reference_attention(pr.params).out).max_rel,
            tolerance(pr.params.dtype));
}

// A real device fault (a GEMM reading far past a 4 KiB buffer that was
// passed off as a [1, 65536, 32, 128] tensor) loses the context for the
// whole process; the backend must then refuse work with UNAVAILABLE naming
// the error (so the registry's "auto" picks the CPU), and the process must
// still exit cleanly. Run in a child process: the fault would break every
// later test of this one.
void sticky_fault_child() {
  std::string why;
  std::unique_ptr<Backend> cuda = cuda::make_cuda_backend(&why);
  if (cuda == nullptr) std::exit(3);
  const AttentionOptions o =
      testing::shaped({1, 65536, 65536, 32, 0, 128}, {.dtype = DType::kBF16, .mode = Mode::kExact, .estimates = false});
  void* small[4] = {};
  for (void*& b : small)
    if (cudaMalloc(&b, 4096) != cudaSuccess) std::exit(4);
  StatusOr<AttentionParams> p = make_params(o, {small[0], small[1], small[2], small[3], nullptr, MemorySpace::kDevice});
  if (!p.ok()) std::exit(5);
  const Status s = testing::plan_and_forward(*cuda, *p, ExecContext{}, nullptr);
  std::fprintf(stderr, "forward: %s\n", s.to_string().c_str());
  const cudaError_t sync = cudaDeviceSynchronize();
  if (!cuda::is_sticky_error(sync)) {
    std::fprintf(stderr, "no sticky error (%s): the out-of-bounds reads met mapped memory\n", cudaGetErrorName(sync));
    std::exit(6);
  }
  const Status refused = cuda->supports(*p);
  std::fprintf(stderr, "supports after the fault: %s; device: %s\n", refused.to_string().c_str(),
               cuda->device().c_str());
  const bool ok = !s.ok() && refused.code() == StatusCode::kUnavailable &&
                  refused.message().find(cudaGetErrorName(sync)) != std::string::npos &&
                  cuda->device().find("unusable") != std::string::npos;
  std::exit(ok ? 0 : 1);  // exit() runs the static destructors, as the server's does
}

TEST(CudaErrorsDeathTest, StickyFaultMakesTheBackendRefuseWorkAndExitCleanly) {
  REQUIRE_CUDA(cuda);
  (void)cuda;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(sticky_fault_child(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace plsh
