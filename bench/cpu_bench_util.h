// What the CPU benchmarks (bench_cpu, bench_cpu_backward) share: the
// attention call they time, median wall and CPU seconds, and how they fail.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#include "plsh/params.h"

namespace plsh::bench {

// Seconds of CPU used by the whole process (all threads): on a shared
// machine wall time also counts the time other processes held the cores.
inline double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Timing {
  double wall = 0, cpu = 0;
};

// Runs f `runs` times; the median wall and the median CPU seconds.
template <typename F>
Timing median_of(int runs, F&& f) {
  std::vector<double> wall, cpu;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = process_cpu_seconds();
    f();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(process_cpu_seconds() - c0);
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

// Prints s and exits 1 unless it is OK.
inline void die_unless(const Status& s) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s\n", s.to_string().c_str());
  std::exit(1);
}

// B = 1, n queries over n keys, H = 8, D = 64, fp32, causal, standard ALiBi
// slopes, seed 1, no estimates: the call both benchmarks time.
inline AttentionOptions timed_options(int64_t n, int64_t samples) {
  AttentionOptions o;
  o.q_len = o.kv_len = n;
  o.heads = 8;
  o.head_dim = 64;
  o.causal = true;
  o.samples = samples;
  o.seed = 1;
  o.estimates = false;
  return o;
}

}  // namespace plsh::bench
