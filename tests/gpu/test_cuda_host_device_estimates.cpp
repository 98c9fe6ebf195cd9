// run_attention's estimates for a backend that computes the probe rows with
// its forward (plsh/device_estimates.h, issue 19), end to end on the host: a
// backend that forwards like the CPU backend and returns probe rows from
// the fused probe kernel's host emulation (fused_host.h). Its estimates must
// be the CPU backend's: the same mask errors (the same code, beside the
// forward instead of after it), the same sample, and a probe that agrees to
// float32 (or, below kDeviceProbeFloor, is the same float64 probe).
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
#include "plsh/attention.h"
#include "plsh/device_estimates.h"
#include "problem.h"
#include "shaped.h"

namespace plsh {
namespace {

using plsh::testing::head_slopes;
using plsh::testing::shaped;

// The CPU backend, plus probe rows from the emulated fused probe kernel.
class EmulatedDeviceProbe final : public Backend {
 public:
  EmulatedDeviceProbe() : cpu_(make_cpu_backend()) {}
  std::string name() const override { return cpu_->name(); }
  std::string device() const override { return "host emulation of the fused probe"; }
  Status supports(const AttentionParams& p) const override { return cpu_->supports(p); }
  StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
    return cpu_->plan(p, limits);
  }
  Status forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                 ForwardStats* stats) override {
    return cpu_->forward(plan, workspace, ctx, stats);
  }
  bool probes_with_forward(const Plan&) const override { return true; }
  Status forward_with_probe(const Plan& plan, const std::vector<std::vector<int64_t>>& rows,
                            const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats,
                            ProbeRowsOut* out) override {
    RETURN_IF_ERROR(cpu_->forward(plan, workspace, ctx, stats));
    ++probes;
    const AttentionParams& p = plan.params;
    const cuda::FusedTables t = cuda::fused_tables(p, plan.draws);
    const cuda::FusedArgs a = cuda::fused_args(p, t, t.heads.data(), t.hashes.data());
    std::vector<cuda::ProbeGroup> groups;
    std::vector<int32_t> row_index;
    cuda::fused_probe_groups(p, rows, &groups, &row_index);
    cuda::ProbeArgs pa;
    pa.groups = groups.data();
    pa.row_index = row_index.data();
    pa.splits = 2;
    pa.mode = static_cast<int32_t>(p.mode);
    pa.head_dim = p.head_dim;
    std::vector<float> partial(groups.size() * 2 * cuda::kFusedRows * cuda::probe_floats(p.head_dim));
    std::vector<float> result(row_index.size() * static_cast<size_t>(p.head_dim + 3));
    pa.partial = partial.data();
    pa.result = result.data();
    if (!cuda::fused_probe_on_host(p.dtype, p.head_dim, a, pa, static_cast<int64_t>(groups.size())))
      return internal_error("no fused probe for this shape");
    const size_t D = static_cast<size_t>(p.head_dim);
    out->o_star.assign(rows.size(), {});
    out->bound_ratio.assign(rows.size(), {});
    out->max_v2.assign(rows.size(), {});
    size_t at = 0;
    for (size_t h = 0; h < rows.size(); ++h)
      for (size_t r = 0; r < rows[h].size(); ++r, ++at) {
        const float* row = result.data() + at * (D + 3);
        out->o_star[h].insert(out->o_star[h].end(), row, row + D);
        out->bound_ratio[h].push_back(row[D]);
        out->max_v2[h].push_back(row[D + 1]);
      }
    return Status::Ok();
  }
  int probes = 0;

 private:
  std::unique_ptr<Backend> cpu_;
};

struct EstimatesCase {
  std::string name;
  AttentionOptions options;
  bool float64_again;  // the measured error is below kDeviceProbeFloor: the host's float64 probe
};
void PrintTo(const EstimatesCase& c, std::ostream* os) { *os << c.name; }

class DeviceEstimatesOnHost : public ::testing::TestWithParam<EstimatesCase> {};

TEST_P(DeviceEstimatesOnHost, AreTheCpuBackendsEstimates) {
  const EstimatesCase& c = GetParam();
  testing::Problem a = testing::make_problem(c.options, 21), b = testing::make_problem(c.options, 21);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  EmulatedDeviceProbe device;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  PlanLimits limits;
  limits.threads = 2;
  StatusOr<AttentionResult> on_device = run_attention(device, a.params, limits, ExecContext{});
  StatusOr<AttentionResult> on_cpu = run_attention(*cpu, b.params, limits, ExecContext{});
  ASSERT_TRUE(on_device.ok()) << on_device.status().to_string();
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status().to_string();
  EXPECT_EQ(device.probes, 1);
  const ProbeEstimate &x = on_device->probe, &y = on_cpu->probe;
  std::printf(
      "%s: rel_err %.6g vs %.6g (cpu), stderr %.3g vs %.3g, bound_max %.4g vs %.4g; timings compute %.3f s, "
      "estimates %.3f s (masks %.3f s beside the forward, probe %.3f s)\n",
      c.name.c_str(), x.rel_err, y.rel_err, x.rel_err_stderr, y.rel_err_stderr, x.bound_max, y.bound_max,
      on_device->timings["compute"], on_device->timings["estimates"], on_device->timings["estimates_masks"],
      on_device->timings["estimates_probe"]);
  EXPECT_EQ(x.rows, y.rows);
  EXPECT_EQ(on_device->mask_max_err, on_cpu->mask_max_err);
  EXPECT_EQ(on_device->mask_spectral_err, on_cpu->mask_spectral_err);
  ASSERT_EQ(on_device->heads.size(), on_cpu->heads.size());
  const double tol = c.float64_again ? 1e-12 : 1e-3;
  EXPECT_NEAR(x.rel_err, y.rel_err, tol * y.rel_err);
  EXPECT_NEAR(x.rel_err_upper, y.rel_err_upper, tol * y.rel_err_upper + 1e-12);
  EXPECT_NEAR(x.max_abs_err, y.max_abs_err, 1e-3 * y.max_abs_err + 1e-6);
  EXPECT_NEAR(x.bound_max, y.bound_max, 1e-3 * y.bound_max);
  for (const char* t : {"compute", "estimates", "estimates_masks", "estimates_probe"})
    EXPECT_TRUE(on_device->timings.count(t)) << t;
}

// A table, one case a line or two: clang-format would put each designated
// field on a line of its own.
// clang-format off
std::vector<EstimatesCase> estimates_cases() {
  return {
      {"lsh_causal_gqa_bf16", shaped({1, 300, 300, 4, 2, 64}, {.dtype = DType::kBF16, .causal = true,
           .slopes = head_slopes(0.9, 0.31, 0.05, 0.0), .mode = Mode::kLsh, .samples = 16, .probe_rows = 40}), false},
      {"lsh_batch2_f32", shaped({2, 150, 150, 2, 0, 128}, {.dtype = DType::kF32, .causal = false,
           .slopes = head_slopes(0.5, 0.02), .mode = Mode::kLsh, .samples = 8, .probe_rows = 70}), false},
      // A window so wide its error is below float32's reach: the float64 probe.
      {"window_tiny_error_f32", shaped({1, 200, 200, 2, 0, 64}, {.dtype = DType::kF32, .causal = true,
           .slopes = head_slopes(0.5, 0.25), .mode = Mode::kWindow, .window_eps = 1e-9, .probe_rows = 64}), true},
  };
}
// clang-format on

INSTANTIATE_TEST_SUITE_P(Cases, DeviceEstimatesOnHost, ::testing::ValuesIn(estimates_cases()), testing::CaseName());

}  // namespace
}  // namespace plsh
