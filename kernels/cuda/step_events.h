// The CUDA events that pace a call's steps (step_pacer.h), the pacer's
// hooks on them, and the rounds of a call paced with them: shared by the
// forward and the backward.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/step_pacer.h"
#include "plsh/backend.h"
#include "plsh/status.h"

namespace plsh::cuda {

// The events of StepPacer's steps, destroyed with the call (an event
// still pending is released once it completes).
class StepEvents {
 public:
  StepEvents() = default;
  StepEvents(const StepEvents&) = delete;
  StepEvents& operator=(const StepEvents&) = delete;
  ~StepEvents() {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  Status create(int n) {
    for (int i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
    }
    return Status::Ok();
  }
  cudaEvent_t at(int slot) const { return events_[static_cast<size_t>(slot)]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// StepPacer's hooks on these events and `stream`: record and query the
// events, poll ctx's stop condition, report ctx's progress, and between two
// polls spin briefly (a step may be nearly done), then sleep: the next step
// is queued behind the one waited for, so the GPU does not wait for the host.
inline StepPacer::Hooks event_hooks(const StepEvents& events, cudaStream_t stream, const ExecContext& ctx) {
  StepPacer::Hooks hooks;
  hooks.record = [&events, stream](int slot) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events.at(slot), stream));
    return Status::Ok();
  };
  hooks.done = [&events](int slot) -> StatusOr<bool> {
    const cudaError_t e = cudaEventQuery(events.at(slot));
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not yet" is no error to keep
      return false;
    }
    CUDA_RETURN_IF_ERROR(e);
    return true;
  };
  hooks.check_stop = [&ctx] { return ctx.check_stop(); };
  hooks.progress = ctx.progress;
  hooks.pause = [](int polls) {
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  };
  return hooks;
}

// A call's rounds paced on the GPU: steps of about kStepFlops, at most
// kStepsInFlight queued, so that cancel, deadline and progress follow the
// device, not the host; and the FLOPs its rounds did.
class PacedRounds {
 public:
  // `chunks`: how many chunks the call runs (chunk_count); progress counts them.
  explicit PacedRounds(int64_t chunks) : chunks_(static_cast<double>(chunks)) {}

  Status start(cudaStream_t stream, const ExecContext& ctx) {
    RETURN_IF_ERROR(events_.create(kStepsInFlight));
    pacer_.emplace(kStepsInFlight, kStepFlops, event_hooks(events_, stream, ctx));
    return Status::Ok();
  }

  // Round `round` of the `rounds` of chunk `chunk` is queued, `flops` of
  // work; done once it has run: that chunk's share of its rounds.
  Status add_round(int64_t chunk, size_t round, size_t rounds, double flops) {
    flops_ += flops;
    return pacer_->add(
        flops, (static_cast<double>(chunk) + static_cast<double>(round + 1) / static_cast<double>(rounds)) / chunks_);
  }

  // The last step (what was queued after the rounds: the copies back) is
  // waited for the same way, so that a stop still acts while the GPU
  // finishes; then the stream.
  Status finish(cudaStream_t stream) {
    RETURN_IF_ERROR(pacer_->add(0, 1.0));
    RETURN_IF_ERROR(pacer_->finish());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return Status::Ok();
  }

  double flops() const { return flops_; }

 private:
  StepEvents events_;
  std::optional<StepPacer> pacer_;  // after events_: its hooks use them
  double chunks_;
  double flops_ = 0;
};

}  // namespace plsh::cuda
