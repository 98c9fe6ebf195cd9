#include "server/scheduler.h"

#include <string>

namespace plsh::server {

Scheduler::Scheduler(int64_t workers, int64_t queue_depth, std::function<void(int64_t)> on_queue_change)
    : queue_depth_(queue_depth), on_queue_change_(std::move(on_queue_change)) {
  for (int64_t i = 0; i < workers; ++i) workers_.emplace_back([this] { work(); });
}

Scheduler::~Scheduler() { stop(); }

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
