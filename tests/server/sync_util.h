// Gates and counters with bounded waits, so a broken scheduler fails a test
// instead of hanging it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "server_test_util.h"

namespace plsh::server::testing {

// Closed until open(); wait() returns whether it opened within kWaitLimit.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }
  bool wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kWaitLimit, [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
};

// Opens a gate when it goes out of scope. Declared after the Scheduler in a
// test, it lets a worker held on the gate go before ~Scheduler joins it, so
// a test that fails (returns early) while a worker is held does not wait out
// kWaitLimit there.
class OpenOnExit {
 public:
  explicit OpenOnExit(Gate& gate) : gate_(gate) {}
  ~OpenOnExit() { gate_.open(); }
  OpenOnExit(const OpenOnExit&) = delete;
  OpenOnExit& operator=(const OpenOnExit&) = delete;

 private:
  Gate& gate_;
};

class Counter {
 public:
  void add() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++count_;
    }
    changed_.notify_all();
  }
  int64_t get() {
    std::lock_guard<std::mutex> lock(mutex_);
    return count_;
  }
  // Whether the count reached n within kWaitLimit.
  bool wait_for(int64_t n) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kWaitLimit, [&] { return count_ >= n; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t count_ = 0;
};

}  // namespace plsh::server::testing
