// plsh bench: load-tests a plsh-server the way ghz or perf_analyzer do for
// other gRPC services, and reports what an operator sizes a deployment by:
// per load level, requests ok and failed by status code, throughput, client
// latency percentiles and the server's own phase times. The load generator
// itself lives in client/bench (a library, so that tests/bench can check it);
// client/bench/README.md documents the JSON and CSV schema.
//
//   plsh bench --target 127.0.0.1:50051 --concurrency 1,2,4,8,16 --p99-threshold 250
//     finds the concurrency at which p99 latency crosses 250 ms.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/attend_load.h"
#include "bench/load.h"
#include "bench/report.h"
#include "bench/server_metrics.h"
#include "cli/commands.h"
#include "cli/connection_flags.h"
#include "cli/flags.h"
#include "cli/shard_flags.h"
#include "plsh/backend.h"

namespace plsh::cli {
namespace {

struct BenchArgs {
  std::string target = "127.0.0.1:50051";
  client::ChannelOptions channel;  // TLS and the bearer token
  std::string concurrency;         // "4" or "1,2,4,8"
  std::string rate;                // "50" or "10,20,40" requests/s
  std::string arrivals = "constant";
  std::optional<double> duration;   // seconds per level
  std::optional<int64_t> requests;  // requests per level
  double warmup = 1;
  std::string shape = "1,1024,8,8,64";
  std::string mode = mode_name(AttentionOptions{}.mode);
  int64_t samples = kDefaultSamples;
  std::string sampling = sampling_name(kDefaultSampling);
  double target_error = 0;  // > 0: error-targeted requests
  bool mode_given = false;
  bool causal = false;
  std::string wire_dtype = "f32";
  int64_t window_width = 0;
  bool no_estimates = false;
  std::string backend = "auto";
  int64_t chunk_bytes = 0;
  double deadline = 0;
  bool unary = false;
  bool backward = false;
  int64_t connections = 1;
  double verify = 0;
  std::optional<double> verify_tolerance;
  std::string json_path, csv_path;
  uint64_t seed = 0;
  std::optional<double> p99_threshold_ms;
  std::string metrics;  // host:port of the server's /metrics
  bool quiet = false;
  bool shm = false;                  // inputs and outputs in a shared-memory file (same host)
  std::string shm_dir = "/dev/shm";  // the server's --shm-dir as this process sees it
  ShardCliArgs sharding;             // --shards, --shard-by: with a list of targets
};

// Default cap on requests in flight for --rate without --concurrency: the
// server's default --max-concurrent, so the client queues before the
// server refuses.
constexpr int kDefaultRateInFlight = 64;

StatusOr<std::vector<std::string>> split_list(const std::string& flag, const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    items.push_back(text.substr(start, comma - start));
    if (items.back().empty())
      return invalid_argument(flag + " = '" + text + "': item " + std::to_string(items.size() - 1) +
                              " is empty, expected comma-separated values");
    start = comma + 1;
  }
  return items;
}

StatusOr<int64_t> parse_positive_int(const std::string& flag, const std::string& item, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(item.c_str(), &end, 10);
  if (end != item.c_str() + item.size() || errno == ERANGE || v < 1)
    return invalid_argument(flag + " = '" + text + "': '" + item + "' is not an integer >= 1");
  return static_cast<int64_t>(v);
}

StatusOr<std::vector<int64_t>> parse_int_list(const std::string& flag, const std::string& text) {
  ASSIGN_OR_RETURN(const std::vector<std::string> items, split_list(flag, text));
  std::vector<int64_t> values;
  for (const std::string& item : items) {
    ASSIGN_OR_RETURN(const int64_t v, parse_positive_int(flag, item, text));
    values.push_back(v);
  }
  return values;
}

StatusOr<std::vector<double>> parse_rate_list(const std::string& text) {
  ASSIGN_OR_RETURN(const std::vector<std::string> items, split_list("rate", text));
  std::vector<double> values;
  for (const std::string& item : items) {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(item.c_str(), &end);
    if (end != item.c_str() + item.size() || errno == ERANGE || !(v > 0) || !std::isfinite(v))
      return invalid_argument("rate = '" + text + "': '" + item + "' is not a number > 0 (requests per second)");
    values.push_back(v);
  }
  return values;
}

// --shape B,N,H,Hkv,D -> the shape fields of the options (Nq = Nk = N).
Status apply_shape(const std::string& text, AttentionOptions* o) {
  ASSIGN_OR_RETURN(const std::vector<int64_t> v, parse_int_list("shape", text));
  if (v.size() != 5)
    return invalid_argument("shape = '" + text + "': " + std::to_string(v.size()) + " values, expected 5: B,N,H,Hkv,D");
  o->batch = v[0];
  o->q_len = o->kv_len = v[1];
  o->heads = v[2];
  o->kv_heads = v[3];
  o->head_dim = v[4];
  return Status::Ok();
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  return gethostname(buf, sizeof buf - 1) == 0 ? buf : "";
}

// Opens (and so creates) an output file before the run, so that a typo in
// --json does not throw away a long sweep.
StatusOr<std::unique_ptr<std::ofstream>> open_output(const std::string& flag, const std::string& path) {
  auto out = std::make_unique<std::ofstream>(path, std::ios::trunc);
  if (!*out) return failed_precondition(flag + " = '" + path + "': cannot create: " + std::strerror(errno));
  return out;
}

Status write_output(std::ofstream& out, const std::string& flag, const std::string& path, const std::string& text) {
  out << text;
  out.close();
  if (!out) return failed_precondition(flag + " = '" + path + "': write failed: " + std::strerror(errno));
  return Status::Ok();
}

nlohmann::ordered_json server_json(const v1::GetInfoResponse& info) {
  nlohmann::ordered_json j;
  j["version"] = info.version();
  nlohmann::ordered_json backends = nlohmann::ordered_json::array();
  for (const v1::BackendInfo& b : info.backends()) backends.push_back({{"name", b.name()}, {"device", b.device()}});
  j["backends"] = backends;
  const v1::Limits& l = info.limits();
  j["limits"] = {{"max_tokens", l.max_tokens()},
                 {"max_request_bytes", l.max_request_bytes()},
                 {"memory_budget", l.memory_budget()},
                 {"max_samples", l.max_samples()},
                 {"max_message_bytes", l.max_message_bytes()},
                 {"max_chunk_payload_bytes", l.max_chunk_payload_bytes()},
                 {"max_concurrent", l.max_concurrent()},
                 {"queue_depth", l.queue_depth()},
                 {"workers", l.workers()}};
  return j;
}

Status bench(const BenchArgs& a, int* exit_code) {
  // 1. Flags -> the request and the load levels, all checked before any
  // input is generated.
  if (a.duration && a.requests) return invalid_argument("duration and requests: give one of them, not both");
  if (a.duration && !(*a.duration > 0))
    return invalid_argument("duration = " + std::to_string(*a.duration) + ", expected > 0 seconds");
  if (a.requests && *a.requests < 1)
    return invalid_argument("requests = " + std::to_string(*a.requests) + ", expected >= 1");
  if (!(a.warmup >= 0)) return invalid_argument("warmup = " + std::to_string(a.warmup) + ", expected >= 0 seconds");
  if (a.p99_threshold_ms && !(*a.p99_threshold_ms > 0))
    return invalid_argument("p99_threshold = " + std::to_string(*a.p99_threshold_ms) + ", expected > 0 milliseconds");
  ASSIGN_OR_RETURN(const bench::Arrivals arrivals, bench::parse_arrivals(a.arrivals));
  if (a.connections < 1 || a.connections > 1024)
    return invalid_argument("connections = " + std::to_string(a.connections) + ", expected in [1, 1024]");

  RETURN_IF_ERROR(check_backend_name(a.backend));

  bench::AttendLoadConfig config;
  config.target = a.target;
  config.channel = a.channel;
  AttentionOptions& o = config.options;
  RETURN_IF_ERROR(apply_shape(a.shape, &o));
  ASSIGN_OR_RETURN(o.dtype, parse_dtype(a.wire_dtype));
  RETURN_IF_ERROR(apply_mode_flags(a.mode, a.mode_given, a.sampling, a.target_error, &o));
  o.samples = a.samples;
  o.seed = a.seed;
  o.causal = a.causal;
  o.window_width = a.window_width;
  o.estimates = !a.no_estimates;
  config.backend = a.backend;
  config.chunk_bytes = a.chunk_bytes;
  config.deadline = a.deadline;
  config.unary = a.unary;
  config.backward = a.backward;
  config.connections = static_cast<int>(a.connections);
  config.input_seed = a.seed;
  config.verify_fraction = a.verify;
  config.verify_tolerance = a.verify_tolerance;
  config.shard = wants_sharding(a.target, a.sharding);
  config.sharding = sharding_options(a.sharding);
  if (config.shard && a.unary)
    return invalid_argument(
        "unary: AttendUnary sends one request whole, expected no --unary with --shards or a list of targets");

  std::vector<bench::LevelSpec> levels;
  bench::LevelSpec base;
  base.duration = a.requests ? 0 : a.duration.value_or(10);
  base.requests = a.requests.value_or(0);
  base.warmup = a.warmup;
  base.seed = a.seed;
  base.arrivals = arrivals;
  if (!a.rate.empty()) {
    ASSIGN_OR_RETURN(const std::vector<double> rates, parse_rate_list(a.rate));
    int64_t cap = kDefaultRateInFlight;
    if (!a.concurrency.empty()) {
      ASSIGN_OR_RETURN(const std::vector<int64_t> c, parse_int_list("concurrency", a.concurrency));
      if (c.size() != 1)
        return invalid_argument("concurrency = '" + a.concurrency +
                                "': with --rate it is the one cap on requests in flight, expected a single value");
      cap = c[0];
    }
    for (double r : rates) {
      bench::LevelSpec l = base;
      l.rate = r;
      l.concurrency = static_cast<int>(cap);
      levels.push_back(l);
    }
  } else {
    ASSIGN_OR_RETURN(const std::vector<int64_t> cs,
                     parse_int_list("concurrency", a.concurrency.empty() ? "1" : a.concurrency));
    for (int64_t c : cs) {
      bench::LevelSpec l = base;
      l.concurrency = static_cast<int>(c);
      levels.push_back(l);
    }
  }
  for (const bench::LevelSpec& l : levels) {
    if (l.concurrency > 4096)
      return invalid_argument("concurrency = " + std::to_string(l.concurrency) +
                              ", expected at most 4096 (one thread each)");
    config.workers = std::max(config.workers, l.concurrency);  // one output buffer per request in flight
  }
  if (a.shm) config.shm_dir = a.shm_dir;

  std::unique_ptr<std::ofstream> json_out, csv_out;
  if (!a.json_path.empty()) {
    ASSIGN_OR_RETURN(json_out, open_output("json", a.json_path));
  }
  if (!a.csv_path.empty()) {
    ASSIGN_OR_RETURN(csv_out, open_output("csv", a.csv_path));
  }

  // gRPC allocates every message's buffer anew. With glibc's defaults a
  // 4 MiB buffer is mapped, faulted in page by page and unmapped again for
  // each message; a fixed mmap threshold of 32 MiB (glibc's largest) and a
  // high trim threshold keep such buffers in the heap for reuse. Measured
  // on one 256 MiB request: 0.37 -> 0.28 client CPU seconds
  // (bench/RESULTS.md, "Ingest"): less of the machine for the load generator.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);

  // 2. Inputs (once), the server's info, the reference output; the
  // server's metrics once, so that a wrong --metrics fails before the run.
  ASSIGN_OR_RETURN(std::unique_ptr<bench::AttendLoad> load, bench::AttendLoad::create(config));
  if (!a.metrics.empty()) {
    RETURN_IF_ERROR(bench::scrape_counters(a.metrics).status());
  }

  bench::RunReport run;
  run.target = a.target;
  run.started_at = utc_now();
  if (a.p99_threshold_ms) run.p99_threshold = *a.p99_threshold_ms / 1e3;
  run.config = {
      {"shape",
       {{"batch", o.batch}, {"n", o.q_len}, {"heads", o.heads}, {"kv_heads", o.kv_heads}, {"head_dim", o.head_dim}}},
      {"mode", mode_name(o.mode)},
      {"samples", o.samples},
      {"sampling", sampling_name(o.sampling)},
      {"target_rel_err", o.target_rel_err},
      {"causal", o.causal},
      {"wire_dtype", dtype_name(o.dtype)},
      {"window_width", o.window_width},
      {"estimates", o.estimates},
      {"backend", a.backend},
      {"rpc", a.unary      ? "AttendUnary"
              : a.backward ? "Attend+AttendBackward"
                           : "Attend"},
      {"chunk_bytes", a.chunk_bytes},
      {"deadline_s", a.deadline},
      {"connections", a.connections},
      {"shared_memory", a.shm},
      {"seed", a.seed},
      {"verify", a.verify},
      {"duration_s", base.duration > 0 ? nlohmann::ordered_json(base.duration) : nlohmann::ordered_json(nullptr)},
      {"requests", base.requests > 0 ? nlohmann::ordered_json(base.requests) : nlohmann::ordered_json(nullptr)},
      {"warmup_s", a.warmup}};
  if (config.shard) run.config["sharding"] = {{"shards", a.sharding.shards}, {"by", a.sharding.by}};
  run.server = server_json(load->server_info());
  run.client = {
      {"host", host_name()},
      {"cores", bench::usable_cores()},
      {"input_bytes", load->input_bytes()},
      {"output_bytes", load->output_bytes()},
      {"tokens_per_request", load->tokens()},
      {"verify_tolerance", a.verify > 0 ? nlohmann::ordered_json(load->tolerance()) : nlohmann::ordered_json(nullptr)},
      {"reference_s", load->reference_seconds()}};

  // 3. The levels, in order; a sweep with a threshold stops at the first
  // level over it (the levels after it would only be further over).
  const bool tty = isatty(STDERR_FILENO) != 0;
  for (const bench::LevelSpec& spec : levels) {
    bench::ProgressFn progress;
    if (!a.quiet) {
      progress = [&spec, tty](const bench::Progress& p) {
        if (tty)
          std::cerr << "\r" << bench::progress_line(spec, p) << "\033[K" << std::flush;
        else
          std::cerr << bench::progress_line(spec, p) << "\n";
      };
    }
    std::optional<bench::ServerCounters> counters_before;
    if (!a.metrics.empty()) {
      ASSIGN_OR_RETURN(counters_before, bench::scrape_counters(a.metrics));
    }
    bench::LevelResult result = bench::run_level(
        spec, [&load](int worker, int64_t index) { return load->call(worker, index); }, progress, tty ? 0.25 : 5.0);
    // The server counts a request before its final status goes out, so
    // every request of the level is in the counters once run_level returns.
    if (counters_before) {
      ASSIGN_OR_RETURN(const bench::ServerCounters after, bench::scrape_counters(a.metrics));
      result.server_counters = bench::counters_delta(*counters_before, after);
    }
    if (!a.quiet) {
      if (tty) std::cerr << "\r\033[K";
      std::cerr << bench::level_summary_line(result) << std::endl;
    }
    run.levels.push_back(std::move(result));
    if (run.p99_threshold && bench::over_threshold(run.levels.back(), *run.p99_threshold)) break;
  }

  // 4. Report.
  std::cout << bench::text_report(run) << std::flush;
  if (json_out) RETURN_IF_ERROR(write_output(*json_out, "json", a.json_path, bench::report_json(run).dump(2) + "\n"));
  if (csv_out) RETURN_IF_ERROR(write_output(*csv_out, "csv", a.csv_path, bench::report_csv(run)));

  int64_t mismatches = 0;
  for (const bench::LevelResult& l : run.levels) mismatches += l.mismatches;
  if (mismatches > 0) {
    std::cerr << "plsh bench: " << mismatches << " verified responses differed from the in-process result by more than "
              << load->tolerance() << std::endl;
    *exit_code = kExitRuntime;
  }
  // A sweep with a threshold answers "which load stays under it": none did
  // when the first level crossed it (text_report's verdict says how).
  if (run.p99_threshold && !run.levels.empty() && bench::over_threshold(run.levels.front(), *run.p99_threshold)) {
    std::cerr << "plsh bench: no level met --p99-threshold " << *a.p99_threshold_ms << " ms" << std::endl;
    *exit_code = kExitRuntime;
  }
  return Status::Ok();
}

RunFn setup_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  add_target_and_shard_flags(app, a->target, a->sharding, "each request");
  add_connection_flags(app, a->channel);
  app.add_option("--concurrency", a->concurrency,
                 "requests in flight (closed loop), one value or a sweep '1,2,4,8'; with --rate: the most in flight "
                 "(default 1; 64 with --rate)");
  app.add_option("--rate", a->rate, "open loop: requests per second, one value or a sweep '10,20,40'");
  app.add_option("--arrivals", a->arrivals, "open loop arrivals: constant or poisson")->capture_default_str();
  app.add_option_function<double>(
      "--duration", [a](const double& v) { a->duration = v; }, "seconds measured per level (default 10)");
  app.add_option_function<int64_t>(
         "--requests", [a](const int64_t& v) { a->requests = v; }, "requests measured per level")
      ->transform(decimal_integer(true));
  app.add_option("--warmup", a->warmup, "seconds of the same load before each level is measured")
      ->capture_default_str();
  app.add_option("--shape", a->shape, "B,N,H,Hkv,D: batch, sequence length (q and kv), heads, kv heads, head dim")
      ->capture_default_str();
  app.add_option("--mode", a->mode,
                 "exact, lsh, window or fixed_blocks (a biased baseline; with --target-error and no --mode: window)")
      ->capture_default_str()
      ->each([a](const std::string&) { a->mode_given = true; });
  app.add_option("--samples", a->samples, "lsh: hashes per head")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--sampling", a->sampling, "lsh: iid, stratified or ash")->capture_default_str();
  app.add_option("--target-error", a->target_error,
                 "error-targeted requests: the relative error each must stay under (0: off)")
      ->capture_default_str();
  app.add_flag("--causal", a->causal, "causal attention");
  app.add_option("--wire-dtype", a->wire_dtype, "dtype of q, k, v and out on the wire: f32, f16 or bf16")
      ->capture_default_str();
  app.add_option("--window-width", a->window_width, "window: one width for every head (0: from the server's eps)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_flag("--no-estimates", a->no_estimates, "ask for no error estimates (lsh and window)");
  app.add_option("--backend", a->backend, "the server's backend: " + backend_names_text())->capture_default_str();
  app.add_option("--chunk-bytes", a->chunk_bytes, "tensor payload per message both ways (0: the server's largest)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--deadline", a->deadline, "seconds per request (0: none)")->capture_default_str();
  app.add_flag("--unary", a->unary, "send AttendUnary (one message each way) instead of the Attend stream");
  app.add_flag("--backward", a->backward,
               "each request a training step: a forward that keeps its context, then its backward by context id "
               "(dout ~ N(0, 1)); latency percentiles per call and per step");
  app.add_option("--connections", a->connections, "gRPC channels (TCP connections) the workers share")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--verify", a->verify, "share of responses checked against this process's CPU result, in [0, 1]")
      ->capture_default_str();
  app.add_option_function<double>(
      "--verify-tolerance", [a](const double& v) { a->verify_tolerance = v; },
      "largest max|out - ref| / max|ref| that matches (default 1e-5 f32, 2e-3 f16, 1e-2 bf16)");
  app.add_option("--json", a->json_path, "write the results as JSON (schema: client/bench/README.md)");
  app.add_option("--csv", a->csv_path, "write one CSV line per level (columns: client/bench/README.md)");
  app.add_option("--seed", a->seed, "seed of the inputs, the lsh draws, Poisson arrivals and the verified share")
      ->capture_default_str()
      ->transform(decimal_integer(false));
  app.add_option_function<double>(
      "--p99-threshold", [a](const double& v) { a->p99_threshold_ms = v; },
      "milliseconds: stop the sweep at the first level whose p99 exceeds it (or that has "
      "failures) and report the last level under it; exit 1 when no level is under it");
  app.add_option("--metrics", a->metrics,
                 "the server's metrics address host:port: report its plsh_requests_total change per level next to "
                 "this client's counts");
  app.add_flag("--quiet", a->quiet, "no progress on stderr");
  app.add_flag("--shm", a->shm,
               "inputs and outputs in a shared-memory file of --shm-dir, registered once, instead of the socket (a "
               "server on this host started with the same --shm-dir, as the same user)");
  app.add_option("--shm-dir", a->shm_dir, "with --shm: the server's shared-memory directory")->capture_default_str();
  return [a] {
    int exit_code = kExitOk;
    const Status s = bench(*a, &exit_code);
    return s.ok() ? exit_code : report_error("bench", s);
  };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(bench,
                      "Load-test a plsh-server: latency percentiles, throughput and server phases per load level",
                      plsh::cli::setup_bench);
