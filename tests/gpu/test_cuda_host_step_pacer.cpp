// StepPacer (kernels/cuda/step_pacer.h) against a fake GPU: the host never
// has more than two steps queued, progress reports only what the GPU
// finished, and a cancel or a deadline stops the wait while the GPU still
// works. The backend drives the same class with CUDA events.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "cuda/step_pacer.h"
#include "plsh/backend.h"

namespace plsh::cuda {
namespace {

// Steps are recorded into event slots; the fake GPU finishes one step every
// `polls_per_step` pauses of the host (never, with 0).
struct FakeGpu {
  int polls_per_step = 3;
  int recorded = 0;            // steps recorded so far
  int finished = 0;            // steps the GPU has finished
  std::vector<int> slot_step;  // which step each slot's event marks
  int pauses = 0;
  int most_queued = 0;
  std::vector<double> progress;
  bool fail_next_query = false;

  StepPacer::Hooks hooks(const ExecContext& ctx) {
    StepPacer::Hooks h;
    h.record = [this](int slot) {
      if (static_cast<int>(slot_step.size()) <= slot) slot_step.resize(static_cast<size_t>(slot) + 1, -1);
      slot_step[static_cast<size_t>(slot)] = recorded++;
      most_queued = std::max(most_queued, recorded - finished);
      return Status::Ok();
    };
    h.done = [this](int slot) -> StatusOr<bool> {
      if (fail_next_query) return internal_error("cudaEventQuery failed: cudaErrorIllegalAddress");
      return slot_step[static_cast<size_t>(slot)] < finished;
    };
    h.check_stop = [&ctx] { return ctx.check_stop(); };
    h.progress = [this](double f) { progress.push_back(f); };
    h.pause = [this](int) {
      ++pauses;
      if (polls_per_step > 0 && pauses % polls_per_step == 0 && finished < recorded) ++finished;
    };
    return h;
  }
};

TEST(CudaStepPacer, AtMostTwoStepsQueuedAndProgressFollowsTheGpu) {
  FakeGpu gpu;
  ExecContext ctx;
  StepPacer pacer(kStepsInFlight, 100.0, gpu.hooks(ctx));
  const int rounds = 40;
  for (int r = 0; r < rounds; ++r) {
    ASSERT_TRUE(pacer.add(50.0, static_cast<double>(r + 1) / rounds).ok());  // a step every two rounds
    EXPECT_LE(gpu.recorded - gpu.finished, kStepsInFlight) << "round " << r;
  }
  ASSERT_TRUE(pacer.finish().ok());
  EXPECT_EQ(pacer.steps(), rounds / 2);
  EXPECT_EQ(gpu.most_queued, kStepsInFlight);
  EXPECT_EQ(gpu.finished, gpu.recorded);
  // One report per finished step, increasing, ending at 1; every report
  // came after the GPU finished that step.
  ASSERT_EQ(static_cast<int>(gpu.progress.size()), rounds / 2);
  for (size_t i = 1; i < gpu.progress.size(); ++i) EXPECT_GT(gpu.progress[i], gpu.progress[i - 1]);
  EXPECT_DOUBLE_EQ(gpu.progress.back(), 1.0);
}

TEST(CudaStepPacer, CancelStopsTheWaitWhileTheGpuIsBusy) {
  FakeGpu gpu;
  gpu.polls_per_step = 0;  // the GPU never finishes: only a stop ends the wait
  std::atomic<bool> cancel{false};
  ExecContext ctx;
  ctx.cancel = &cancel;
  StepPacer::Hooks hooks = gpu.hooks(ctx);
  auto pause = hooks.pause;
  hooks.pause = [&, pause](int polls) {
    pause(polls);
    if (gpu.pauses == 10) cancel.store(true);
  };
  StepPacer pacer(kStepsInFlight, 1.0, std::move(hooks));
  Status s;
  int added = 0;
  for (; added < 100 && s.ok(); ++added) s = pacer.add(1.0, added / 100.0);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.to_string();
  EXPECT_EQ(added, kStepsInFlight + 1) << "the third step waits for the first";
  EXPECT_EQ(gpu.recorded, kStepsInFlight);
  EXPECT_EQ(gpu.pauses, 10);
  EXPECT_TRUE(gpu.progress.empty()) << "nothing finished, nothing reported";
}

TEST(CudaStepPacer, DeadlineStopsTheFinalWait) {
  FakeGpu gpu;
  gpu.polls_per_step = 0;
  ExecContext ctx;
  ctx.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  StepPacer::Hooks hooks = gpu.hooks(ctx);
  hooks.pause = [](int) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); };
  StepPacer pacer(kStepsInFlight, 1e9, std::move(hooks));
  ASSERT_TRUE(pacer.add(10.0, 1.0).ok());  // below a step: queued by finish()
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = pacer.finish();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(gpu.recorded, 1);
}

TEST(CudaStepPacer, AFailedStepIsTheError) {
  FakeGpu gpu;
  ExecContext ctx;
  StepPacer pacer(kStepsInFlight, 1.0, gpu.hooks(ctx));
  ASSERT_TRUE(pacer.add(1.0, 0.5).ok());
  gpu.fail_next_query = true;
  const Status s = pacer.finish();
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("cudaErrorIllegalAddress"), std::string::npos);
}

TEST(CudaStepPacer, SmallWorkIsOneStepAtTheEnd) {
  FakeGpu gpu;
  ExecContext ctx;
  StepPacer pacer(kStepsInFlight, kStepFlops, gpu.hooks(ctx));
  for (int r = 0; r < 10; ++r) ASSERT_TRUE(pacer.add(1e6, (r + 1) / 10.0).ok());
  EXPECT_EQ(gpu.recorded, 0);
  ASSERT_TRUE(pacer.finish().ok());
  EXPECT_EQ(gpu.recorded, 1);
  ASSERT_EQ(gpu.progress.size(), 1u);
  EXPECT_DOUBLE_EQ(gpu.progress[0], 1.0);
}

}  // namespace
}  // namespace plsh::cuda
