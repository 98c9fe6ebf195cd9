// Clients that stall, dribble, stop reading or send what does not parse
// (issue 12): the server ends such streams, gives their memory back, counts
// them by reason, and logs and counts the code the client really got.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "integration_util.h"

namespace plsh {
namespace {

using testing::scrape;
using testing::seconds_since;

using Clock = std::chrono::steady_clock;

struct SmallRequest {
  AttentionOptions options;
  std::vector<float> q, k, v;
  AttendCall call() const { return testing::attend_call(options, q, k, v, 60); }
};

SmallRequest small_request(int64_t n = 64) {
  SmallRequest r;
  r.options.q_len = r.options.kv_len = n;
  r.options.heads = 2;
  r.options.head_dim = 16;
  r.options.mode = Mode::kExact;
  r.options.causal = true;
  r.q.assign(static_cast<size_t>(n * 2 * 16), 0.25f);
  r.k = r.q;
  r.v = r.q;
  return r;
}

v1::AttendRequest header_of(const AttentionOptions& o) {
  AttendCall call;
  call.options = o;
  v1::AttendRequest m;
  *m.mutable_header() = client::make_header(call);
  return m;
}

// A header for a request of `input_bytes` of q + k + v (f32, H = 8, D = 64).
AttentionOptions options_with_input(int64_t rows) {
  AttentionOptions o;
  o.q_len = o.kv_len = rows;
  o.heads = 8;
  o.head_dim = 64;
  o.mode = Mode::kExact;
  return o;
}

// Reads a stream to its end; returns its status.
grpc::Status drain(grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>* stream) {
  v1::AttendResponse r;
  while (stream->Read(&r)) {
  }
  return stream->Finish();
}

// A header, then silence: the stream holds its memory until
// --stream-idle-timeout, then ends with DEADLINE_EXCEEDED naming the flag,
// and the memory serves the next request.
TEST(Hardening, AStreamSilentAfterItsHeaderTimesOutAndGivesItsMemoryBack) {
  const AttentionOptions big = options_with_input(1 << 16);  // 512 MiB of q, k, v, out
  ServerProcess server(
      {"--backend", "cpu", "--stream-idle-timeout", "1.5", "--memory-budget", std::to_string(int64_t{700} << 20)});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  grpc::ClientContext ctx;
  auto stream = rpc->Attend(&ctx);
  ASSERT_TRUE(stream->Write(header_of(big)));
  v1::AttendResponse ack;
  ASSERT_TRUE(stream->Read(&ack));
  ASSERT_TRUE(ack.has_ack());
  EXPECT_GT(metric_sum(scrape(server), "plsh_memory_reserved_bytes", {"space=\"host\""}), 512 << 20);

  // While it holds the budget, another 512 MiB request is refused...
  {
    grpc::ClientContext ctx2;
    auto other = rpc->Attend(&ctx2);
    ASSERT_TRUE(other->Write(header_of(big)));
    EXPECT_EQ(drain(other.get()).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // ...until the silent one times out.
  const auto t0 = Clock::now();
  const grpc::Status s = drain(stream.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_NE(s.error_message().find("--stream-idle-timeout"), std::string::npos) << s.error_message();
  EXPECT_LT(seconds_since(t0), 5.0);

  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_stream_timeouts_total", {"reason=\"receive_idle\""}), 1);
  EXPECT_EQ(metric_sum(m, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
  EXPECT_EQ(metric_sum(m, "plsh_memory_budget_bytes", {"space=\"host\""}), 700 << 20);
  EXPECT_EQ(metric_sum(m, "plsh_requests_total", {"code=\"DEADLINE_EXCEEDED\""}), 1) << server.log();
  EXPECT_NE(server.log().find("receive_idle"), std::string::npos);

  Client c(server.grpc_address());
  const SmallRequest small = small_request();
  AttendReply reply;
  EXPECT_TRUE(c.attend(small.call(), &reply).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// Streams that never send a header fill --max-concurrent no longer than the
// idle timeout.
TEST(Hardening, StreamsWithoutAHeaderTimeOutAndFreeTheirSlots) {
  ServerProcess server({"--backend", "cpu", "--stream-idle-timeout", "1", "--max-concurrent", "3"});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>>> streams;
  for (int i = 0; i < 3; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(rpc->Attend(contexts.back().get()));
  }
  // Once the server holds all three, a fourth is refused.
  ASSERT_TRUE(testing::eventually([&] { return metric_sum(scrape(server), "plsh_inflight_requests") == 3; }));
  Client c(server.grpc_address());
  const SmallRequest small = small_request();
  AttendReply reply;
  EXPECT_EQ(c.attend(small.call(), &reply).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  for (auto& s : streams) EXPECT_EQ(drain(s.get()).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(c.attend(small.call(), &reply).ok());
  EXPECT_EQ(metric_sum(scrape(server), "plsh_stream_timeouts_total", {"reason=\"receive_idle\""}), 3);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// A client that sends one row every 0.3 s is never idle for 1 s, yet far
// below --min-stream-rate: it ends within idle + bytes / rate.
TEST(Hardening, ADribblingClientIsCutByTheMinimumRate) {
  const AttentionOptions o = options_with_input(1024);  // 3 x 2 MiB of q, k, v: allowed 1 + 6 MiB / 2 MiB = 4 s
  ServerProcess server(
      {"--backend", "cpu", "--stream-idle-timeout", "1", "--min-stream-rate", std::to_string(2 << 20)});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  grpc::ClientContext ctx;
  auto stream = rpc->Attend(&ctx);
  ASSERT_TRUE(stream->Write(header_of(o)));
  const std::vector<float> row(static_cast<size_t>(8 * 64), 0.5f);
  const auto t0 = Clock::now();
  // One thread reads (the status arrives as soon as the server ends the
  // stream), this one dribbles until then.
  std::atomic<bool> ended{false};
  double ended_after = 0;
  grpc::Status s;
  std::thread reader([&] {
    s = drain(stream.get());
    ended_after = seconds_since(t0);
    ended = true;
  });
  for (int64_t r = 0; r < 1024 && !ended && seconds_since(t0) < 15; ++r) {
    v1::AttendRequest m;
    v1::TensorChunk* c = m.mutable_chunk();
    c->set_tensor(v1::TENSOR_Q);
    c->set_row_start(r);
    c->set_row_count(1);
    c->set_data(row.data(), row.size() * 4);
    if (!stream->Write(m)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  stream->WritesDone();
  reader.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_NE(s.error_message().find("--min-stream-rate"), std::string::npos) << s.error_message();
  EXPECT_GT(ended_after, 3.5);  // 1 s + 6 MiB at 2 MiB/s, checked every 0.25 s
  EXPECT_LT(ended_after, 6.0);
  EXPECT_EQ(metric_sum(scrape(server), "plsh_stream_timeouts_total", {"reason=\"receive_slow\""}), 1);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// A client that sends a whole request and then never reads its 32 MiB of
// output: the server's writes stall, the stream is cancelled after the idle
// timeout and its memory comes back. The log names what the client got.
TEST(Hardening, AClientThatDoesNotReadItsOutputTimesOut) {
  ServerProcess server({"--backend", "cpu", "--stream-idle-timeout", "1"});
  ASSERT_TRUE(server.started()) << server.log();
  // Exact, one key: trivial to compute, 65536 x 8 x 16 f32 = 32 MiB out.
  SmallRequest r;
  r.options.q_len = 65536;
  r.options.kv_len = 1;
  r.options.heads = 8;
  r.options.head_dim = 16;
  r.options.mode = Mode::kExact;
  r.q.assign(static_cast<size_t>(65536 * 8 * 16), 0.5f);
  r.k.assign(static_cast<size_t>(8 * 16), 0.5f);
  r.v = r.k;
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  grpc::ClientContext ctx;
  auto stream = rpc->Attend(&ctx);
  ASSERT_TRUE(stream->Write(header_of(r.options)));
  const struct {
    v1::Tensor t;
    const std::vector<float>& data;
    int64_t rows;
  } inputs[] = {{v1::TENSOR_Q, r.q, 65536}, {v1::TENSOR_K, r.k, 1}, {v1::TENSOR_V, r.v, 1}};
  for (const auto& in : inputs) {
    const int64_t row_floats = 8 * 16, per = 4096;  // 2 MiB messages
    for (int64_t row = 0; row < in.rows; row += per) {
      const int64_t n = std::min(per, in.rows - row);
      v1::AttendRequest m;
      v1::TensorChunk* c = m.mutable_chunk();
      c->set_tensor(in.t);
      c->set_row_start(row);
      c->set_row_count(n);
      c->set_data(in.data.data() + row * row_floats, static_cast<size_t>(n * row_floats * 4));
      ASSERT_TRUE(stream->Write(m));
    }
  }
  v1::AttendRequest end;
  end.mutable_end();
  ASSERT_TRUE(stream->Write(end));
  // Never read. Wait for the server to give up.
  EXPECT_TRUE(testing::eventually(
      [&] { return metric_sum(scrape(server), "plsh_stream_timeouts_total", {"reason=\"send_idle\""}) == 1; }, 20));
  const auto t1 = Clock::now();
  EXPECT_TRUE(testing::eventually([&] { return metric_sum(scrape(server), "plsh_inflight_requests") == 0; }));
  EXPECT_LT(seconds_since(t1), 1.0) << "the memory came back only after the stuck write failed";
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
  EXPECT_EQ(metric_sum(m, "plsh_inflight_requests"), 0) << server.log();
  // The client's view: the stream was cancelled.
  EXPECT_EQ(drain(stream.get()).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(metric_sum(scrape(server), "plsh_requests_total", {"code=\"CANCELLED\""}), 1) << server.log();
  EXPECT_NE(server.log().find("send_idle"), std::string::npos) << server.log();
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// SIGTERM does not wait for a client that sent only a header: it gets
// UNAVAILABLE at once and the server exits well inside --drain-timeout.
TEST(Hardening, DrainEndsStreamsStillReceiving) {
  ServerProcess server({"--backend", "cpu", "--stream-idle-timeout", "600", "--drain-timeout", "30"});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  grpc::ClientContext ctx;
  auto stream = rpc->Attend(&ctx);
  ASSERT_TRUE(stream->Write(header_of(small_request().options)));
  v1::AttendResponse ack;
  ASSERT_TRUE(stream->Read(&ack));
  const auto t0 = Clock::now();
  std::thread stop([&] { EXPECT_EQ(server.terminate(), 0) << server.log(); });
  const grpc::Status s = drain(stream.get());
  stop.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_NE(server.log().find("stop_reason=drain"), std::string::npos);
}

// Messages over --max-message-bytes and bytes that are no AttendRequest:
// the log and plsh_requests_total carry the code the client got.
TEST(Hardening, RefusedMessagesAreCountedWithTheCodeTheClientGot) {
  ServerProcess server({"--backend", "cpu", "--max-message-bytes", std::to_string(64 << 10)});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  // A 100 KB header: 12800 slopes.
  AttentionOptions o = small_request().options;
  o.heads = 12800;
  o.slopes.assign(12800, 0.5);
  {
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    stream->Write(header_of(o));
    EXPECT_EQ(drain(stream.get()).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // An oversized chunk after a valid header.
  {
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    ASSERT_TRUE(stream->Write(header_of(small_request(4096).options)));
    v1::AttendRequest m;
    v1::TensorChunk* c = m.mutable_chunk();
    c->set_tensor(v1::TENSOR_Q);
    c->set_row_start(0);
    c->set_row_count(1000);
    c->set_data(std::string(1000 * 2 * 16 * 4, '\0'));  // 128000 bytes
    stream->Write(m);
    EXPECT_EQ(drain(stream.get()).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // Bytes that do not parse as an AttendRequest, through gRPC's generic client.
  grpc::Status garbage;
  {
    grpc::GenericStub generic(testing::plaintext_channel(server.grpc_address()));
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    auto call = generic.PrepareCall(&ctx, "/plsh.v1.Attention/Attend", &cq);
    void* tag = nullptr;
    bool ok = false;
    call->StartCall(reinterpret_cast<void*>(1));
    cq.Next(&tag, &ok);
    const std::string junk = "\x0a\xff\xff\xff\xff\x0f" + std::string(16, '\xff');
    grpc::Slice slice(junk);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    grpc::ByteBuffer reply;
    call->Read(&reply, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    call->Finish(&garbage, reinterpret_cast<void*>(5));
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
    }
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
  }
  EXPECT_NE(garbage.error_code(), grpc::StatusCode::OK);
  // The counters agree with what the clients saw, once the server has
  // closed all three calls.
  ASSERT_TRUE(testing::eventually([&] { return metric_sum(scrape(server), "plsh_inflight_requests") == 0; }));
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_requests_total", {"code=\"RESOURCE_EXHAUSTED\""}), 2);
  const std::string garbage_code = client::status_code_name(garbage.error_code());
  EXPECT_EQ(metric_sum(m, "plsh_requests_total", {"code=\"" + garbage_code + "\""}), 1) << garbage_code;
  EXPECT_EQ(metric_sum(m, "plsh_requests_total"), 3);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// An lsh header whose draws alone (heads x samples) exceed the budget is
// refused before they are made: planning holds their bound against the
// budget (it used to allocate 1.3 GB per such header, then compare).
TEST(Hardening, DrawsBeyondTheBudgetAreRefusedBeforeTheyAreMade) {
  ServerProcess server({"--backend", "cpu", "--memory-budget", std::to_string(int64_t{32} << 20)});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  AttentionOptions o;
  o.q_len = o.kv_len = 1;
  o.head_dim = 1;
  o.mode = Mode::kLsh;
  o.samples = 4096;
  // 82M draws (1.3 GB): past the draws a request may have at all; 4M (64
  // MB): past this budget.
  for (const auto& [heads, expected] :
       {std::pair{int64_t{20000}, "made with the header"}, std::pair{int64_t{1024}, "can never fit"}}) {
    SCOPED_TRACE(heads);
    o.heads = heads;
    const auto t0 = Clock::now();
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    ASSERT_TRUE(stream->Write(header_of(o)));
    const grpc::Status s = drain(stream.get());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find(expected), std::string::npos) << s.error_message();
    EXPECT_LT(seconds_since(t0), 2.0) << "the draws were made before the refusal";
  }
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// A scale whose scores float32 cannot hold is refused (it used to return OK
// with a NaN probe error that turned the histogram's sum into NaN); a 1 MB
// backend name gets a short, escaped message and log line.
TEST(Hardening, HostileValuesAreRefusedShortlyAndNothingNonFiniteReachesMetrics) {
  ServerProcess server({"--backend", "cpu"});
  ASSERT_TRUE(server.started()) << server.log();
  Client c(server.grpc_address());
  SmallRequest r = small_request();
  r.options.mode = Mode::kLsh;
  AttendCall call = r.call();
  call.options.scale = 1e308;
  AttendReply reply;
  grpc::Status s = c.attend(call, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("scale"), std::string::npos);

  call = r.call();
  call.backend = std::string(1 << 20, 'x') + "\n\x1b[31m";
  s = c.attend(call, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size(), 300u) << s.error_message().size();
  ASSERT_TRUE(c.attend(r.call(), &reply).ok());
  const auto m = scrape(server);
  EXPECT_TRUE(std::isfinite(metric_sum(m, "plsh_probe_relative_error_sum")));
  EXPECT_TRUE(std::isfinite(metric_sum(m, "plsh_mask_max_error_sum")));
  EXPECT_EQ(server.terminate(), 0);
  // No log line anywhere near the backend string's size, no raw escape.
  const std::string log = server.log();
  EXPECT_LT(log.size(), 100000u);
  EXPECT_EQ(log.find("\x1b[31m"), std::string::npos);
}

}  // namespace
}  // namespace plsh
