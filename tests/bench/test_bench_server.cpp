// `plsh bench` as an operator runs it, against a real plsh-server on
// loopback (free ports), with small shapes so that each test takes seconds:
// its counts agree with the server's own metrics, its percentiles are
// ordered, an open-loop run holds its rate, and failures are counted by
// status code.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/attend_load.h"
#include "server_process.h"

#ifndef PLSH_BIN
#error "PLSH_BIN must name the plsh binary"
#endif

namespace plsh::bench {
namespace {

using json = nlohmann::json;
using plsh::testing::ServerProcess;

// One worker thread and one CPU thread per request: CI has two cores, and
// the client needs some of them.
const std::vector<std::string> kServerFlags = {"--workers", "1", "--threads", "1"};
// 1 x 256 positions x 2 heads x 16: a few milliseconds per request.
const std::vector<std::string> kSmall = {"--shape", "1,256,2,2,16", "--mode", "lsh", "--samples", "4"};
constexpr int64_t kSmallTokens = 256;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct BenchRun {
  int exit_code = -1;
  std::string out, err;  // stdout, stderr
  json report;           // --json, when the run wrote it
  std::string csv;
};

// Runs `plsh bench --target <server> args... --json F --csv G`, stdout and
// stderr to files (so stderr is not a terminal: plain progress lines).
BenchRun run_bench(const ServerProcess& server, std::vector<std::string> args) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("plsh_bench_" + std::to_string(getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  const std::string json_path = (dir / "run.json").string(), csv_path = (dir / "run.csv").string();
  const std::string out_path = (dir / "stdout").string(), err_path = (dir / "stderr").string();
  std::filesystem::remove(json_path);
  std::vector<std::string> argv_s = {PLSH_BIN, "bench",   "--target", server.grpc_address(),
                                     "--json", json_path, "--csv",    csv_path};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid == 0) {
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    std::vector<char*> argv;
    for (std::string& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  BenchRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  const std::string j = read_file(json_path);
  if (!j.empty()) r.report = json::parse(j);
  r.csv = read_file(csv_path);
  return r;
}

std::map<std::string, double> scrape(const ServerProcess& server) {
  return plsh::testing::parse_metrics(plsh::testing::http_get(server.metrics_address(), "/metrics"));
}

double requests_total(const std::map<std::string, double>& m, const std::string& code = "") {
  return plsh::testing::metric_sum(
      m, "plsh_requests_total",
      code.empty() ? std::vector<std::string>{} : std::vector<std::string>{"code=\"" + code + "\""});
}

void expect_ordered(const json& s, const std::string& what) {
  ASSERT_TRUE(s.is_object()) << what;
  std::vector<std::string> keys;
  for (const char* k : {"min", "p50", "p90", "p95", "p99", "max"})
    if (s.contains(k)) keys.push_back(k);
  ASSERT_GE(keys.size(), 3u) << what;
  for (size_t i = 1; i < keys.size(); ++i)
    EXPECT_LE(s[keys[i - 1]].get<double>(), s[keys[i]].get<double>())
        << what << ": " << keys[i - 1] << " > " << keys[i];
  EXPECT_LE(s["avg"].get<double>(), s["max"].get<double>()) << what;
  EXPECT_GT(s["p50"].get<double>(), 0) << what;
}

TEST(BenchServer, OkCountEqualsTheServersRequestCounter) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  const auto before = scrape(server);
  ASSERT_FALSE(before.empty()) << "no metrics at " << server.metrics_address();

  std::vector<std::string> args = kSmall;
  for (const char* a : {"--concurrency", "2", "--requests", "25", "--warmup", "0.3"}) args.push_back(a);
  args.insert(args.end(), {"--metrics", server.metrics_address()});
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  ASSERT_EQ(run.report["levels"].size(), 1u);
  const json& level = run.report["levels"][0];
  EXPECT_EQ(level["ok"], 25);
  EXPECT_EQ(level["failed"], 0);
  const int64_t warmup_ok = level["warmup"]["ok"];
  EXPECT_GT(warmup_ok, 0) << "0.3 s of warmup ran no request";

  // The server counts a request before its final status goes out, so the
  // counter is complete once the client has its answers.
  const auto after = scrape(server);
  EXPECT_EQ(requests_total(after, "OK") - requests_total(before, "OK"), 25 + warmup_ok);
  EXPECT_EQ(requests_total(after) - requests_total(before), 25 + warmup_ok);
  EXPECT_EQ(
      plsh::testing::metric_sum(after, "plsh_tokens_total") - plsh::testing::metric_sum(before, "plsh_tokens_total"),
      static_cast<double>((25 + warmup_ok) * kSmallTokens));
  EXPECT_NEAR(level["throughput"]["tokens_per_s"].get<double>() * level["window_s"].get<double>(), 25.0 * kSmallTokens,
              1e-6 * 25 * kSmallTokens);
  // The measured requests' bytes: q, k, v up and out down, float32.
  const double window = level["window_s"];
  const double up_bytes = 25.0 * 3 * 256 * 2 * 16 * 4, down_bytes = 25.0 * 256 * 2 * 16 * 4;
  EXPECT_NEAR(level["throughput"]["mb_up_per_s"].get<double>() * window * 1e6, up_bytes, 1e-6 * up_bytes);
  EXPECT_NEAR(level["throughput"]["mb_down_per_s"].get<double>() * window * 1e6, down_bytes, 1e-6 * down_bytes);
  // The server's computing histogram saw the same request timings the
  // summaries carried, warmup included.
  const double computing_count =
      plsh::testing::metric_sum(after, "plsh_phase_duration_seconds_count", {"phase=\"computing\""}) -
      plsh::testing::metric_sum(before, "plsh_phase_duration_seconds_count", {"phase=\"computing\""});
  EXPECT_EQ(computing_count, 25 + warmup_ok);
  EXPECT_EQ(level["server_ms"]["computing"]["count"], 25);

  // --metrics: the report carries the same comparison for the operator.
  EXPECT_EQ(level["server_metrics"]["requests"]["OK"], 25 + warmup_ok) << level["server_metrics"];
  EXPECT_EQ(level["server_metrics"]["tokens"], static_cast<double>((25 + warmup_ok) * kSmallTokens));
  EXPECT_TRUE(level["server_metrics"]["agrees"].get<bool>());
  EXPECT_NE(run.out.find("agrees"), std::string::npos) << run.out;
}

TEST(BenchServer, PercentilesAreOrderedAtEveryLevel) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--concurrency", "1,3", "--duration", "1", "--warmup", "0.2"}) args.push_back(a);
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  ASSERT_EQ(run.report["levels"].size(), 2u);
  for (const json& level : run.report["levels"]) {
    const std::string at = "concurrency " + std::to_string(level["concurrency"].get<int>());
    EXPECT_GT(level["ok"].get<int64_t>(), 5) << at;
    EXPECT_EQ(level["failed"], 0) << at;
    expect_ordered(level["latency_ms"], at + " latency");
    EXPECT_LE(level["latency_ms"]["min"].get<double>(), level["latency_ms"]["avg"].get<double>()) << at;
    for (const char* phase : {"queued", "receiving", "computing", "sending"}) {
      const json& s = level["server_ms"][phase];
      ASSERT_TRUE(s.is_object()) << at << " " << phase;
      EXPECT_LE(s["p50"].get<double>(), s["p99"].get<double>()) << at << " " << phase;
      EXPECT_LE(s["p99"].get<double>(), s["max"].get<double>()) << at << " " << phase;
    }
    // The server's computing time is part of what the client waited for.
    EXPECT_LE(level["server_ms"]["computing"]["p50"].get<double>(), level["latency_ms"]["max"].get<double>()) << at;
  }
  // CSV: a header and one line per level; the text report has both levels.
  EXPECT_EQ(std::count(run.csv.begin(), run.csv.end(), '\n'), 3) << run.csv;
  EXPECT_EQ(run.csv.rfind("concurrency,rate,arrivals,", 0), 0u) << run.csv;
  EXPECT_NE(run.out.find("concurrency 3"), std::string::npos) << run.out;
  // stderr is a file here: plain lines, no carriage returns.
  EXPECT_EQ(run.err.find('\r'), std::string::npos);
  EXPECT_NE(run.err.find("concurrency 1: ok "), std::string::npos) << run.err;
}

TEST(BenchServer, ConstantRateBelowSaturationIsHeldWithinTenPercent) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--rate", "25", "--duration", "3", "--warmup", "0.4", "--concurrency", "8"}) args.push_back(a);
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const json& level = run.report["levels"][0];
  // 25/s for 3 s: exactly 75 arrivals are scheduled and all must succeed.
  EXPECT_EQ(level["ok"], 75);
  EXPECT_EQ(level["rate"], 25.0);
  EXPECT_EQ(level["arrivals"], "constant");
  EXPECT_NEAR(level["throughput"]["requests_per_s"].get<double>(), 25, 2.5);
  EXPECT_NEAR(level["throughput"]["started_per_s"].get<double>(), 25, 2.5);
  EXPECT_EQ(level["schedule"]["lag_ms"]["count"], 75);
}

TEST(BenchServer, PoissonRateIsHeldWithinItsOwnNoise) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--rate", "40", "--arrivals", "poisson", "--duration", "3", "--warmup", "0", "--seed", "17"})
    args.push_back(a);
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const json& level = run.report["levels"][0];
  // Arrivals in 3 s at 40/s: Poisson(120), standard deviation sqrt(120).
  EXPECT_NEAR(level["ok"].get<double>(), 120, 4 * std::sqrt(120.0));
  EXPECT_EQ(level["failed"], 0);
  EXPECT_EQ(level["arrivals"], "poisson");
}

TEST(BenchServer, FailuresAreCountedByStatusCode) {
  // 256 tokens per request against a limit of 64: every request refused.
  std::vector<std::string> flags = kServerFlags;
  flags.insert(flags.end(), {"--max-tokens", "64"});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  const auto before = scrape(server);
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--concurrency", "2", "--requests", "12", "--warmup", "0"}) args.push_back(a);
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const json& level = run.report["levels"][0];
  EXPECT_EQ(level["ok"], 0);
  EXPECT_EQ(level["failed"], 12);
  EXPECT_EQ(level["codes"]["RESOURCE_EXHAUSTED"], 12);
  EXPECT_TRUE(level["latency_ms"].is_null());
  EXPECT_NE(level["errors"]["RESOURCE_EXHAUSTED"].get<std::string>().find("64"), std::string::npos) << level["errors"];
  const auto after = scrape(server);
  EXPECT_EQ(requests_total(after, "RESOURCE_EXHAUSTED") - requests_total(before, "RESOURCE_EXHAUSTED"), 12);
  EXPECT_NE(run.out.find("12 x RESOURCE_EXHAUSTED"), std::string::npos) << run.out;
  EXPECT_EQ(run.csv.find("RESOURCE_EXHAUSTED:12") != std::string::npos, true) << run.csv;
}

TEST(BenchServer, VerifiedResponsesMatchTheInProcessResult) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  for (const char* dtype : {"f32", "bf16"}) {
    std::vector<std::string> args = kSmall;
    for (const char* a : {"--requests", "8", "--warmup", "0", "--verify", "1", "--causal", "--wire-dtype"})
      args.push_back(a);
    args.push_back(dtype);
    const BenchRun run = run_bench(server, args);
    ASSERT_EQ(run.exit_code, 0) << dtype << ": " << run.err;
    const json& level = run.report["levels"][0];
    EXPECT_EQ(level["verify"]["checked"], 8) << dtype;
    EXPECT_EQ(level["verify"]["mismatches"], 0) << dtype;
    EXPECT_LE(level["verify"]["max_error"].get<double>(), run.report["client"]["verify_tolerance"].get<double>())
        << dtype;
  }
}

TEST(BenchServer, VerificationCatchesAWrongOutput) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  AttendLoadConfig config;
  config.target = server.grpc_address();
  config.options.q_len = config.options.kv_len = 64;
  config.options.heads = config.options.kv_heads = 2;
  config.options.head_dim = 8;
  config.verify_fraction = 1;
  StatusOr<std::unique_ptr<AttendLoad>> load = AttendLoad::create(config);
  ASSERT_TRUE(load.ok()) << load.status().to_string();
  const Outcome good = (*load)->call(0, 0);
  EXPECT_EQ(good.code, "OK") << good.message;
  EXPECT_TRUE(good.verified);
  EXPECT_FALSE(good.mismatch) << good.verify_error;
  // Zeros for an output: off by the output's largest magnitude, error 1.
  std::vector<uint8_t> zeros(static_cast<size_t>((*load)->output_bytes()), 0);
  EXPECT_DOUBLE_EQ((*load)->compare_with_reference(zeros), 1.0);
  std::vector<uint8_t> short_output(8, 0);
  EXPECT_TRUE(std::isinf((*load)->compare_with_reference(short_output)));
}

TEST(BenchServer, ThresholdStopsTheSweepAndNamesTheLastLevelUnderIt) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  std::vector<std::string> args = kSmall;
  // 1 microsecond: the very first level is over it.
  for (const char* a : {"--concurrency", "1,2,4", "--requests", "5", "--warmup", "0", "--p99-threshold", "0.001"})
    args.push_back(a);
  BenchRun run = run_bench(server, args);
  // No level under the threshold: the report as ever, and exit code 1.
  ASSERT_EQ(run.exit_code, 1) << run.err;
  EXPECT_NE(run.err.find("no level met --p99-threshold 0.001 ms"), std::string::npos) << run.err;
  EXPECT_EQ(run.report["levels"].size(), 1u);
  EXPECT_EQ(run.report["threshold"]["crossed_at"]["concurrency"], 1);
  EXPECT_TRUE(run.report["threshold"]["last_under"].is_null());
  EXPECT_NE(run.out.find("crossed at concurrency 1"), std::string::npos) << run.out;

  // Ten minutes: never crossed, every level runs.
  args = kSmall;
  for (const char* a : {"--concurrency", "1,2,4", "--requests", "5", "--warmup", "0", "--p99-threshold", "600000"})
    args.push_back(a);
  run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.report["levels"].size(), 3u);
  EXPECT_TRUE(run.report["threshold"]["crossed_at"].is_null());
  EXPECT_EQ(run.report["threshold"]["last_under"]["concurrency"], 4);
  EXPECT_NE(run.out.find("stayed under"), std::string::npos) << run.out;
}

TEST(BenchServer, BadFlagsAndAnUnreachableTargetFailInOneLine) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--shape", "1,2,3"}, 2, "INVALID_ARGUMENT: shape = '1,2,3': 3 values, expected 5: B,N,H,Hkv,D"},
      {{"--duration", "1", "--requests", "3"}, 2, "give one of them"},
      {{"--concurrency", "1,,2"}, 2, "concurrency = '1,,2': item 1 is empty"},
      {{"--concurrency", "0"}, 2, "'0' is not an integer >= 1"},
      {{"--rate", "10,-1"}, 2, "'-1' is not a number > 0"},
      {{"--rate", "10", "--concurrency", "1,2"}, 2, "expected a single value"},
      {{"--arrivals", "uniform", "--rate", "5"}, 2, "arrivals = 'uniform'"},
      {{"--wire-dtype", "f64"}, 2, "f64"},
      {{"--verify", "1.5"}, 2, "expected a fraction in [0, 1]"},
      {{"--shape", "1,16,3,2,8"}, 2, "kv_heads"},
      {{"--connections", "0"}, 2, "connections = 0, expected in [1, 1024]"},
      {{"--metrics", "127.0.0.1:1"}, 1, "metrics 127.0.0.1:1: connect failed"},
  };
  for (const Case& c : cases) {
    const BenchRun run = run_bench(server, c.args);
    EXPECT_EQ(run.exit_code, c.exit_code) << c.message << ": " << run.err;
    EXPECT_NE(run.err.find(c.message), std::string::npos) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
  // A port nothing listens on: UNAVAILABLE from GetInfo, before any load.
  ServerProcess stopped(kServerFlags);
  ASSERT_TRUE(stopped.started());
  const std::string address = stopped.grpc_address();
  stopped.terminate();
  const BenchRun run = run_bench(stopped, {"--requests", "1"});
  EXPECT_EQ(run.exit_code, 1) << run.err;
  EXPECT_NE(run.err.find("UNAVAILABLE"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find(address), std::string::npos) << run.err;
}

}  // namespace
}  // namespace plsh::bench

namespace plsh::bench {
namespace {

// --backward: each request a training step (a forward that keeps its
// context, then its backward by context id): both calls counted by the
// server, percentiles per call, no context left behind.
TEST(BenchServer, BackwardStepsCountTwoCallsEachAndLeaveNoContext) {
  ServerProcess server(kServerFlags);
  ASSERT_TRUE(server.started()) << server.log();
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--causal", "--backward", "--requests", "12", "--warmup", "0.2"}) args.push_back(a);
  args.insert(args.end(), {"--metrics", server.metrics_address()});
  const BenchRun run = run_bench(server, args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const json& level = run.report["levels"][0];
  EXPECT_EQ(level["ok"], 12);
  EXPECT_EQ(run.report["config"]["rpc"], "Attend+AttendBackward");
  expect_ordered(level["step_ms"]["forward"], "forward");
  expect_ordered(level["step_ms"]["backward"], "backward");
  EXPECT_EQ(level["step_ms"]["forward"]["count"], 12);
  // Each call's receiving phase alone (bench/ingest.sh compares dout's with
  // the same steps' q, k, v): the step's summed phase is their sum.
  const json& fwd_in = level["step_ms"]["forward_receiving"];
  const json& bwd_in = level["step_ms"]["backward_receiving"];
  ASSERT_TRUE(fwd_in.is_object() && bwd_in.is_object()) << level.dump();
  EXPECT_EQ(fwd_in["count"], 12);
  EXPECT_EQ(bwd_in["count"], 12);
  EXPECT_GT(fwd_in["p50"].get<double>(), 0);
  EXPECT_GT(bwd_in["p50"].get<double>(), 0);
  const double summed = level["server_ms"]["receiving"]["avg"].get<double>();
  EXPECT_NEAR(fwd_in["avg"].get<double>() + bwd_in["avg"].get<double>(), summed, 1e-9 * summed + 1e-12);
  EXPECT_TRUE(level["server_metrics"]["agrees"].get<bool>()) << run.out;
  const int64_t steps = 12 + level["warmup"]["ok"].get<int64_t>();
  const auto m = scrape(server);
  EXPECT_EQ(plsh::testing::metric_sum(m, "plsh_requests_total", {"method=\"AttendBackward\"", "code=\"OK\""}), steps);
  EXPECT_EQ(plsh::testing::metric_sum(m, "plsh_requests_total", {"method=\"Attend\"", "code=\"OK\""}), steps);
  EXPECT_EQ(plsh::testing::metric_sum(m, "plsh_context_evictions_total", {"reason=\"consumed\""}), steps);
  EXPECT_EQ(plsh::testing::metric_sum(m, "plsh_contexts"), 0);
  EXPECT_NE(run.out.find("training steps (--backward)"), std::string::npos) << run.out;
  // The CSV's last six columns: forward and backward avg / p50 / p99.
  EXPECT_NE(run.csv.find("backward_p99_ms\n"), std::string::npos);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace plsh::bench
