#include "server/socket_deadlines.h"

#include <sys/socket.h>

#include "server/logging.h"

namespace plsh::server {

SocketDeadlines::SocketDeadlines(std::chrono::milliseconds deadline)
    : deadline_(deadline), thread_([this] { watch(); }) {}

SocketDeadlines::~SocketDeadlines() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void SocketDeadlines::track(const void* key, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  sockets_[key] = Tracked{fd, std::chrono::steady_clock::now(), false};
}

void SocketDeadlines::forget(const void* key) {
  std::lock_guard<std::mutex> lock(mutex_);
  sockets_.erase(key);
}

void SocketDeadlines::watch() {
  // A quarter of a second: a late client is cut within 250 ms of its
  // deadline, for a wake-up that costs nothing measurable.
  constexpr auto kPeriod = std::chrono::milliseconds(250);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, kPeriod, [this] { return stop_; })) {
    const auto now = std::chrono::steady_clock::now();
    for (auto& [key, s] : sockets_) {
      if (s.cut || now - s.since < deadline_) continue;
      // Under the lock: forget() (and so the owner's close) cannot run
      // between the check and this call.
      shutdown(s.fd, SHUT_RDWR);
      s.cut = true;
      log_event(spdlog::level::debug, "connection_cut",
                {{"reason", "connection open past its deadline"},
                 {"deadline_s", std::chrono::duration<double>(deadline_).count()}});
    }
  }
}

}  // namespace plsh::server
