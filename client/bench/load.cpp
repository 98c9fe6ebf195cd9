#include "bench/load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

namespace plsh::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What one worker saw; merged once at the end, so the hot path takes no lock.
struct WorkerTally {
  int64_t ok = 0, failed = 0, warmup_ok = 0, warmup_failed = 0;
  std::map<std::string, int64_t> codes;
  std::map<std::string, std::string> first_error;
  Samples latency, queued, receiving, computing, sending, lag;
  Samples forward, backward;  // --backward: the step's two calls
  Samples forward_receiving, backward_receiving;
  int64_t late_starts = 0;
  int64_t rpcs = 0, ok_rpcs = 0;
  int64_t tokens = 0, bytes_up = 0, bytes_down = 0;
  int64_t verified = 0, mismatches = 0;
  double max_verify_error = 0;
  int64_t started = 0;                                           // measured requests started
  double first_start = std::numeric_limits<double>::infinity();  // seconds from the level start
  double last_start = -std::numeric_limits<double>::infinity();
  double last_end = -std::numeric_limits<double>::infinity();
  double thread_cpu = 0;

  // start, end: seconds from the level start; latency_from: when the
  // latency clock started (the call, or the open loop's schedule).
  void record(const Outcome& o, bool measured, double latency_from, double start, double end) {
    const bool ok_request = o.code == "OK";
    rpcs += o.rpcs;
    ok_rpcs += o.ok_rpcs >= 0 ? o.ok_rpcs : ok_request ? o.rpcs : 0;
    if (!measured) {
      ++(ok_request ? warmup_ok : warmup_failed);
      return;
    }
    ++(ok_request ? ok : failed);
    ++codes[o.code];
    if (!ok_request && first_error.count(o.code) == 0) first_error[o.code] = o.message;
    ++started;
    first_start = std::min(first_start, start);
    last_start = std::max(last_start, start);
    last_end = std::max(last_end, end);
    bytes_up += o.bytes_up;
    bytes_down += o.bytes_down;
    if (o.verified) {
      ++verified;
      if (o.mismatch) ++mismatches;
      max_verify_error = std::max(max_verify_error, o.verify_error);
    }
    if (!ok_request) return;
    tokens += o.tokens;
    latency.add(end - latency_from);
    if (o.forward_seconds >= 0) forward.add(o.forward_seconds);
    if (o.backward_seconds >= 0) backward.add(o.backward_seconds);
    if (o.forward_receiving >= 0) forward_receiving.add(o.forward_receiving);
    if (o.backward_receiving >= 0) backward_receiving.add(o.backward_receiving);
    if (o.has_server_timings) {
      queued.add(o.queued);
      receiving.add(o.receiving);
      computing.add(o.computing);
      sending.add(o.sending);
    }
  }

  void merge(const WorkerTally& w);
};

// A tally field that LevelResult reports, and its place there.
template <typename Tally, typename Result>
struct Reported {
  Tally WorkerTally::*tally;
  Result LevelResult::*result;
};
// The distributions and the counts reported as they are: the one list that
// merge() sums and run_level() copies, so that one added is added to both.
constexpr Reported<Samples, Summary> kDistributions[] = {
    {&WorkerTally::latency, &LevelResult::latency},
    {&WorkerTally::queued, &LevelResult::queued},
    {&WorkerTally::receiving, &LevelResult::receiving},
    {&WorkerTally::computing, &LevelResult::computing},
    {&WorkerTally::sending, &LevelResult::sending},
    {&WorkerTally::forward, &LevelResult::forward},
    {&WorkerTally::backward, &LevelResult::backward},
    {&WorkerTally::lag, &LevelResult::lag},
    {&WorkerTally::forward_receiving, &LevelResult::forward_receiving},
    {&WorkerTally::backward_receiving, &LevelResult::backward_receiving}};
constexpr Reported<int64_t, int64_t> kCounts[] = {{&WorkerTally::ok, &LevelResult::ok},
                                                  {&WorkerTally::failed, &LevelResult::failed},
                                                  {&WorkerTally::warmup_ok, &LevelResult::warmup_ok},
                                                  {&WorkerTally::warmup_failed, &LevelResult::warmup_failed},
                                                  {&WorkerTally::rpcs, &LevelResult::rpcs},
                                                  {&WorkerTally::ok_rpcs, &LevelResult::ok_rpcs},
                                                  {&WorkerTally::late_starts, &LevelResult::late_starts},
                                                  {&WorkerTally::verified, &LevelResult::verified},
                                                  {&WorkerTally::mismatches, &LevelResult::mismatches}};

void WorkerTally::merge(const WorkerTally& w) {
  for (const auto& d : kDistributions) (this->*d.tally).merge(w.*d.tally);
  for (const auto& c : kCounts) this->*c.tally += w.*c.tally;
  for (const auto& [code, n] : w.codes) codes[code] += n;
  for (const auto& [code, message] : w.first_error) first_error.emplace(code, message);
  tokens += w.tokens;
  bytes_up += w.bytes_up;
  bytes_down += w.bytes_down;
  max_verify_error = std::max(max_verify_error, w.max_verify_error);
  started += w.started;
  first_start = std::min(first_start, w.first_start);
  last_start = std::max(last_start, w.last_start);
  last_end = std::max(last_end, w.last_end);
  thread_cpu = std::max(thread_cpu, w.thread_cpu);
}

}  // namespace

LevelResult run_level(const LevelSpec& spec, const RequestFn& request, const ProgressFn& progress,
                      double progress_interval) {
  const int workers = std::max(1, spec.concurrency);
  const bool open_loop = spec.rate.has_value();
  const bool by_count = spec.requests > 0;
  const double measure_from = std::max(0.0, spec.warmup);  // seconds from the level start
  const double measure_until = measure_from + std::max(0.0, spec.duration);

  std::vector<WorkerTally> tallies(static_cast<size_t>(workers));
  std::atomic<int64_t> next_index{0};
  std::atomic<int64_t> measured_claimed{0};  // by_count: measured requests handed out
  std::atomic<int64_t> live_ok{0}, live_failed{0}, in_flight{0};
  std::optional<ArrivalSchedule> schedule;
  if (open_loop) schedule.emplace(spec.arrivals, *spec.rate, spec.seed);

  const CpuSnapshot cpu_begin = cpu_snapshot();
  const Clock::time_point t0 = Clock::now();
  auto since_start = [t0](Clock::time_point t) { return seconds(t - t0); };

  // Whether a request that starts (or is scheduled) at `at` is measured,
  // and whether it is issued at all.
  enum class Slot { kWarmup, kMeasured, kStop };
  auto claim = [&](double at) {
    if (at < measure_from) return Slot::kWarmup;
    if (by_count) return measured_claimed.fetch_add(1) < spec.requests ? Slot::kMeasured : Slot::kStop;
    return at < measure_until ? Slot::kMeasured : Slot::kStop;
  };

  auto run_one = [&](int worker, WorkerTally& tally, bool measured, Clock::time_point latency_from) {
    const int64_t index = next_index.fetch_add(1);
    in_flight.fetch_add(1);
    const Clock::time_point start = Clock::now();
    const Outcome outcome = request(worker, index);
    const Clock::time_point end = Clock::now();
    in_flight.fetch_sub(1);
    if (measured) (outcome.code == "OK" ? live_ok : live_failed).fetch_add(1);
    tally.record(outcome, measured, since_start(latency_from), since_start(start), since_start(end));
    return start;
  };

  auto closed_worker = [&](int worker) {
    WorkerTally& tally = tallies[static_cast<size_t>(worker)];
    const double cpu0 = thread_cpu_seconds();
    for (;;) {
      const Clock::time_point now = Clock::now();
      const Slot slot = claim(since_start(now));
      if (slot == Slot::kStop) break;
      run_one(worker, tally, slot == Slot::kMeasured, now);
    }
    tally.thread_cpu = thread_cpu_seconds() - cpu0;
  };

  auto open_worker = [&](int worker) {
    WorkerTally& tally = tallies[static_cast<size_t>(worker)];
    const double cpu0 = thread_cpu_seconds();
    for (;;) {
      const ArrivalSchedule::Arrival arrival = schedule->next();
      const Slot slot = claim(arrival.at);
      if (slot == Slot::kStop) break;
      const Clock::time_point due =
          t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival.at));
      std::this_thread::sleep_until(due);
      const Clock::time_point start = run_one(worker, tally, slot == Slot::kMeasured, due);
      if (slot == Slot::kMeasured) {
        const double lag = seconds(start - due);
        tally.lag.add(lag);
        if (lag > kLateSeconds) ++tally.late_starts;
      }
    }
    tally.thread_cpu = thread_cpu_seconds() - cpu0;
  };

  std::mutex done_mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::thread monitor;
  auto report = [&] {
    Progress p;
    p.elapsed = since_start(Clock::now()) - measure_from;
    p.warming = p.elapsed < 0;
    p.ok = live_ok.load();
    p.failed = live_failed.load();
    p.in_flight = in_flight.load();
    progress(p);
  };
  if (progress) {
    monitor = std::thread([&] {
      std::unique_lock<std::mutex> lock(done_mutex);
      while (!done_cv.wait_for(lock, std::chrono::duration<double>(progress_interval), [&] { return done; })) report();
    });
  }

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w)
    threads.emplace_back(open_loop ? std::function<void(int)>(open_worker) : closed_worker, w);
  for (std::thread& t : threads) t.join();
  const CpuSnapshot cpu_end = cpu_snapshot();
  if (monitor.joinable()) {
    {
      std::lock_guard<std::mutex> lock(done_mutex);
      done = true;
    }
    done_cv.notify_all();
    monitor.join();
  }

  WorkerTally all;
  for (const WorkerTally& t : tallies) all.merge(t);

  LevelResult r;
  r.spec = spec;
  for (const auto& d : kDistributions) r.*d.result = (all.*d.tally).summary();
  for (const auto& c : kCounts) r.*c.result = all.*c.tally;
  r.codes = all.codes;
  r.first_error = all.first_error;
  // The window opens when measuring starts (the first measured start when
  // a count-limited run begins after the warmup) and closes at the last
  // measured completion.
  if (all.started > 0) r.window_seconds = all.last_end - std::min(measure_from, all.first_start);
  if (r.window_seconds > 0) {
    const double n = static_cast<double>(all.ok + all.failed);
    r.requests_per_second = n / r.window_seconds;
    r.ok_per_second = static_cast<double>(all.ok) / r.window_seconds;
    r.tokens_per_second = static_cast<double>(all.tokens) / r.window_seconds;
    r.mb_up_per_second = 1e-6 * static_cast<double>(all.bytes_up) / r.window_seconds;
    r.mb_down_per_second = 1e-6 * static_cast<double>(all.bytes_down) / r.window_seconds;
  }
  if (all.started > 1 && all.last_start > all.first_start)
    r.started_per_second = static_cast<double>(all.started - 1) / (all.last_start - all.first_start);
  r.max_verify_error = all.max_verify_error;
  r.cpu = cpu_usage(cpu_begin, cpu_end, all.thread_cpu);
  return r;
}

}  // namespace plsh::bench
