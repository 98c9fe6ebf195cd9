// What happens around requests: metrics that count exactly, cancellation
// that frees the worker, SIGTERM that drains, /metrics next to CUDA.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "integration_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"

namespace plsh {
namespace {

using testing::scrape;
using testing::seconds_since;

// Inputs of zeros are enough here: these tests are about the plumbing.
struct Request {
  AttentionOptions options;
  std::vector<uint8_t> q, k, v;
  AttendCall call() const { return testing::attend_call(options, q, k, v, 120); }
};

Request make_request(Mode mode, int64_t n, int64_t heads, DType dtype = DType::kF32) {
  Request r;
  r.options.q_len = r.options.kv_len = n;
  r.options.heads = heads;
  r.options.head_dim = 64;
  r.options.dtype = dtype;
  r.options.mode = mode;
  r.options.causal = true;
  const size_t bytes = static_cast<size_t>(n * heads * 64) * dtype_bytes(dtype);
  r.q.assign(bytes, 0);
  r.k.assign(bytes, 0);
  r.v.assign(bytes, 0);
  // Non-zero values so the probe has something to measure.
  for (size_t i = 0; i < bytes; i += 4) r.q[i + 3] = r.k[i + 3] = r.v[i + 3] = 0x3f;
  return r;
}

// Waits (up to 30 s) until the server has received all of r's q, k and v:
// the request is then whole and on its way to a worker. No assertion here:
// each test checks what it expects to follow.
void wait_until_received(const ServerProcess& server, const Request& r) {
  testing::eventually([&] { return metric_sum(scrape(server), "plsh_received_bytes_total") >= 3.0 * r.q.size(); }, 30);
}

// Waits (up to 30 s) until `workers` workers compute a request.
bool wait_until_busy(const ServerProcess& server, int workers) {
  return testing::eventually([&] { return metric_sum(scrape(server), "plsh_busy_workers") == workers; }, 30);
}

// Sends a whole request on a raw stream under ctx and waits for the end;
// the caller cancels ctx from another thread when it wants to.
grpc::Status stream_request(const std::string& target, const Request& r, grpc::ClientContext* ctx) {
  const AttendCall call = r.call();
  auto rpc = testing::plaintext_attention_client(target);
  auto stream = rpc->Attend(ctx);
  v1::AttendRequest m;
  *m.mutable_header() = client::make_header(call);
  stream->Write(m);
  const int64_t row_bytes = r.options.heads * r.options.head_dim * static_cast<int64_t>(dtype_bytes(r.options.dtype));
  const int64_t rows = r.options.q_len, rows_per = std::max<int64_t>(1, (1 << 20) / row_bytes);
  for (const std::vector<uint8_t>* data : {&r.q, &r.k, &r.v})
    for (int64_t row = 0; row < rows; row += rows_per) {
      const int64_t n = std::min(rows_per, rows - row);
      m.Clear();
      auto* c = m.mutable_chunk();
      c->set_tensor(data == &r.q ? v1::TENSOR_Q : data == &r.k ? v1::TENSOR_K : v1::TENSOR_V);
      c->set_row_start(row);
      c->set_row_count(n);
      c->set_data(data->data() + row * row_bytes, static_cast<size_t>(n * row_bytes));
      stream->Write(m);
    }
  m.Clear();
  m.mutable_end();
  stream->Write(m);
  stream->WritesDone();
  v1::AttendResponse response;
  while (stream->Read(&response)) {
  }
  return stream->Finish();
}

TEST(ServiceMetrics, MoveByExactlyTheRequestsMade) {
  ServerProcess server({"--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  const auto before = scrape(server);
  ASSERT_FALSE(before.empty()) << "no /metrics from " << server.metrics_address();
  EXPECT_EQ(metric_sum(before, "plsh_build_info", {"backend=\"cpu\""}), 1);

  Client c(server.grpc_address());
  const Request lsh = make_request(Mode::kLsh, 300, 2);
  AttendReply a, b, bad;
  ASSERT_TRUE(c.attend(lsh.call(), &a).ok());
  ASSERT_TRUE(c.attend_unary(lsh.call(), &b).ok());
  AttendCall invalid = lsh.call();
  invalid.options.samples = 0;
  EXPECT_EQ(c.attend(invalid, &bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  const auto after = scrape(server);
  auto delta = [&](const std::string& name, const std::vector<std::string>& labels = {}) {
    return metric_sum(after, name, labels) - metric_sum(before, name, labels);
  };
  EXPECT_EQ(delta("plsh_requests_total", {"code=\"OK\"", "mode=\"lsh\"", "backend=\"cpu\""}), 2);
  EXPECT_EQ(delta("plsh_requests_total", {"code=\"INVALID_ARGUMENT\"", "mode=\"lsh\""}), 1);
  EXPECT_EQ(delta("plsh_requests_total"), 3);
  EXPECT_EQ(delta("plsh_request_duration_seconds_count"), 3);
  EXPECT_EQ(delta("plsh_tokens_total", {"mode=\"lsh\""}), 2 * 300);
  EXPECT_EQ(delta("plsh_received_bytes_total"), a.sent_bytes + b.sent_bytes);
  EXPECT_EQ(delta("plsh_sent_bytes_total"), a.received_bytes + b.received_bytes);
  EXPECT_EQ(delta("plsh_probe_relative_error_count", {"mode=\"lsh\""}), 2);
  EXPECT_EQ(delta("plsh_mask_max_error_count", {"mode=\"lsh\""}), 2);
  EXPECT_EQ(delta("plsh_phase_duration_seconds_count", {"phase=\"computing\""}), 2);
  EXPECT_EQ(metric_sum(after, "plsh_inflight_requests"), 0);
  EXPECT_EQ(metric_sum(after, "plsh_queue_depth"), 0);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// A long exact request, cancelled once it computes, must free the one
// worker: a small request sent right after finishes in well under the time
// the long one would have taken.
TEST(ServiceLifecycle, CancelMidRequestFreesTheWorker) {
  ServerProcess server({"--workers", "1", "--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  const Request big = make_request(Mode::kExact, 16384, 8, DType::kF16);  // ~0.5 TFLOP: minutes on 2 cores

  grpc::ClientContext ctx;
  grpc::Status big_status;
  std::thread caller([&] { big_status = stream_request(server.grpc_address(), big, &ctx); });
  wait_until_received(server, big);
  ASSERT_TRUE(wait_until_busy(server, 1));  // cancelled in compute, not while receiving
  ctx.TryCancel();
  caller.join();
  EXPECT_EQ(big_status.error_code(), grpc::StatusCode::CANCELLED);

  const auto t1 = std::chrono::steady_clock::now();
  const Request small = make_request(Mode::kLsh, 64, 2);
  AttendReply reply;
  const grpc::Status s = Client(server.grpc_address()).attend(small.call(), &reply);
  const double waited = seconds_since(t1);
  EXPECT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_LT(waited, 5.0) << "the cancelled request still held the worker";
  // The server saw the cancellation as such.
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_requests_total", {"code=\"CANCELLED\"", "mode=\"exact\""}), 1);
  EXPECT_EQ(metric_sum(m, "plsh_inflight_requests"), 0);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// A client that sends header, chunks and end without reading the ack, then
// cancels at once, while the request is queued or computing: the server must
// stay up, free the reservation and close every stream. (The race this
// guards against, a failed ack write finishing the call under a working
// worker, needs the tiny ack's write to stall; this loop does not force
// that, so service.cpp's pump() rule is what prevents it.)
TEST(ServiceLifecycle, CancelRightAfterEndWithoutReadingTheAck) {
  ServerProcess server({"--workers", "1", "--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  const Request r = make_request(Mode::kExact, 512, 4);
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  for (int i = 0; i < 40; ++i) {
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    v1::AttendRequest m;
    *m.mutable_header() = client::make_header(r.call());
    stream->Write(m);
    const int64_t row_bytes = r.options.heads * r.options.head_dim * 4;
    for (const std::vector<uint8_t>* data : {&r.q, &r.k, &r.v}) {
      m.Clear();
      auto* c = m.mutable_chunk();
      c->set_tensor(data == &r.q ? v1::TENSOR_Q : data == &r.k ? v1::TENSOR_K : v1::TENSOR_V);
      c->set_row_start(0);
      c->set_row_count(r.options.q_len);
      c->set_data(data->data(), static_cast<size_t>(r.options.q_len * row_bytes));
      stream->Write(m);
    }
    m.Clear();
    m.mutable_end();
    stream->Write(m);
    if (i % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(i % 7));  // vary where the cancel lands
    ctx.TryCancel();
    stream->Finish();
  }
  // Still serving, nothing in flight, and the whole memory budget free again.
  const Request small = make_request(Mode::kLsh, 64, 2);
  AttendReply reply;
  const grpc::Status s = Client(server.grpc_address()).attend(small.call(), &reply);
  EXPECT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_TRUE(testing::eventually([&] { return metric_sum(scrape(server), "plsh_inflight_requests") == 0; }));
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST(ServiceLifecycle, SigtermFinishesTheRequestInFlightAndExitsZero) {
  ServerProcess server({"--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  // Seconds of exact attention (~140 GFLOP): long enough to look at the
  // draining server while it computes.
  const Request r = make_request(Mode::kExact, 8192, 8);
  AttendReply reply;
  grpc::Status status;
  std::atomic<bool> done{false};
  std::thread caller([&] {
    status = Client(server.grpc_address()).attend(r.call(), &reply);
    done = true;
  });
  wait_until_received(server, r);
  kill(server.pid(), SIGTERM);

  // While draining: NOT_SERVING, and new requests are UNAVAILABLE.
  Client c(server.grpc_address());
  std::string health;
  EXPECT_TRUE(testing::eventually([&] { return c.health("", &health).ok() && health == "NOT_SERVING"; })) << health;
  ASSERT_TRUE(c.health("plsh.v1.Attention", &health).ok());
  EXPECT_EQ(health, "NOT_SERVING");
  const Request small = make_request(Mode::kLsh, 64, 2);
  AttendReply refused_reply;
  const grpc::Status refused = c.attend(small.call(), &refused_reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << client::status_string(refused);
  EXPECT_FALSE(done.load()) << "the request finished before the draining server could be observed";

  caller.join();
  EXPECT_TRUE(status.ok()) << client::status_string(status);
  EXPECT_EQ(reply.out.size(), r.q.size());
  EXPECT_EQ(server.terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("draining"), std::string::npos);
  // After it: nothing listens any more.
  EXPECT_FALSE(Client(server.grpc_address()).health("", &health, 2).ok());
}

// Admission refuses at once rather than queueing without bound: with one
// worker and no queue, a second request while the first computes is
// RESOURCE_EXHAUSTED (queue full); with one stream allowed, a second open
// stream is too.
TEST(ServiceLifecycle, FullQueueAndTooManyStreamsAreResourceExhausted) {
  ServerProcess server({"--workers", "1", "--queue-depth", "0", "--max-concurrent", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  const Request big = make_request(Mode::kExact, 16384, 8, DType::kF16);  // minutes of compute: cancelled below
  grpc::ClientContext big_ctx;
  grpc::Status big_status;
  std::thread caller([&] { big_status = stream_request(server.grpc_address(), big, &big_ctx); });
  wait_until_received(server, big);
  ASSERT_TRUE(wait_until_busy(server, 1));  // the end message reached the worker

  Client c(server.grpc_address());
  const Request small = make_request(Mode::kLsh, 64, 2);
  AttendReply reply;
  const grpc::Status queued = c.attend(small.call(), &reply);
  EXPECT_EQ(queued.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << client::status_string(queued);
  EXPECT_NE(queued.error_message().find("queue-depth"), std::string::npos) << queued.error_message();

  // The big stream is one of two allowed; hold a second open, a third is refused.
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  grpc::ClientContext held_ctx;
  auto held = rpc->Attend(&held_ctx);
  v1::AttendRequest header;
  *header.mutable_header() = client::make_header(small.call());
  ASSERT_TRUE(held->Write(header));
  v1::AttendResponse ack;
  ASSERT_TRUE(held->Read(&ack));  // admitted: the stream is open on the server
  EXPECT_TRUE(ack.has_ack());
  const grpc::Status third = c.attend(small.call(), &reply);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << client::status_string(third);
  EXPECT_NE(third.error_message().find("max-concurrent"), std::string::npos) << third.error_message();

  held_ctx.TryCancel();
  held->Finish();
  big_ctx.TryCancel();
  caller.join();
  EXPECT_EQ(big_status.error_code(), grpc::StatusCode::CANCELLED);
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_requests_total", {"code=\"RESOURCE_EXHAUSTED\""}), 2);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// Every way a request ends gives its memory back: with a budget that holds
// one request (plus the backend's workspace) and not two, requests that
// succeed, fail validation after their memory was reserved, or are refused
// can follow each other indefinitely; one twice the size is refused.
TEST(ServiceLifecycle, MemoryBudgetIsReleasedOnEveryPath) {
  const Request one = make_request(Mode::kExact, 1000, 2);
  const int64_t request_bytes = 4 * static_cast<int64_t>(one.q.size());  // q, k, v, out
  std::vector<uint8_t> out(one.q.size());
  TensorRefs t;
  t.q = one.q.data();
  t.k = one.k.data();
  t.v = one.v.data();
  t.out = out.data();
  StatusOr<AttentionParams> p = make_params(one.options, t);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  StatusOr<Backend*> cpu = BackendRegistry::global().find("cpu");
  ASSERT_TRUE(cpu.ok());
  // The server plans for all cores (--threads 0), as this plan does.
  const StatusOr<Plan> plan = plan_attention(**cpu, *p, PlanLimits{});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const int64_t budget = request_bytes + plan->workspace().host_bytes + request_bytes / 2;
  ServerProcess server({"--memory-budget", std::to_string(budget), "--backend", "cpu"});
  ASSERT_TRUE(server.started()) << server.log();
  Client c(server.grpc_address());

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    AttendReply reply;
    grpc::Status s = c.attend(one.call(), &reply);
    EXPECT_TRUE(s.ok()) << client::status_string(s);
    // Reserved at the header, then the stream ends without its end message.
    auto rpc = testing::plaintext_attention_client(server.grpc_address());
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    v1::AttendRequest m;
    *m.mutable_header() = client::make_header(one.call());
    stream->Write(m);
    stream->WritesDone();
    v1::AttendResponse r;
    while (stream->Read(&r)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    // A NaN found after the whole input arrived, at make_params.
    Request nan = one;
    nan.v[8] = 0xff, nan.v[9] = 0xff, nan.v[10] = 0xc0, nan.v[11] = 0x7f;
    s = c.attend(nan.call(), &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << client::status_string(s);
  }
  const Request two = make_request(Mode::kExact, 2000, 2);
  AttendReply reply;
  const grpc::Status refused = c.attend(two.call(), &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("memory-budget"), std::string::npos) << refused.error_message();
  EXPECT_TRUE(c.attend(one.call(), &reply).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// The server must serve /metrics in a process that loads the CUDA backend
// library (libcublasLt's 92 KiB of static TLS once broke the old metrics
// server's 100 KiB thread stacks; test_metrics_port.cpp attacks that process).
TEST(ServiceMetrics, ServedWhenTheCudaLibraryIsLoaded) {
  const std::string lib = PLSH_CUDA_LIBRARY;
  struct stat st {};
  if (stat(lib.c_str(), &st) != 0) GTEST_SKIP() << lib << " not built here (no CUDA toolkit): nothing to check";
  ServerProcess server({}, {"PLSH_CUDA_BACKEND=" + lib});
  ASSERT_TRUE(server.started()) << server.log();
  // The library (and with it cuBLAS) really loaded: its factory ran, and
  // either found a device or said why not.
  const std::string log = server.log();
  EXPECT_TRUE(log.find("name=cuda") != std::string::npos || log.find("cuda backend unavailable") != std::string::npos)
      << log;
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_build_info"), 1) << server.log();
  std::string health;
  ASSERT_TRUE(Client(server.grpc_address()).health("", &health).ok());
  EXPECT_EQ(health, "SERVING");
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace plsh
