// The CUDA events that pace a call's steps (step_pacer.h), and the pacer's
// hooks on them: shared by the forward and the backward.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
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
    if (polls < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  };
  return hooks;
}

}  // namespace plsh::cuda
