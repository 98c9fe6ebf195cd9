// The load generator on plain functions (no server): counts, warmup,
// failures by code, closed and open loop timing, and the reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "bench/load.h"
#include "bench/report.h"

namespace plsh::bench {
namespace {

using namespace std::chrono_literals;

Outcome ok_after(std::chrono::microseconds d) {
  std::this_thread::sleep_for(d);
  return {.has_server_timings = true,
          .receiving = 0.0002,
          .computing = 0.001,
          .bytes_up = 1000,
          .bytes_down = 500,
          .tokens = 10};
}

TEST(Load, ClosedLoopRunsExactlyTheRequestsAsked) {
  std::atomic<int> in_flight{0}, most{0};
  std::mutex m;
  std::set<int64_t> indices;
  const LevelSpec spec{.concurrency = 3, .requests = 30};
  const LevelResult r = run_level(spec, [&](int worker, int64_t index) {
    EXPECT_GE(worker, 0);
    EXPECT_LT(worker, 3);
    {
      std::lock_guard<std::mutex> lock(m);
      EXPECT_TRUE(indices.insert(index).second) << "index " << index << " twice";
    }
    const int now = ++in_flight;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    Outcome o = ok_after(2ms);
    --in_flight;
    return o;
  });
  EXPECT_EQ(r.ok, 30);
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(r.codes.at("OK"), 30);
  EXPECT_EQ(static_cast<int>(indices.size()), 30);
  EXPECT_LE(most.load(), 3);
  EXPECT_EQ(r.latency.count, 30);
  EXPECT_GE(r.latency.min, 0.002);  // the call slept 2 ms
  EXPECT_EQ(r.computing.count, 30);
  EXPECT_DOUBLE_EQ(r.computing.p99, 0.001);
  // Throughput follows from the window: 30 requests, 10 tokens and 1000 bytes up each.
  ASSERT_GT(r.window_seconds, 0);
  EXPECT_NEAR(r.requests_per_second, 30 / r.window_seconds, 1e-9);
  EXPECT_NEAR(r.tokens_per_second, 300 / r.window_seconds, 1e-9);
  EXPECT_NEAR(r.mb_up_per_second, 30 * 1000 * 1e-6 / r.window_seconds, 1e-9);
  EXPECT_NEAR(r.mb_down_per_second, 30 * 500 * 1e-6 / r.window_seconds, 1e-9);
  // Three at a time, 2 ms each: at least 10 rounds.
  EXPECT_GE(r.window_seconds, 10 * 0.002);
}

TEST(Load, FailuresAreCountedByCode) {
  const LevelSpec spec{.concurrency = 2, .requests = 40};
  const LevelResult r = run_level(spec, [](int, int64_t index) {
    Outcome o;
    if (index % 4 == 1) {
      o.code = "RESOURCE_EXHAUSTED";
      o.message = "tokens = 128, expected <= 64";
    } else if (index % 4 == 2) {
      o.code = "INVALID_ARGUMENT";
      o.message = "samples = 0";
    } else {
      o.tokens = 1;
    }
    return o;
  });
  EXPECT_EQ(r.ok, 20);
  EXPECT_EQ(r.failed, 20);
  EXPECT_EQ(r.codes.at("OK"), 20);
  EXPECT_EQ(r.codes.at("RESOURCE_EXHAUSTED"), 10);
  EXPECT_EQ(r.codes.at("INVALID_ARGUMENT"), 10);
  EXPECT_EQ(r.first_error.at("RESOURCE_EXHAUSTED"), "tokens = 128, expected <= 64");
  EXPECT_EQ(r.first_error.count("OK"), 0u);
  // Latency and server phases come from the ok requests only.
  EXPECT_EQ(r.latency.count, 20);
  EXPECT_NEAR(r.ok_per_second * 2, r.requests_per_second, 1e-9);
}

TEST(Load, WarmupRequestsAreRunButNotMeasured) {
  const LevelSpec spec{.concurrency = 2, .requests = 10, .warmup = 0.1};
  std::atomic<int64_t> calls{0};
  const LevelResult r = run_level(spec, [&](int, int64_t) {
    ++calls;
    return ok_after(5ms);
  });
  EXPECT_EQ(r.ok, 10);
  // Both workers start at t = 0, inside the 0.1 s warmup: at least two
  // warmup calls however slow the machine (about 40 on an idle one).
  EXPECT_GE(r.warmup_ok, 2);
  EXPECT_EQ(r.warmup_ok + r.ok, calls.load());
  EXPECT_EQ(r.latency.count, 10);
}

TEST(Load, DurationStopsIssuingAtTheEnd) {
  const LevelSpec spec{.concurrency = 1, .duration = 0.2};
  const auto t0 = std::chrono::steady_clock::now();
  const LevelResult r = run_level(spec, [](int, int64_t) { return ok_after(10ms); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Requests start while t < 0.2 s and finish 10+ ms later.
  // At most the 20 that fit; at least a quarter of them even if sleeps
  // overshoot on a busy machine.
  EXPECT_GE(r.ok, 5);
  EXPECT_LE(r.ok, 21);
  EXPECT_LT(took, 0.2 + 0.2);
  EXPECT_GE(r.window_seconds, 0.2);
}

TEST(Load, OpenLoopHoldsTheRate) {
  const LevelSpec spec{.concurrency = 8, .rate = 200, .duration = 1.0};
  const LevelResult r = run_level(spec, [](int, int64_t) { return ok_after(2ms); });
  // Constant arrivals at 200/s for 1 s: exactly 200 are scheduled.
  EXPECT_EQ(r.ok, 200);
  EXPECT_NEAR(r.started_per_second, 200, 20);
  EXPECT_NEAR(r.requests_per_second, 200, 20);
  EXPECT_EQ(r.lag.count, 200);
}

TEST(Load, OpenLoopLatencyCountsTheWaitForASlot) {
  // One slot, 20 ms per request, arrivals every 5 ms: requests queue in the
  // client; their latency must grow with the queue (measured from the
  // schedule), and the schedule must be reported as not kept.
  const LevelSpec spec{.concurrency = 1, .rate = 200, .requests = 10};
  const LevelResult r = run_level(spec, [](int, int64_t) { return ok_after(20ms); });
  EXPECT_EQ(r.ok, 10);
  // The 10th request was due at 45 ms and started at ~180 ms: ~155 ms late.
  EXPECT_GT(r.latency.max, 0.15);
  EXPECT_GE(r.late_starts, 9);
  EXPECT_GT(r.lag.max, 0.12);
  EXPECT_LT(r.started_per_second, 60);
}

TEST(Load, ProgressIsReported) {
  const LevelSpec spec{.concurrency = 1, .duration = 0.3};
  std::atomic<int> calls{0};
  Progress last;
  std::mutex m;
  run_level(
      spec, [](int, int64_t) { return ok_after(1ms); },
      [&](const Progress& p) {
        std::lock_guard<std::mutex> lock(m);
        ++calls;
        last = p;
      },
      0.05);
  EXPECT_GE(calls.load(), 3);
  EXPECT_FALSE(last.warming);
  EXPECT_GT(last.ok, 3);
  EXPECT_GE(last.in_flight, 0);
  EXPECT_LE(last.in_flight, 1);
}

TEST(Load, ClientCpuIsMeasured) {
  // A request that spins makes its worker thread busy; one that sleeps
  // does not. (How busy the spinner gets depends on what else runs on the
  // machine, so only the contrast is checked here; the rule itself is
  // checked on fixed figures below.)
  const LevelSpec spec{.concurrency = 1, .duration = 0.3};
  const LevelResult spin = run_level(spec, [](int, int64_t) {
    const auto until = std::chrono::steady_clock::now() + 5ms;
    volatile double x = 0;
    while (std::chrono::steady_clock::now() < until) x = x + 1;
    return Outcome{};
  });
  const LevelResult idle = run_level(spec, [](int, int64_t) { return ok_after(5ms); });
  // Even on two cores shared by a dozen runnable threads, a spinner gets
  // a sixth of a core.
  EXPECT_GT(spin.cpu.max_thread_core, 0.05);
  EXPECT_GT(spin.cpu.process_cores, 0.05);
  EXPECT_LT(idle.cpu.max_thread_core, 0.1);
  EXPECT_GT(spin.cpu.max_thread_core, 3 * idle.cpu.max_thread_core);
  EXPECT_GE(spin.cpu.wall_seconds, 0.3);
  EXPECT_FALSE(idle.cpu.client_bound) << idle.cpu.reason;
}

TEST(CpuRule, EachRuleTrips) {
  const int cores = usable_cores();
  const long machine_cores = sysconf(_SC_NPROCESSORS_ONLN);
  CpuSnapshot a, b;
  a.wall = 100;
  b.wall = 110;         // 10 s
  a.machine_total = 1;  // readable /proc/stat
  b.machine_total = 1001;
  a.machine_busy = 0;
  b.machine_busy = 500;  // 50% busy

  // Nothing busy.
  b.process_cpu = 1;
  CpuUsage u = cpu_usage(a, b, 1.0);
  EXPECT_FALSE(u.client_bound) << u.reason;
  EXPECT_NEAR(u.process_cores, 0.1, 1e-12);
  EXPECT_NEAR(u.max_thread_core, 0.1, 1e-12);
  EXPECT_NEAR(u.machine_busy, 0.5, 1e-12);

  // 1: one thread 95% of the wall time.
  u = cpu_usage(a, b, 9.5);
  EXPECT_TRUE(u.client_bound);
  EXPECT_NE(u.reason.find("worker thread was busy 95%"), std::string::npos) << u.reason;

  // 2: the process on 95% of its cores.
  b.process_cpu = 0.95 * cores * 10;
  u = cpu_usage(a, b, 1.0);
  EXPECT_TRUE(u.client_bound);
  EXPECT_NE(u.reason.find("of its " + std::to_string(cores) + " cores"), std::string::npos) << u.reason;

  // 3: machine 95% busy, the client half of it; then a tenth of it.
  b.machine_busy = 950;
  b.process_cpu = 0.5 * 0.95 * static_cast<double>(machine_cores) * 10;
  if (b.process_cpu <= 0.9 * cores * 10) {  // not already rule 2
    u = cpu_usage(a, b, 1.0);
    EXPECT_TRUE(u.client_bound);
    EXPECT_NE(u.reason.find("took 50%"), std::string::npos) << u.reason;
  }
  b.process_cpu = 0.1 * 0.95 * static_cast<double>(machine_cores) * 10;
  u = cpu_usage(a, b, 1.0);
  EXPECT_FALSE(u.client_bound) << u.reason;

  // Unreadable /proc/stat: the machine rule is skipped, not guessed.
  a.machine_total = b.machine_total = 0;
  u = cpu_usage(a, b, 1.0);
  EXPECT_EQ(u.machine_busy, -1);
}

// A level with fixed figures: reports are checked on numbers, not on
// sleeps that a busy machine could stretch.
LevelResult fixed_level(int concurrency, double p99) {
  LevelResult l;
  l.spec.concurrency = concurrency;
  l.spec.requests = 20;
  l.ok = 20;
  l.codes["OK"] = 20;
  l.window_seconds = 0.5;
  l.requests_per_second = l.ok_per_second = l.started_per_second = 40;
  l.latency = Summary{20, p99 / 2, p99 / 4, p99 / 2, p99 * 0.8, p99 * 0.9, p99, p99 * 1.1};
  l.computing = Summary{20, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001};
  l.queued = l.receiving = l.sending = Summary{20, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4};
  return l;
}

TEST(Report, JsonCsvAndVerdict) {
  RunReport run;
  run.target = "127.0.0.1:1";
  run.p99_threshold = 0.004;
  // p99 2 ms at concurrency 1 and 3 ms at 2 (under 4 ms); 8 ms at 4 (over).
  run.levels = {fixed_level(1, 0.002), fixed_level(2, 0.003), fixed_level(4, 0.008)};
  const nlohmann::ordered_json j = report_json(run);
  EXPECT_EQ(j["schema"], "plsh.bench/1");
  ASSERT_EQ(j["levels"].size(), 3u);
  for (const auto& l : j["levels"]) {
    EXPECT_EQ(l["ok"], 20);
    EXPECT_EQ(l["failed"], 0);
    for (const char* k : {"avg", "min", "p50", "p90", "p95", "p99", "max"})
      EXPECT_TRUE(l["latency_ms"].contains(k)) << k;
    EXPECT_TRUE(l["server_ms"]["computing"].contains("p50"));
    EXPECT_TRUE(l["server_ms"]["queued"]["p99"].is_number());
  }
  EXPECT_DOUBLE_EQ(j["levels"][2]["latency_ms"]["p99"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(j["levels"][0]["throughput"]["requests_per_s"].get<double>(), 40.0);
  EXPECT_EQ(j["threshold"]["crossed_at"]["concurrency"], 4);
  EXPECT_EQ(j["threshold"]["last_under"]["concurrency"], 2);
  EXPECT_FALSE(j["levels"][1]["over_threshold"].get<bool>());
  EXPECT_TRUE(j["levels"][2]["over_threshold"].get<bool>());
  const std::string verdict = threshold_verdict(run);
  EXPECT_NE(verdict.find("crossed at concurrency 4"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("highest level under it: concurrency 2"), std::string::npos) << verdict;

  // CSV: a header and one line per level, every line with the header's columns.
  std::istringstream csv(report_csv(run));
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(csv, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);
  const auto columns = [](const std::string& s) { return std::count(s.begin(), s.end(), ',') + 1; };
  for (const std::string& l : lines) EXPECT_EQ(columns(l), columns(lines[0])) << l;
  EXPECT_NE(lines[0].find(",p50_ms,p90_ms,p95_ms,p99_ms,"), std::string::npos);
  EXPECT_EQ(lines[1].substr(0, 2), "1,");
  // The p99_ms column of the last line: 8 ms.
  const auto field = [](const std::string& l, size_t index) {
    std::istringstream in(l);
    std::string f;
    for (size_t i = 0; i <= index && std::getline(in, f, ','); ++i) {
    }
    return f;
  };
  size_t p99_column = 0;
  while (p99_column < 64 && field(lines[0], p99_column) != "p99_ms") ++p99_column;
  ASSERT_LT(p99_column, 64u) << lines[0];
  EXPECT_EQ(field(lines[3], p99_column), "8");

  const std::string text = text_report(run);
  EXPECT_NE(text.find("concurrency 4"), std::string::npos);
  EXPECT_NE(text.find("crossed at"), std::string::npos);
}

TEST(ServerMetrics, ParsesPrometheusTextAndSumsCounters) {
  const std::string text =
      "# HELP plsh_requests_total Requests\n"
      "# TYPE plsh_requests_total counter\n"
      "plsh_requests_total{backend=\"cpu\",code=\"OK\",mode=\"lsh\"} 10\n"
      "plsh_requests_total{backend=\"cpu\",code=\"OK\",mode=\"exact\"} 5\n"
      "plsh_requests_total{backend=\"cpu\",code=\"RESOURCE_EXHAUSTED\",mode=\"lsh\"} 2\n"
      "plsh_tokens_total{mode=\"lsh\"} 2560\n"
      "plsh_build_info{version=\"0.1 beta\",backend=\"cpu\",device=\"x86_64, 2 threads\"} 1\n"
      "plsh_received_bytes_total 1.5e+06\n";
  const auto m = parse_prometheus(text);
  EXPECT_EQ(m.size(), 6u);
  EXPECT_EQ(m.at("plsh_received_bytes_total"), 1.5e6);
  // A label value with spaces stays inside the key.
  EXPECT_EQ(m.at("plsh_build_info{version=\"0.1 beta\",backend=\"cpu\",device=\"x86_64, 2 threads\"}"), 1);

  ServerCounters before, after;
  before.requests_by_code = {{"OK", 3}};
  after.requests_by_code = {{"OK", 15}, {"RESOURCE_EXHAUSTED", 2}};
  after.tokens = 2560;
  const ServerCounters d = counters_delta(before, after);
  EXPECT_EQ(d.requests_by_code.at("OK"), 12);
  EXPECT_EQ(d.requests_by_code.at("RESOURCE_EXHAUSTED"), 2);
  EXPECT_EQ(d.tokens, 2560);

  LevelResult l;
  l.ok = 10;
  l.failed = 2;
  l.warmup_ok = 2;
  l.server_counters = d;
  EXPECT_TRUE(server_counts_agree(l));
  l.warmup_failed = 1;  // one request the server did not count
  EXPECT_FALSE(server_counts_agree(l));
}

TEST(ServerMetrics, UnreachableAddressIsUnavailable) {
  // Port 1 on loopback: nothing listens there in a test environment.
  const StatusOr<std::string> r = http_get("127.0.0.1:1", "/metrics", 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("127.0.0.1:1"), std::string::npos);
  EXPECT_EQ(http_get("no-port", "/metrics").status().code(), StatusCode::kInvalidArgument);
}

TEST(Report, FailuresCrossTheThreshold) {
  LevelResult l;
  l.ok = 100;
  l.latency.p99 = 0.001;
  EXPECT_FALSE(over_threshold(l, 0.01));
  l.failed = 1;
  EXPECT_TRUE(over_threshold(l, 0.01));
  LevelResult none;
  EXPECT_TRUE(over_threshold(none, 0.01));
}

}  // namespace
}  // namespace plsh::bench
