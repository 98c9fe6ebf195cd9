// AttendBackward and kept contexts end to end (SPEC section 8, issue 10):
// the real plsh-server on loopback through the C++ client library (raw
// stubs where a test breaks the protocol).
//   - gradients through the server against the float64 reference
//     (tests/kernels/reference.h) and, bit for bit, against the same
//     forward+backward in this process (one thread both sides, so the CPU
//     backward's dq accumulation runs in one order);
//   - the stateless forms give the same bits as the kept context;
//   - bad backward requests get the contract's codes;
//   - contexts never leak: the plsh_contexts gauge (and the reserved host
//     bytes) return to 0 after TTL, release, eviction, consumption, a
//     cancelled forward, and a drain;
//   - with tokens, contexts are bound to their client.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "integration_util.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "reference.h"
#include "trust_files.h"

namespace plsh {
namespace {

using client::BackwardCall;
using client::BackwardReply;
using testing::eventually;
using testing::odd_gqa_options;
using testing::scrape;

double gauge(const ServerProcess& s, const std::string& name, const std::vector<std::string>& labels = {}) {
  return metric_sum(scrape(s), name, labels);
}

// q, k, v and dout ~ N(0, 1) in the options' dtypes, fixed seed.
struct Problem {
  AttentionOptions options;
  std::vector<uint8_t> q, k, v, dout;
};

Problem make_problem(const AttentionOptions& o, uint64_t seed) {
  Problem p;
  p.options = o;
  testing::Gaussian normal(seed);
  normal.qkv(o, &p.q, &p.k, &p.v);
  p.dout = normal.tensor(o.batch * o.q_len * o.heads * o.head_dim, o.out_dtype.value_or(o.dtype));
  return p;
}

AttendCall forward_call(const Problem& p, bool keep_context, int64_t chunk_bytes = 0) {
  AttendCall c = testing::attend_call(p.options, p.q, p.k, p.v, 60);
  c.return_lse = true;
  c.keep_context = keep_context;
  c.chunk_bytes = chunk_bytes;
  return c;
}

BackwardCall by_context(const Problem& p, const std::string& id, bool keep = false, int64_t chunk_bytes = 0) {
  BackwardCall b;
  b.options = p.options;
  b.context_id = id;
  b.keep_context = keep;
  b.dout = p.dout.data();
  b.chunk_bytes = chunk_bytes;
  b.deadline_seconds = 60;
  return b;
}

// p's params in this process, with the forward output in *out (sized here).
StatusOr<AttentionParams> params_for(const Problem& p, std::vector<uint8_t>* out) {
  const AttentionOptions& o = p.options;
  out->resize(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) *
              dtype_bytes(o.out_dtype.value_or(o.dtype)));
  TensorRefs t;
  t.q = p.q.data();
  t.k = p.k.data();
  t.v = p.v.data();
  t.out = out->data();
  StatusOr<AttentionParams> params = make_params(o, t);
  EXPECT_TRUE(params.ok()) << params.status().to_string();
  return params;
}

// The same forward and backward in this process, one thread, CPU.
struct LocalGradients {
  std::vector<uint8_t> dq, dk, dv;
};
LocalGradients local_gradients(const Problem& p, DType grad_dtype) {
  const AttentionOptions& o = p.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  std::vector<uint8_t> out;
  const StatusOr<AttentionParams> params = params_for(p, &out);
  LocalGradients g;
  g.dq.resize(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(grad_dtype));
  g.dk.resize(static_cast<size_t>(o.batch * o.kv_len * kv_heads * o.head_dim) * dtype_bytes(grad_dtype));
  g.dv.resize(g.dk.size());
  GradientRefs refs;
  refs.dout = p.dout.data();
  refs.dq = g.dq.data();
  refs.dk = g.dk.data();
  refs.dv = g.dv.data();
  refs.grad_dtype = grad_dtype;
  PlanLimits limits;
  limits.threads = 1;
  StatusOr<Backend*> cpu = BackendRegistry::global().find("cpu");
  EXPECT_TRUE(cpu.ok());
  StatusOr<ForwardBackwardResult> r = run_forward_backward(**cpu, *params, limits, refs, ExecContext{});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return g;
}

// The float64 reference's gradients (SPEC section 8 from the definition).
testing::ReferenceGradients reference_gradients(const Problem& p) {
  const AttentionOptions& o = p.options;
  std::vector<uint8_t> out;
  const StatusOr<AttentionParams> params = params_for(p, &out);
  const int64_t n = o.batch * o.q_len * o.heads * o.head_dim;
  std::vector<double> dout(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    dout[static_cast<size_t>(i)] = load_element(p.dout.data(), o.out_dtype.value_or(o.dtype), i);
  return testing::reference_backward(*params, testing::dense_inputs(*params), testing::reference_weights(*params),
                                     dout);
}

class BackwardTest : public testing::SharedServerTest<BackwardTest> {
 public:
  // One CPU thread per request: the in-process comparison is bit for bit.
  static std::vector<std::string> server_flags() {
    return {"--max-samples", "256", "--threads", "1", "--context-ttl", "60"};
  }

 protected:
  void TearDown() override {
    // Every test leaves the store empty and the budget whole.
    EXPECT_TRUE(eventually([] { return gauge(*server_, "plsh_contexts") == 0; })) << "contexts left behind";
    EXPECT_TRUE(eventually([] { return gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}) == 0; }));
  }
};

// --------------------------------------------------- gradients

TEST_F(BackwardTest, ByContextMatchesFloat64ReferenceAndInProcessBitForBit) {
  Client c(server_->grpc_address());
  for (Mode mode : {Mode::kExact, Mode::kLsh, Mode::kWindow}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string(mode_name(mode)) + (causal ? " causal" : ""));
      const Problem p = make_problem(odd_gqa_options(mode, causal), 5);
      AttendReply forward;
      // Small chunks both ways: many messages.
      grpc::Status s = c.attend(forward_call(p, true, 3000), &forward);
      ASSERT_TRUE(s.ok()) << client::status_string(s);
      ASSERT_EQ(forward.context_id.size(), 36u) << forward.context_id;  // "ctx-" + 32 hex digits
      EXPECT_EQ(forward.context_id.rfind("ctx-", 0), 0u);
      EXPECT_EQ(forward.context_ttl_seconds, 60);
      EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
      EXPECT_EQ(gauge(*server_, "plsh_context_bytes"), forward.context_bytes);

      BackwardReply grads;
      s = c.backward(by_context(p, forward.context_id, false, 3000), &grads);
      ASSERT_TRUE(s.ok()) << client::status_string(s);
      EXPECT_GT(grads.messages, 10);
      EXPECT_EQ(grads.context_id, forward.context_id);
      EXPECT_FALSE(grads.context_kept);
      EXPECT_EQ(grads.grad_dtype, DType::kF32);
      EXPECT_GT(grads.result.flops, 0);
      EXPECT_EQ(grads.sent_bytes, static_cast<int64_t>(p.dout.size()));  // only dout went up
      EXPECT_EQ(grads.received_bytes, static_cast<int64_t>(grads.dq.size() + grads.dk.size() + grads.dv.size()));

      const LocalGradients local = local_gradients(p, DType::kF32);
      EXPECT_EQ(grads.dq, local.dq) << "dq differs from plsh compute's in-process backward";
      EXPECT_EQ(grads.dk, local.dk);
      EXPECT_EQ(grads.dv, local.dv);

      const testing::ReferenceGradients ref = reference_gradients(p);
      const double dq = testing::compare(grads.dq.data(), DType::kF32, ref.dq).max_rel;
      const double dk = testing::compare(grads.dk.data(), DType::kF32, ref.dk).max_rel;
      const double dv = testing::compare(grads.dv.data(), DType::kF32, ref.dv).max_rel;
      std::printf("%s%s: max_rel vs float64 dq %.2e dk %.2e dv %.2e\n", mode_name(mode), causal ? " causal" : "", dq,
                  dk, dv);
      // float32 tolerance (tests/kernels/test_backward.cpp's).
      EXPECT_LE(dq, 1e-5);
      EXPECT_LE(dk, 1e-5);
      EXPECT_LE(dv, 1e-5);
      // Consumed.
      EXPECT_EQ(gauge(*server_, "plsh_contexts"), 0);
    }
  }
}

// The experiments' baselines through the C++ client (SPEC section 4):
// fixed_blocks (labelled so in the summary, one fixed hash per head) and no
// bias (every slope 0) in exact and lsh, forward and backward against the
// float64 reference, whose fixed-blocks mask is floor(p / 2 sigma) itself.
TEST_F(BackwardTest, BaselinesForwardAndBackwardMatchFloat64Reference) {
  Client c(server_->grpc_address());
  struct Baseline {
    const char* name;
    Mode mode;
    std::vector<double> slopes;
  };
  const Baseline baselines[] = {{"fixed_blocks", Mode::kFixedBlocks, {}},
                                {"fixed_blocks_slopes", Mode::kFixedBlocks, {0.9, 0.05, 1.0 / 300, 0.0}},
                                {"exact_no_bias", Mode::kExact, {0.0, 0.0, 0.0, 0.0}},
                                {"lsh_no_bias", Mode::kLsh, {0.0, 0.0, 0.0, 0.0}}};
  for (const Baseline& b : baselines) {
    SCOPED_TRACE(b.name);
    AttentionOptions o = odd_gqa_options(b.mode, true);
    o.slopes = b.slopes;
    o.return_draws = true;
    const Problem p = make_problem(o, 13);
    AttendReply forward;
    grpc::Status s = c.attend(forward_call(p, true), &forward);
    ASSERT_TRUE(s.ok()) << client::status_string(s);
    EXPECT_EQ(forward.result.mode, b.mode);
    if (b.mode == Mode::kFixedBlocks) {
      EXPECT_EQ(forward.result.samples, 1);
      ASSERT_EQ(forward.result.heads.size(), 4u);
      for (const HeadEstimate& h : forward.result.heads) {
        ASSERT_EQ(h.draws.size(), 1u);
        EXPECT_EQ(h.draws[0].pitch, 2 * h.sigma);
        EXPECT_EQ(h.draws[0].shift, 0.0);
        // Its mask error is its bias: not 0 where the head has a slope.
        if (h.slope > 0) {
          EXPECT_GT(h.mask_max_err, 0.05) << "head " << h.head;
        }
      }
    }
    std::vector<uint8_t> out;
    const StatusOr<AttentionParams> params = params_for(p, &out);
    ASSERT_TRUE(params.ok());
    const testing::ReferenceOutput ref = testing::reference_attention(*params);
    EXPECT_LE(testing::compare(forward.out.data(), DType::kF32, ref.out).max_rel, 1e-5);

    BackwardReply grads;
    s = c.backward(by_context(p, forward.context_id), &grads);
    ASSERT_TRUE(s.ok()) << client::status_string(s);
    const testing::ReferenceGradients g = reference_gradients(p);
    EXPECT_LE(testing::compare(grads.dq.data(), DType::kF32, g.dq).max_rel, 1e-5);
    EXPECT_LE(testing::compare(grads.dk.data(), DType::kF32, g.dk).max_rel, 1e-5);
    EXPECT_LE(testing::compare(grads.dv.data(), DType::kF32, g.dv).max_rel, 1e-5);
  }
}

TEST_F(BackwardTest, HalfPrecisionWithFloat32GradientsMatchesInProcess) {
  Client c(server_->grpc_address());
  AttentionOptions o = odd_gqa_options(Mode::kLsh, true);
  o.dtype = DType::kBF16;
  const Problem p = make_problem(o, 9);
  AttendReply forward;
  ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
  BackwardCall b = by_context(p, forward.context_id);
  b.grad_dtype = DType::kF32;
  BackwardReply grads;
  const grpc::Status s = c.backward(b, &grads);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_EQ(grads.grad_dtype, DType::kF32);
  const LocalGradients local = local_gradients(p, DType::kF32);
  EXPECT_EQ(grads.dq, local.dq);
  EXPECT_EQ(grads.dk, local.dk);
  EXPECT_EQ(grads.dv, local.dv);
}

TEST_F(BackwardTest, StatelessFormsGiveTheKeptContextsBits) {
  Client c(server_->grpc_address());
  for (Mode mode : {Mode::kLsh, Mode::kWindow}) {
    SCOPED_TRACE(mode_name(mode));
    const Problem p = make_problem(odd_gqa_options(mode, true), 13);
    AttendReply forward;
    ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
    BackwardReply kept;
    ASSERT_TRUE(c.backward(by_context(p, forward.context_id), &kept).ok());

    BackwardCall b;
    b.options = p.options;
    b.q = p.q.data();
    b.k = p.k.data();
    b.v = p.v.data();
    b.out = forward.out.data();
    b.lse = forward.lse.data();
    b.dout = p.dout.data();
    b.chunk_bytes = 5000;
    BackwardReply stateless;
    grpc::Status s = c.backward(b, &stateless);
    ASSERT_TRUE(s.ok()) << client::status_string(s);
    EXPECT_EQ(stateless.dq, kept.dq);
    EXPECT_EQ(stateless.dk, kept.dk);
    EXPECT_EQ(stateless.dv, kept.dv);
    EXPECT_EQ(stateless.context_id, "");
    EXPECT_EQ(stateless.forward_flops, 0);
    // Everything went up: q, k, v, out, lse and dout.
    EXPECT_EQ(stateless.sent_bytes, static_cast<int64_t>(p.q.size() + p.k.size() + p.v.size() + forward.out.size() +
                                                         forward.lse.size() * sizeof(float) + p.dout.size()));

    b.out = nullptr;
    b.lse = nullptr;
    b.recompute_forward = true;
    BackwardReply recomputed;
    s = c.backward(b, &recomputed);
    ASSERT_TRUE(s.ok()) << client::status_string(s);
    EXPECT_EQ(recomputed.dq, kept.dq);
    EXPECT_EQ(recomputed.dk, kept.dk);
    EXPECT_EQ(recomputed.dv, kept.dv);
    EXPECT_GT(recomputed.forward_flops, 0);
  }
}

// --------------------------------------------------- context lifetime

TEST_F(BackwardTest, ABackwardConsumesItsContextUnlessAskedToKeepIt) {
  Client c(server_->grpc_address());
  const Problem p = make_problem(odd_gqa_options(Mode::kExact, true), 17);
  AttendReply forward;
  ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
  BackwardReply first, second, third;
  ASSERT_TRUE(c.backward(by_context(p, forward.context_id, /*keep=*/true), &first).ok());
  EXPECT_TRUE(first.context_kept);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
  ASSERT_TRUE(c.backward(by_context(p, forward.context_id), &second).ok());
  EXPECT_EQ(first.dq, second.dq);
  const double consumed = gauge(*server_, "plsh_context_evictions_total", {"reason=\"consumed\""});
  const grpc::Status s = c.backward(by_context(p, forward.context_id), &third);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find(forward.context_id + ": consumed"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("by backward request"), std::string::npos) << s.error_message();
  EXPECT_GE(consumed, 1);
  const auto m = scrape(*server_);
  EXPECT_GE(metric_sum(m, "plsh_requests_total", {"method=\"AttendBackward\"", "code=\"OK\""}), 2);
  EXPECT_GE(metric_sum(m, "plsh_requests_total", {"method=\"AttendBackward\"", "code=\"FAILED_PRECONDITION\""}), 1);
  EXPECT_GE(metric_sum(m, "plsh_backward_duration_seconds_count"), 3);
}

// A reply passed again keeps its gradients' storage (no zero-fill per
// step) and comes back with every byte written: scribbled and wrongly
// sized vectors give the fresh reply's bits.
TEST_F(BackwardTest, AReplyUsedAgainGetsEveryByteWritten) {
  Client c(server_->grpc_address());
  const Problem p = make_problem(odd_gqa_options(Mode::kWindow, true), 23);
  AttendReply forward;
  ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
  BackwardReply fresh, reused;
  ASSERT_TRUE(c.backward(by_context(p, forward.context_id, /*keep=*/true), &fresh).ok());
  reused.dq.assign(fresh.dq.size(), 0xFF);          // the same size, every byte wrong
  reused.dk.assign(fresh.dk.size() + 4096, 0xFF);   // larger
  reused.dv.assign(fresh.dv.size() / 2 + 1, 0xFF);  // smaller
  reused.context_id = "stale";
  const uint8_t* storage = reused.dq.data();
  ASSERT_TRUE(c.backward(by_context(p, forward.context_id), &reused).ok());
  EXPECT_EQ(reused.dq.data(), storage);  // kept, not reallocated
  EXPECT_EQ(reused.dq, fresh.dq);
  EXPECT_EQ(reused.dk, fresh.dk);
  EXPECT_EQ(reused.dv, fresh.dv);
  EXPECT_EQ(reused.context_id, forward.context_id);
  EXPECT_FALSE(reused.context_kept);
}

TEST_F(BackwardTest, ReleaseGivesTheMemoryBack) {
  Client c(server_->grpc_address());
  const Problem p = make_problem(odd_gqa_options(Mode::kWindow, false), 19);
  AttendReply forward;
  ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
  EXPECT_EQ(gauge(*server_, "plsh_context_bytes"), forward.context_bytes);
  EXPECT_EQ(gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}), forward.context_bytes);
  int64_t released = 0;
  ASSERT_TRUE(c.release_context(forward.context_id, &released).ok());
  EXPECT_EQ(released, forward.context_bytes);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 0);
  EXPECT_EQ(gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
  BackwardReply grads;
  grpc::Status s = c.backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("released"), std::string::npos) << s.error_message();
  s = c.release_context(forward.context_id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("released"), std::string::npos) << s.error_message();
}

// A forward cancelled after its computation (while its output streams)
// leaves no context.
TEST_F(BackwardTest, ACancelledForwardLeavesNoContext) {
  const double kept_before = gauge(*server_, "plsh_contexts_kept_total");
  // 2.6 MB of output through a fixed 64 KiB stream window (no BDP probing
  // to grow it): the server cannot have sent it all when the client
  // cancels after reading one chunk.
  AttentionOptions o = odd_gqa_options(Mode::kExact, true);
  o.q_len = o.kv_len = 2048;
  const Problem p = make_problem(o, 23);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto rpc = v1::Attention::NewStub(testing::plaintext_channel(server_->grpc_address(), args));
  grpc::ClientContext ctx;
  auto stream = rpc->Attend(&ctx);
  AttendCall call = forward_call(p, true);
  call.chunk_bytes = 1;  // one row per output chunk: many of them
  v1::AttendRequest r;
  *r.mutable_header() = client::make_header(call);
  ASSERT_TRUE(stream->Write(r));
  const int64_t q_row = p.options.heads * p.options.head_dim * 4, kv_row = 2 * p.options.head_dim * 4;
  const struct {
    v1::Tensor t;
    const std::vector<uint8_t>& data;
    int64_t row_bytes;
  } inputs[] = {{v1::TENSOR_Q, p.q, q_row}, {v1::TENSOR_K, p.k, kv_row}, {v1::TENSOR_V, p.v, kv_row}};
  for (const auto& in : inputs) {
    r.Clear();
    r.mutable_chunk()->set_tensor(in.t);
    r.mutable_chunk()->set_row_start(0);
    r.mutable_chunk()->set_row_count(static_cast<int64_t>(in.data.size()) / in.row_bytes);
    r.mutable_chunk()->set_data(in.data.data(), in.data.size());
    ASSERT_TRUE(stream->Write(r));
  }
  r.Clear();
  r.mutable_end();
  ASSERT_TRUE(stream->Write(r));
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response) && response.has_ack());
  ASSERT_TRUE(stream->Read(&response) && response.has_out_chunk());  // computed: its id was made
  ctx.TryCancel();
  stream->Finish();
  EXPECT_TRUE(eventually([] { return gauge(*server_, "plsh_inflight_requests") == 0; }));
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 0);
  EXPECT_EQ(gauge(*server_, "plsh_contexts_kept_total"), kept_before);
}

// A cancelled backward leaves its context in place (not consumed).
TEST_F(BackwardTest, ACancelledBackwardLeavesItsContextForARetry) {
  Client c(server_->grpc_address());
  const Problem p = make_problem(odd_gqa_options(Mode::kLsh, true), 29);
  AttendReply forward;
  ASSERT_TRUE(c.attend(forward_call(p, true), &forward).ok());
  {
    auto rpc = testing::plaintext_attention_client(server_->grpc_address());
    grpc::ClientContext ctx;
    auto stream = rpc->AttendBackward(&ctx);
    v1::BackwardRequest r;
    r.mutable_header()->set_context_id(forward.context_id);
    ASSERT_TRUE(stream->Write(r));
    v1::BackwardResponse ack;
    ASSERT_TRUE(stream->Read(&ack) && ack.has_ack());
    // While it is checked out: another backward and a release are refused.
    BackwardReply other;
    grpc::Status s = c.backward(by_context(p, forward.context_id), &other);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("in use by backward request"), std::string::npos) << s.error_message();
    s = c.release_context(forward.context_id);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    ctx.TryCancel();
    stream->Finish();
  }
  EXPECT_TRUE(eventually([] { return gauge(*server_, "plsh_inflight_requests") == 0; }));
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
  BackwardReply grads;
  const grpc::Status s = c.backward(by_context(p, forward.context_id), &grads);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_EQ(grads.dq, local_gradients(p, DType::kF32).dq);
}

// --------------------------------------------------- bad requests

struct RawResult {
  grpc::Status status;
  bool acked = false;
};

RawResult raw_backward(const std::string& target, const std::vector<v1::BackwardRequest>& messages) {
  auto rpc = testing::plaintext_attention_client(target);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = rpc->AttendBackward(&ctx);
  for (const v1::BackwardRequest& m : messages)
    if (!stream->Write(m)) break;
  stream->WritesDone();
  RawResult result;
  v1::BackwardResponse r;
  while (stream->Read(&r))
    if (r.has_ack()) result.acked = true;
  result.status = stream->Finish();
  return result;
}

v1::BackwardRequest header_by_id(const std::string& id) {
  v1::BackwardRequest r;
  r.mutable_header()->set_context_id(id);
  return r;
}
v1::BackwardRequest chunk(v1::Tensor t, int64_t start, int64_t count, const void* data, size_t bytes) {
  v1::BackwardRequest r;
  r.mutable_chunk()->set_tensor(t);
  r.mutable_chunk()->set_row_start(start);
  r.mutable_chunk()->set_row_count(count);
  r.mutable_chunk()->set_data(data, bytes);
  return r;
}
v1::BackwardRequest end() {
  v1::BackwardRequest r;
  r.mutable_end();
  return r;
}

TEST_F(BackwardTest, BadRequestsGetTheContractsCodes) {
  Client c(server_->grpc_address());
  const std::string target = server_->grpc_address();
  AttentionOptions o = odd_gqa_options(Mode::kLsh, true);
  o.batch = 1;
  o.q_len = o.kv_len = 16;
  const Problem p = make_problem(o, 31);
  const int64_t rows = 16, dout_row = o.heads * o.head_dim * 4;

  struct Case {
    std::string name;
    std::function<grpc::Status()> send;
    grpc::StatusCode code;
    std::string mention;
  };
  // A fresh context for the cases that need one (each is left in place by a
  // failed backward, and released at the end).
  std::vector<std::string> made;
  auto context = [&]() {
    AttendReply f;
    EXPECT_TRUE(c.attend(forward_call(p, true), &f).ok());
    made.push_back(f.context_id);
    return f.context_id;
  };
  std::vector<float> nan_dout(p.dout.size() / 4, 0.5f);
  nan_dout[37] = std::nanf("");
  const std::vector<Case> cases = {
      {"never existed",
       [&] {
         BackwardReply r;
         return c.backward(by_context(p, "ctx-00000000000000000000000000000000"), &r);
       },
       grpc::StatusCode::NOT_FOUND, "no such context for this client"},
      {"empty id",
       [&] {
         return raw_backward(target, {header_by_id(""), end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context_id is empty"},
      {"no source",
       [&] {
         v1::BackwardRequest h;
         h.mutable_header()->set_request_id("x");
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "neither context_id nor forward"},
      {"recompute with a context",
       [&] {
         v1::BackwardRequest h = header_by_id("ctx-1");
         h.mutable_header()->set_recompute_forward(true);
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "recompute_forward = true with context_id"},
      {"keep without a context",
       [&] {
         v1::BackwardRequest h;
         *h.mutable_header()->mutable_forward() = client::make_header(forward_call(p, false));
         h.mutable_header()->set_keep_context(true);
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "keep_context = true with a stateless backward"},
      {"bad grad dtype",
       [&] {
         v1::BackwardRequest h = header_by_id("ctx-1");
         h.mutable_header()->set_grad_dtype(static_cast<v1::DType>(9));
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "grad_dtype = 9"},
      {"bad forward header",
       [&] {
         v1::BackwardRequest h;
         AttendCall f = forward_call(p, false);
         f.options.samples = 0;
         *h.mutable_header()->mutable_forward() = client::make_header(f);
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "samples = 0"},
      {"a q chunk by context",
       [&] {
         return raw_backward(target, {header_by_id(context()), chunk(v1::TENSOR_Q, 0, 1, p.q.data(), dout_row), end()})
             .status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "expected TENSOR_DOUT"},
      {"dout rows short",
       [&] {
         return raw_backward(target, {header_by_id(context()),
                                      chunk(v1::TENSOR_DOUT, 0, rows - 1, p.dout.data(), (rows - 1) * dout_row), end()})
             .status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "dout: rows [15, 16) missing"},
      {"dout bytes wrong",
       [&] {
         return raw_backward(target,
                             {header_by_id(context()), chunk(v1::TENSOR_DOUT, 0, 2, p.dout.data(), dout_row), end()})
             .status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "chunk of dout: data = "},
      {"dout twice",
       [&] {
         return raw_backward(target,
                             {header_by_id(context()), chunk(v1::TENSOR_DOUT, 0, rows, p.dout.data(), rows * dout_row),
                              chunk(v1::TENSOR_DOUT, 3, 1, p.dout.data(), dout_row), end()})
             .status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "overlap"},
      {"non-finite dout",
       [&] {
         return raw_backward(target, {header_by_id(context()),
                                      chunk(v1::TENSOR_DOUT, 0, rows, nan_dout.data(), rows * dout_row), end()})
             .status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "dout has a non-finite value (nan) at [b=0, n=0, h=0, d=37]"},
      {"a stateless out chunk with recompute",
       [&] {
         v1::BackwardRequest h;
         *h.mutable_header()->mutable_forward() = client::make_header(forward_call(p, false));
         h.mutable_header()->set_recompute_forward(true);
         return raw_backward(target, {h, chunk(v1::TENSOR_OUT, 0, 1, p.dout.data(), dout_row), end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "expected TENSOR_Q, TENSOR_K, TENSOR_V or TENSOR_DOUT"},
      {"stateless without lse rows",
       [&] {
         v1::BackwardRequest h;
         *h.mutable_header()->mutable_forward() = client::make_header(forward_call(p, false));
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "missing at end of input"},
      {"stateless over the size limit",
       [&] {
         v1::BackwardRequest h;
         AttendCall f = forward_call(p, false);
         f.options.q_len = f.options.kv_len = 90000;
         f.options.heads = f.options.kv_heads = 64;
         f.options.head_dim = 128;
         *h.mutable_header()->mutable_forward() = client::make_header(f);
         return raw_backward(target, {h, end()}).status;
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-request-bytes"},
      {"release never existed", [&] { return c.release_context("ctx-nope"); }, grpc::StatusCode::NOT_FOUND,
       "no such context for this client"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const grpc::Status s = k.send();
    EXPECT_EQ(s.error_code(), k.code) << client::status_string(s);
    EXPECT_NE(s.error_message().find(k.mention), std::string::npos) << s.error_message();
  }
  // Failed backwards leave their contexts: each is still there to release.
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), static_cast<double>(made.size()));
  for (const std::string& id : made) EXPECT_TRUE(c.release_context(id).ok()) << id;
}

// --------------------------------------------------- servers of their own

std::string stopped_line(const std::string& log) {
  std::smatch m;
  return std::regex_search(log, m, std::regex("stopped[^\n]*")) ? m[0].str() : "";
}

// Each test starts a server of its own flags (start) and a client of it;
// the server must exit cleanly at the end, in stop() or TearDown.
class BackwardContexts : public ::testing::Test {
 protected:
  void start(const std::vector<std::string>& flags) {
    server_ = std::make_unique<ServerProcess>(flags);
    ASSERT_TRUE(server_->started()) << server_->log();
    client_ = std::make_unique<Client>(server_->grpc_address());
  }
  void stop() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    stopped_ = true;
  }
  void TearDown() override {
    if (server_ != nullptr && !stopped_) stop();
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  bool stopped_ = false;
};

TEST_F(BackwardContexts, ExpireAfterTheirTimeToLive) {
  ASSERT_NO_FATAL_FAILURE(start({"--context-ttl", "0.3", "--threads", "1"}));
  const Problem p = make_problem(odd_gqa_options(Mode::kExact, false), 37);
  AttendReply forward;
  ASSERT_TRUE(client_->attend(forward_call(p, true), &forward).ok());
  EXPECT_EQ(forward.context_ttl_seconds, 0.3);
  EXPECT_TRUE(eventually([&] { return gauge(*server_, "plsh_contexts") == 0; }, 5));
  EXPECT_EQ(gauge(*server_, "plsh_context_evictions_total", {"reason=\"expired\""}), 1);
  EXPECT_EQ(gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
  BackwardReply grads;
  const grpc::Status s = client_->backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("expired"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("--context-ttl = 0.3 s"), std::string::npos) << s.error_message();
}

TEST_F(BackwardContexts, AreEvictedLeastRecentlyUsedFirstWhenTheBudgetNeedsRoom) {
  // Exact, one thread: the workspaces are known here, so that the budget
  // fits one kept context and its backward (dout, dq, dk, dv and the
  // backward's workspace beside it), and not two contexts.
  AttentionOptions o = odd_gqa_options(Mode::kExact, true);
  o.batch = 1;
  o.q_len = o.kv_len = 512;
  const Problem p = make_problem(o, 41);
  StatusOr<AttentionParams> params = resolve_params(o);
  ASSERT_TRUE(params.ok());
  Backend* cpu = *BackendRegistry::global().find("cpu");
  PlanLimits keep_limits;
  keep_limits.threads = 1;
  keep_limits.backward = true;
  const StatusOr<Plan> keep_plan = plan_attention(*cpu, *params, keep_limits);
  const int64_t w_keep = keep_plan->workspace().host_bytes, w_backward = keep_plan->backward_workspace.host_bytes;
  const int64_t tensors =
      static_cast<int64_t>(p.q.size() + p.k.size() + p.v.size() + p.q.size()) + o.q_len * o.heads * 4;
  const int64_t gradients = static_cast<int64_t>(p.dout.size() + p.q.size() + p.k.size() + p.v.size());
  const int64_t budget = std::max(tensors + w_keep, tensors + gradients + w_backward) + 1024;
  ASSERT_GT(2 * tensors + w_keep, budget) << "the budget would hold two: the test would prove nothing (tensors "
                                          << tensors << ", workspaces " << w_keep << " " << w_backward << ")";

  ASSERT_NO_FATAL_FAILURE(start({"--threads", "1", "--memory-budget", std::to_string(budget)}));
  AttendReply a, b;
  ASSERT_TRUE(client_->attend(forward_call(p, true), &a).ok());
  EXPECT_EQ(a.context_bytes, tensors);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
  // A second forward needs the room: the first context goes.
  grpc::Status s = client_->attend(forward_call(p, true), &b);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
  EXPECT_EQ(gauge(*server_, "plsh_context_evictions_total", {"reason=\"evicted\""}), 1);
  BackwardReply grads;
  s = client_->backward(by_context(p, a.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("evicted"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("--memory-budget"), std::string::npos) << s.error_message();
  // The second one's backward fits beside it, and consumes it.
  s = client_->backward(by_context(p, b.context_id), &grads);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_EQ(grads.dq, local_gradients(p, DType::kF32).dq);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 0);
  EXPECT_EQ(gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
  // A request larger than the whole budget evicts nothing.
  ASSERT_TRUE(client_->attend(forward_call(p, true), &a).ok());
  AttentionOptions big = o;
  big.q_len = big.kv_len = 4096;
  const Problem large = make_problem(big, 43);
  s = client_->attend(forward_call(large, false), &b);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
}

TEST_F(BackwardContexts, OverMaxContextsTheLeastRecentlyUsedGoes) {
  ASSERT_NO_FATAL_FAILURE(start({"--threads", "1", "--max-contexts", "2"}));
  const Problem p = make_problem(odd_gqa_options(Mode::kExact, true), 47);
  AttendReply f[3];
  for (AttendReply& r : f) ASSERT_TRUE(client_->attend(forward_call(p, true), &r).ok());
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 2);
  BackwardReply grads;
  const grpc::Status s = client_->backward(by_context(p, f[0].context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("--max-contexts = 2"), std::string::npos) << s.error_message();
  EXPECT_TRUE(client_->backward(by_context(p, f[2].context_id), &grads).ok());
}

TEST_F(BackwardContexts, ADrainDropsThemAll) {
  ASSERT_NO_FATAL_FAILURE(start({"--threads", "1"}));
  const Problem p = make_problem(odd_gqa_options(Mode::kLsh, true), 53);
  AttendReply f;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client_->attend(forward_call(p, true), &f).ok());
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 3);
  EXPECT_GT(gauge(*server_, "plsh_context_bytes"), 0);
  stop();
  const std::string line = stopped_line(server_->log());
  EXPECT_NE(line.find("contexts=0"), std::string::npos) << line;
  EXPECT_NE(line.find("context_bytes=0"), std::string::npos) << line;
  EXPECT_NE(line.find("reserved_host_bytes=0"), std::string::npos) << line;
}

TEST_F(BackwardContexts, AServerWithoutContextsRefusesKeepContextButServesStateless) {
  ASSERT_NO_FATAL_FAILURE(start({"--context-ttl", "0"}));
  const Problem p = make_problem(odd_gqa_options(Mode::kWindow, true), 59);
  AttendReply f;
  grpc::Status s = client_->attend(forward_call(p, true), &f);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("--context-ttl 0"), std::string::npos) << s.error_message();
  BackwardReply grads;
  s = client_->backward(by_context(p, "ctx-x"), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  BackwardCall b = by_context(p, "");
  b.q = p.q.data();
  b.k = p.k.data();
  b.v = p.v.data();
  b.recompute_forward = true;
  s = client_->backward(b, &grads);
  EXPECT_TRUE(s.ok()) << client::status_string(s);
  v1::GetInfoResponse info;
  ASSERT_TRUE(client_->info(&info).ok());
  EXPECT_EQ(info.limits().context_ttl_seconds(), 0);
}

// AttendUnary keeps a context too; a backward stream that goes silent is
// ended by the watchdog like a forward's, and its context stays.
TEST_F(BackwardContexts, UnaryForwardsKeepThemAndSilentBackwardsTimeOut) {
  ASSERT_NO_FATAL_FAILURE(start({"--threads", "1", "--stream-idle-timeout", "0.5"}));
  const Problem p = make_problem(odd_gqa_options(Mode::kWindow, true), 67);
  AttendReply forward;
  ASSERT_TRUE(client_->attend_unary(forward_call(p, true), &forward).ok());
  ASSERT_FALSE(forward.context_id.empty());
  {
    auto rpc = testing::plaintext_attention_client(server_->grpc_address());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = rpc->AttendBackward(&ctx);
    v1::BackwardRequest r;
    r.mutable_header()->set_context_id(forward.context_id);
    ASSERT_TRUE(stream->Write(r));
    v1::BackwardResponse response;
    while (stream->Read(&response)) {
    }
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_NE(s.error_message().find("--stream-idle-timeout"), std::string::npos) << s.error_message();
  }
  EXPECT_TRUE(eventually([&] { return gauge(*server_, "plsh_inflight_requests") == 0; }));
  EXPECT_EQ(gauge(*server_, "plsh_stream_timeouts_total", {"reason=\"receive_idle\""}), 1);
  EXPECT_EQ(gauge(*server_, "plsh_contexts"), 1);
  BackwardReply grads;
  const grpc::Status s = client_->backward(by_context(p, forward.context_id), &grads);
  ASSERT_TRUE(s.ok()) << client::status_string(s);
  EXPECT_EQ(grads.dq, local_gradients(p, DType::kF32).dq);
  EXPECT_EQ(gauge(*server_, "plsh_memory_reserved_bytes", {"space=\"host\""}), 0);
}

// With a token file a context belongs to the client that made it.
TEST_F(BackwardContexts, AreBoundToTheirClient) {
  testing::TempDir dir;
  const std::string alice = testing::random_token(), bob = testing::random_token(), fwd = testing::random_token();
  auto entry = [](const std::string& name, const std::string& token, nlohmann::json methods) {
    nlohmann::json e = {{"name", name}, {"sha256", {testing::sha256_hex(token)}}};
    if (!methods.is_null()) e["methods"] = methods;
    return e;
  };
  testing::write_file_atomically(dir.file("tokens.json"),
                                 nlohmann::json{{"version", 1},
                                                {"clients",
                                                 {entry("alice", alice, nullptr), entry("bob", bob, nullptr),
                                                  entry("forward_only", fwd, {"Attend", "GetInfo"})}}}
                                     .dump());
  ASSERT_NO_FATAL_FAILURE(start({"--token-file", dir.file("tokens.json"), "--threads", "1"}));
  auto connect = [&](const std::string& token) {
    client::ChannelOptions o;
    o.token = token;
    std::unique_ptr<Client> c;
    EXPECT_TRUE(Client::connect(server_->grpc_address(), o, &c).ok());
    return c;
  };
  std::unique_ptr<Client> a = connect(alice), b = connect(bob), f = connect(fwd);
  const Problem p = make_problem(odd_gqa_options(Mode::kExact, true), 61);
  AttendReply forward;
  ASSERT_TRUE(a->attend(forward_call(p, true), &forward).ok());
  BackwardReply grads;
  // What bob sees of an id, with the id itself written as ID: the same for
  // alice's context, live or gone, as for one that never existed (issue 24,
  // D4), through AttendBackward and ReleaseContext alike.
  auto seen = [](const grpc::Status& status, const std::string& id) {
    std::string text = status.error_message();
    for (size_t at = text.find(id); at != std::string::npos; at = text.find(id)) text.replace(at, id.size(), "ID");
    return client::status_string(grpc::Status(status.error_code(), text));
  };
  const std::string unknown = "ctx-" + std::string(32, '7');
  const std::string never_backward = seen(b->backward(by_context(p, unknown), &grads), unknown);
  const std::string never_release = seen(b->release_context(unknown), unknown);
  EXPECT_NE(never_backward.find("NOT_FOUND"), std::string::npos) << never_backward;
  EXPECT_EQ(never_backward, never_release);
  grpc::Status s = b->backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(seen(s, forward.context_id), never_backward);
  EXPECT_EQ(s.error_message().find("alice"), std::string::npos) << "the owner is not named: " << s.error_message();
  s = b->release_context(forward.context_id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(seen(s, forward.context_id), never_release);
  s = f->backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("may not call AttendBackward"), std::string::npos) << s.error_message();
  s = f->release_context(forward.context_id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Still alice's, and hers to use.
  s = a->backward(by_context(p, forward.context_id), &grads);
  EXPECT_TRUE(s.ok()) << client::status_string(s);
  // Gone: alice is told why, bob only that there is none of his.
  s = a->backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  s = b->backward(by_context(p, forward.context_id), &grads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(seen(s, forward.context_id), never_backward);
  EXPECT_EQ(seen(b->release_context(forward.context_id), forward.context_id), never_release);
  // The context counted against alice's reservations while it was held.
  const auto m = scrape(*server_);
  EXPECT_EQ(metric_sum(m, "plsh_client_reserved_bytes", {"client=\"alice\"", "space=\"host\""}), 0);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total",
                       {"client=\"bob\"", "method=\"AttendBackward\"", "code=\"NOT_FOUND\""}),
            3);
}

}  // namespace
}  // namespace plsh
