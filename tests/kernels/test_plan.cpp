// The plan step (plsh/plan.h): made once per request from params without
// tensors, it holds the draws that forward and the estimates both read, and
// the workspace by memory space that a server charges before any data.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cpu/cpu_backend.h"
#include "plsh/attention.h"
#include "plsh/estimates.h"
#include "plsh/plan.h"
#include "reference.h"
#include "shaped.h"
#include "status_assert.h"

namespace plsh {
namespace {

using plsh::testing::shaped;

AttentionOptions lsh_options() {
  return shaped({2, 97, 131, 4, 2, 24},
                {.causal = true, .mode = Mode::kLsh, .samples = 6, .seed = 5, .probe_rows = 16, .return_draws = true});
}

struct Tensors {
  testing::RandomTensors qkv;
  std::vector<uint8_t> out;
  std::vector<float> lse;
  TensorRefs refs() { return {qkv.q.data(), qkv.k.data(), qkv.v.data(), out.data(), lse.data(), MemorySpace::kHost}; }
};

Tensors tensors_for(const AttentionOptions& o) {
  Tensors t{testing::random_qkv(o, 3), testing::output_buffer(o), {}};
  t.lse.resize(static_cast<size_t>(o.batch * o.q_len * o.heads));
  return t;
}

// Planned before the data, bound after: the same bytes as make_params.
TEST(Plan, MadeWithoutTensorsThenBoundGivesTheSameResult) {
  const AttentionOptions o = lsh_options();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_OK_AND_ASSIGN(AttentionParams resolved, resolve_params(o));
  EXPECT_EQ(resolved.q, nullptr);
  ASSERT_OK_AND_ASSIGN(Plan plan, plan_attention(*cpu, resolved));

  Tensors a = tensors_for(o), b = tensors_for(o);
  ASSERT_TRUE(bind_tensors(&plan.params, a.refs()).ok());
  ASSERT_OK_AND_ASSIGN(AttentionResult late, run_attention(*cpu, plan, ExecContext{}));
  StatusOr<AttentionParams> bound = make_params(o, b.refs());
  ASSERT_TRUE(bound.ok());
  StatusOr<AttentionResult> direct = run_attention(*cpu, *bound, PlanLimits{}, ExecContext{});
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(late.probe.rel_err, direct->probe.rel_err);
}

TEST(Plan, ForwardRefusesUnboundTensorsAndAnotherBackendsPlan) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<AttentionParams> resolved = resolve_params(lsh_options());
  ASSERT_TRUE(resolved.ok());
  StatusOr<Plan> plan = cpu->plan(*resolved, PlanLimits{});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(testing::run_forward(*cpu, *plan, ExecContext{}, nullptr).code(), StatusCode::kFailedPrecondition);
  Plan foreign = *plan;
  foreign.backend = "cuda";
  const Status s = testing::run_forward(*cpu, foreign, ExecContext{}, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda"), std::string::npos) << s.message();
}

// The draws live in the plan alone: forward and the estimates both read
// them, so changing the plan's draws changes what both report.
TEST(Plan, ForwardAndEstimatesReadThePlanDraws) {
  const AttentionOptions o = lsh_options();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  Tensors a = tensors_for(o), b = tensors_for(o);
  StatusOr<AttentionParams> pa = make_params(o, a.refs()), pb = make_params(o, b.refs());
  ASSERT_TRUE(pa.ok() && pb.ok());
  StatusOr<Plan> plain = plan_attention(*cpu, *pa), changed = plan_attention(*cpu, *pb);
  ASSERT_TRUE(plain.ok() && changed.ok());
  ASSERT_EQ(plain->draws.size(), 4u);
  for (int64_t h = 0; h < 4; ++h) {
    const std::vector<Draw> want = draw_hashes(o.seed, h, pa->sigma(h), o.samples);
    ASSERT_EQ(plain->draws[static_cast<size_t>(h)].size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(plain->draws[static_cast<size_t>(h)][k].pitch, want[k].pitch);
  }
  // Head 3 gets one block holding every position in every sample.
  for (Draw& d : changed->draws[3]) d = Draw{1e9, 0.5e9};
  StatusOr<AttentionResult> ra = run_attention(*cpu, *plain, ExecContext{});
  StatusOr<AttentionResult> rb = run_attention(*cpu, *changed, ExecContext{});
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_EQ(rb->heads[3].draws[0].pitch, 1e9);  // the estimates' report
  EXPECT_EQ(rb->heads[3].max_block, o.kv_len);
  // Heads 0-2 are untouched, head 3's output differs.
  const size_t row = static_cast<size_t>(o.heads * o.head_dim * 4);  // f32 bytes of one row of out
  bool head3_differs = false;
  for (size_t r = 0; r < static_cast<size_t>(o.batch * o.q_len); ++r) {
    EXPECT_EQ(std::memcmp(a.out.data() + r * row, b.out.data() + r * row, 3 * o.head_dim * 4), 0) << "row " << r;
    head3_differs |= std::memcmp(a.out.data() + r * row + 3 * o.head_dim * 4,
                                 b.out.data() + r * row + 3 * o.head_dim * 4, o.head_dim * 4) != 0;
  }
  EXPECT_TRUE(head3_differs);
}

// Each step runs in exactly the bytes its figure names and is refused one
// byte short: the figures are what the steps use, not tokens. More threads
// need more (per-thread tiles), and a plan for four threads does not run in
// one thread's bytes.
TEST(Plan, WorkspaceIsSplitByMemorySpace) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  AttentionOptions o = lsh_options();
  PlanLimits one, four;
  one.threads = 1;
  four.threads = 4;
  Tensors t = tensors_for(o);
  StatusOr<AttentionParams> p = make_params(o, t.refs());
  ASSERT_TRUE(p.ok());
  StatusOr<Plan> p1 = plan_attention(*cpu, *p, one), p4 = plan_attention(*cpu, *p, four);
  ASSERT_TRUE(p1.ok() && p4.ok());
  EXPECT_EQ(p1->threads, 1);
  EXPECT_EQ(p4->threads, 4);
  EXPECT_EQ(p1->workspace().device_bytes, 0);
  EXPECT_EQ(p1->workspace().host_bytes, std::max(p1->forward_workspace.host_bytes, p1->estimates_workspace.host_bytes));
  // The plan holds its draws; no workspace counts them again.
  EXPECT_EQ(p1->own_host_bytes, draw_bytes(*p));
  EXPECT_EQ(draw_bytes(*p), o.heads * (static_cast<int64_t>(sizeof(std::vector<Draw>)) + o.samples * 16));

  for (const Plan* plan : {&*p1, &*p4}) {
    SCOPED_TRACE(plan->threads);
    const int64_t forward = plan->forward_workspace.host_bytes, estimates = plan->estimates_workspace.host_bytes;
    StatusOr<HostWorkspace> w = HostWorkspace::allocate(std::max(forward, estimates));
    ASSERT_TRUE(w.ok());
    const WorkspaceRef exact_forward{w->ref().host, forward, nullptr, 0};
    const WorkspaceRef exact_estimates{w->ref().host, estimates, nullptr, 0};
    const WorkspaceRef short_forward{w->ref().host, forward - 1, nullptr, 0};
    const WorkspaceRef short_estimates{w->ref().host, estimates - 1, nullptr, 0};
    EXPECT_EQ(cpu->forward(*plan, short_forward, ExecContext{}, nullptr).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(cpu->forward(*plan, exact_forward, ExecContext{}, nullptr).ok());
    AttentionResult result;
    EXPECT_EQ(compute_estimates(*plan, short_estimates, ExecContext{}, &result).code(), StatusCode::kInvalidArgument);
    const Status s = compute_estimates(*plan, exact_estimates, ExecContext{}, &result);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(result.probe.rows, o.heads * o.probe_rows);
    // run_attention needs the larger of the two.
    const WorkspaceRef short_whole{w->ref().host, std::max(forward, estimates) - 1, nullptr, 0};
    EXPECT_EQ(run_attention(*cpu, *plan, short_whole, ExecContext{}).status().code(), StatusCode::kInvalidArgument);
  }
  const WorkspaceRef one_threads_bytes{nullptr, p1->forward_workspace.host_bytes, nullptr, 0};
  EXPECT_GT(p4->forward_workspace.host_bytes, p1->forward_workspace.host_bytes);
  EXPECT_GT(p4->estimates_workspace.host_bytes, p1->estimates_workspace.host_bytes);
  StatusOr<HostWorkspace> small = HostWorkspace::allocate(one_threads_bytes.host_bytes);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(cpu->forward(*p4, small->ref(), ExecContext{}, nullptr).code(), StatusCode::kInvalidArgument);

  // Exact has no estimates and no draws.
  o.mode = Mode::kExact;
  StatusOr<AttentionParams> pe = resolve_params(o);
  ASSERT_TRUE(pe.ok());
  StatusOr<Plan> exact = plan_attention(*cpu, *pe, one);
  ASSERT_TRUE(exact.ok());
  EXPECT_TRUE(exact->draws.empty());
  EXPECT_EQ(exact->own_host_bytes, 0);
  EXPECT_EQ(exact->estimates_workspace.host_bytes, 0);
}

// What a server holds while it plans covers what the plan then holds.
TEST(Plan, PlanningBytesCoverThePlan) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (int64_t samples : {1, 16, 256}) {
    AttentionOptions o = lsh_options();
    o.samples = samples;
    StatusOr<AttentionParams> p = resolve_params(o);
    ASSERT_TRUE(p.ok());
    StatusOr<Plan> plan = plan_attention(*cpu, *p);
    ASSERT_TRUE(plan.ok());
    EXPECT_GE(planning_host_bytes(*cpu, *p), plan->own_host_bytes);
    EXPECT_GE(plan->own_host_bytes, o.heads * samples * 16);
    o.target_rel_err = 0.05;
    o.probe_rows = kMinTargetProbeRows;
    ASSERT_OK_AND_ASSIGN(AttentionParams targeted, resolve_params(o));
    StatusOr<Plan> tp = plan_attention(*cpu, targeted);
    ASSERT_TRUE(tp.ok());
    EXPECT_GE(planning_host_bytes(*cpu, targeted), tp->own_host_bytes);
    EXPECT_GT(tp->own_host_bytes, plan->own_host_bytes);  // every attempt's draws
  }
}

}  // namespace
}  // namespace plsh
