// How both CPU benchmarks (bench_cpu, bench_cpu_backward) start: the flags
// they share and the head of their markdown table. Apart from
// cpu_bench_util.h (the timed call) so that each main() still lists its
// own flags where its --help has them: --sizes first, then its own
// (bench_cpu_backward's --modes), then these.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "cpu/cpu_backend.h"
#include "plsh/params.h"

namespace plsh::bench {

struct RunFlags {
  int runs = 3;
  int threads = 0;
  int64_t samples = AttentionOptions().samples;  // the library's default
};

// --runs, --threads, --samples.
inline void add_run_flags(CLI::App& app, RunFlags& f) {
  app.add_option("--runs", f.runs, "timed runs per cell; the median is reported")->check(CLI::PositiveNumber);
  app.add_option("--threads", f.threads, "worker threads; 0: all cores")->check(CLI::NonNegativeNumber);
  app.add_option("--samples", f.samples, "lsh hashes per head")->check(CLI::PositiveNumber);
}

// The CPU backend, after printing the table's head: the device line, then
// `columns` ("| n | mode | ... |") and its markdown rule, one "---" a column.
inline std::unique_ptr<Backend> cpu_backend_with_table_head(const std::string& columns) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::printf("device: %s\n\n", cpu->device().c_str());
  std::string rule = "|";
  for (size_t i = 1; i < columns.size(); ++i)
    if (columns[i] == '|') rule += "---|";
  std::printf("%s\n%s\n", columns.c_str(), rule.c_str());
  return cpu;
}

}  // namespace plsh::bench
