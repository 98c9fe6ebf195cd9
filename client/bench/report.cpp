#include "bench/report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace plsh::bench {

namespace {

using json = nlohmann::ordered_json;

// Milliseconds with about four significant figures, for tables.
std::string ms(double seconds) {
  const double v = 1e3 * seconds;
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.3f" : v < 1000 ? "%.1f" : "%.0f", v);
  return buf;
}

std::string fixed(double v, int decimals) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string pad(const std::string& s, size_t width, bool left = false) {
  if (s.size() >= width) return s;
  return left ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

json summary_json(const Summary& s, bool full) {
  if (s.count == 0) return nullptr;
  json j;
  j["count"] = s.count;
  j["avg"] = 1e3 * s.avg;
  if (full) j["min"] = 1e3 * s.min;
  j["p50"] = 1e3 * s.p50;
  if (full) {
    j["p90"] = 1e3 * s.p90;
    j["p95"] = 1e3 * s.p95;
  }
  j["p99"] = 1e3 * s.p99;
  j["max"] = 1e3 * s.max;
  return j;
}

std::string codes_text(const std::map<std::string, int64_t>& codes, bool with_ok) {
  std::string s;
  for (const auto& [code, n] : codes) {
    if (code == "OK" && !with_ok) continue;
    s += (s.empty() ? "" : ";") + code + ":" + std::to_string(n);
  }
  return s;
}

// CSV fields never hold commas or quotes except the error codes list,
// which uses ';'; numbers print with %.6g.
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string opt_ms(const Summary& s, double Summary::*field) { return s.count == 0 ? "" : num(1e3 * (s.*field)); }

}  // namespace

bool server_counts_agree(const LevelResult& l) {
  if (!l.server_counters) return false;
  double ok = 0, total = 0;
  for (const auto& [code, n] : l.server_counters->requests_by_code) {
    total += n;
    if (code == "OK") ok = n;
  }
  // Levels from run_level count their RPCs (a --backward step makes two).
  if (l.rpcs > 0) return ok == static_cast<double>(l.ok_rpcs) && total == static_cast<double>(l.rpcs);
  return ok == static_cast<double>(l.ok + l.warmup_ok) &&
         total == static_cast<double>(l.ok + l.failed + l.warmup_ok + l.warmup_failed);
}

bool over_threshold(const LevelResult& level, double threshold_seconds) {
  return level.ok == 0 || level.failed > 0 || level.latency.p99 > threshold_seconds;
}

std::string level_label(const LevelSpec& spec) {
  if (!spec.rate) return "concurrency " + std::to_string(spec.concurrency);
  return "rate " + num(*spec.rate) + "/s " + arrivals_name(spec.arrivals) + " (at most " +
         std::to_string(spec.concurrency) + " in flight)";
}

std::string progress_line(const LevelSpec& spec, const Progress& p) {
  std::string line = level_label(spec) + "  ";
  if (p.warming) {
    line += "warming up, " + fixed(-p.elapsed, 1) + " s left";
  } else {
    line += fixed(p.elapsed, 1) + " s";
    if (spec.duration > 0) line += " of " + fixed(spec.duration, 1);
    if (spec.requests > 0)
      line += ", " + std::to_string(p.ok + p.failed) + " of " + std::to_string(spec.requests) + " requests";
    line += "  ok " + std::to_string(p.ok) + "  failed " + std::to_string(p.failed);
    if (p.elapsed > 0) line += "  " + fixed(static_cast<double>(p.ok + p.failed) / p.elapsed, 1) + " req/s";
  }
  line += "  in flight " + std::to_string(p.in_flight);
  return line;
}

std::string level_summary_line(const LevelResult& l) {
  std::string line = level_label(l.spec) + ": ok " + std::to_string(l.ok) + ", failed " + std::to_string(l.failed) +
                     ", " + fixed(l.requests_per_second, 1) + " req/s";
  if (l.latency.count > 0) line += ", p50 " + ms(l.latency.p50) + " ms, p99 " + ms(l.latency.p99) + " ms";
  if (l.cpu.client_bound) line += " (CLIENT-BOUND: " + l.cpu.reason + ")";
  return line;
}

std::string threshold_verdict(const RunReport& run) {
  if (!run.p99_threshold || run.levels.empty()) return "";
  const double t = *run.p99_threshold;
  const std::string limit = ms(t) + " ms";
  const LevelResult* last_under = nullptr;
  for (const LevelResult& l : run.levels) {
    if (over_threshold(l, t)) {
      std::string why = l.ok == 0 ? "no request succeeded"
                        : l.failed > 0
                            ? std::to_string(l.failed) + " requests failed (p99 " + ms(l.latency.p99) + " ms)"
                            : "p99 " + ms(l.latency.p99) + " ms";
      return "p99 threshold " + limit + " crossed at " + level_label(l.spec) + " (" + why +
             "); highest level under it: " +
             (last_under ? level_label(last_under->spec) + " (p99 " + ms(last_under->latency.p99) + " ms)" : "none");
    }
    last_under = &l;
  }
  return "p99 stayed under " + limit + " up to " + level_label(run.levels.back().spec) + " (p99 " +
         ms(run.levels.back().latency.p99) + " ms); the threshold was not reached";
}

std::string text_report(const RunReport& run) {
  std::ostringstream out;
  out << "plsh bench  target " << run.target << "  started " << run.started_at << "\n";
  out << "client latency, ms (ok requests; open loop: from the scheduled time)\n";
  size_t label_width = 5;
  for (const LevelResult& l : run.levels) label_width = std::max(label_width, level_label(l.spec).size());
  out << pad("load", label_width, true) << pad("ok", 8) << pad("failed", 8) << pad("req/s", 10) << pad("tokens/s", 12)
      << pad("MB/s up", 10) << pad("MB/s dn", 10) << pad("avg", 9) << pad("p50", 9) << pad("p90", 9) << pad("p95", 9)
      << pad("p99", 9) << pad("max", 9) << "\n";
  for (const LevelResult& l : run.levels) {
    const bool any = l.latency.count > 0;
    out << pad(level_label(l.spec), label_width, true) << pad(std::to_string(l.ok), 8)
        << pad(std::to_string(l.failed), 8) << pad(fixed(l.requests_per_second, 1), 10)
        << pad(fixed(l.tokens_per_second, 0), 12) << pad(fixed(l.mb_up_per_second, 1), 10)
        << pad(fixed(l.mb_down_per_second, 1), 10) << pad(any ? ms(l.latency.avg) : "-", 9)
        << pad(any ? ms(l.latency.p50) : "-", 9) << pad(any ? ms(l.latency.p90) : "-", 9)
        << pad(any ? ms(l.latency.p95) : "-", 9) << pad(any ? ms(l.latency.p99) : "-", 9)
        << pad(any ? ms(l.latency.max) : "-", 9) << "\n";
  }
  out << "server phases, ms avg / p50 / p99 (from the response summaries)\n";
  out << pad("load", label_width, true) << pad("queued", 24) << pad("receiving", 24) << pad("computing", 24)
      << pad("sending", 24) << "\n";
  for (const LevelResult& l : run.levels) {
    auto cell = [](const Summary& s) {
      return s.count == 0 ? std::string("-") : ms(s.avg) + " / " + ms(s.p50) + " / " + ms(s.p99);
    };
    out << pad(level_label(l.spec), label_width, true) << pad(cell(l.queued), 24) << pad(cell(l.receiving), 24)
        << pad(cell(l.computing), 24) << pad(cell(l.sending), 24) << "\n";
  }
  bool steps = false;
  for (const LevelResult& l : run.levels) steps = steps || l.forward.count > 0;
  if (steps) {
    out << "training steps (--backward): client latency per call, ms avg / p50 / p99\n";
    out << pad("load", label_width, true) << pad("forward (keeps context)", 26) << pad("backward (by context)", 26)
        << "\n";
    for (const LevelResult& l : run.levels) {
      auto cell = [](const Summary& s) {
        return s.count == 0 ? std::string("-") : ms(s.avg) + " / " + ms(s.p50) + " / " + ms(s.p99);
      };
      out << pad(level_label(l.spec), label_width, true) << pad(cell(l.forward), 26) << pad(cell(l.backward), 26)
          << "\n";
    }
  }
  for (const LevelResult& l : run.levels) {
    const std::string at = level_label(l.spec) + ": ";
    for (const auto& [code, n] : l.codes) {
      if (code == "OK") continue;
      const auto m = l.first_error.find(code);
      out << at << n << " x " << code
          << (m != l.first_error.end() && !m->second.empty() ? " (first: " + m->second + ")" : "") << "\n";
    }
    out << at << "client CPU " << fixed(l.cpu.process_cores, 2) << " cores of " << l.cpu.cores
        << ", busiest worker thread " << fixed(100 * l.cpu.max_thread_core, 0) << "%";
    if (l.cpu.machine_busy >= 0) out << ", machine " << fixed(100 * l.cpu.machine_busy, 0) << "% busy";
    out << "\n";
    if (l.cpu.client_bound)
      out << at << "CLIENT-BOUND: " << l.cpu.reason << "; these figures measure the client, not the server\n";
    if (l.spec.rate && l.late_starts > 0)
      out << at << l.late_starts << " of " << (l.ok + l.failed) << " requests started more than " << ms(kLateSeconds)
          << " ms late (lag p99 " << ms(l.lag.p99) << " ms, max " << ms(l.lag.max)
          << " ms): the in-flight cap or the client's CPU held the schedule back\n";
    if (l.verified > 0)
      out << at << "verified " << l.verified << " responses, " << l.mismatches << " mismatches (max error "
          << num(l.max_verify_error) << ")\n";
    if (l.warmup_ok + l.warmup_failed > 0)
      out << at << "warmup: " << l.warmup_ok << " ok, " << l.warmup_failed << " failed (not in the figures)\n";
    if (l.server_counters) {
      double total = 0;
      std::string codes;
      for (const auto& [code, n] : l.server_counters->requests_by_code) {
        total += n;
        codes += (codes.empty() ? "" : ", ") + code + " " + fixed(n, 0);
      }
      out << at << "server's plsh_requests_total rose by " << fixed(total, 0)
          << (codes.empty() ? "" : " (" + codes + ")") << "; this client sent "
          << (l.rpcs > 0 ? l.rpcs : l.ok + l.failed + l.warmup_ok + l.warmup_failed) << " (warmup included): "
          << (server_counts_agree(l) ? "agrees" : "DIFFERS (other clients on this server, or requests it never saw)")
          << "\n";
    }
  }
  const std::string verdict = threshold_verdict(run);
  if (!verdict.empty()) out << verdict << "\n";
  return out.str();
}

json level_json(const LevelResult& l, const std::optional<double>& p99_threshold) {
  json j;
  j["concurrency"] = l.spec.concurrency;
  j["rate"] = l.spec.rate ? json(*l.spec.rate) : json(nullptr);
  j["arrivals"] = l.spec.rate ? json(arrivals_name(l.spec.arrivals)) : json(nullptr);
  j["window_s"] = l.window_seconds;
  j["ok"] = l.ok;
  j["failed"] = l.failed;
  j["codes"] = l.codes;
  j["errors"] = l.first_error;
  j["warmup"] = {{"ok", l.warmup_ok}, {"failed", l.warmup_failed}};
  j["throughput"] = {{"requests_per_s", l.requests_per_second}, {"ok_per_s", l.ok_per_second},
                     {"started_per_s", l.started_per_second},   {"tokens_per_s", l.tokens_per_second},
                     {"mb_up_per_s", l.mb_up_per_second},       {"mb_down_per_s", l.mb_down_per_second}};
  j["latency_ms"] = summary_json(l.latency, true);
  j["server_ms"] = {{"queued", summary_json(l.queued, false)},
                    {"receiving", summary_json(l.receiving, false)},
                    {"computing", summary_json(l.computing, false)},
                    {"sending", summary_json(l.sending, false)}};
  if (l.forward.count > 0 || l.backward.count > 0)
    j["step_ms"] = {{"forward", summary_json(l.forward, true)},
                    {"backward", summary_json(l.backward, true)},
                    {"forward_receiving", summary_json(l.forward_receiving, false)},
                    {"backward_receiving", summary_json(l.backward_receiving, false)}};
  if (l.spec.rate) j["schedule"] = {{"late_starts", l.late_starts}, {"lag_ms", summary_json(l.lag, true)}};
  j["verify"] = {{"checked", l.verified}, {"mismatches", l.mismatches}, {"max_error", l.max_verify_error}};
  j["client_cpu"] = {{"wall_s", l.cpu.wall_seconds},
                     {"cores", l.cpu.cores},
                     {"process_cores", l.cpu.process_cores},
                     {"max_thread_core", l.cpu.max_thread_core},
                     {"machine_busy", l.cpu.machine_busy >= 0 ? json(l.cpu.machine_busy) : json(nullptr)},
                     {"client_bound", l.cpu.client_bound},
                     {"reason", l.cpu.reason}};
  if (l.server_counters) {
    const ServerCounters& c = *l.server_counters;
    j["server_metrics"] = {{"requests", c.requests_by_code},
                           {"tokens", c.tokens},
                           {"received_bytes", c.received_bytes},
                           {"sent_bytes", c.sent_bytes},
                           {"agrees", server_counts_agree(l)}};
  }
  if (p99_threshold) j["over_threshold"] = over_threshold(l, *p99_threshold);
  return j;
}

json report_json(const RunReport& run) {
  json j;
  j["schema"] = "plsh.bench/1";
  j["target"] = run.target;
  j["started_at"] = run.started_at;
  j["config"] = run.config;
  j["server"] = run.server;
  j["client"] = run.client;
  json levels = json::array();
  for (const LevelResult& l : run.levels) levels.push_back(level_json(l, run.p99_threshold));
  j["levels"] = levels;
  if (run.p99_threshold) {
    json t;
    t["p99_ms"] = 1e3 * *run.p99_threshold;
    const LevelResult* last_under = nullptr;
    const LevelResult* crossed = nullptr;
    for (const LevelResult& l : run.levels) {
      if (over_threshold(l, *run.p99_threshold)) {
        crossed = &l;
        break;
      }
      last_under = &l;
    }
    auto load = [](const LevelResult* l) -> json {
      if (l == nullptr) return nullptr;
      return {{"concurrency", l->spec.concurrency}, {"rate", l->spec.rate ? json(*l->spec.rate) : json(nullptr)}};
    };
    t["crossed_at"] = load(crossed);
    t["last_under"] = load(last_under);
    t["verdict"] = threshold_verdict(run);
    j["threshold"] = t;
  }
  return j;
}

std::string report_csv(const RunReport& run) {
  std::ostringstream out;
  out << "concurrency,rate,arrivals,window_s,ok,failed,codes,warmup_ok,warmup_failed,requests_per_s,ok_per_s,started_"
         "per_s,"
         "tokens_per_s,mb_up_per_s,mb_down_per_s,avg_ms,min_ms,p50_ms,p90_ms,p95_ms,p99_ms,max_ms,"
         "queued_avg_ms,queued_p50_ms,queued_p99_ms,receiving_avg_ms,receiving_p50_ms,receiving_p99_ms,"
         "computing_avg_ms,computing_p50_ms,computing_p99_ms,sending_avg_ms,sending_p50_ms,sending_p99_ms,"
         "late_starts,lag_p99_ms,verified,mismatches,max_verify_error,client_cpu_cores,client_max_thread_core,"
         "machine_busy,client_bound,forward_avg_ms,forward_p50_ms,forward_p99_ms,backward_avg_ms,backward_p50_ms,"
         "backward_p99_ms\n";
  for (const LevelResult& l : run.levels) {
    out << l.spec.concurrency << ',' << (l.spec.rate ? num(*l.spec.rate) : "") << ','
        << (l.spec.rate ? arrivals_name(l.spec.arrivals) : "") << ',' << num(l.window_seconds) << ',' << l.ok << ','
        << l.failed << ',' << codes_text(l.codes, false) << ',' << l.warmup_ok << ',' << l.warmup_failed << ','
        << num(l.requests_per_second) << ',' << num(l.ok_per_second) << ',' << num(l.started_per_second) << ','
        << num(l.tokens_per_second) << ',' << num(l.mb_up_per_second) << ',' << num(l.mb_down_per_second);
    for (double Summary::*f :
         {&Summary::avg, &Summary::min, &Summary::p50, &Summary::p90, &Summary::p95, &Summary::p99, &Summary::max})
      out << ',' << opt_ms(l.latency, f);
    for (const Summary* s : {&l.queued, &l.receiving, &l.computing, &l.sending})
      for (double Summary::*f : {&Summary::avg, &Summary::p50, &Summary::p99}) out << ',' << opt_ms(*s, f);
    out << ',' << (l.spec.rate ? std::to_string(l.late_starts) : "") << ','
        << (l.spec.rate ? opt_ms(l.lag, &Summary::p99) : "") << ',' << l.verified << ',' << l.mismatches << ','
        << num(l.max_verify_error) << ',' << num(l.cpu.process_cores) << ',' << num(l.cpu.max_thread_core) << ','
        << (l.cpu.machine_busy >= 0 ? num(l.cpu.machine_busy) : "") << ',' << (l.cpu.client_bound ? "true" : "false");
    for (const Summary* s : {&l.forward, &l.backward})
      for (double Summary::*f : {&Summary::avg, &Summary::p50, &Summary::p99}) out << ',' << opt_ms(*s, f);
    out << "\n";
  }
  return out.str();
}

}  // namespace plsh::bench
