// What plsh bench prints and writes: the live progress line, the text
// report, and the JSON and CSV files whose schema README.md documents.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/load.h"

namespace plsh::bench {

struct RunReport {
  std::string target;
  std::string started_at;               // UTC, ISO 8601
  nlohmann::ordered_json config;        // the request and load flags as run
  nlohmann::ordered_json server;        // GetInfo: version, backends, limits
  nlohmann::ordered_json client;        // host, cores, input bytes, reference time
  std::vector<LevelResult> levels;      // in run order
  std::optional<double> p99_threshold;  // seconds (--p99-threshold)
};

// --p99-threshold: a level is over it when its p99 latency exceeds the
// threshold, when it has failed requests (a server refusing load is past
// its capacity whatever the p99 of the requests it did serve), or when no
// request succeeded.
bool over_threshold(const LevelResult& level, double threshold_seconds);

// "concurrency 4" or "rate 20/s poisson (at most 64 in flight)".
std::string level_label(const LevelSpec& spec);

// One line: label, phase, elapsed, ok, failed, req/s, in flight. No newline.
std::string progress_line(const LevelSpec& spec, const Progress& p);

// With server counters: whether the server counted every request the
// client made at this level (warmup included), OK and in total.
bool server_counts_agree(const LevelResult& level);

// "concurrency 4: ok 120, failed 0, 38.2 req/s, p50 12.1 ms, p99 30.5 ms"
// (and "CLIENT-BOUND" when the client was the bottleneck).
std::string level_summary_line(const LevelResult& level);

// Tables for a terminal or a log: one row per level, then the server's
// phases, then notes (errors by code, client bottleneck, schedule,
// verification, threshold verdict).
std::string text_report(const RunReport& run);
// "p99 crossed 50 ms at concurrency 8; the highest level under it: concurrency 4"
std::string threshold_verdict(const RunReport& run);

nlohmann::ordered_json level_json(const LevelResult& level, const std::optional<double>& p99_threshold);
nlohmann::ordered_json report_json(const RunReport& run);
// Header line, then one line per level (README.md lists the columns).
std::string report_csv(const RunReport& run);

}  // namespace plsh::bench
