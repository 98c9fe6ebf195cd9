// server/scheduler.h: the bounded queue in front of the workers, FIFO order,
// stop, and the queue-depth and busy-worker callbacks.
// Workers are held on gates (condition variables with generous timeouts), so
// every ordering a test relies on is forced, not hoped for.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <ostream>
#include <thread>
#include <vector>

#include "server/scheduler.h"
#include "server_test_util.h"
#include "sync_util.h"

namespace plsh::server {

namespace {

using testing::Counter;
using testing::eventually;
using testing::Gate;
using testing::has_error;
using testing::is_ok;
using testing::OpenOnExit;

using testing::kExhausted;
// ---- Queue and workers --------------------------------------------------------

// Holds the workers: blocker() jobs report that they started and wait for
// release. Each test declares `const OpenOnExit unblock(release);` after its
// Scheduler (and after anything its jobs capture), so an early return
// releases the workers before the Scheduler joins them.
class SchedulerQueueTest : public ::testing::Test {
 protected:
  std::function<void()> blocker() {
    return [this] {
      started.add();
      EXPECT_TRUE(release.wait()) << "a blocked worker was never released";
    };
  }
  // A job that appends `id` to ran.
  std::function<void()> recorder(int id) {
    return [this, id] {
      std::lock_guard<std::mutex> lock(mutex);
      ran.push_back(id);
    };
  }
  std::vector<int> ran_now() {
    std::lock_guard<std::mutex> lock(mutex);
    return ran;
  }

  Counter started;
  Gate release;
  std::mutex mutex;
  std::vector<int> ran;
};

TEST_F(SchedulerQueueTest, QueueFullWhileWorkersAreBusy) {
  Scheduler s(1, 2, nullptr);
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit(blocker())));
  ASSERT_TRUE(started.wait_for(1));
  ASSERT_TRUE(is_ok(s.submit(recorder(1))));
  ASSERT_TRUE(is_ok(s.submit(recorder(2))));
  EXPECT_TRUE(has_error(s.submit(recorder(3)), kExhausted,
                        {"queue full", "2 requests wait for 1 workers", "--queue-depth 2", "retry later"}));
  release.open();
  s.stop();
  EXPECT_EQ(ran_now(), (std::vector<int>{1, 2}));  // the refused job never runs
}

// With --queue-depth 0 a job is admitted only when an idle worker takes it
// at once. The scheduler has no signal for "the worker is parked", so the
// first submit is retried until the worker has started (bounded by
// kWaitLimit); a scheduler that counted that job against the queue would
// refuse it forever.
TEST_F(SchedulerQueueTest, IdleWorkerTakesJobWithoutQueueRoom) {
  Scheduler s(1, 0, nullptr);
  const OpenOnExit unblock(release);
  Status last;
  ASSERT_TRUE(eventually([&] {
    last = s.submit(blocker());
    return last.ok();
  })) << last.to_string();
  ASSERT_TRUE(started.wait_for(1));
  EXPECT_TRUE(has_error(s.submit(recorder(1)), kExhausted, {"--queue-depth 0"}));  // the only worker is busy
  release.open();
  s.stop();
  EXPECT_TRUE(ran_now().empty());
}

TEST_F(SchedulerQueueTest, JobsRunInFifoOrder) {
  Scheduler s(1, 20, nullptr);
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit(blocker())));
  ASSERT_TRUE(started.wait_for(1));
  std::vector<int> submitted;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(is_ok(s.submit(recorder(i))));
    submitted.push_back(i);
  }
  release.open();
  s.stop();
  EXPECT_EQ(ran_now(), submitted);
}

// Two workers run two jobs at once: each job waits for the other to start.
TEST_F(SchedulerQueueTest, WorkersRunJobsConcurrently) {
  Counter met;
  Scheduler s(2, 0, nullptr);
  const OpenOnExit unblock(release);
  auto meet = [&] {
    met.add();
    if (met.wait_for(2)) recorder(1)();
  };
  Status last;
  for (int i = 0; i < 2; ++i)
    ASSERT_TRUE(eventually([&] {
      last = s.submit(meet);
      return last.ok();
    })) << last.to_string();
  s.stop();
  EXPECT_EQ(ran_now(), (std::vector<int>{1, 1}));
}

// stop() begun while jobs wait still runs them, then joins: the blocked
// worker is released only once stop() has closed the door (submit says
// UNAVAILABLE), and every queued job has run when stop() returns.
TEST_F(SchedulerQueueTest, StopRunsWhatIsQueuedThenJoins) {
  Scheduler s(1, 3, nullptr);
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit(blocker())));
  ASSERT_TRUE(started.wait_for(1));
  for (int i = 1; i <= 3; ++i) ASSERT_TRUE(is_ok(s.submit(recorder(i))));

  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    s.stop();
    stopped = true;
  });
  // The queue is full, so until stop() begins a submit is refused and adds nothing.
  Status last;
  const bool closed = eventually([&] {
    last = s.submit(recorder(99));
    return last.code() == StatusCode::kUnavailable;
  });
  EXPECT_TRUE(closed) << last.to_string();
  EXPECT_TRUE(has_error(last, StatusCode::kUnavailable, {"shutting down"}));
  EXPECT_FALSE(stopped.load());  // the blocker still holds the only worker
  release.open();
  stopper.join();
  EXPECT_EQ(ran_now(), (std::vector<int>{1, 2, 3}));
}

TEST_F(SchedulerQueueTest, SubmitAfterStopIsUnavailable) {
  Scheduler s(2, 4, nullptr);
  const OpenOnExit unblock(release);
  s.stop();
  EXPECT_TRUE(has_error(s.submit(recorder(1)), StatusCode::kUnavailable, {"shutting down"}));
  s.stop();  // twice is harmless, and so is the destructor after it
  EXPECT_TRUE(ran_now().empty());
}

TEST_F(SchedulerQueueTest, QueueChangeCallbackSeesTheDepth) {
  std::mutex depths_mutex;
  std::vector<int64_t> depths;
  Scheduler s(1, 2, [&](int64_t depth) {
    std::lock_guard<std::mutex> lock(depths_mutex);
    depths.push_back(depth);
  });
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit(blocker())));  // 1, then 0 when the worker takes it
  ASSERT_TRUE(started.wait_for(1));
  ASSERT_TRUE(is_ok(s.submit(recorder(1))));  // 1
  ASSERT_TRUE(is_ok(s.submit(recorder(2))));  // 2
  EXPECT_FALSE(s.submit(recorder(3)).ok());   // refused: no change
  release.open();                             // 1, 0
  s.stop();
  std::lock_guard<std::mutex> lock(depths_mutex);
  EXPECT_EQ(depths, (std::vector<int64_t>{1, 0, 1, 2, 1, 0}));
}

// plsh_busy_workers: the workers running a job, as they take and finish them.
TEST_F(SchedulerQueueTest, BusyCallbackSeesWorkersTakeAndFinishJobs) {
  std::mutex busy_mutex;
  std::vector<int64_t> busy;
  Scheduler s(2, 2, nullptr);
  s.set_busy_listener([&](int64_t n) {
    std::lock_guard<std::mutex> lock(busy_mutex);
    busy.push_back(n);
  });
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit(blocker())));
  ASSERT_TRUE(is_ok(s.submit(blocker())));
  ASSERT_TRUE(started.wait_for(2));  // both workers hold one: 1, 2
  {
    std::lock_guard<std::mutex> lock(busy_mutex);
    EXPECT_EQ(busy, (std::vector<int64_t>{1, 2}));
  }
  release.open();
  s.stop();
  std::lock_guard<std::mutex> lock(busy_mutex);
  EXPECT_EQ(busy, (std::vector<int64_t>{1, 2, 1, 0}));
}

// The scheduler's half of "cancel while queued" (CallBase::compute checks
// the flag when a worker picks the job up): a job queued behind a busy
// worker runs only after the worker is released, and sees a flag set while
// it waited.
TEST_F(SchedulerQueueTest, FlagSetWhileQueuedIsSeenWhenTheJobRuns) {
  std::atomic<bool> cancel{false};
  std::atomic<bool> blocker_done{false};
  Counter queued_ran;
  bool saw_cancel = false, ran_after_blocker = false;
  Scheduler s(1, 1, nullptr);
  const OpenOnExit unblock(release);
  ASSERT_TRUE(is_ok(s.submit([&] {
    started.add();
    EXPECT_TRUE(release.wait());
    blocker_done = true;
  })));
  ASSERT_TRUE(started.wait_for(1));
  ASSERT_TRUE(is_ok(s.submit([&] {
    ran_after_blocker = blocker_done.load();
    saw_cancel = cancel.load();
    queued_ran.add();
  })));
  cancel = true;
  EXPECT_EQ(queued_ran.get(), 0);
  release.open();
  ASSERT_TRUE(queued_ran.wait_for(1));
  EXPECT_TRUE(ran_after_blocker);
  EXPECT_TRUE(saw_cancel);
}

}  // namespace
}  // namespace plsh::server
