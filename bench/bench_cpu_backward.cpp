// CPU backend: the backward pass against the forward, per mode, on one
// attention call: B = 1, H = 8, D = 64, fp32, causal, standard ALiBi slopes,
// q, k, v and dout from N(0, 1). One plan per mode (PlanLimits::backward);
// Backend::forward and Backend::backward are timed alone (no estimates, no
// validation), and the table gives the backward's time as a multiple of the
// forward's: FlashAttention's backward costs about 2 to 2.5 forwards.
//
//   bench_cpu_backward [--sizes 8192,32768] [--runs 3] [--threads 0] [--samples 16] [--modes exact,window,lsh]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cpu_bench_main.h"
#include "cpu_bench_util.h"
#include "plsh/backward.h"
#include "plsh/params.h"
#include "reference.h"

using plsh::bench::die_unless;
using plsh::bench::median_of;
using plsh::bench::Timing;

int main(int argc, char** argv) {
  CLI::App app{"CPU backend benchmark: backward vs forward"};
  std::vector<int64_t> sizes{8192, 32768};
  std::vector<std::string> modes{"exact", "window", "lsh"};
  plsh::bench::RunFlags flags;
  app.add_option("--sizes", sizes, "sequence lengths (Nq = Nk)")->delimiter(',');
  app.add_option("--modes", modes, "exact, window (eps 1e-4), lsh (auto algorithm)")->delimiter(',');
  plsh::bench::add_run_flags(app, flags);
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<plsh::Backend> cpu = plsh::bench::cpu_backend_with_table_head(
      "| n | mode | forward wall s | backward wall s | backward / forward (wall) | forward CPU s | "
      "backward CPU s | backward / forward (CPU) | backward GFLOP | backward GFLOP per CPU s |");
  for (int64_t n : sizes) {
    plsh::AttentionOptions o = plsh::bench::timed_options(n, flags.samples);
    o.check_finite = false;  // random normals; and the validation is not what is timed
    const plsh::testing::RandomTensors t = plsh::testing::random_qkv(o, 42);
    const size_t elems = static_cast<size_t>(n * o.heads * o.head_dim);
    std::vector<float> out(elems), lse(static_cast<size_t>(n * o.heads)), dout(elems), dq(elems), dk(elems), dv(elems);
    std::mt19937_64 rng(43);
    std::normal_distribution<float> normal;
    for (float& x : dout) x = normal(rng);
    for (const std::string& mode_name : modes) {
      plsh::StatusOr<plsh::Mode> mode = plsh::parse_mode(mode_name);
      die_unless(mode.status());
      o.mode = *mode;
      plsh::TensorRefs refs{t.q.data(), t.k.data(), t.v.data(), out.data(), lse.data()};
      plsh::StatusOr<plsh::AttentionParams> p = plsh::make_params(o, refs);
      die_unless(p.status());
      plsh::PlanLimits limits;
      limits.threads = flags.threads;
      limits.backward = true;
      plsh::StatusOr<plsh::Plan> plan = cpu->plan(*p, limits);  // once: forward and backward alone are timed
      die_unless(plan.status());
      plsh::GradientRefs grads;
      grads.dout = dout.data();
      grads.dq = dq.data();
      grads.dk = dk.data();
      grads.dv = dv.data();
      plsh::StatusOr<plsh::BackwardParams> g = plsh::make_backward_params(plan->params, grads);
      die_unless(g.status());
      plsh::StatusOr<plsh::HostWorkspace> workspace = plsh::HostWorkspace::allocate(plan->workspace().host_bytes);
      die_unless(workspace.status());
      const plsh::WorkspaceRef w = workspace->ref();
      const Timing fwd =
          median_of(flags.runs, [&] { die_unless(cpu->forward(*plan, w, plsh::ExecContext{}, nullptr)); });
      plsh::BackwardStats stats;
      const Timing bwd =
          median_of(flags.runs, [&] { die_unless(cpu->backward(*plan, *g, w, plsh::ExecContext{}, &stats)); });
      std::string label = mode_name;
      if (o.mode == plsh::Mode::kLsh)
        label +=
            " s=" + std::to_string(flags.samples) + " (" + plsh::lsh_algorithm_name(plan->lsh_algorithm) + " forward)";
      if (o.mode == plsh::Mode::kWindow) label += " (eps 1e-4)";
      std::printf("| %lld | %s | %.3f | %.3f | %.2fx | %.3f | %.3f | %.2fx | %.1f | %.1f |\n",
                  static_cast<long long>(n), label.c_str(), fwd.wall, bwd.wall, bwd.wall / fwd.wall, fwd.cpu, bwd.cpu,
                  bwd.cpu / fwd.cpu, stats.flops / 1e9, stats.flops / bwd.cpu / 1e9);
      std::fflush(stdout);
    }
  }
  return 0;
}
