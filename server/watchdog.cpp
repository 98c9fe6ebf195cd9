#include "server/watchdog.h"

#include <algorithm>
#include <string>

#include "server/metrics.h"

namespace plsh::server {

namespace {

constexpr auto kSweepInterval = std::chrono::milliseconds(250);

std::string seconds_text(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", static_cast<double>(ns) * 1e-9);
  return buf;
}

}  // namespace

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void WatchedCall::enter(Phase p, int64_t bytes) {
  const int64_t now = steady_now_ns();
  phase_bytes.store(bytes);
  phase_start_ns.store(now);
  last_progress_ns.store(now);
  phase.store(static_cast<int>(p));
}

void WatchedCall::progress() { last_progress_ns.store(steady_now_ns()); }

StreamWatchdog::StreamWatchdog(double idle_timeout_seconds, int64_t min_rate_bytes_per_second, Metrics* metrics)
    : idle_ns_(static_cast<int64_t>(idle_timeout_seconds * 1e9)),
      min_rate_(min_rate_bytes_per_second),
      metrics_(metrics) {
  if (idle_ns_ > 0 || min_rate_ > 0) thread_ = std::thread([this] { run(); });
}

StreamWatchdog::~StreamWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<CallWatch> StreamWatchdog::watch(WatchedCall* call) {
  auto w = std::make_shared<CallWatch>();
  w->call = call;
  std::lock_guard<std::mutex> lock(mu_);
  // Without a sweeping thread nothing else prunes closed calls.
  if (watches_.size() >= 64 && (watches_.size() & (watches_.size() - 1)) == 0) prune_locked();
  watches_.push_back(w);
  return w;
}

void StreamWatchdog::prune_locked() {
  watches_.erase(std::remove_if(watches_.begin(), watches_.end(),
                                [](const std::shared_ptr<CallWatch>& w) {
                                  std::lock_guard<std::recursive_mutex> l(w->mu);
                                  return w->call == nullptr;
                                }),
                 watches_.end());
}

void StreamWatchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, kSweepInterval, [this] { return stop_; })) {
    lock.unlock();
    sweep();
    lock.lock();
  }
}

void StreamWatchdog::sweep() {
  std::vector<std::shared_ptr<CallWatch>> watches;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Closed calls drop out; their watches die with the last reference.
    prune_locked();
    watches = watches_;
  }
  const int64_t now = steady_now_ns();
  for (const std::shared_ptr<CallWatch>& w : watches) {
    std::lock_guard<std::recursive_mutex> l(w->mu);
    WatchedCall* call = w->call;
    if (call == nullptr) continue;
    const auto phase = static_cast<WatchedCall::Phase>(call->phase.load());
    if (phase != WatchedCall::Phase::kReading && phase != WatchedCall::Phase::kSending) continue;
    const bool reading = phase == WatchedCall::Phase::kReading;
    const int64_t idle = now - call->last_progress_ns.load();
    const int64_t elapsed = now - call->phase_start_ns.load();
    const int64_t bytes = call->phase_bytes.load();
    const char* reason = nullptr;
    std::string message;
    if (idle_ns_ > 0 && idle > idle_ns_) {
      reason = reading ? "receive_idle" : "send_idle";
      message = reading ? "no message from the client for " + seconds_text(idle) + " s while receiving"
                        : "the client took no output for " + seconds_text(idle) + " s";
      message += " (the server's --stream-idle-timeout " + seconds_text(idle_ns_) + " s); the request is dropped";
    } else if (min_rate_ > 0) {
      const int64_t allowed =
          idle_ns_ + static_cast<int64_t>(static_cast<double>(bytes) / static_cast<double>(min_rate_) * 1e9);
      if (elapsed > allowed) {
        reason = reading ? "receive_slow" : "send_slow";
        message = std::string(reading ? "receiving " : "sending ") + std::to_string(bytes) + " bytes took over " +
                  seconds_text(allowed) + " s (the server's --stream-idle-timeout + bytes / --min-stream-rate " +
                  std::to_string(min_rate_) + " B/s); the request is dropped";
      }
    }
    if (reason == nullptr) continue;
    if (metrics_ != nullptr) metrics_->stream_timeout(reason);
    call->expire(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, message), reason);
  }
}

void StreamWatchdog::expire_receiving(const grpc::Status& status, const char* reason) {
  std::vector<std::shared_ptr<CallWatch>> watches;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watches = watches_;
  }
  for (const std::shared_ptr<CallWatch>& w : watches) {
    std::lock_guard<std::recursive_mutex> l(w->mu);
    if (w->call != nullptr && w->call->phase.load() == static_cast<int>(WatchedCall::Phase::kReading))
      w->call->expire(status, reason);
  }
}

}  // namespace plsh::server
