// Admission and execution: a fixed pool of workers (--workers requests
// computed at once), a bounded queue in front of them (--queue-depth), and a
// memory budget shared by every request in flight (--memory-budget).
// Refusals are RESOURCE_EXHAUSTED at once rather than waits: a client that
// is told to back off can retry elsewhere, a client that waits blindly
// cannot.
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
  Scheduler(int64_t workers, int64_t queue_depth, int64_t memory_budget, std::function<void(int64_t)> on_queue_change);
  ~Scheduler();

  // Reserves bytes against the budget, or RESOURCE_EXHAUSTED naming it.
  Status reserve(int64_t bytes);
  void release(int64_t bytes);
  int64_t reserved() const;

  // Queues a job for a worker, or RESOURCE_EXHAUSTED when --queue-depth jobs
  // already wait, or UNAVAILABLE once stopping.
  Status submit(std::function<void()> job);

  // Runs what is queued, then joins the workers.
  void stop();

 private:
  void work();

  const int64_t queue_depth_;
  const int64_t memory_budget_;
  std::function<void(int64_t)> on_queue_change_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  int64_t idle_ = 0;
  int64_t reserved_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace plsh::server
