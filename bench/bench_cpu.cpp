// CPU backend: exact vs window vs lsh (per-sample and banded) on one
// attention call, B = 1, H = 8, D = 64, fp32, causal, standard ALiBi slopes.
// Times backend->forward alone (no estimates), computes each approximate
// output's relative L2 error against the exact output of the same inputs,
// and prints a markdown table for bench/RESULTS.md.
//
//   bench_cpu [--sizes 2048,8192,32768] [--runs 3] [--threads 0] [--samples 16]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "plsh/params.h"
#include "reference.h"

namespace {

struct Variant {
  const char* label;
  plsh::Mode mode;
  plsh::LshAlgorithm algorithm;
};

// Seconds of CPU used by the whole process (all threads): on a shared
// machine wall time also counts the time other processes held the cores.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Measurement {
  double median_s = 0;
  double median_cpu_s = 0;
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
    plsh::AttentionOptions o;
    o.q_len = o.kv_len = n;
    o.heads = 8;
    o.head_dim = 64;
    o.causal = true;
    o.samples = samples;
    o.seed = 1;
    o.estimates = false;
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
      if (!p.ok()) {
        std::fprintf(stderr, "%s\n", p.status().to_string().c_str());
        return 1;
      }
      plsh::PlanLimits limits;
      limits.threads = threads;
      plsh::StatusOr<plsh::Plan> plan = cpu->plan(*p, limits);  // once: forward alone is timed
      if (!plan.ok()) {
        std::fprintf(stderr, "%s\n", plan.status().to_string().c_str());
        return 1;
      }
      std::vector<double> times, cpu_times;
      for (int r = 0; r < runs; ++r) {
        plsh::ForwardStats stats;
        const auto t0 = std::chrono::steady_clock::now();
        const double c0 = process_cpu_seconds();
        const plsh::Status s = cpu->forward(*plan, plsh::ExecContext{}, &stats);
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        cpu_times.push_back(process_cpu_seconds() - c0);
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", s.to_string().c_str());
          return 1;
        }
        m.flops = stats.flops;
        m.used = stats.lsh_algorithm;
      }
      std::sort(times.begin(), times.end());
      std::sort(cpu_times.begin(), cpu_times.end());
      m.median_s = times[times.size() / 2];
      m.median_cpu_s = cpu_times[cpu_times.size() / 2];
      std::string label = v.label;
      if (v.mode == plsh::Mode::kLsh) label += " s=" + std::to_string(samples);
      if (v.algorithm == plsh::LshAlgorithm::kAuto && v.mode == plsh::Mode::kLsh)
        label += std::string(" (") + plsh::lsh_algorithm_name(m.used) + ")";
      if (v.mode == plsh::Mode::kExact) {
        exact_out = m.out;
        exact_s = m.median_s;
        std::printf("| %lld | %s | %.3f | %.3f | 1.0x | 0 | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median_s, m.median_cpu_s, m.flops / 1e9, m.flops / m.median_s / 1e9,
                    m.flops / m.median_cpu_s / 1e9);
      } else {
        std::printf("| %lld | %s | %.3f | %.3f | %.1fx | %.2e | %.1f | %.1f | %.1f |\n", static_cast<long long>(n),
                    label.c_str(), m.median_s, m.median_cpu_s, exact_s / m.median_s, rel_l2(m.out, exact_out),
                    m.flops / 1e9, m.flops / m.median_s / 1e9, m.flops / m.median_cpu_s / 1e9);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
