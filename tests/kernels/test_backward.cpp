// The backward pass (SPEC section 8): the float64 reference gradients are
// checked against central finite differences of the float64 forward, so
// that the reference stands on its own; then the CPU backend's dq, dk, dv
// against the reference on odd sizes, every mode (lsh under both
// algorithms' plans), GQA, causal and not, offsets, f32/f16/bf16; then what
// the backward must refuse, that it stops on cancel and deadline, and that
// an lsh backward reads the plan's draws.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "plsh/attention.h"
#include "plsh/backward.h"
#include "plsh/numeric.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh {
namespace {

using testing::DenseInputs;
using testing::HeadWeights;
using testing::ReferenceGradients;

// ---- The reference against finite differences ------------------------------

struct FdCase {
  const char* name;
  Mode mode;
  bool causal;
  std::optional<int64_t> q_pos0;
  int64_t k_pos0;
  int64_t window_width;
};

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class ReferenceBackward : public ::testing::TestWithParam<FdCase> {};

// L = sum(dO * O(q, k, v)); its gradient is what reference_backward
// returns. Central differences with step 1e-5 have a truncation error of
// order 1e-10 and a rounding error of order 1e-16 / 1e-5 = 1e-11 here.
TEST_P(ReferenceBackward, MatchesCentralFiniteDifferences) {
  const FdCase& c = GetParam();
  // GQA (dk, dv sum two query heads); slopes of sigma from 1.4 to infinity.
  const AttentionOptions o = testing::shaped({2, 5, 7, 4, 2, 3}, {.scale = 0.8,
                                                                  .causal = c.causal,
                                                                  .slopes = {0.7, 0.3, 0.1, 0.0},
                                                                  .q_pos0 = c.q_pos0,
                                                                  .k_pos0 = c.k_pos0,
                                                                  .mode = c.mode,
                                                                  .samples = 4,
                                                                  .seed = 3,
                                                                  .window_width = c.window_width});
  const testing::Problem pr = testing::make_problem(o, 17, false);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  const AttentionParams& p = pr.params;
  const HeadWeights w = testing::reference_weights(p);
  DenseInputs x = testing::dense_inputs(p);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  std::vector<double> dout(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim));
  for (double& v : dout) v = normal(rng);

  const ReferenceGradients g = testing::reference_backward(p, x, w, dout);
  auto loss = [&] {
    const testing::ReferenceOutput r = testing::reference_forward(p, x, w);
    double l = 0;
    for (size_t i = 0; i < dout.size(); ++i) l += dout[i] * r.out[i];
    return l;
  };
  // The float64 forward is reference_attention's.
  {
    const testing::ReferenceOutput a = testing::reference_forward(p, x, w);
    const testing::ReferenceOutput b = testing::reference_attention(p);
    for (size_t i = 0; i < a.out.size(); ++i) ASSERT_NEAR(a.out[i], b.out[i], 1e-12);
  }
  constexpr double kStep = 1e-5;
  double max_err = 0, max_grad = 0;
  auto check = [&](std::vector<double>& input, const std::vector<double>& grad, const char* name) {
    for (size_t i = 0; i < input.size(); ++i) {
      const double saved = input[i];
      input[i] = saved + kStep;
      const double up = loss();
      input[i] = saved - kStep;
      const double down = loss();
      input[i] = saved;
      const double fd = (up - down) / (2 * kStep);
      max_err = std::max(max_err, std::fabs(fd - grad[i]));
      max_grad = std::max(max_grad, std::fabs(grad[i]));
      EXPECT_NEAR(grad[i], fd, 1e-8) << name << "[" << i << "]";
    }
  };
  check(x.q, g.dq, "dq");
  check(x.k, g.dk, "dk");
  check(x.v, g.dv, "dv");
  EXPECT_GT(max_grad, 0.1);  // not vacuous
  std::printf("%s: max |analytic - finite difference| %.2e (max |grad| %.2f)\n", c.name, max_err, max_grad);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ReferenceBackward,
    ::testing::Values(FdCase{"exact_causal", Mode::kExact, true, std::nullopt, 0, 0},
                      // Queries beyond every key, non-causal.
                      FdCase{"exact_offsets", Mode::kExact, false, int64_t{40}, 30, 0},
                      FdCase{"window_causal", Mode::kWindow, true, std::nullopt, 0, 2},
                      FdCase{"window_noncausal_offsets", Mode::kWindow, false, int64_t{101}, 100, 3},
                      FdCase{"lsh_causal", Mode::kLsh, true, std::nullopt, 0, 0},
                      FdCase{"lsh_noncausal_offsets", Mode::kLsh, false, int64_t{1001}, 1000, 0},
                      FdCase{"fixed_blocks_causal", Mode::kFixedBlocks, true, std::nullopt, 0, 0},
                      FdCase{"fixed_blocks_noncausal_offsets", Mode::kFixedBlocks, false, int64_t{1001}, 1000, 0}),
    testing::CaseName());

// ---- The CPU backend against the reference ---------------------------------

// The forward's tensors and params (problem.h) with a backward's: dout
// N(0, 1) in the output dtype, gradients poisoned with 0xEE.
struct BackwardProblem : testing::Problem {
  testing::GradTensors grad;
  GradientRefs grads() { return grad.refs(); }
};

BackwardProblem make_backward_problem(const AttentionOptions& o, std::optional<DType> grad_dtype, uint64_t seed) {
  BackwardProblem pr;
  static_cast<testing::Problem&>(pr) = testing::make_problem(o, seed);
  pr.grad = testing::grad_tensors(o, grad_dtype.value_or(o.dtype), seed + 1000, 0xEE);
  return pr;
}

PlanLimits backward_limits(int threads) {
  PlanLimits limits;
  limits.threads = threads;
  limits.backward = true;
  return limits;
}

// Forward then backward on one plan, as a training step does.
Status forward_backward(Backend& backend, BackwardProblem& pr, int threads, Plan* plan_out = nullptr,
                        BackwardResult* result = nullptr) {
  ASSIGN_OR_RETURN(Plan plan, backend.plan(pr.params, backward_limits(threads)));
  RETURN_IF_ERROR(testing::run_forward(backend, plan, ExecContext{}, nullptr));
  ASSIGN_OR_RETURN(BackwardResult r, run_backward(backend, plan, pr.grads(), ExecContext{}));
  if (plan_out != nullptr) *plan_out = plan;
  if (result != nullptr) *result = r;
  return Status::Ok();
}

// The precision a gradient can have: float32 accumulation (1e-5 relative,
// SPEC and STYLE), and where out or the gradients are rounded to 16 bits,
// that rounding: twice its unit (2^-11 for f16, 2^-8 for bf16), once for
// the gradient itself and once through D_i = dO_i . O_i of a rounded O.
double tolerance(DType out_dtype, DType grad_dtype) {
  auto unit = [](DType t) { return t == DType::kF16 ? 0x1.0p-11 : t == DType::kBF16 ? 0x1.0p-8 : 0.0; };
  return std::max(1e-5, 2 * std::max(unit(out_dtype), unit(grad_dtype)));
}

struct GradErrors {
  testing::ErrorStats dq, dk, dv;
};

GradErrors compare_gradients(const BackwardProblem& pr, const ReferenceGradients& ref) {
  const testing::GradTensors& g = pr.grad;
  return {testing::compare(g.dq.data(), g.grad_dtype, ref.dq), testing::compare(g.dk.data(), g.grad_dtype, ref.dk),
          testing::compare(g.dv.data(), g.grad_dtype, ref.dv)};
}

using BackwardCase = testing::AttentionCase;

class CpuBackward : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(CpuBackward, MatchesFloat64Reference) {
  const BackwardCase& c = GetParam();
  BackwardProblem pr = make_backward_problem(testing::options_of(c, 11), c.grad_dtype, 23);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  Plan plan;
  BackwardResult result;
  const Status s = forward_backward(*cpu, pr, 2, &plan, &result);
  ASSERT_TRUE(s.ok()) << s.to_string();
  if (uses_draws(c.mode) && c.algorithm != LshAlgorithm::kAuto) {
    EXPECT_EQ(plan.lsh_algorithm, c.algorithm);
  }
  EXPECT_GT(result.flops, 0);
  EXPECT_GT(result.dense_flops, 0);

  const ReferenceGradients ref = testing::reference_backward(
      pr.params, testing::dense_inputs(pr.params), testing::reference_weights(pr.params), pr.grad.dout_values());
  const GradErrors e = compare_gradients(pr, ref);
  const double tol = tolerance(pr.params.out_dtype, pr.grad.grad_dtype);
  std::printf("%s: max_rel dq %.2e dk %.2e dv %.2e (rel_l2 %.2e %.2e %.2e), tolerance %.1e\n", c.name.c_str(),
              e.dq.max_rel, e.dk.max_rel, e.dv.max_rel, e.dq.rel_l2, e.dk.rel_l2, e.dv.rel_l2, tol);
  EXPECT_LE(e.dq.max_rel, tol) << "dq";
  EXPECT_LE(e.dk.max_rel, tol) << "dk";
  EXPECT_LE(e.dv.max_rel, tol) << "dv";
}

constexpr DType kF32 = DType::kF32, kF16 = DType::kF16, kBF16 = DType::kBF16;

INSTANTIATE_TEST_SUITE_P(
    Cases, CpuBackward,
    ::testing::Values(
        // n = 1: one query, one key; and one query at the end of 97 keys.
        BackwardCase{"exact_n1_f32", 1, 1, 1, 2, 1, 40, kF32, Mode::kExact, false},
        BackwardCase{"exact_n1_of_97_causal_f16", 1, 1, 97, 2, 2, 59, kF16, Mode::kExact, true},
        BackwardCase{"exact_causal_gqa_f32", 2, 97, 97, 4, 2, 40, kF32, Mode::kExact, true},
        // Queries past the keys (nearest distance up to 76): the logits'
        // shift must go back through lse.
        BackwardCase{"exact_noncausal_offsets_f32", 1, 97, 131, 4, 1, 59, kF32, Mode::kExact, false, int64_t{1100},
                     990},
        BackwardCase{"exact_noncausal_gqa_f16", 2, 97, 97, 4, 1, 40, kF16, Mode::kExact, false},
        BackwardCase{"exact_causal_1025_bf16", 1, 1025, 1025, 2, 1, 59, kBF16, Mode::kExact, true},
        BackwardCase{"exact_noncausal_1025_f32", 1, 1025, 1025, 2, 2, 40, kF32, Mode::kExact, false},
        BackwardCase{"exact_causal_d128_f32", 1, 200, 300, 2, 1, 128, kF32, Mode::kExact, true},
        BackwardCase{"window_causal_1025_f32", 1, 1025, 1025, 2, 1, 40, kF32, Mode::kWindow, true, std::nullopt, 0, 0,
                     LshAlgorithm::kAuto, testing::head_slopes(0.3, 0.02)},
        BackwardCase{"window_width_noncausal_offsets_f16", 2, 97, 131, 4, 2, 59, kF16, Mode::kWindow, false,
                     int64_t{520}, 500, 0, LshAlgorithm::kAuto, testing::head_slopes(), 37},
        BackwardCase{"window_causal_gqa_bf16", 1, 300, 300, 4, 1, 40, kBF16, Mode::kWindow, true},
        BackwardCase{"lsh_banded_causal_1025_f32", 1, 1025, 1025, 2, 1, 40, kF32, Mode::kLsh, true, std::nullopt, 0, 8,
                     LshAlgorithm::kBanded},
        BackwardCase{"lsh_per_sample_causal_1025_f32", 1, 1025, 1025, 2, 1, 40, kF32, Mode::kLsh, true, std::nullopt, 0,
                     8, LshAlgorithm::kPerSample},
        BackwardCase{"lsh_per_sample_noncausal_gqa_bf16", 1, 97, 97, 4, 2, 59, kBF16, Mode::kLsh, false, std::nullopt,
                     0, 5, LshAlgorithm::kPerSample},
        // sigma from 1.1 to infinity (slope 0: one block, M~ = 1), offsets.
        BackwardCase{"lsh_banded_offsets_f16", 2, 97, 131, 4, 2, 40, kF16, Mode::kLsh, true, int64_t{40}, 10, 16,
                     LshAlgorithm::kBanded, testing::head_slopes(0.9, 0.05, 1.0 / 300, 0.0)},
        BackwardCase{"lsh_per_sample_noncausal_offsets_f32", 1, 97, 131, 2, 1, 59, kF32, Mode::kLsh, false,
                     int64_t{1030}, 1000, 16, LshAlgorithm::kPerSample, testing::head_slopes(0.2, 0.01)},
        BackwardCase{"lsh_n1_f32", 1, 1, 1, 2, 1, 40, kF32, Mode::kLsh, false, std::nullopt, 0, 4},
        // fixed_blocks (SPEC section 4): the reference's floor(p / 2 sigma)
        // mask; widths 2.2 to infinity, offsets mid-block, both algorithms.
        BackwardCase{"fixed_blocks_banded_causal_1025_f32", 1, 1025, 1025, 2, 1, 40, kF32, Mode::kFixedBlocks, true,
                     std::nullopt, 0, 0, LshAlgorithm::kBanded},
        BackwardCase{"fixed_blocks_per_sample_offsets_gqa_f16", 2, 97, 131, 4, 2, 40, kF16, Mode::kFixedBlocks, true,
                     int64_t{40}, 10, 0, LshAlgorithm::kPerSample, testing::head_slopes(0.9, 0.05, 1.0 / 300, 0.0)},
        BackwardCase{"fixed_blocks_per_sample_noncausal_f32", 1, 300, 300, 4, 4, 59, kF32, Mode::kFixedBlocks, false,
                     std::nullopt, 0, 0, LshAlgorithm::kPerSample},
        // No bias (every slope 0): exact and lsh (one block, M~ = 1).
        BackwardCase{"exact_no_bias_causal_f32", 1, 300, 300, 4, 2, 40, kF32, Mode::kExact, true, std::nullopt, 0, 0,
                     LshAlgorithm::kAuto, testing::head_slopes(0.0, 0.0, 0.0, 0.0)},
        BackwardCase{"lsh_no_bias_causal_f32", 1, 300, 300, 4, 2, 40, kF32, Mode::kLsh, true, std::nullopt, 0, 8,
                     LshAlgorithm::kAuto, testing::head_slopes(0.0, 0.0, 0.0, 0.0)},
        // Gradient dtype float32 for 16-bit inputs; float32 out too.
        BackwardCase{"exact_bf16_in_f32_grads", 1, 97, 97, 2, 1, 40, kBF16, Mode::kExact, true, std::nullopt, 0, 0,
                     LshAlgorithm::kAuto, testing::head_slopes(), 0, std::nullopt, kF32},
        BackwardCase{"lsh_f16_in_f32_out_f32_grads", 1, 97, 97, 2, 1, 40, kF16, Mode::kLsh, true, std::nullopt, 0, 8,
                     LshAlgorithm::kBanded, testing::head_slopes(), 0, kF32, kF32}),
    testing::CaseName());

// A query far from every key keeps its forward exact by taking its logits
// relative to the nearest key (SPEC section 2's lse includes the bias); the
// backward reads lse in float32, whose rounding at |lse| ~ slope * distance
// bounds what P = exp(s - lse) can be: |lse| * 2^-24 relative, on top of
// float32's 1e-5. This pins that limit down rather than hiding it.
TEST(CpuBackwardPrecision, FarQueriesAreLimitedByLseRounding) {
  const AttentionOptions o = testing::shaped(
      {1, 40, 300, 2, 0, 40}, {.slopes = {0.5, 1.0 / 64}, .q_pos0 = 5000, .mode = Mode::kExact, .estimates = false});
  BackwardProblem pr = make_backward_problem(o, std::nullopt, 29);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(forward_backward(*cpu, pr, 2).ok());
  double max_lse = 0;
  for (float l : pr.lse) max_lse = std::max(max_lse, std::fabs(static_cast<double>(l)));
  EXPECT_GT(max_lse, 2000);  // the case the test is about
  const ReferenceGradients ref = testing::reference_backward(
      pr.params, testing::dense_inputs(pr.params), testing::reference_weights(pr.params), pr.grad.dout_values());
  const GradErrors e = compare_gradients(pr, ref);
  const double tol = 1e-5 + 2 * max_lse * 0x1.0p-24;
  std::printf("far queries (max |lse| %.0f): max_rel dq %.2e dk %.2e dv %.2e, tolerance %.1e\n", max_lse, e.dq.max_rel,
              e.dk.max_rel, e.dv.max_rel, tol);
  EXPECT_LE(e.dq.max_rel, tol);
  EXPECT_LE(e.dk.max_rel, tol);
  EXPECT_LE(e.dv.max_rel, tol);
}

AttentionOptions lsh_backward_options() {
  return testing::shaped({2, 97, 131, 4, 4, 24},
                         {.causal = true, .mode = Mode::kLsh, .samples = 6, .seed = 5, .estimates = false});
}

// Per-sample and banded plans differentiate one function: their gradients
// agree to float32 rounding (their forwards do, to 1e-5).
TEST(CpuBackward, LshAlgorithmsGiveTheSameGradients) {
  AttentionOptions o = lsh_backward_options();
  o.lsh_algorithm = LshAlgorithm::kPerSample;
  BackwardProblem a = make_backward_problem(o, std::nullopt, 31);
  o.lsh_algorithm = LshAlgorithm::kBanded;
  BackwardProblem b = make_backward_problem(o, std::nullopt, 31);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(forward_backward(*cpu, a, 2).ok());
  ASSERT_TRUE(forward_backward(*cpu, b, 2).ok());
  for (auto [x, y] :
       {std::pair{&a.grad.dq, &b.grad.dq}, std::pair{&a.grad.dk, &b.grad.dk}, std::pair{&a.grad.dv, &b.grad.dv}})
    EXPECT_LE(testing::compare(x->data(), DType::kF32, testing::to_doubles(*y, DType::kF32)).max_rel, 1e-5);
}

// The backward reads the plan's draws: with head 3's replaced by one block
// holding every position, its gradients follow the new weights (the
// reference given the same draws) and differ from the seed's.
TEST(CpuBackward, LshReadsThePlanDraws) {
  BackwardProblem pr = make_backward_problem(lsh_backward_options(), std::nullopt, 37);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<Plan> plan = cpu->plan(pr.params, backward_limits(2));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  for (Draw& d : plan->draws[3]) d = Draw{1e9, 0.5e9};
  ASSERT_TRUE(testing::run_forward(*cpu, *plan, ExecContext{}, nullptr).ok());
  StatusOr<BackwardResult> r = run_backward(*cpu, *plan, pr.grads(), ExecContext{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const DenseInputs x = testing::dense_inputs(pr.params);
  const std::vector<double> dout = pr.grad.dout_values();
  const ReferenceGradients tampered =
      testing::reference_backward(pr.params, x, testing::reference_weights(pr.params, &plan->draws), dout);
  const ReferenceGradients seeded =
      testing::reference_backward(pr.params, x, testing::reference_weights(pr.params), dout);
  const GradErrors e = compare_gradients(pr, tampered);
  EXPECT_LE(e.dq.max_rel, 1e-5);
  EXPECT_LE(e.dk.max_rel, 1e-5);
  EXPECT_LE(e.dv.max_rel, 1e-5);
  // Head 3 (and its kv head, 3: no grouping here) moved; the others did not.
  const int64_t D = pr.params.head_dim;
  double moved = 0, kept = 0;
  auto tally = [&](const std::vector<double>& t, const std::vector<double>& u) {
    for (size_t i = 0; i < t.size(); ++i) {
      const int64_t h = (static_cast<int64_t>(i) / D) % 4;
      double& into = h == 3 ? moved : kept;
      into = std::max(into, std::fabs(t[i] - u[i]));
    }
  };
  tally(tampered.dq, seeded.dq);
  tally(tampered.dk, seeded.dk);
  tally(tampered.dv, seeded.dv);
  EXPECT_GT(moved, 1e-2);
  EXPECT_EQ(kept, 0.0);
}

// dk and dv accumulate inside one thread per key tile: the same bits on
// every run. dq gathers key tiles in the threads' order (cpu_backward.h):
// equal to float32 rounding.
TEST(CpuBackward, DkDvAreReproducibleAndDqCloseAcrossRuns) {
  AttentionOptions o = lsh_backward_options();
  o.mode = Mode::kExact;
  o.q_len = o.kv_len = 700;
  BackwardProblem a = make_backward_problem(o, std::nullopt, 41), b = make_backward_problem(o, std::nullopt, 41);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ASSERT_TRUE(forward_backward(*cpu, a, 2).ok());
  ASSERT_TRUE(forward_backward(*cpu, b, 2).ok());
  EXPECT_EQ(a.grad.dk, b.grad.dk);
  EXPECT_EQ(a.grad.dv, b.grad.dv);
  EXPECT_LE(testing::compare(a.grad.dq.data(), DType::kF32, b.grad.values(b.grad.dq)).max_rel, 1e-6);
}

// ---- The plan, the front door, refusals, stops --------------------------------

TEST(BackwardPlan, WorkspaceIsPlannedOnlyWhenAsked) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<AttentionParams> p = resolve_params(lsh_backward_options());
  ASSERT_TRUE(p.ok());
  PlanLimits plain;
  plain.threads = 1;
  StatusOr<Plan> without = plan_attention(*cpu, *p, plain);
  StatusOr<Plan> one = plan_attention(*cpu, *p, backward_limits(1));
  StatusOr<Plan> four = plan_attention(*cpu, *p, backward_limits(4));
  ASSERT_TRUE(without.ok() && one.ok() && four.ok());
  EXPECT_FALSE(without->backward);
  EXPECT_EQ(without->backward_workspace.host_bytes, 0);
  EXPECT_TRUE(one->backward);
  // At least the float32 dQ accumulator [B, Nq, H, D].
  EXPECT_GE(one->backward_workspace.host_bytes, 2 * 97 * 4 * 24 * 4);
  EXPECT_GT(four->backward_workspace.host_bytes, one->backward_workspace.host_bytes);
  EXPECT_EQ(one->backward_workspace.device_bytes, 0);
  EXPECT_GE(one->workspace().host_bytes, one->backward_workspace.host_bytes);
  EXPECT_GE(one->workspace().host_bytes, one->forward_workspace.host_bytes);
  // The forward's share is unchanged by planning the backward.
  EXPECT_EQ(one->forward_workspace.host_bytes, without->forward_workspace.host_bytes);
}

TEST(BackwardPlan, RefusesForeignUnplannedAndIncompleteRequests) {
  BackwardProblem pr = make_backward_problem(lsh_backward_options(), std::nullopt, 43);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<Plan> plan = cpu->plan(pr.params, backward_limits(2));
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(testing::run_forward(*cpu, *plan, ExecContext{}, nullptr).ok());

  Plan foreign = *plan;
  foreign.backend = "cuda";
  Status s = run_backward(*cpu, foreign, pr.grads(), ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda"), std::string::npos) << s.message();

  StatusOr<Plan> unplanned = cpu->plan(pr.params, PlanLimits{});
  ASSERT_TRUE(unplanned.ok());
  s = run_backward(*cpu, *unplanned, pr.grads(), ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("PlanLimits::backward"), std::string::npos) << s.message();

  GradientRefs g = pr.grads();
  g.dout = nullptr;
  s = run_backward(*cpu, *plan, g, ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dout = null"), std::string::npos) << s.message();

  Plan no_lse = *plan;
  no_lse.params.lse = nullptr;
  s = run_backward(*cpu, no_lse, pr.grads(), ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lse = null"), std::string::npos) << s.message();

  g = pr.grads();
  g.memory = MemorySpace::kDevice;
  EXPECT_EQ(run_backward(*cpu, *plan, g, ExecContext{}).status().code(), StatusCode::kInvalidArgument);

  // Non-finite dout: named with its position.
  std::vector<float> bad_dout(pr.grad.dout.size() / 4, 0.5f);
  bad_dout[static_cast<size_t>(((1 * 97 + 3) * 4 + 2) * 24 + 5)] = std::numeric_limits<float>::quiet_NaN();
  g = pr.grads();
  g.dout = bad_dout.data();
  s = run_backward(*cpu, *plan, g, ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dout has a non-finite value"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[b=1, n=3, h=2, d=5]"), std::string::npos) << s.message();

  // A caller's lse is checked too (the plan's own is the forward's output).
  std::vector<float> bad_lse = pr.lse;
  bad_lse[static_cast<size_t>((0 * 97 + 7) * 4 + 1)] = -std::numeric_limits<float>::infinity();
  g = pr.grads();
  g.lse = bad_lse.data();
  s = run_backward(*cpu, *plan, g, ExecContext{}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lse has a non-finite value (-inf) at [b=0, n=7, h=1]"), std::string::npos) << s.message();
}

// A backend without a backward says so, from supports_backward and from
// backward, whatever it computes forward.
TEST(BackwardPlan, BackendsWithoutABackwardSayUnimplemented) {
  class ForwardOnly final : public Backend {
   public:
    std::string name() const override { return "forward-only"; }
    std::string device() const override { return "none"; }
    Status supports(const AttentionParams&) const override { return Status::Ok(); }
    StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
      return start_plan(p, name(), limits);
    }
    Status forward(const Plan&, const WorkspaceRef&, const ExecContext&, ForwardStats*) override {
      return Status::Ok();
    }
  } backend;
  StatusOr<AttentionParams> p = resolve_params(lsh_backward_options());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(backend.supports_backward(*p).code(), StatusCode::kUnimplemented);
  EXPECT_NE(backend.supports_backward(*p).message().find("forward-only"), std::string::npos);
  StatusOr<Plan> plan = backend.plan(*p, PlanLimits{});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(backend.backward(*plan, BackwardParams{}, WorkspaceRef{}, ExecContext{}, nullptr).code(),
            StatusCode::kUnimplemented);
}

BackwardProblem stop_problem() {
  return make_backward_problem(
      testing::shaped({1, 2048, 2048, 2, 0, 64}, {.causal = true, .mode = Mode::kExact, .estimates = false}),
      std::nullopt, 47);
}

TEST(BackwardStop, CancelAndDeadlineStopTheBackward) {
  BackwardProblem pr = stop_problem();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  StatusOr<Plan> plan = cpu->plan(pr.params, backward_limits(2));
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(testing::run_forward(*cpu, *plan, ExecContext{}, nullptr).ok());

  std::atomic<bool> cancel{true};
  ExecContext cancelled;
  cancelled.cancel = &cancel;
  EXPECT_EQ(run_backward(*cpu, *plan, pr.grads(), cancelled).status().code(), StatusCode::kCancelled);

  ExecContext late;
  late.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  EXPECT_EQ(run_backward(*cpu, *plan, pr.grads(), late).status().code(), StatusCode::kDeadlineExceeded);

  // Cancelled part way: the first progress report sets the flag, and the
  // backward returns well before it would have finished.
  std::atomic<bool> midway{false};
  std::atomic<int> reports{0};
  ExecContext ctx;
  ctx.cancel = &midway;
  ctx.progress = [&](double) {
    ++reports;
    midway = true;
  };
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = run_backward(*cpu, *plan, pr.grads(), ctx).status();
  const double stopped_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.to_string();
  EXPECT_GE(reports.load(), 1);
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_backward(*cpu, *plan, pr.grads(), ExecContext{}).ok());
  const double full_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_LT(stopped_s, full_s);
  std::printf("cancelled after %.3f s of a %.3f s backward\n", stopped_s, full_s);
}

// run_forward_backward: one plan, forward then backward, an lse of its own
// when the caller has none; the same bytes as the steps one by one.
TEST(BackwardFrontDoor, ForwardBackwardMatchesTheStepsOneByOne) {
  BackwardProblem a = make_backward_problem(lsh_backward_options(), std::nullopt, 53),
                  b = make_backward_problem(lsh_backward_options(), std::nullopt, 53);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  AttentionParams no_lse = a.params;
  no_lse.lse = nullptr;
  PlanLimits one;
  one.threads = 1;  // one thread: dq's order is fixed
  StatusOr<ForwardBackwardResult> joint = run_forward_backward(*cpu, no_lse, one, a.grads(), ExecContext{});
  ASSERT_TRUE(joint.ok()) << joint.status().to_string();
  EXPECT_GT(joint->backward.flops, 0);
  EXPECT_GT(joint->backward.timings.count("backward"), 0u);
  EXPECT_GT(joint->backward.host_workspace_bytes, 0);
  EXPECT_EQ(joint->backward.backend, "cpu");
  ASSERT_TRUE(forward_backward(*cpu, b, 1).ok());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.grad.dq, b.grad.dq);
  EXPECT_EQ(a.grad.dk, b.grad.dk);
  EXPECT_EQ(a.grad.dv, b.grad.dv);

  GradientRefs g = a.grads();
  g.lse = b.lse.data();
  EXPECT_EQ(run_forward_backward(*cpu, a.params, one, g, ExecContext{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace plsh
