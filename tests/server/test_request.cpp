// server/request.h: plan_request turns a header into a plan or names what is
// wrong with it (the wire field for malformed headers, the server's flag for
// sizes over a limit), and charges the request by memory space.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>

#include "plsh/backend.h"
#include "request_test_util.h"
#include "server/request.h"
#include "server_test_util.h"

namespace plsh::server {
namespace {

using testing::f32_header;
using testing::has_error;
using testing::is_ok;
using testing::roomy_limits;

using testing::kExhausted;
using testing::kInvalid;

// q, k, v, out of this header: 16 rows * 2 heads * 8 dims * 4 bytes each.
constexpr int64_t kTensorBytes = 16 * 2 * 8 * 4;
constexpr int64_t kLseBytes = 16 * 2 * 4;

v1::AttendHeader small_header(v1::Mode mode = v1::MODE_EXACT) { return f32_header(16, 2, 8, mode); }

bool cuda_available() { return BackendRegistry::global().find("cuda").ok(); }

TEST(PlanRequest, SmallExactRequests) {
  StatusOr<Request> plan = check_and_plan(small_header(), roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->shape.q.rows, 16);
  EXPECT_EQ(plan->shape.k.rows, 16);
  EXPECT_EQ(plan->shape.q.row_bytes, 2 * 8 * 4);
  EXPECT_EQ(plan->shape.k.row_bytes, 2 * 8 * 4);
  EXPECT_EQ(plan->shape.out.row_bytes, 2 * 8 * 4);
  EXPECT_EQ(plan->shape.lse.row_bytes, 2 * 4);
  EXPECT_EQ(plan->tensor_bytes(), 4 * kTensorBytes);
  EXPECT_EQ(plan->tokens(), 16);
  EXPECT_EQ(plan->options.mode, Mode::kExact);
  ASSERT_NE(plan->backend, nullptr);
  EXPECT_EQ(plan->backend->name(), "cpu");
  EXPECT_EQ(plan->plan.backend, "cpu");
}

// A targeted request chooses its configuration while computing: there is
// no plan for a kept context to hold, so the two are refused together.
TEST(PlanRequest, KeepContextWithATargetIsRefused) {
  v1::AttendHeader h = small_header(v1::MODE_WINDOW);
  h.set_target_rel_err(0.1);
  h.set_keep_context(true);
  EXPECT_TRUE(
      has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"keep_context = true with target_rel_err"}));
  h.set_keep_context(false);
  EXPECT_TRUE(is_ok(check_and_plan(h, roomy_limits()).status()));
}

TEST(PlanRequest, RowSizesFollowGroupingAndDtypes) {
  v1::AttendHeader h = small_header();
  h.set_batch(3);
  h.set_kv_len(5);
  h.set_heads(4);
  h.set_kv_heads(2);
  h.set_dtype(v1::DTYPE_F16);
  h.set_out_dtype(v1::DTYPE_F32);
  h.set_return_lse(true);
  StatusOr<Request> plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->shape.q.rows, 3 * 16);
  EXPECT_EQ(plan->shape.k.rows, 3 * 5);
  EXPECT_EQ(plan->shape.q.row_bytes, 4 * 8 * 2);
  EXPECT_EQ(plan->shape.k.row_bytes, 2 * 8 * 2);
  EXPECT_EQ(plan->shape.out.row_bytes, 4 * 8 * 4);
  EXPECT_EQ(plan->shape.lse.row_bytes, 4 * 4);
  EXPECT_EQ(plan->tensor_bytes(), 48 * 64 + 2 * 15 * 32 + 48 * 128 + 48 * 16);
}

TEST(PlanRequest, BatchZeroIsOne) {
  v1::AttendHeader h = small_header();
  h.set_batch(0);
  StatusOr<Request> plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->options.batch, 1);
  EXPECT_EQ(plan->shape.q.rows, 16);
  EXPECT_EQ(plan->shape.k.rows, 16);
}

TEST(PlanRequest, RequestIdKeptOrMadeUnique) {
  v1::AttendHeader h = small_header();
  h.set_request_id("client-42");
  StatusOr<Request> named = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(named.status()));
  EXPECT_EQ(named->id, "client-42");

  std::set<std::string> made;
  for (int i = 0; i < 3; ++i) {
    StatusOr<Request> plan = check_and_plan(small_header(), roomy_limits());
    ASSERT_TRUE(is_ok(plan.status()));
    EXPECT_FALSE(plan->id.empty());
    made.insert(plan->id);
  }
  EXPECT_EQ(made.size(), 3u);
}

// ---- Server limits: RESOURCE_EXHAUSTED naming the flag -------------------

TEST(PlanRequestLimits, MaxTokensCountsTheLongerSide) {
  RequestLimits limits = roomy_limits();
  limits.max_tokens = 32;
  v1::AttendHeader h = small_header();
  h.set_batch(2);
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));  // 2 * 16 = 32: at the limit
  h.set_kv_len(17);                                        // 2 * max(16, 17) = 34
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted, {"34 tokens", "<= 32", "--max-tokens"}));
  h.set_kv_len(8);
  h.set_q_len(17);
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted, {"34 tokens", "--max-tokens"}));
}

TEST(PlanRequestLimits, MaxRequestBytesCountsEveryTensor) {
  RequestLimits limits = roomy_limits();
  limits.max_request_bytes = 4 * kTensorBytes;
  v1::AttendHeader h = small_header();
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
  h.set_return_lse(true);  // lse tips it over
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted,
                        {std::to_string(4 * kTensorBytes + kLseBytes).c_str(), "+ lse", "--max-request-bytes"}));
  limits.max_request_bytes = 4 * kTensorBytes + kLseBytes;
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
  limits.max_request_bytes = 4 * kTensorBytes - 1;
  h.set_return_lse(false);
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted, {"--max-request-bytes"}));
}

TEST(PlanRequestLimits, MaxSamplesAppliesToLshOnly) {
  RequestLimits limits = roomy_limits();
  limits.max_samples = 8;
  v1::AttendHeader h = small_header(v1::MODE_LSH);
  h.set_samples(8);
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
  h.set_samples(9);
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted, {"samples = 9", "<= 8", "--max-samples"}));
  h.set_mode(v1::MODE_EXACT);  // exact draws nothing: samples is ignored
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
}

// The draws are made with the header: heads x samples is bounded, so that a
// header alone holds little memory (issue 24, D2).
TEST(PlanRequestLimits, DrawsPerRequestAreBounded) {
  RequestLimits limits = roomy_limits();
  limits.max_draws = 2 * 64;
  v1::AttendHeader h = small_header(v1::MODE_LSH);  // 2 heads
  h.set_samples(64);
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
  h.set_samples(65);
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted,
                        {"heads * samples = 2 * 65 draws", "<= 128", "made with the header"}));
  // A targeted request counts its largest attempt's samples.
  h.set_samples(16);
  h.set_target_rel_err(0.01);
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted, {"heads * samples = 2 * 1024 draws"}));
  h.set_mode(v1::MODE_WINDOW);  // no draws
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
}

TEST(PlanRequestLimits, MaxMessageBytesMustHoldOneRow) {
  RequestLimits limits = roomy_limits();
  const int64_t row = 2 * 8 * 4;
  limits.max_message_bytes = kMessageHeadroom + row;
  EXPECT_TRUE(is_ok(check_and_plan(small_header(), limits).status()));
  limits.max_message_bytes = kMessageHeadroom + row - 1;
  EXPECT_TRUE(has_error(check_and_plan(small_header(), limits).status(), kExhausted,
                        {"one row is 64 bytes", "<= 63", "--max-message-bytes"}));
}

// lse rows (H * 4 bytes) are wider than f16 rows of D = 1 (H * 2 bytes), so
// return_lse alone can make a row not fit.
TEST(PlanRequestLimits, MaxMessageBytesMustHoldOneLseRow) {
  RequestLimits limits = roomy_limits();
  limits.max_message_bytes = kMessageHeadroom + 15;
  v1::AttendHeader h = small_header();
  h.set_heads(4);
  h.set_head_dim(1);
  h.set_dtype(v1::DTYPE_F16);
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));  // rows of 8 bytes
  h.set_return_lse(true);                                  // lse rows of 16
  EXPECT_TRUE(has_error(check_and_plan(h, limits).status(), kExhausted,
                        {"with return_lse", "one row is 16 bytes", "--max-message-bytes"}));
}

TEST(PlanRequestLimits, MaxMessageBytesMustHoldTheSummaryWithDraws) {
  RequestLimits limits = roomy_limits();
  v1::AttendHeader h = small_header(v1::MODE_LSH);
  h.set_samples(64);
  h.set_return_draws(true);
  const int64_t summary = 2 * (200 + 20 * 64);
  StatusOr<Request> roomy = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(roomy.status()));
  ASSERT_EQ(summary_bytes(roomy->options), summary);
  limits.max_message_bytes = kMessageHeadroom + summary;
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
  limits.max_message_bytes = kMessageHeadroom + summary - 1;
  EXPECT_TRUE(
      has_error(check_and_plan(h, limits).status(), kExhausted,
                {"return_draws = true", "samples = 64", std::to_string(summary).c_str(), "--max-message-bytes"}));
  h.set_return_draws(false);  // 400 bytes of summary fit
  EXPECT_TRUE(is_ok(check_and_plan(h, limits).status()));
}

TEST(SummaryBytes, PerHeadEntriesAndDraws) {
  AttentionOptions o;
  o.heads = 3;
  o.samples = 10;
  o.mode = Mode::kExact;
  EXPECT_EQ(summary_bytes(o), 0);
  o.return_draws = true;
  EXPECT_EQ(summary_bytes(o), 0);
  o.mode = Mode::kWindow;  // no draws to return
  EXPECT_EQ(summary_bytes(o), 3 * 200);
  o.mode = Mode::kLsh;
  EXPECT_EQ(summary_bytes(o), 3 * (200 + 20 * 10));
  o.return_draws = false;
  EXPECT_EQ(summary_bytes(o), 3 * 200);
}

// ---- Malformed headers: INVALID_ARGUMENT naming the wire field -------------

TEST(PlanRequestHeader, DtypeRequired) {
  v1::AttendHeader h = small_header();
  h.set_dtype(v1::DTYPE_UNSPECIFIED);
  const Status s = check_and_plan(h, roomy_limits()).status();
  EXPECT_TRUE(has_error(s, kInvalid, {"dtype = DTYPE_UNSPECIFIED", "expected DTYPE_F32"}));
  EXPECT_EQ(s.message().rfind("dtype", 0), 0u) << s.message();  // dtype, not out_dtype
}

TEST(PlanRequestHeader, EnumsOutOfRange) {
  v1::AttendHeader h = small_header();
  h.set_out_dtype(static_cast<v1::DType>(42));
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"out_dtype = 42"}));
  h = small_header();
  h.set_dtype(static_cast<v1::DType>(-3));
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"dtype = -3"}));
  h = small_header();
  h.set_mode(static_cast<v1::Mode>(42));
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"mode = 42", "MODE_EXACT"}));
  h = small_header(v1::MODE_LSH);
  h.set_lsh_algorithm(static_cast<v1::LshAlgorithm>(42));
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"lsh_algorithm = 42"}));
}

TEST(PlanRequestHeader, NegativeOutChunkBytes) {
  v1::AttendHeader h = small_header();
  h.set_out_chunk_bytes(-1);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"out_chunk_bytes = -1", ">= 0"}));
}

TEST(PlanRequestHeader, RequestIdLengthAndBytes) {
  v1::AttendHeader h = small_header();
  h.set_request_id(std::string(128, 'a'));
  EXPECT_TRUE(is_ok(check_and_plan(h, roomy_limits()).status()));
  h.set_request_id(std::string(129, 'a'));
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"request_id", "129", "<= 128"}));
  for (const std::string& id : {std::string("a\nb"), std::string("tab\there"), std::string("nul\0x", 5),
                                std::string("del\x7f"), std::string("utf8-\xc3\xa9")}) {
    h.set_request_id(id);
    EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"request_id", "printable"}))
        << "id of " << id.size() << " bytes";
  }
  h.set_request_id("spaces and ~punctuation!");
  EXPECT_TRUE(is_ok(check_and_plan(h, roomy_limits()).status()));
}

TEST(PlanRequestHeader, BackendNames) {
  v1::AttendHeader h = small_header();
  for (const char* name : {"gpu", "CPU", " cpu", "cuda0", "metal"}) {
    h.set_backend(name);
    EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid,
                          {(std::string("backend = '") + name + "'").c_str(), "auto, cpu, cuda"}))
        << name;
  }
}

// plsh::validate_options names the option, which is also the wire field.
TEST(PlanRequestHeader, ValidationOfOptionsPassesThrough) {
  v1::AttendHeader h = small_header();
  h.set_heads(8);
  h.set_kv_heads(3);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"kv_heads = 3"}));
  h = small_header();
  h.set_batch(-1);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"batch = -1"}));
  h = small_header();
  h.set_kv_len(0);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"kv_len = 0"}));
  h = small_header();
  h.set_head_dim(1025);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"head_dim = 1025"}));
  // A shape whose element count overflows is malformed, not merely large.
  h = small_header();
  h.set_batch(int64_t{1} << 40);
  h.set_q_len(int64_t{1} << 40);
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), kInvalid, {"q_len"}));
}

// ---- Backend choice -------------------------------------------------------

TEST(PlanRequestBackend, EmptyAndAutoMeanTheServersDefault) {
  RequestLimits limits = roomy_limits();
  for (const char* asked : {"", "auto"}) {
    v1::AttendHeader h = small_header();
    h.set_backend(asked);
    limits.default_backend = "cpu";
    StatusOr<Request> plan = check_and_plan(h, limits);
    ASSERT_TRUE(is_ok(plan.status())) << "'" << asked << "'";
    EXPECT_EQ(plan->backend_name, "cpu") << "'" << asked << "'";
    EXPECT_EQ(plan->backend->name(), "cpu");
    limits.default_backend = "auto";
    plan = check_and_plan(h, limits);
    ASSERT_TRUE(is_ok(plan.status())) << "'" << asked << "'";
    EXPECT_EQ(plan->backend_name, "auto") << "'" << asked << "'";
    // auto: the registry's first backend for these params, CPU without a GPU.
    EXPECT_EQ(plan->backend->name(), cuda_available() ? "cuda" : "cpu");
  }
}

TEST(PlanRequestBackend, HeaderNameWinsOverTheDefault) {
  RequestLimits limits = roomy_limits();
  limits.default_backend = "cuda";
  v1::AttendHeader h = small_header();
  h.set_backend("cpu");
  StatusOr<Request> plan = check_and_plan(h, limits);
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->backend_name, "cpu");
  EXPECT_EQ(plan->backend->name(), "cpu");
}

TEST(PlanRequestBackend, CudaWithoutDeviceIsFailedPrecondition) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA backend is available here";
  v1::AttendHeader h = small_header();
  h.set_backend("cuda");
  EXPECT_TRUE(has_error(check_and_plan(h, roomy_limits()).status(), StatusCode::kFailedPrecondition,
                        {"backend = 'cuda'", "not available"}));
  // The same through the server's default.
  RequestLimits limits = roomy_limits();
  limits.default_backend = "cuda";
  EXPECT_TRUE(has_error(check_and_plan(small_header(), limits).status(), StatusCode::kFailedPrecondition,
                        {"backend = 'cuda'"}));
}

// ---- Output chunking -------------------------------------------------------

TEST(PlanRequestOutChunk, ZeroMeansTheLargestPayload) {
  RequestLimits limits = roomy_limits();
  StatusOr<Request> plan = check_and_plan(small_header(), limits);
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, limits.max_message_bytes - kMessageHeadroom);
}

TEST(PlanRequestOutChunk, CappedByTheMessageSize) {
  RequestLimits limits = roomy_limits();
  v1::AttendHeader h = small_header();
  h.set_out_chunk_bytes(int64_t{1} << 40);
  StatusOr<Request> plan = check_and_plan(h, limits);
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, limits.max_message_bytes - kMessageHeadroom);
  h.set_out_chunk_bytes(1000);
  plan = check_and_plan(h, limits);
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, 1000);
}

TEST(PlanRequestOutChunk, FlooredToOneRow) {
  v1::AttendHeader h = small_header();
  h.set_out_chunk_bytes(1);
  StatusOr<Request> plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, 2 * 8 * 4);  // one out row
  h.set_out_dtype(v1::DTYPE_F16);
  plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, 2 * 8 * 2);  // out rows follow out_dtype
  // With D = 1 in f16 an lse row (H * 4) is wider than an out row (H * 2).
  h.set_head_dim(1);
  h.set_return_lse(true);
  plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  EXPECT_EQ(plan->out_chunk_bytes, 2 * 4);
}

// ---- The charge and the kernel plan ---------------------------------------

TEST(PlanRequestCharge, TensorsPlusHostWorkspaceAndNoDeviceOnCpu) {
  for (v1::Mode mode : {v1::MODE_EXACT, v1::MODE_LSH, v1::MODE_WINDOW}) {
    v1::AttendHeader h = small_header(mode);
    h.set_backend("cpu");
    h.set_return_lse(true);
    StatusOr<Request> plan = check_and_plan(h, roomy_limits());
    ASSERT_TRUE(is_ok(plan.status())) << v1::Mode_Name(mode);
    EXPECT_EQ(plan->tensor_bytes(), 4 * kTensorBytes + kLseBytes) << v1::Mode_Name(mode);
    // The block the admission grants: the tensors at 4 KiB boundaries and
    // the workspace; the charge adds the draws the plan holds.
    const MemoryLayout layout = plan->memory_layout();
    EXPECT_EQ(layout.workspace, plan->plan.workspace().host_bytes) << v1::Mode_Name(mode);
    EXPECT_GE(layout.tensor_bytes(), plan->tensor_bytes()) << v1::Mode_Name(mode);
    EXPECT_LT(layout.tensor_bytes(), plan->tensor_bytes() + 5 * MemoryLayout::kAlignment) << v1::Mode_Name(mode);
    EXPECT_EQ(plan->host_charge(), layout.total_bytes() + plan->plan.own_host_bytes) << v1::Mode_Name(mode);
    EXPECT_EQ(plan->plan.own_host_bytes, draw_bytes(plan->plan.params)) << v1::Mode_Name(mode);
    EXPECT_EQ(plan->device_charge(), 0) << v1::Mode_Name(mode);
    EXPECT_EQ(plan->plan.workspace().device_bytes, 0) << v1::Mode_Name(mode);
    // Not vacuous: the CPU backend's tiles make the two sides differ.
    EXPECT_GT(plan->plan.workspace().host_bytes, 0) << v1::Mode_Name(mode);
  }
}

TEST(PlanRequestKernel, LshPlansOneDrawPerSamplePerHead) {
  v1::AttendHeader h = small_header(v1::MODE_LSH);
  h.set_heads(3);
  h.set_samples(5);
  h.set_seed(7);
  StatusOr<Request> plan = check_and_plan(h, roomy_limits());
  ASSERT_TRUE(is_ok(plan.status()));
  ASSERT_EQ(plan->plan.draws.size(), 3u);
  for (const auto& head : plan->plan.draws) EXPECT_EQ(head.size(), 5u);
  EXPECT_NE(plan->plan.lsh_algorithm, LshAlgorithm::kAuto);  // the backend chose one
}

TEST(PlanRequestKernel, ExactAndWindowPlanNoDraws) {
  for (v1::Mode mode : {v1::MODE_EXACT, v1::MODE_WINDOW}) {
    v1::AttendHeader h = small_header(mode);
    h.set_samples(5);
    StatusOr<Request> plan = check_and_plan(h, roomy_limits());
    ASSERT_TRUE(is_ok(plan.status())) << v1::Mode_Name(mode);
    EXPECT_TRUE(plan->plan.draws.empty()) << v1::Mode_Name(mode);
  }
}

}  // namespace
}  // namespace plsh::server
