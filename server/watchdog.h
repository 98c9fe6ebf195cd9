// Streams that wait on their client too long end and give their memory back
// (SPEC section 9): one thread looks at every open Attend stream four times a
// second and ends those that are
//   - idle: no message from the client for --stream-idle-timeout while
//     receiving (the header included), or no write completed for as long
//     while sending (a client that does not read its output), or
//   - slow: receiving (or sending) N bytes for longer than
//     --stream-idle-timeout + N / --min-stream-rate,
// counted by reason in plsh_stream_timeouts_total. At a drain it ends every
// stream still receiving, so that a silent client cannot hold up SIGTERM.
//
// A call registers a CallWatch; the watchdog acts on a call only under the
// watch's mutex, which the call's close() also takes before it finishes, so
// the call is alive whenever the watchdog touches it.
#pragma once

#include <grpcpp/support/status.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace plsh::server {

class Metrics;

// What the watchdog may read of a call, and how it ends one.
class WatchedCall {
 public:
  enum class Phase : int { kReading = 0, kComputing = 1, kSending = 2, kDone = 3 };

  // Ends the call with `status` (the reason goes to the log and metrics).
  // Called with the call's watch locked; never blocks on the client.
  virtual void expire(const grpc::Status& status, const char* reason) = 0;

  // Phase, when it began, when the client last made progress, and the bytes
  // the phase moves in all (steady-clock nanoseconds; atomics: the call's
  // threads write them, the watchdog reads them).
  std::atomic<int> phase{static_cast<int>(Phase::kReading)};
  std::atomic<int64_t> phase_start_ns{0};
  std::atomic<int64_t> last_progress_ns{0};
  std::atomic<int64_t> phase_bytes{0};

  void enter(Phase p, int64_t bytes);
  void progress();

 protected:
  ~WatchedCall() = default;
};

struct CallWatch {
  std::recursive_mutex mu;      // held while the watchdog acts on the call; close() takes it too
  WatchedCall* call = nullptr;  // null once the call has closed
};

class StreamWatchdog {
 public:
  StreamWatchdog(double idle_timeout_seconds, int64_t min_rate_bytes_per_second, Metrics* metrics);
  ~StreamWatchdog();

  std::shared_ptr<CallWatch> watch(WatchedCall* call);
  // Ends every stream that has not finished receiving: at a drain.
  void expire_receiving(const grpc::Status& status, const char* reason);

 private:
  void run();
  void sweep();
  void prune_locked();

  const int64_t idle_ns_;
  const int64_t min_rate_;
  Metrics* metrics_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<std::shared_ptr<CallWatch>> watches_;
  std::thread thread_;
};

int64_t steady_now_ns();

}  // namespace plsh::server
