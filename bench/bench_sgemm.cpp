// The CPU backend's yardstick (issue 23): the machine's own SGEMM rate,
// C = A B with A, B, C n x n float32 (4096 unless --size), through the same
// cblas_sgemm (system OpenBLAS) and thread count that the CPU backend uses.
// A fused attention tile spends its time in two GEMMs, so its GFLOP/s over
// this figure is the measure of how much of the machine it reaches.
//
//   bench_sgemm [--size 4096] [--runs 5] [--threads 0]
//
// Prints one line: "sgemm n=4096 threads=2: median 190.3 GFLOP/s (min ...,
// max ...) over 5 runs". Run it before and after an attention benchmark in
// the same minutes, so that both see the same machine and load.
#include <cblas.h>
#include <omp.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

extern "C" void openblas_set_num_threads(int);

int main(int argc, char** argv) {
  CLI::App app{"SGEMM yardstick: n x n x n float32 through the system BLAS"};
  int size = 4096;
  int runs = 5;
  int threads = 0;
  app.add_option("--size", size, "n of the n x n x n product")->check(CLI::Range(64, 16384));
  app.add_option("--runs", runs, "timed runs; the median is reported")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "BLAS threads; 0: all cores")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (threads == 0) threads = omp_get_num_procs();
  openblas_set_num_threads(threads);

  const size_t n = static_cast<size_t>(size);
  std::vector<float> a(n * n), b(n * n), c(n * n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& x : a) x = normal(rng);
  for (float& x : b) x = normal(rng);
  auto product = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, size, size, size, 1.0f, a.data(), size, b.data(), size, 0.0f,
                c.data(), size);
  };
  product();  // warm-up: page faults, OpenBLAS's thread start
  std::vector<double> rates;
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    product();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(flops / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  std::printf("sgemm n=%d threads=%d: median %.1f GFLOP/s (min %.1f, max %.1f) over %d runs\n", size, threads,
              rates[rates.size() / 2], rates.front(), rates.back(), runs);
  return 0;
}
