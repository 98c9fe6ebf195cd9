// Execution: a fixed pool of workers (--workers requests computed at once)
// and a bounded queue in front of them (--queue-depth). A job that finds
// the queue full is refused with RESOURCE_EXHAUSTED at once rather than
// made to wait. Memory is not the scheduler's: a request is admitted, with
// its memory, before it is ever submitted (admission.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "plsh/status.h"

namespace plsh::server {

class Scheduler {
 public:
  // on_queue_change(depth) is called whenever the number of waiting jobs changes.
  Scheduler(int64_t workers, int64_t queue_depth, std::function<void(int64_t)> on_queue_change);
  ~Scheduler();

  // Called with the number of workers running a job whenever it changes
  // (under the lock). Set before serving.
  void set_busy_listener(std::function<void(int64_t)> on_change) { on_busy_change_ = std::move(on_change); }

  // Queues a job for a worker, or RESOURCE_EXHAUSTED when --queue-depth jobs
  // already wait, or UNAVAILABLE once stopping.
  Status submit(std::function<void()> job);

  // Runs what is queued, then joins the workers.
  void stop();

 private:
  void work();

  const int64_t queue_depth_;
  std::function<void(int64_t)> on_queue_change_;
  std::function<void(int64_t)> on_busy_change_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  int64_t idle_ = 0;
  int64_t busy_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace plsh::server
