// CPU backend: exact vs window vs lsh (per-sample and banded) on one
// attention call, B = 1, H = 8, D = 64, fp32, causal, standard ALiBi slopes.
// Times backend->forward alone (no estimates), computes each approximate
// output's relative L2 error against the exact output of the same inputs,
// and prints a markdown table for bench/RESULTS.md.
//
//   bench_cpu [--sizes 2048,8192,32768] [--runs 3] [--threads 0] [--samples 16]
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu_bench_util.h"
#include "plsh/params.h"
#include "reference.h"

namespace {

struct Variant {
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

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    err += d * d;
    ref += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(err / ref);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU backend benchmark: exact vs window vs lsh"};
  std::vector<int64_t> sizes{2048, 8192, 32768};
  int runs = 3;
  int threads = 0;
  int64_t samples = 16;
  app.add_option("--sizes", sizes, "sequence lengths (Nq = Nk)")->delimiter(',');
  app.add_option("--runs", runs, "timed runs per cell; the median is reported")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "worker threads; 0: all cores")->check(CLI::NonNegativeNumber);
  app.add_option("--samples", samples, "lsh hashes per head")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<plsh::Backend> cpu = plsh::make_cpu_backend();
  std::printf("device: %s\n\n", cpu->device().c_str());
  std::printf("| n | mode | median wall s | median CPU s | speedup vs exact | rel L2 err vs exact | GFLOP done | "
              "GFLOP/s (wall) | GFLOP per CPU s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");

  const Variant variants[] = {
      {"exact", plsh::Mode::kExact, plsh::LshAlgorithm::kAuto},
      {"window (eps 1e-4)", plsh::Mode::kWindow, plsh::LshAlgorithm::kAuto},
      {"lsh per-sample", plsh::Mode::kLsh, plsh::LshAlgorithm::kPerSample},
      {"lsh banded", plsh::Mode::kLsh, plsh::LshAlgorithm::kBanded},
      {"lsh auto", plsh::Mode::kLsh, plsh::LshAlgorithm::kAuto},
  };
  for (int64_t n : sizes) {
    plsh::AttentionOptions o = plsh::bench::timed_options(n, samples);
    const plsh::testing::RandomTensors t = plsh::testing::random_qkv(o, 42);
    std::vector<float> exact_out;
    double exact_s = 0;
    for (const Variant& v : variants) {
      o.mode = v.mode;
      o.lsh_algorithm = v.algorithm;
      Measurement m;
      m.out.resize(static_cast<size_t>(n * o.heads * o.head_dim));
      plsh::TensorRefs refs{t.q.data(), t.k.data(), t.v.data(), m.out.data(), nullptr};
      plsh::StatusOr<plsh::AttentionParams> p = plsh::make_params(o, refs);
      die_unless(p.status());
      plsh::PlanLimits limits;
      limits.threads = threads;
      plsh::StatusOr<plsh::Plan> plan = cpu->plan(*p, limits);  // once: forward alone is timed
      die_unless(plan.status());
      m.median = plsh::bench::median_of(runs, [&] {
        plsh::ForwardStats stats;
        die_unless(cpu->forward(*plan, plsh::ExecContext{}, &stats));
        m.flops = stats.flops;
        m.used = stats.lsh_algorithm;
      });
      std::string label = v.label;
      if (v.mode == plsh::Mode::kLsh) label += " s=" + std::to_string(samples);
      if (v.algorithm == plsh::LshAlgorithm::kAuto && v.mode == plsh::Mode::kLsh)
        label += std::string(" (") + plsh::lsh_algorithm_name(m.used) + ")";
      if (v.mode == plsh::Mode::kExact) {
        exact_out = m.out;
        exact_s = m.median.wall;
        std::printf("| %lld | %s | %.3f | %.3f | 1.0x | 0 | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median.wall, m.median.cpu, m.flops / 1e9, m.flops / m.median.wall / 1e9,
                    m.flops / m.median.cpu / 1e9);
      } else {
        std::printf("| %lld | %s | %.3f | %.3f | %.1fx | %.2e | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median.wall, m.median.cpu, exact_s / m.median.wall, rel_l2(m.out, exact_out),
                    m.flops / 1e9, m.flops / m.median.wall / 1e9, m.flops / m.median.cpu / 1e9);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
