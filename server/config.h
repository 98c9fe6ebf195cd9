// plsh-server's configuration: CLI11 flags, each with a PLSH_* environment
// equivalent (the flag wins). The names are a contract shared with the
// deploy files (Helm values, compose) and the docs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace plsh::server {

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";          // gRPC address; port 0 picks a free port
  std::string metrics_listen = "127.0.0.1:9464";   // Prometheus /metrics; "" or "off": none
  std::string backend = "auto";                    // auto|cpu|cuda
  int64_t workers = 1;                             // requests computed at once
  int64_t threads = 0;                             // CPU threads per request; 0: all cores
  int64_t max_concurrent = 64;                     // streams open at once, queued ones included
  int64_t queue_depth = 16;                        // requests waiting for a worker
  int64_t max_tokens = int64_t{1} << 20;           // per request, B * max(Nq, Nk)
  int64_t max_request_bytes = int64_t{8} << 30;    // q + k + v + out (+ lse)
  int64_t memory_budget = int64_t{16} << 30;       // host bytes of all in-flight requests together
  int64_t device_memory_budget = 0;                // device bytes of all in-flight requests; 0: the device backend's own budget
  int64_t max_samples = 4096;                      // lsh samples per request, <= plsh::kMaxSamples (2^24)
  int64_t max_message_bytes = int64_t{4} << 20;    // gRPC max receive/send message
  std::string log_level = "info";                  // trace|debug|info|warn|error
  std::string log_format = "text";                 // text|json
  double drain_timeout = 30;                       // seconds to finish in-flight work on SIGTERM
  double stream_idle_timeout = 30;                 // seconds a stream may wait on its client (read or write); 0: none
  int64_t min_stream_rate = int64_t{1} << 20;      // bytes/s a stream's input and output must average; 0: none

  bool metrics_enabled() const { return !metrics_listen.empty() && metrics_listen != "off"; }
};

// Parses argv and the PLSH_* environment. Returns the config, or the exit
// code the process should end with (0 after --help, CLI11's non-zero code on a bad flag) with the
// message already printed.
struct ParsedConfig {
  std::optional<ServerConfig> config;
  int exit_code = 0;
};
ParsedConfig parse_config(int argc, char** argv);

}  // namespace plsh::server
