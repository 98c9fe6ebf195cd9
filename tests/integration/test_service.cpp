// plsh-server end to end: the real binary on loopback, called through the
// C++ client library (and raw stubs where a test must break the protocol).
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "integration_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"

namespace plsh {
namespace {

struct Inputs {
  AttentionOptions options;
  std::vector<uint8_t> q, k, v;
};

// Gaussian q, k, v in options.dtype, fixed seed.
Inputs make_inputs(const AttentionOptions& o, uint64_t seed) {
  Inputs in;
  in.options = o;
  testing::Gaussian(seed).qkv(o, &in.q, &in.k, &in.v);
  return in;
}

struct Local {
  std::vector<uint8_t> out;
  std::vector<float> lse;
  AttentionResult result;
};

// The same request in this process, on the CPU backend.
Local compute_local(const Inputs& in) {
  const AttentionOptions& o = in.options;
  Local l;
  l.out.resize(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) *
               dtype_bytes(o.out_dtype.value_or(o.dtype)));
  l.lse.resize(static_cast<size_t>(o.batch * o.q_len * o.heads));
  TensorRefs t;
  t.q = in.q.data();
  t.k = in.k.data();
  t.v = in.v.data();
  t.out = l.out.data();
  t.lse = l.lse.data();
  StatusOr<AttentionParams> p = make_params(o, t);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  StatusOr<Backend*> b = BackendRegistry::global().find("cpu");
  EXPECT_TRUE(b.ok());
  StatusOr<AttentionResult> r = run_attention(**b, *p, PlanLimits{}, ExecContext{});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  l.result = *r;
  return l;
}

AttendCall call_for(const Inputs& in, int64_t chunk_bytes = 0) {
  AttendCall c = testing::attend_call(in.options, in.q, in.k, in.v, 60);
  c.return_lse = true;
  c.chunk_bytes = chunk_bytes;
  return c;
}

// max |a - b| / max |b| over float32 arrays.
double rel_diff(const float* a, const float* b, size_t n) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

class ServiceTest : public testing::SharedServerTest<ServiceTest> {
 public:
  static std::vector<std::string> server_flags() {
    return {"--max-samples", "256", "--max-tokens", "100000", "--threads", "2"};
  }
};

AttentionOptions small_options(Mode mode) { return testing::odd_gqa_options(mode, true); }

TEST_F(ServiceTest, EveryModeEqualsInProcessStreamedAndUnary) {
  Client c(server_->grpc_address());
  for (Mode mode : {Mode::kExact, Mode::kLsh, Mode::kWindow}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string(mode_name(mode)) + (causal ? " causal" : ""));
      AttentionOptions o = small_options(mode);
      o.causal = causal;
      const Inputs in = make_inputs(o, 11);
      const Local local = compute_local(in);
      // 3000-byte chunks: several rows per chunk, many chunks, a ragged last one.
      for (bool unary : {false, true}) {
        AttendReply reply;
        const grpc::Status s = unary ? c.attend_unary(call_for(in), &reply) : c.attend(call_for(in, 3000), &reply);
        ASSERT_TRUE(s.ok()) << client::status_string(s);
        const size_t n = local.out.size() / sizeof(float);
        EXPECT_LE(rel_diff(reinterpret_cast<const float*>(reply.out.data()),
                           reinterpret_cast<const float*>(local.out.data()), n),
                  1e-6);
        EXPECT_LE(rel_diff(reply.lse.data(), local.lse.data(), local.lse.size()), 1e-6);
        EXPECT_EQ(reply.result.mode, mode);
        EXPECT_EQ(reply.result.backend, "cpu");
        // rel_err = ||o~ - o*|| / ||o*||: outputs 1e-6 apart move it by at most ~1e-6 (triangle inequality).
        EXPECT_NEAR(reply.result.probe.rel_err, local.result.probe.rel_err, 1e-6);
        EXPECT_NEAR(reply.result.mask_max_err, local.result.mask_max_err, 1e-12);
        EXPECT_EQ(reply.result.heads.size(), local.result.heads.size());
        EXPECT_GT(reply.timings.total, 0);
        EXPECT_GE(reply.timings.computing, 0);
        if (!unary) {
          EXPECT_GT(reply.messages, 10);  // it really streamed
        }
      }
    }
  }
}

// A case of the bad-input table: a way to send a request, and what must come back.
using Send = std::function<grpc::Status(const std::string& target)>;
struct BadCase {
  std::string name;
  Send send;
  grpc::StatusCode code;
  std::string must_mention;
};

// A call through the client library whose options (or inputs) the edits break.
Send attend_with(std::function<void(AttentionOptions&)> edit, std::function<void(Inputs&)> edit_inputs = nullptr) {
  return [edit = std::move(edit), edit_inputs = std::move(edit_inputs)](const std::string& target) {
    AttentionOptions o = small_options(Mode::kLsh);
    o.q_len = 8;
    o.kv_len = 8;
    // Inputs come from a valid shape; the edit then breaks the header.
    Inputs in = make_inputs(o, 3);
    if (edit_inputs) edit_inputs(in);
    AttendCall call = call_for(in);
    edit(call.options);
    AttendReply reply;
    return Client(target).attend(call, &reply);
  };
}

// Raw messages, for breaking the protocol itself.
grpc::Status raw_stream(const std::string& target, const std::vector<v1::AttendRequest>& messages,
                        bool writes_done = true) {
  auto channel = testing::plaintext_channel(target);
  auto rpc = v1::Attention::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = rpc->Attend(&ctx);
  for (const v1::AttendRequest& m : messages)
    if (!stream->Write(m)) break;
  if (writes_done) stream->WritesDone();
  v1::AttendResponse r;
  while (stream->Read(&r)) {
  }
  return stream->Finish();
}

v1::AttendRequest header_msg(int64_t q_len = 4, int64_t kv_len = 4) {
  v1::AttendRequest m;
  v1::AttendHeader* h = m.mutable_header();
  h->set_q_len(q_len);
  h->set_kv_len(kv_len);
  h->set_heads(2);
  h->set_head_dim(8);
  h->set_dtype(v1::DTYPE_F32);
  h->set_mode(v1::MODE_EXACT);
  return m;
}

v1::AttendRequest chunk_msg(v1::Tensor t, int64_t start, int64_t count, int64_t row_bytes = 2 * 8 * 4) {
  v1::AttendRequest m;
  v1::TensorChunk* c = m.mutable_chunk();
  c->set_tensor(t);
  c->set_row_start(start);
  c->set_row_count(count);
  c->set_data(std::string(static_cast<size_t>(count * row_bytes), '\0'));
  return m;
}

v1::AttendRequest end_msg() {
  v1::AttendRequest m;
  m.mutable_end();
  return m;
}

std::vector<v1::AttendRequest> full_input(int64_t rows = 4) {
  return {chunk_msg(v1::TENSOR_Q, 0, rows), chunk_msg(v1::TENSOR_K, 0, rows), chunk_msg(v1::TENSOR_V, 0, rows)};
}

// Writes these raw messages.
Send stream_of(std::vector<v1::AttendRequest> messages) {
  return [messages = std::move(messages)](const std::string& target) { return raw_stream(target, messages); };
}

// One header, edited the way the client library never would.
Send header_with(const std::function<void(v1::AttendHeader&)>& edit) {
  v1::AttendRequest m = header_msg();
  edit(*m.mutable_header());
  return stream_of({m});
}

std::vector<v1::AttendRequest> concat(std::vector<v1::AttendRequest> a, const std::vector<v1::AttendRequest>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_F(ServiceTest, BadInputTableGetsTheRightCodeAndNamesTheField) {
  using SC = grpc::StatusCode;
  const auto INV = SC::INVALID_ARGUMENT;
  const auto RES = SC::RESOURCE_EXHAUSTED;
  std::vector<BadCase> cases = {
      {"heads 0", attend_with([](auto& o) { o.heads = 0; }), INV, "heads"},
      {"H % Hkv != 0", attend_with([](auto& o) { o.kv_heads = 3; }), INV, "kv_heads"},
      {"head_dim over 1024", attend_with([](auto& o) { o.head_dim = 2000; }), INV, "head_dim"},
      {"q_len 0", attend_with([](auto& o) { o.q_len = 0; }), INV, "q_len"},
      {"negative slope", attend_with([](auto& o) {
         o.slopes = {0.5, -0.1, 0.2, 0.1};
       }),
       INV, "slopes[1]"},
      {"slopes count", attend_with([](auto& o) { o.slopes = {0.5}; }), INV, "slopes"},
      {"samples 0", attend_with([](auto& o) { o.samples = 0; }), INV, "samples"},
      {"samples over --max-samples", attend_with([](auto& o) { o.samples = 257; }), RES, "samples"},
      {"N over --max-tokens", attend_with([](auto& o) { o.kv_len = 200000; }), RES, "max-tokens"},
      {"negative scale", attend_with([](auto& o) { o.scale = -1.0; }), INV, "scale"},
      {"causal with no key for row 0", attend_with([](auto& o) { o.q_pos0 = -5; }), INV, "q_pos0"},
      {"window_eps out of (0, 1)", attend_with([](auto& o) {
         o.mode = Mode::kWindow;
         o.window_eps = 2;
       }),
       INV, "window_eps"},
      {"NaN in q",
       attend_with([](auto&) {},
                   [](Inputs& in) {
                     const float nan = std::nanf("");
                     std::memcpy(in.q.data() + 4 * 45, &nan, 4);
                   }),
       INV, "q has a non-finite value"},
      {"unknown dtype", header_with([](auto& h) { h.set_dtype(static_cast<v1::DType>(9)); }), INV, "dtype"},
      {"dtype unspecified", header_with([](auto& h) { h.clear_dtype(); }), INV, "dtype"},
      {"unknown mode", header_with([](auto& h) { h.set_mode(static_cast<v1::Mode>(7)); }), INV, "mode"},
      {"unknown backend", header_with([](auto& h) { h.set_backend("tpu"); }), INV, "backend"},
      {"request_id too long", header_with([](auto& h) { h.set_request_id(std::string(200, 'x')); }), INV, "request_id"},
      {"data before header", stream_of(full_input()), INV, "header"},
      {"end before header", stream_of({end_msg()}), INV, "header"},
      {"header twice", stream_of({header_msg(), header_msg()}), INV, "header"},
      {"chunk out of range", stream_of({header_msg(), chunk_msg(v1::TENSOR_Q, 3, 2)}), INV, "row_count"},
      {"chunk row_start past the end", stream_of({header_msg(), chunk_msg(v1::TENSOR_K, 4, 1)}), INV, "row_start"},
      {"overlapping chunks", stream_of({header_msg(), chunk_msg(v1::TENSOR_V, 0, 3), chunk_msg(v1::TENSOR_V, 2, 2)}),
       INV, "overlap"},
      {"wrong byte count", stream_of({header_msg(), chunk_msg(v1::TENSOR_Q, 0, 2, 60)}), INV, "data"},
      {"chunk of no tensor", stream_of({header_msg(), chunk_msg(v1::TENSOR_UNSPECIFIED, 0, 1)}), INV, "chunk.tensor"},
      {"chunk of an output tensor", stream_of({header_msg(), chunk_msg(v1::TENSOR_OUT, 0, 1)}), INV, "chunk.tensor"},
      {"rows missing at end",
       stream_of({header_msg(), chunk_msg(v1::TENSOR_Q, 0, 4), chunk_msg(v1::TENSOR_K, 0, 4),
                  chunk_msg(v1::TENSOR_V, 0, 2), end_msg()}),
       INV, "missing"},
      {"stream ended early (no end)", stream_of(concat({header_msg()}, full_input())), INV, "end"},
      {"message with nothing set", stream_of({v1::AttendRequest{}}), INV, "kind"},
      {"unary q of the wrong size",
       [](auto& t) {
         auto rpc = testing::plaintext_attention_client(t);
         grpc::ClientContext ctx;
         v1::AttendUnaryRequest req;
         *req.mutable_header() = header_msg().header();
         req.set_q(std::string(10, '\0'));
         v1::AttendUnaryResponse resp;
         return rpc->AttendUnary(&ctx, req, &resp);
       },
       INV, "q = 10 bytes"},
  };
  ASSERT_GE(cases.size(), 20u);
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    const grpc::Status s = bad.send(server_->grpc_address());
    EXPECT_EQ(s.error_code(), bad.code) << client::status_string(s);
    EXPECT_NE(s.error_message().find(bad.must_mention), std::string::npos) << client::status_string(s);
  }
  // Still healthy, and a good request still works.
  Client c(server_->grpc_address());
  std::string health;
  ASSERT_TRUE(c.health("plsh.v1.Attention", &health).ok());
  EXPECT_EQ(health, "SERVING");
  EXPECT_TRUE(raw_stream(server_->grpc_address(), concat(concat({header_msg()}, full_input()), {end_msg()})).ok());
  EXPECT_TRUE(server_->running());
}

TEST_F(ServiceTest, GetInfoSaysBackendsLimitsAndDefaults) {
  v1::GetInfoResponse info;
  ASSERT_TRUE(Client(server_->grpc_address()).info(&info).ok());
  EXPECT_FALSE(info.version().empty());
  ASSERT_GE(info.backends_size(), 1);
  EXPECT_EQ(info.backends(info.backends_size() - 1).name(), "cpu");
  EXPECT_EQ(info.limits().max_samples(), 256);
  EXPECT_EQ(info.limits().max_tokens(), 100000);
  EXPECT_EQ(info.limits().max_message_bytes(), 4 << 20);
  EXPECT_EQ(info.defaults().samples(), 16);
}

// Every message stays under the limit whatever N is.
TEST(ServiceLarge, N65536H8D64F16StreamsUnderTheMessageLimit) {
  ServerProcess server({"--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  AttentionOptions o;
  o.q_len = o.kv_len = 65536;
  o.heads = 8;
  o.head_dim = 64;
  o.dtype = DType::kF16;
  o.mode = Mode::kWindow;
  o.window_width = 16;  // a narrow band keeps this about I/O, not compute
  o.causal = true;
  o.estimates = false;
  const Inputs in = make_inputs(o, 5);
  AttendReply reply;
  const auto t0 = std::chrono::steady_clock::now();
  const grpc::Status s = Client(server.grpc_address()).attend(call_for(in), &reply);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(reply.largest_message_bytes, 4 << 20);
  EXPECT_GT(reply.messages, 4 * 65536 * 8 * 64 * 2 / (4 << 20));  // q, k, v, out: at least this many messages
  const Local local = compute_local(in);
  ASSERT_EQ(reply.out.size(), local.out.size());
  // The same float32 arithmetic up to summation order (the backend's
  // threads), then rounded to float16: at most one float16 ulp apart
  // (2^-10 relative, 2^-24 absolute at subnormals).
  const auto* a = reinterpret_cast<const uint16_t*>(reply.out.data());
  const auto* b = reinterpret_cast<const uint16_t*>(local.out.data());
  int64_t over_one_ulp = 0;
  for (size_t i = 0; i < local.out.size() / 2; ++i) {
    const float x = half_to_float(a[i]), y = half_to_float(b[i]);
    if (std::fabs(x - y) > std::ldexp(std::max(std::fabs(x), std::fabs(y)), -10) + std::ldexp(1.0f, -24))
      ++over_one_ulp;
  }
  EXPECT_EQ(over_one_ulp, 0);
  RecordProperty("seconds", std::to_string(seconds));
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace plsh

namespace plsh {
namespace {

// One lse row (4 bytes per head) can be wider than one out row (2 bytes per
// element at head_dim 1): with return_lse, that row must fit in a message
// too, or the server would compute and then fail to send. Refused up front.
TEST(ServiceLarge, LseRowOverTheMessageLimitIsRefusedBeforeTheAck) {
  ServerProcess server({"--threads", "2", "--max-message-bytes", "65536"});
  ASSERT_TRUE(server.started()) << server.log();
  AttentionOptions o;
  o.q_len = o.kv_len = 4;
  o.heads = 16384;  // q/out rows 32 KiB in f16, lse rows 64 KiB
  o.head_dim = 1;
  o.dtype = DType::kF16;
  o.mode = Mode::kExact;
  const Inputs in = make_inputs(o, 3);
  client::AttendCall call = call_for(in);
  call.return_lse = true;
  AttendReply reply;
  const grpc::Status s = Client(server.grpc_address()).attend(call, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << client::status_string(s);
  EXPECT_NE(s.error_message().find("return_lse"), std::string::npos) << s.error_message();
  call.return_lse = false;  // without lse the same request fits
  const grpc::Status ok = Client(server.grpc_address()).attend(call, &reply);
  EXPECT_TRUE(ok.ok()) << client::status_string(ok);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace plsh
