// CPU backend: exact vs window vs lsh (per-sample and banded) on one
// attention call, B = 1, H = 8, D = 64, fp32, causal, standard ALiBi slopes.
// Times backend->forward alone (no estimates), computes each approximate
// output's relative L2 error against the exact output of the same inputs,
// and prints a markdown table for bench/RESULTS.md.
//
//   bench_cpu [--sizes 2048,8192,32768] [--runs 3] [--threads 0] [--samples 16]
//             [--only exact,window,per-sample,banded,auto]
// (--only runs those rows alone, for a profile of one; without exact, the
// error column is left empty)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cpu_bench_main.h"
#include "cpu_bench_util.h"
#include "plsh/params.h"
#include "reference.h"

namespace {

struct Variant {
  const char* name;  // for --only
  const char* label;
  plsh::Mode mode;
  plsh::LshAlgorithm algorithm;
};

using plsh::bench::die_unless;

struct Measurement {
  plsh::bench::Timing median;
  double flops = 0;
  std::vector<float> out;
  plsh::LshAlgorithm used = plsh::LshAlgorithm::kAuto;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU backend benchmark: exact vs window vs lsh"};
  std::vector<int64_t> sizes{2048, 8192, 32768};
  plsh::bench::RunFlags flags;
  app.add_option("--sizes", sizes, "sequence lengths (Nq = Nk)")->delimiter(',');
  std::vector<std::string> only{"exact", "window", "per-sample", "banded", "auto"};
  plsh::bench::add_run_flags(app, flags);
  app.add_option("--only", only, "rows to run")
      ->delimiter(',')
      ->check(CLI::IsMember({"exact", "window", "per-sample", "banded", "auto"}));
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<plsh::Backend> cpu = plsh::bench::cpu_backend_with_table_head(
      "| n | mode | median wall s | median CPU s | speedup vs exact | rel L2 err vs exact | GFLOP done | "
      "GFLOP/s (wall) | GFLOP per CPU s |");

  const Variant variants[] = {
      {"exact", "exact", plsh::Mode::kExact, plsh::LshAlgorithm::kAuto},
      {"window", "window (eps 1e-4)", plsh::Mode::kWindow, plsh::LshAlgorithm::kAuto},
      {"per-sample", "lsh per-sample", plsh::Mode::kLsh, plsh::LshAlgorithm::kPerSample},
      {"banded", "lsh banded", plsh::Mode::kLsh, plsh::LshAlgorithm::kBanded},
      {"auto", "lsh auto", plsh::Mode::kLsh, plsh::LshAlgorithm::kAuto},
  };
  for (int64_t n : sizes) {
    plsh::AttentionOptions o = plsh::bench::timed_options(n, flags.samples);
    const plsh::testing::RandomTensors t = plsh::testing::random_qkv(o, 42);
    std::vector<double> exact_out;  // the reference of plsh::testing::compare
    double exact_s = 0;
    for (const Variant& v : variants) {
      if (std::find(only.begin(), only.end(), v.name) == only.end()) continue;
      o.mode = v.mode;
      o.lsh_algorithm = v.algorithm;
      Measurement m;
      m.out.resize(static_cast<size_t>(n * o.heads * o.head_dim));
      plsh::TensorRefs refs{t.q.data(), t.k.data(), t.v.data(), m.out.data(), nullptr};
      plsh::StatusOr<plsh::AttentionParams> p = plsh::make_params(o, refs);
      die_unless(p.status());
      plsh::PlanLimits limits;
      limits.threads = flags.threads;
      plsh::StatusOr<plsh::Plan> plan = cpu->plan(*p, limits);  // once: forward alone is timed
      die_unless(plan.status());
      plsh::StatusOr<plsh::HostWorkspace> workspace = plsh::HostWorkspace::allocate(plan->forward_workspace.host_bytes);
      die_unless(workspace.status());
      m.median = plsh::bench::median_of(flags.runs, [&] {
        plsh::ForwardStats stats;
        die_unless(cpu->forward(*plan, workspace->ref(), plsh::ExecContext{}, &stats));
        m.flops = stats.flops;
        m.used = stats.lsh_algorithm;
      });
      std::string label = v.label;
      if (v.mode == plsh::Mode::kLsh) label += " s=" + std::to_string(flags.samples);
      if (v.algorithm == plsh::LshAlgorithm::kAuto && v.mode == plsh::Mode::kLsh)
        label += std::string(" (") + plsh::lsh_algorithm_name(m.used) + ")";
      if (v.mode == plsh::Mode::kExact) {
        exact_out.assign(m.out.begin(), m.out.end());
        exact_s = m.median.wall;
        std::printf("| %lld | %s | %.3f | %.3f | 1.0x | 0 | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median.wall, m.median.cpu, m.flops / 1e9, m.flops / m.median.wall / 1e9,
                    m.flops / m.median.cpu / 1e9);
      } else if (exact_out.empty()) {
        std::printf("| %lld | %s | %.3f | %.3f | | | %.1f | %.1f | %.1f |\n", static_cast<long long>(n), label.c_str(),
                    m.median.wall, m.median.cpu, m.flops / 1e9, m.flops / m.median.wall / 1e9,
                    m.flops / m.median.cpu / 1e9);
      } else {
        std::printf("| %lld | %s | %.3f | %.3f | %.1fx | %.2e | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median.wall, m.median.cpu, exact_s / m.median.wall,
                    plsh::testing::compare(m.out.data(), plsh::DType::kF32, exact_out).rel_l2, m.flops / 1e9,
                    m.flops / m.median.wall / 1e9, m.flops / m.median.cpu / 1e9);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
