#include "cpu/cpu_backend.h"

#include <sys/utsname.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "cpu/cpu_backward.h"
#include "cpu/tiles.h"
#include "plsh/draws.h"

namespace plsh {

namespace {

// Job n of a forward: row tiles of every (batch, head), the last rows
// first (under causal they see the most keys, and starting them first keeps
// the dynamic schedule's tail short). Computed, not listed: the forward
// holds no job table.
cpu::TileJob tile_job(const AttentionParams& p, int64_t n) {
  const int64_t rows = cpu::row_tile(p.mode);
  const int64_t tiles = (p.q_len + rows - 1) / rows;
  const int64_t per_tile = p.batch * p.heads;
  const int64_t t = tiles - 1 - n / per_tile;
  const int64_t b = (n % per_tile) / p.heads, h = n % p.heads;
  const int64_t i0 = t * rows;
  return {b, h, i0, std::min(rows, p.q_len - i0)};
}

int64_t tile_job_count(const AttentionParams& p) {
  const int64_t rows = cpu::row_tile(p.mode);
  return p.batch * p.heads * ((p.q_len + rows - 1) / rows);
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }

  std::string device() const override {
    utsname u{};
    const std::string arch = uname(&u) == 0 ? u.machine : "unknown";
    const int threads = plan_threads(0);
    return arch + ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads") + " (OpenMP), " +
           (cpu::have_avx2_kernels() ? "AVX2+FMA" : "generic") + " kernels";
  }

  Status supports(const AttentionParams& p) const override {
    if (p.memory != MemorySpace::kHost)
      return failed_precondition(
          "memory = device, expected host memory: the cpu backend reads q, k, v and writes "
          "out through host pointers");
    if (uses_draws(p.mode) && p.samples < 1)
      return invalid_argument("samples = " + std::to_string(p.samples) + ", expected >= 1 in " + mode_name(p.mode) +
                              " mode");
    // BLAS takes int leading dimensions.
    for (auto [name, stride] : {std::pair{"q_row_stride", p.q_row_stride}, std::pair{"k_row_stride", p.k_row_stride},
                                std::pair{"v_row_stride", p.v_row_stride}}) {
      if (stride > std::numeric_limits<int>::max())
        return failed_precondition(std::string(name) + " = " + std::to_string(stride) +
                                   ", expected <= 2^31 - 1 for the cpu backend's BLAS calls");
    }
    if (p.mode == Mode::kWindow && static_cast<int64_t>(p.window.size()) != p.heads)
      return invalid_argument("window has " + std::to_string(p.window.size()) + " widths, expected one per head (" +
                              std::to_string(p.heads) + ")");
    return Status::Ok();
  }

  StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
    RETURN_IF_ERROR(supports(p));
    ASSIGN_OR_RETURN(Plan plan, start_plan(p, name(), limits));
    if (uses_draws(p.mode))
      plan.lsh_algorithm =
          p.lsh_algorithm != LshAlgorithm::kAuto ? p.lsh_algorithm : cpu::choose_lsh_algorithm(p, plan.draws);
    plan.forward_workspace.host_bytes = workspace_for(p, plan.threads, plan.lsh_algorithm);
    if (limits.backward) {
      RETURN_IF_ERROR(supports_backward(p));
      plan.backward = true;
      plan.backward_workspace.host_bytes = cpu::backward_workspace_bytes(p, plan.threads);
    }
    return plan;
  }

  // Every mode, dtype and shape the forward runs (exact, window, lsh and
  // fixed_blocks with either algorithm: one function, SPEC section 8).
  Status supports_backward(const AttentionParams& p) const override { return supports(p); }

  Status backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace, const ExecContext& ctx,
                  BackwardStats* stats) override {
    if (plan.backend != name())
      return invalid_argument("plan made by backend '" + plan.backend + "', expected a plan of the cpu backend");
    if (!plan.backward)
      return failed_precondition(
          "cpu backend: the plan was made without PlanLimits::backward, expected a plan "
          "whose backward workspace is sized (and charged)");
    RETURN_IF_ERROR(check_backward_inputs(plan, g));
    RETURN_IF_ERROR(check_workspace(workspace, plan.backward_workspace, "cpu backend backward"));
    const AttentionParams& p = plan.params;
    if (uses_draws(p.mode) && static_cast<int64_t>(plan.draws.size()) != p.heads)
      return invalid_argument("cpu backend: the plan has draws for " + std::to_string(plan.draws.size()) +
                              " heads, expected " + std::to_string(p.heads));
    return cpu::backward(plan, g, workspace, ctx, stats);
  }

  Status forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                 ForwardStats* stats) override {
    if (plan.backend != name())
      return invalid_argument("plan made by backend '" + plan.backend + "', expected a plan of the cpu backend");
    const AttentionParams& p = plan.params;
    if (p.q == nullptr || p.out == nullptr)
      return failed_precondition("cpu backend: the plan's tensors are not bound, expected bind_tensors first");
    RETURN_IF_ERROR(supports(p));
    RETURN_IF_ERROR(check_workspace(workspace, plan.forward_workspace, "cpu backend forward"));
    RETURN_IF_ERROR(ctx.check_stop());
    const int threads = plan.threads;
    const bool banded = plan.lsh_algorithm == LshAlgorithm::kBanded;
    Carver carver(workspace);
    cpu::Scratch* scratch = carve_thread_scratch(p, threads, banded, carver);
    if (carver.overflowed())
      return internal_error("cpu backend: the forward carved " + std::to_string(carver.used()) +
                            " bytes, the plan sized " + std::to_string(plan.forward_workspace.host_bytes));

    const auto tile = [&](int t, int64_t n, Status* why) {
      *why = ctx.check_stop();
      if (!why->ok()) return 0.0;
      cpu::Scratch& s = scratch[t];
      const cpu::TileJob job = tile_job(p, n);
      double f = 0;
      if (!uses_draws(p.mode)) {
        f = cpu::exact_tile(p, job, s);
      } else {
        const std::vector<Draw>& d = plan.draws[static_cast<size_t>(job.h)];
        f = banded ? cpu::lsh_banded_tile(p, job, d, s) : cpu::lsh_per_sample_tile(p, job, d, ctx, s);
      }
      *why = ctx.check_stop();  // a per-sample tile may have stopped half way
      return f;
    };
    ASSIGN_OR_RETURN(const double flops, cpu::run_jobs(threads, tile_job_count(p), ctx, tile));

    if (stats != nullptr) {
      stats->flops = flops;
      stats->lsh_algorithm = plan.lsh_algorithm;
      stats->workspace = {carver.used(), 0};
    }
    return Status::Ok();
  }

 private:
  // The forward's workspace: one Scratch per thread, each in its own slice
  // (the job list is computed, the draws are the plan's own). Null when
  // counting.
  static cpu::Scratch* carve_thread_scratch(const AttentionParams& p, int threads, bool banded, Carver& carver) {
    cpu::Scratch* views = carver.take<cpu::Scratch>(threads);
    const int64_t per_thread = cpu::scratch_bytes(p, banded);
    for (int t = 0; t < threads; ++t) {
      Carver slice = carver.split(per_thread);
      cpu::Scratch s;
      cpu::carve_scratch(p, banded, slice, &s);
      if (views != nullptr) new (&views[t]) cpu::Scratch(s);
    }
    return views;
  }
  static int64_t workspace_for(const AttentionParams& p, int threads, LshAlgorithm algorithm) {
    Carver counting;
    carve_thread_scratch(p, threads, algorithm == LshAlgorithm::kBanded, counting);
    return counting.used();
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace plsh
