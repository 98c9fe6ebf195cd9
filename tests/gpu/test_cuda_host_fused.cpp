// The fused forward (kernels/cuda/fused_forward.h) run on the host by
// HostExec: the kernel's own body, its loop over the reachable key tiles,
// its lsh blocks and hash classification, its online softmax and its
// fragment layouts (ldmatrix and mma.m16n8k16 as the PTX ISA defines them),
// against the float64 reference and the CPU backend. What this cannot see
// is the hardware itself (the inline PTX, timing, races): the GPU tests
// (test_cuda_fused.cpp) run the same cases on the device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/fused_host.h"
#include "cuda/fused_plan.h"
#include "fused_cases.h"
#include "log_reference.h"
#include "plsh/numeric.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace plsh::cuda {
namespace {

using plsh::testing::shaped;

// The emulated forward's out (as float64) and lse, and the (warp, key tile)
// products it ran.
struct EmulatedForward {
  std::vector<double> out;
  std::vector<float> lse;
  unsigned long long tiles = 0;
};

EmulatedForward emulate(const AttentionParams& p) {
  const FusedTables t = fused_tables(p, plan_draws(p));
  std::vector<uint8_t> out(static_cast<size_t>(p.batch * p.q_len * p.heads * p.head_dim) * dtype_bytes(p.out_dtype),
                           0xFF);
  std::vector<float> lse(static_cast<size_t>(p.batch * p.q_len * p.heads), std::nanf(""));
  AttentionParams q = p;
  q.out = out.data();
  q.lse = lse.data();
  FusedArgs a = fused_args(q, t, t.heads.data(), t.hashes.data());
  EmulatedForward e;
  a.tiles_done = &e.tiles;
  EXPECT_TRUE(fused_forward_on_host(p.dtype, p.head_dim, a, 0, fused_tiles(p.q_len, kFusedRows)));
  e.out = testing::to_doubles(out, p.out_dtype);
  e.lse = std::move(lse);
  return e;
}

class FusedForwardOnHost : public ::testing::TestWithParam<testing::AttentionCase> {};

TEST_P(FusedForwardOnHost, MatchesFloat64ReferenceAndCpuBackend) {
  const testing::AttentionCase& c = GetParam();
  testing::Problem pr = testing::make_problem(testing::fused_options(c), 5);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  const AttentionParams& p = pr.params;
  ASSERT_TRUE(fused_supported(p).ok()) << fused_supported(p).to_string();
  const EmulatedForward e = emulate(p);

  const testing::ReferenceOutput ref = testing::log_domain_reference(p);
  const testing::FusedErrors vs_ref = testing::fused_errors(e.out, e.lse, ref.out, ref.lse);
  // The CPU backend on the same inputs (banded lsh: the same algorithm).
  testing::Problem on_cpu = testing::make_problem(testing::fused_options(c, true), 5);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const Status s = testing::plan_and_forward(*cpu, on_cpu.params, ExecContext{}, nullptr, 1);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const std::vector<double> cpu_lse(on_cpu.lse.begin(), on_cpu.lse.end());
  const testing::FusedErrors vs_cpu =
      testing::fused_errors(e.out, e.lse, testing::to_doubles(on_cpu.out, on_cpu.params.out_dtype), cpu_lse);
  std::printf("%s: %llu tile products; vs float64 max_rel %.3g lse %.3g; vs cpu max_rel %.3g lse %.3g\n",
              c.name.c_str(), e.tiles, vs_ref.max_rel, vs_ref.lse, vs_cpu.max_rel, vs_cpu.lse);
  ASSERT_EQ(vs_ref.unwritten, 0) << "outputs the emulated kernel did not write";
  const testing::FusedTolerance tol = testing::fused_tolerance(p.dtype, p.out_dtype);
  EXPECT_LE(vs_ref.max_rel, tol.out);
  EXPECT_LE(vs_ref.lse, tol.lse);
  EXPECT_LE(vs_cpu.max_rel, 2 * tol.out) << "emulated fused kernel vs cpu backend";
  EXPECT_LE(vs_cpu.lse, 2 * tol.lse) << "emulated fused kernel vs cpu backend";
  EXPECT_GT(e.tiles, 0u);
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedForwardOnHost, ::testing::ValuesIn(testing::fused_cases()), testing::CaseName());

// The host's planners agree with the kernels: the steps' key needs (what
// the pipelined uploads wait for) cover every key tile a query tile reads,
// and the backward's query-tile search finds exactly the tiles whose spans
// hold a key tile.
TEST(FusedPlan, StepsAndSpansCoverWhatTheKernelsRead) {
  for (const testing::AttentionCase& c : testing::fused_cases()) {
    testing::Problem pr = testing::make_problem(testing::options_of(c, 99), 5, false);
    ASSERT_TRUE(pr.status.ok());
    const AttentionParams& p = pr.params;
    const FusedTables t = fused_tables(p, plan_draws(p));
    const FusedArgs a = fused_args(p, t, t.heads.data(), t.hashes.data());
    const int64_t tiles = fused_tiles(p.q_len, kFusedRows), key_tiles = fused_tiles(p.kv_len, kFusedKeys);
    std::vector<int32_t> spans(static_cast<size_t>(2 * p.heads * tiles));
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t q = 0; q < tiles; ++q) fused_span(a, h, q, spans.data());
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t kt = 0; kt < key_tiles; ++kt) {
        const TileSpan found = fused_query_tiles(spans.data() + 2 * h * tiles, tiles, kt);
        for (int64_t q = 0; q < tiles; ++q) {
          const TileSpan s = fused_key_tiles(fused_key_range(a, t.heads[static_cast<size_t>(h)], q));
          const bool reads = s.begin <= kt && kt < s.end;
          ASSERT_EQ(reads, q >= found.begin && q < found.end)
              << c.name << " head " << h << " key tile " << kt << " query tile " << q;
        }
      }
    for (int64_t step_rows : {int64_t{64}, int64_t{128}, int64_t{1} << 20}) {
      int64_t covered = 0;
      for (const ForwardStep& s : fused_forward_steps(p, t, step_rows)) {
        ASSERT_EQ(s.t0, covered);
        for (int64_t q = s.t0; q < s.t1; ++q)
          for (const FusedHead& h : t.heads) EXPECT_LE(fused_key_range(a, h, q).end, s.keys) << c.name;
        covered = s.t1;
      }
      EXPECT_EQ(covered, tiles);
    }
  }
}

// SPEC's cost model for the CUDA backend's lsh_algorithm = auto: the fused
// banded kernel wherever it runs (s up to 64), which at s = 16 reads the
// union of the blocks once where the per-sample pipeline reads every block
// per hash and writes its scores to memory; the per-sample pipeline past
// 64 hashes or for head dims without a fused kernel.
TEST(FusedPlan, AutoPicksBandedWhereTheFusedKernelRuns) {
  auto params = [](int64_t n, int64_t d, int64_t s) {
    AttentionOptions o =
        shaped({1, n, n, 32, 0, d}, {.dtype = DType::kBF16, .causal = true, .mode = Mode::kLsh, .samples = s});
    StatusOr<AttentionParams> p = resolve_params(o);
    EXPECT_TRUE(p.ok());
    return *p;
  };
  const AttentionParams big = params(131072, 128, 16);
  const LshCosts c = cuda_lsh_costs(big, plan_draws(big));
  std::printf("N = 131072, H = 32, D = 128, s = 16: banded %.3g s, per-sample %.3g s (model)\n", c.banded_s,
              c.per_sample_s);
  EXPECT_LT(c.banded_s * 10, c.per_sample_s);
  EXPECT_EQ(cuda_lsh_algorithm(big, plan_draws(big)), LshAlgorithm::kBanded);
  const AttentionParams many = params(4096, 128, 256);
  EXPECT_EQ(cuda_lsh_algorithm(many, plan_draws(many)), LshAlgorithm::kPerSample);
  const AttentionParams odd_dim = params(4096, 40, 16);
  EXPECT_EQ(cuda_lsh_algorithm(odd_dim, plan_draws(odd_dim)), LshAlgorithm::kPerSample);
}

}  // namespace
}  // namespace plsh::cuda
