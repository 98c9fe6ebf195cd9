// Admission and execution: a fixed pool of workers (--workers requests
// computed at once), a bounded queue in front of them (--queue-depth), and
// two memory budgets shared by every request in flight, one per memory
// space: host (--memory-budget: tensors and host workspace) and device
// (--device-memory-budget: a GPU backend's staging and workspace).
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

// Bytes by memory space: what a request is charged, or a budget.
struct MemoryCharge {
  int64_t host_bytes = 0;
  int64_t device_bytes = 0;
};

class Scheduler {
 public:
  // on_queue_change(depth) is called whenever the number of waiting jobs changes.
  Scheduler(int64_t workers, int64_t queue_depth, MemoryCharge budget, std::function<void(int64_t)> on_queue_change);
  ~Scheduler();

  // Reserves both parts against their budgets, all or nothing, or
  // RESOURCE_EXHAUSTED naming the budget's flag.
  Status reserve(const MemoryCharge& charge);
  void release(const MemoryCharge& charge);
  MemoryCharge reserved() const;
  MemoryCharge budget() const { return budget_; }
  // Called with the new totals whenever reservations change (under the
  // lock, so a gauge sees the changes in order). Set before serving.
  void set_memory_listener(std::function<void(const MemoryCharge&)> on_change) { on_memory_change_ = std::move(on_change); }
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
  const MemoryCharge budget_;
  std::function<void(int64_t)> on_queue_change_;
  std::function<void(const MemoryCharge&)> on_memory_change_;
  std::function<void(int64_t)> on_busy_change_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  int64_t idle_ = 0;
  int64_t busy_ = 0;
  MemoryCharge reserved_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace plsh::server
