#include "server/scheduler.h"

#include <string>

namespace plsh::server {

Scheduler::Scheduler(int64_t workers, int64_t queue_depth, MemoryCharge budget,
                     std::function<void(int64_t)> on_queue_change)
    : queue_depth_(queue_depth), budget_(budget), on_queue_change_(std::move(on_queue_change)) {
  for (int64_t i = 0; i < workers; ++i) workers_.emplace_back([this] { work(); });
}

Scheduler::~Scheduler() { stop(); }

Status Scheduler::reserve(const MemoryCharge& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t host_free = budget_.host_bytes - reserved_.host_bytes;
  const int64_t device_free = budget_.device_bytes - reserved_.device_bytes;
  // A charge over the whole budget can never fit: say so, not "retry".
  if (c.host_bytes > host_free)
    return resource_exhausted("request needs " + std::to_string(c.host_bytes) + " bytes of host memory, " +
                              std::to_string(host_free) + " of the server's --memory-budget " +
                              std::to_string(budget_.host_bytes) + " are free; " +
                              (c.host_bytes > budget_.host_bytes ? "it can never fit" : "retry later"));
  if (c.device_bytes > device_free)
    return resource_exhausted("request needs " + std::to_string(c.device_bytes) + " bytes of device memory, " +
                              std::to_string(device_free) + " of the server's --device-memory-budget " +
                              std::to_string(budget_.device_bytes) + " are free; " +
                              (c.device_bytes > budget_.device_bytes ? "it can never fit" : "retry later"));
  reserved_.host_bytes += c.host_bytes;
  reserved_.device_bytes += c.device_bytes;
  if (on_memory_change_) on_memory_change_(reserved_);
  return Status::Ok();
}

void Scheduler::release(const MemoryCharge& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_.host_bytes -= c.host_bytes;
  reserved_.device_bytes -= c.device_bytes;
  if (on_memory_change_) on_memory_change_(reserved_);
}

MemoryCharge Scheduler::reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

Status Scheduler::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return unavailable("server is shutting down");
    // Jobs an idle worker is about to take do not wait.
    const int64_t waiting_after = static_cast<int64_t>(queue_.size()) + 1 - idle_;
    if (waiting_after > queue_depth_)
      return resource_exhausted("queue full: " + std::to_string(queue_.size()) + " requests wait for " +
                                std::to_string(workers_.size()) + " workers (the server's --queue-depth " +
                                std::to_string(queue_depth_) + "); retry later");
    queue_.push_back(std::move(job));
    // Under the lock, so the gauge sees the changes in order.
    if (on_queue_change_) on_queue_change_(static_cast<int64_t>(queue_.size()));
  }
  ready_.notify_one();
  return Status::Ok();
}

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  ready_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void Scheduler::work() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ++idle_;
      ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      if (on_queue_change_) on_queue_change_(static_cast<int64_t>(queue_.size()));
      ++busy_;
      if (on_busy_change_) on_busy_change_(busy_);
    }
    job();
    std::lock_guard<std::mutex> lock(mutex_);
    --busy_;
    if (on_busy_change_) on_busy_change_(busy_);
  }
}

}  // namespace plsh::server
