// The load generator of plsh bench, apart from gRPC: it calls a request
// function from worker threads in a closed loop (a fixed number of
// requests in flight) or an open loop (a schedule of arrivals, ArrivalSchedule),
// times each call, and folds the outcomes into one LevelResult per load
// level. Tests drive it with plain functions; cmd_bench drives it with
// AttendLoad (attend_load.h).
//
// Timing: a closed-loop request's latency runs from the call to its
// return; an open-loop request's from its *scheduled* time to its return,
// so time spent waiting for a free in-flight slot counts (no coordinated
// omission). Requests that start before the warmup ends are run and
// counted apart (warmup_ok, warmup_failed), never in the statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "bench/arrivals.h"
#include "bench/cpu_usage.h"
#include "bench/server_metrics.h"
#include "bench/stats.h"

namespace plsh::bench {

// What one request did, as the request function reports it.
struct Outcome {
  std::string code = "OK";  // gRPC status name: OK, RESOURCE_EXHAUSTED, ...
  std::string message;      // the error message (empty when OK)
  bool has_server_timings = false;
  double queued = 0, receiving = 0, computing = 0, sending = 0;  // seconds, from the server's summary
  int64_t bytes_up = 0;                                          // tensor payload sent
  int64_t bytes_down = 0;                                        // tensor payload received
  int64_t tokens = 0;                                            // B * Nq of a completed request
  bool verified = false;                                         // the output was checked against an in-process result
  bool mismatch = false;                                         // ... and differed by more than the tolerance
  double verify_error = 0;                                       // max |out - ref| / max |ref|
  // --backward: a training step's two calls, client-side seconds (< 0: not a
  // step), and each call's own receiving phase (the server's: q, k, v's
  // ingest and dout's).
  double forward_seconds = -1, backward_seconds = -1, forward_receiving = -1, backward_receiving = -1;
  // RPCs the server saw for this request, and how many of them were OK
  // (-1: all of them when code is OK, else none): a step makes two.
  int rpcs = 1, ok_rpcs = -1;
};

// worker: in [0, concurrency); index: unique per level, in start order (0, 1, ...).
using RequestFn = std::function<Outcome(int worker, int64_t index)>;

struct LevelSpec {
  int concurrency = 1;         // closed loop: requests in flight; open loop: the most in flight
  std::optional<double> rate;  // requests per second: open loop; none: closed loop
  Arrivals arrivals = Arrivals::kConstant;
  double duration = 0;   // seconds measured (after warmup); 0: until `requests`
  int64_t requests = 0;  // requests measured; 0: until `duration`
  double warmup = 0;     // seconds of the same load before measuring
  uint64_t seed = 0;     // Poisson arrivals
};

// A snapshot for the live progress line.
struct Progress {
  bool warming = false;
  double elapsed = 0;          // seconds since the measurement started (< 0 while warming)
  int64_t ok = 0, failed = 0;  // measured so far
  int64_t in_flight = 0;
};
using ProgressFn = std::function<void(const Progress&)>;

struct LevelResult {
  LevelSpec spec;
  double window_seconds = 0;  // measurement start to the last measured completion
  int64_t ok = 0, failed = 0;
  std::map<std::string, int64_t> codes;            // every measured request by status name, OK included
  std::map<std::string, std::string> first_error;  // per failing code: its first message
  int64_t warmup_ok = 0, warmup_failed = 0;
  double requests_per_second = 0;  // completed (ok + failed) / window
  double ok_per_second = 0;
  double started_per_second = 0;  // (measured requests - 1) / (last start - first start): the send rate achieved
  double tokens_per_second = 0;   // ok requests' B * Nq / window
  double mb_up_per_second = 0;    // 1 MB = 1e6 bytes of tensor payload
  double mb_down_per_second = 0;
  Summary latency;                                // seconds, ok requests
  Summary queued, receiving, computing, sending;  // seconds, the server's, ok requests
  Summary forward, backward;                      // --backward: client latency of each call of a step, ok steps
  Summary forward_receiving;      // --backward: the server's receiving phase of the forward alone (q, k, v)
  Summary backward_receiving;     // --backward: the server's receiving phase of the backward alone (dout)
  int64_t rpcs = 0, ok_rpcs = 0;  // RPCs made (warmup included), for the server's counters
  Summary lag;                    // open loop: actual start - scheduled start, seconds
  int64_t late_starts = 0;        // open loop: started more than kLateSeconds after schedule
  int64_t verified = 0, mismatches = 0;
  double max_verify_error = 0;
  CpuUsage cpu;  // over the level, warmup included
  // With --metrics: the change of the server's counters over the level,
  // warmup included (filled in by the caller, not by run_level).
  std::optional<ServerCounters> server_counters;
};

// Open-loop requests that start this much after their scheduled time mean
// the client (its in-flight cap or its CPU) did not keep the schedule.
inline constexpr double kLateSeconds = 0.001;

// Runs one level. progress (may be empty) is called every progress_interval
// seconds from a monitor thread while the level runs.
LevelResult run_level(const LevelSpec& spec, const RequestFn& request, const ProgressFn& progress = {},
                      double progress_interval = 0.5);

}  // namespace plsh::bench
