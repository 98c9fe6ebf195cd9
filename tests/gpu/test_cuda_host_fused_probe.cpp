// The estimates' probe rows on the device (kernels/cuda/fused_probe.h), run
// on the host by HostExec after the emulated fused forward: every row's o*,
// the per-row bound's sums and max ||v||^2, split over the keys and merged,
// against the float64 probe of kernels/src/probe_sweep.cpp (probe_rows, visiting
// every allowed key) on the same rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/fused_host.h"
#include "cuda/fused_plan.h"
#include "fused_cases.h"
#include "plsh/estimates.h"
#include "plsh/numeric.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"

namespace plsh::cuda {
namespace {

class FusedProbeOnHost : public ::testing::TestWithParam<testing::AttentionCase> {};

TEST_P(FusedProbeOnHost, MatchesTheFloat64Probe) {
  const testing::AttentionCase& c = GetParam();
  testing::Problem pr = testing::make_problem(testing::options_of(c, 99), 5);
  ASSERT_TRUE(pr.status.ok());
  AttentionParams& p = pr.params;
  Plan plan;
  plan.params = p;
  plan.draws = plan_draws(p);
  const FusedTables t = fused_tables(p, plan.draws);
  FusedArgs a = fused_args(p, t, t.heads.data(), t.hashes.data());
  ASSERT_TRUE(fused_forward_on_host(p.dtype, p.head_dim, a, 0, fused_tiles(p.q_len, kFusedRows)));

  // Every head's sample: 70 rows (two groups, one of them partial) or all.
  std::vector<std::vector<int64_t>> samples(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h)
    samples[static_cast<size_t>(h)] = sample_indices(p.batch * p.q_len, 70, 1234 + static_cast<uint64_t>(h));
  std::vector<ProbeGroup> groups;
  std::vector<int32_t> row_index;
  fused_probe_groups(p, samples, &groups, &row_index);
  const int64_t D = p.head_dim;
  ProbeArgs pa;
  pa.groups = groups.data();
  pa.row_index = row_index.data();
  pa.splits = 3;  // merged across splits, as on the device
  pa.mode = static_cast<int32_t>(p.mode);
  pa.head_dim = D;
  std::vector<float> partial(groups.size() * pa.splits * kFusedRows * probe_floats(D), std::nanf(""));
  std::vector<float> result(row_index.size() * (D + 3), std::nanf(""));
  pa.partial = partial.data();
  pa.result = result.data();
  ASSERT_TRUE(fused_probe_on_host(p.dtype, D, a, pa, static_cast<int64_t>(groups.size())));

  double worst_err2 = 0, worst_ref2 = 0, worst_bound = 0;
  for (const ProbeGroup& g : groups) {
    std::vector<int64_t> rows(row_index.begin() + g.first, row_index.begin() + g.first + g.rows);
    std::vector<ProbeRow> host(rows.size());
    probe_rows(p, head_mask(plan, g.head), g.head, g.batch, rows, host.data());
    for (int32_t r = 0; r < g.rows; ++r) {
      const float* res = result.data() + (g.first + r) * (D + 3);
      double err2 = 0, ref2 = 0;
      const int64_t o_off = g.batch * p.o_batch_stride + rows[r] * p.o_row_stride + g.head * p.o_head_stride;
      for (int64_t d = 0; d < D; ++d) {
        const double diff = load_element(p.out, p.out_dtype, o_off + d) - res[d];
        err2 += diff * diff;
        ref2 += static_cast<double>(res[d]) * res[d];
      }
      const double bound = 2 * std::sqrt(static_cast<double>(res[D + 1])) * res[D];
      const ProbeRow& e = host[static_cast<size_t>(r)];
      // What o*'s rounding (1e-5 relative: 2^-17 from P's two parts on 16-bit inputs) may move err2 by, and 1e-3 of
      // err2.
      const double allowed = 1e-3 * e.err2 + 2e-5 * std::sqrt(e.err2 * e.ref2) + 1e-10 * e.ref2;
      worst_err2 = std::max(worst_err2, std::fabs(err2 - e.err2) / allowed);
      worst_ref2 = std::max(worst_ref2, std::fabs(ref2 - e.ref2) / e.ref2);
      worst_bound = std::max(worst_bound, std::fabs(bound - e.bound) / e.bound);
    }
  }
  std::printf("%s: %zu groups of %zu rows; vs float64 probe: err2 %.2f of its allowance, ref2 %.2e, bound %.2e\n",
              c.name.c_str(), groups.size(), row_index.size(), worst_err2, worst_ref2, worst_bound);
  // o* to float32's accuracy whatever the dtype (P in two parts): ref2 to
  // 1e-5; err2 = ||o~ - o*||^2 within 1e-3 of itself plus what o*'s
  // rounding can move it; the bound's float32 sums to 1e-3.
  EXPECT_LE(worst_ref2, 1e-5);
  EXPECT_LE(worst_err2, 1.0);
  EXPECT_LE(worst_bound, 1e-3);
}

std::vector<testing::AttentionCase> probe_cases() {
  std::vector<testing::AttentionCase> v;
  for (const testing::AttentionCase& c : testing::fused_cases())
    if (c.mode != Mode::kExact) v.push_back(c);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, FusedProbeOnHost, ::testing::ValuesIn(probe_cases()), testing::CaseName());

}  // namespace
}  // namespace plsh::cuda
