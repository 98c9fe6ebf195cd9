// The server's own counters around a load level, scraped from its
// Prometheus endpoint (plsh-server --metrics-listen), so that the report
// shows side by side what the client counted and what the server counted.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "plsh/status.h"

namespace plsh::bench {

// GET http://addr{path} over a plain socket (HTTP/1.0); the body of a 200.
StatusOr<std::string> http_get(const std::string& addr, const std::string& path, double timeout_seconds = 5);

// Prometheus text format -> {"name{labels}": value}, one entry per sample line.
std::map<std::string, double> parse_prometheus(const std::string& text);

// The counters plsh bench compares with its own (service contract names).
struct ServerCounters {
  std::map<std::string, double> requests_by_code;  // plsh_requests_total, summed over mode and backend
  double tokens = 0;                               // plsh_tokens_total
  double received_bytes = 0;                       // plsh_received_bytes_total
  double sent_bytes = 0;                           // plsh_sent_bytes_total
};

StatusOr<ServerCounters> scrape_counters(const std::string& metrics_addr);
// after - before, per code (codes absent before count from 0).
ServerCounters counters_delta(const ServerCounters& before, const ServerCounters& after);

}  // namespace plsh::bench
