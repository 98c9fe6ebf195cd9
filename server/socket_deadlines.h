// A deadline per TCP connection. An idle timeout (the only
// one libmicrohttpd has) restarts on every byte, so a client that sends its
// request a byte a second would hold its connection slot for hours; with
// enough of them, nobody could scrape. Here a thread wakes a few times a
// second and shuts down (shutdown(2), never close: the socket stays owned by
// whoever accepted it) every socket whose clock is past the deadline; the
// owner then reads EOF and closes it as it would any finished connection.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace plsh::server {

class SocketDeadlines {
 public:
  // Starts the watching thread (std::system_error if it cannot).
  explicit SocketDeadlines(std::chrono::milliseconds deadline);
  ~SocketDeadlines();
  SocketDeadlines(const SocketDeadlines&) = delete;
  SocketDeadlines& operator=(const SocketDeadlines&) = delete;

  // fd (a connected socket, known as key) starts its clock. The owner must
  // call forget(key) before it closes fd, so that no later socket that
  // reuses the number is ever shut down.
  void track(const void* key, int fd);
  void forget(const void* key);

 private:
  struct Tracked {
    int fd;                                       // the connection's socket
    std::chrono::steady_clock::time_point since;  // when track() saw it
    bool cut;                                     // already shut down
  };
  void watch();

  const std::chrono::milliseconds deadline_;
  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  bool stop_ = false;
  std::unordered_map<const void*, Tracked> sockets_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace plsh::server
