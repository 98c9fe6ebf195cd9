// server/call.h, the queued-cancel path: CallBase::compute refuses a request
// whose client left while it waited for a worker, and close() gives its
// memory back. No network: a default-constructed CallbackServerContext (no
// call behind it: empty peer, no deadline, never cancelled by gRPC) stands in
// for the RPC, and a subclass reaches CallBase's protected steps.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <optional>

#include "request_test_util.h"
#include "server/call.h"
#include "server/logging.h"
#include "server_test_util.h"
#include "sync_util.h"

namespace plsh::server {
namespace {

using testing::Counter;
using testing::Gate;
using testing::has_error;
using testing::is_ok;

class TestCall : public CallBase {
 public:
  TestCall(ServiceContext& s, grpc::CallbackServerContext* ctx) : CallBase(s, ctx, "Test") {}
  using CallBase::admit_header;
  using CallBase::close;
  using CallBase::compute;
  using CallBase::open;
  void cancel() { cancel_ = true; }
  // Never watched here (open(false)): nothing calls it.
  void expire(const grpc::Status&, const char*) override {}
  const Request& request() const { return *request_; }
  // Zero inputs: finite, so check_finite passes.
  void zero_inputs() {
    std::memset(memory_.q, 0, static_cast<size_t>(request_->shape.q.bytes()));
    std::memset(memory_.k, 0, static_cast<size_t>(request_->shape.k.bytes()));
    std::memset(memory_.v, 0, static_cast<size_t>(request_->shape.v.bytes()));
  }
};

class CallCancelTest : public ::testing::Test {
 protected:
  CallCancelTest()
      : budget_({int64_t{1} << 30, 0}),
        admission_({64}, &budget_, nullptr, nullptr, nullptr),
        scheduler_(1, 4, nullptr) {
    // No request log lines in the test output. Once per process: a second
    // init_logging throws (spdlog: logger 'plsh' already exists).
    static const Status logging = init_logging("warn", "text");
    EXPECT_TRUE(is_ok(logging));
    s_.config = &config_;
    s_.metrics = &metrics_;
    s_.scheduler = &scheduler_;
    s_.admission = &admission_;
    s_.limits = testing::roomy_limits();
  }
  void TearDown() override { release_.open(); }

  static v1::AttendHeader header() { return testing::f32_header(8, 2, 4, v1::MODE_EXACT); }

  // Admits a call up to the point where it would be queued.
  void admit(TestCall& call) {
    ASSERT_TRUE(is_ok(call.open(/*watched=*/false)));
    ASSERT_TRUE(is_ok(call.admit_header(header())));
    const MemoryCharge reserved = budget_.reserved();
    EXPECT_EQ(reserved.host_bytes, call.request().host_charge());
    EXPECT_GT(reserved.host_bytes, 0);
    call.zero_inputs();
  }

  // Queues call.compute behind a job holding the only worker, runs
  // `while_queued`, then lets the worker go and returns compute's result.
  StatusOr<AttentionResult> compute_behind_blocker(TestCall& call, const std::function<void()>& while_queued) {
    Counter started, done;
    std::optional<StatusOr<AttentionResult>> result;
    EXPECT_TRUE(is_ok(scheduler_.submit([&] {
      started.add();
      EXPECT_TRUE(release_.wait());
    })));
    EXPECT_TRUE(started.wait_for(1));
    const Clock::time_point queued_at = Clock::now();
    EXPECT_TRUE(is_ok(scheduler_.submit([&] {
      result.emplace(call.compute(queued_at));
      done.add();
    })));
    while_queued();
    EXPECT_EQ(done.get(), 0);
    release_.open();
    if (!done.wait_for(1)) {
      scheduler_.stop();  // the job captures this frame: let it finish before returning
      return internal_error("the queued compute never ran in time");
    }
    return *result;
  }

  ServerConfig config_;
  Metrics metrics_;
  MemoryBudget budget_;
  Admission admission_;
  Scheduler scheduler_;
  ServiceContext s_;
  Gate release_;
};

TEST_F(CallCancelTest, CancelledWhileQueuedIsNotComputedAndReleasesItsMemory) {
  grpc::CallbackServerContext rpc;
  TestCall call(s_, &rpc);
  admit(call);
  StatusOr<AttentionResult> result = compute_behind_blocker(call, [&] { call.cancel(); });
  EXPECT_TRUE(has_error(result.status(), StatusCode::kCancelled, {"while queued"}));
  const grpc::Status closed = call.close(grpc::Status(grpc::StatusCode::UNKNOWN, "from the reactor"));
  EXPECT_EQ(closed.error_code(), grpc::StatusCode::CANCELLED) << closed.error_message();
  EXPECT_EQ(budget_.reserved().host_bytes, 0);
  EXPECT_EQ(budget_.reserved().device_bytes, 0);
  EXPECT_EQ(admission_.open_calls(), 0);
}

// The control: the same call, not cancelled, computes.
TEST_F(CallCancelTest, NotCancelledComputes) {
  grpc::CallbackServerContext rpc;
  TestCall call(s_, &rpc);
  admit(call);
  StatusOr<AttentionResult> result = compute_behind_blocker(call, [] {});
  EXPECT_TRUE(is_ok(result.status()));
  const grpc::Status closed = call.close(grpc::Status::OK);
  EXPECT_TRUE(closed.ok()) << closed.error_message();
  EXPECT_EQ(budget_.reserved().host_bytes, 0);
  EXPECT_EQ(admission_.open_calls(), 0);
}

}  // namespace
}  // namespace plsh::server
