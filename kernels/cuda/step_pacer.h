// How far the host may run ahead of the GPU. forward() only enqueues: left
// alone, the host queues a whole request in milliseconds and then waits,
// uninterruptibly, for the GPU; a cancel or a deadline would act only while
// it enqueues, and progress would report what was queued, not what ran. So
// the rounds are cut into steps of about step_flops; the host records an
// event after each step, and before it queues more than `max_in_flight`
// steps it waits for the oldest one by polling its event and the stop
// condition in turn. A cancel then stops the work within the steps already
// queued (their drain is what is left), and progress reports the steps the
// GPU has finished.
//
// Pure host code: the events are hooks (cudaEventRecord / cudaEventQuery in
// the backend, fakes in the tests).
#pragma once

#include <deque>
#include <functional>
#include <utility>

#include "plsh/status.h"

namespace plsh::cuda {

// About 1 ms of GPU work per step on an H200 (at 200 TFLOP/s, what batched
// 64-row tiles might reach; an estimate, not yet measured): short enough
// that a cancel acts within milliseconds, long enough that the host's
// polling (StepPacer::Hooks::pause) never leaves the GPU idle with a second
// step queued behind the one it waits for.
inline constexpr double kStepFlops = 2e11;
// Steps queued at once: the one the GPU runs and the next, so that it never
// waits for the host.
inline constexpr int kStepsInFlight = 2;

class StepPacer {
 public:
  struct Hooks {
    std::function<Status(int slot)> record;        // record event `slot` after all work queued so far
    std::function<StatusOr<bool>(int slot)> done;  // has the GPU passed event `slot`? An error: a step failed
    std::function<Status()> check_stop;            // CANCELLED / DEADLINE_EXCEEDED when the work should stop
    std::function<void(double)> progress;          // may be empty: the fraction of the work the GPU finished
    std::function<void(int polls)> pause;          // between two polls of one event
  };

  StepPacer(int max_in_flight, double step_flops, Hooks hooks)
      : max_in_flight_(max_in_flight < 1 ? 1 : max_in_flight), step_flops_(step_flops), hooks_(std::move(hooks)) {}

  // Work just queued (its flops), and the fraction of the whole request
  // that is done once it has run. Closes a step when the step's work
  // reaches step_flops, waiting first when max_in_flight steps are queued.
  Status add(double flops, double fraction_when_done) {
    pending_flops_ += flops;
    pending_fraction_ = fraction_when_done;
    pending_ = true;
    if (pending_flops_ >= step_flops_) return close_step();
    return Status::Ok();
  }

  // Closes the last step and waits, still polling the stop condition, until
  // the GPU has finished every step.
  Status finish() {
    if (pending_) RETURN_IF_ERROR(close_step());
    while (!queued_.empty()) RETURN_IF_ERROR(wait_oldest());
    return Status::Ok();
  }

  int in_flight() const { return static_cast<int>(queued_.size()); }
  int steps() const { return steps_; }

 private:
  struct Step {
    int slot;
    double fraction;
  };

  Status close_step() {
    if (static_cast<int>(queued_.size()) >= max_in_flight_) RETURN_IF_ERROR(wait_oldest());
    RETURN_IF_ERROR(hooks_.record(next_slot_));
    queued_.push_back({next_slot_, pending_fraction_});
    next_slot_ = (next_slot_ + 1) % max_in_flight_;
    ++steps_;
    pending_flops_ = 0;
    pending_ = false;
    return Status::Ok();
  }

  Status wait_oldest() {
    const Step oldest = queued_.front();
    for (int polls = 0;; ++polls) {
      ASSIGN_OR_RETURN(const bool done, hooks_.done(oldest.slot));
      if (done) break;
      RETURN_IF_ERROR(hooks_.check_stop());
      hooks_.pause(polls);
    }
    queued_.pop_front();
    if (hooks_.progress) hooks_.progress(oldest.fraction);
    return Status::Ok();
  }

  int max_in_flight_;
  double step_flops_;
  Hooks hooks_;
  std::deque<Step> queued_;
  int next_slot_ = 0;
  int steps_ = 0;
  double pending_flops_ = 0;
  double pending_fraction_ = 0;
  bool pending_ = false;
};

}  // namespace plsh::cuda
