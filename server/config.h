// plsh-server's configuration: CLI11 flags, each with a PLSH_* environment
// equivalent (the flag wins). The names are a contract shared with the
// deploy files (Helm values, compose) and the docs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace plsh::server {

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";         // gRPC address; port 0 picks a free port
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus /metrics; "" or "off": none
  std::string backend = "auto";                   // auto|cpu|cuda
  int64_t workers = 1;                            // requests computed at once
  int64_t threads = 0;                            // CPU threads per request; 0: all cores
  int64_t max_concurrent = 64;                    // streams open at once, queued ones included
  int64_t queue_depth = 16;                       // requests waiting for a worker
  int64_t max_tokens = int64_t{1} << 20;          // per request, B * max(Nq, Nk)
  int64_t max_request_bytes = int64_t{8} << 30;   // q + k + v + out (+ lse)
  int64_t memory_budget = 0;         // host bytes of all in-flight requests together; 0: half of host_memory()
  int64_t pool_keep_bytes = 0;       // resident bytes idle pool blocks may keep; 0: memory_budget / 8
  int64_t device_memory_budget = 0;  // device bytes of all in-flight requests; 0: the device backend's own budget
  int64_t max_samples = 4096;        // lsh samples per request, <= plsh::kMaxSamples (2^24)
  int64_t max_message_bytes = int64_t{4} << 20;  // gRPC max receive/send message
  std::string log_level = "info";                // trace|debug|info|warn|error
  std::string log_format = "text";               // text|json
  double drain_timeout = 30;                     // seconds to finish in-flight work on SIGTERM
  double exit_timeout = 15;                      // seconds after the drain to stop and exit; then exit 3 regardless
  double stream_idle_timeout = 30;               // seconds a stream may wait on its client (read or write); 0: none
  int64_t min_stream_rate = int64_t{1} << 20;    // bytes/s a stream's input and output must average; 0: none
  double context_ttl = 300;                      // seconds a kept context lives after its last use; 0: none kept
  int64_t max_contexts = 1024;                   // kept contexts held at once
  // Trust (SPEC section 9; all off by default: plaintext, no tokens).
  std::string tls_cert;                  // PEM certificate chain of --listen; "": plaintext
  std::string tls_key;                   // PEM private key of tls_cert (unencrypted)
  std::string tls_client_ca;             // PEM CA bundle that client certificates must chain to
  std::string tls_client_auth = "none";  // none|optional|require: client certificates
  std::string token_file;                // JSON token file (server/auth.h); "": no bearer tokens
  double token_reload_interval = 5;      // seconds between checks of the token file; 0: on SIGHUP only
  std::string health_listen = "off";     // plaintext grpc.health.v1-only address; "" or "off": none
  // Same-host shared memory (SPEC section 9; off by default).
  std::string shm_dir = "off";  // directory whose files clients may register; "" or "off": none
  int64_t max_shm_bytes = 0;    // bytes all registered regions may map together; 0: host_memory()

  bool metrics_enabled() const { return !metrics_listen.empty() && metrics_listen != "off"; }
  bool tls_enabled() const { return !tls_cert.empty(); }
  bool tokens_enabled() const { return !token_file.empty(); }
  bool health_listen_enabled() const { return !health_listen.empty() && health_listen != "off"; }
  bool shm_enabled() const { return !shm_dir.empty() && shm_dir != "off"; }
};

// Parses argv and the PLSH_* environment, then resolves the defaults that
// follow the host (0 for --memory-budget, --pool-keep-bytes and
// --max-shm-bytes: host_memory.h). Returns the config, or the exit
// code the process should end with (0 after --help, CLI11's non-zero code on a bad flag) with the
// message already printed.
struct ParsedConfig {
  std::optional<ServerConfig> config;
  int exit_code = 0;
};
ParsedConfig parse_config(int argc, char** argv);

struct HostMemory;
// The settings left 0 that follow the host: --memory-budget (half of its
// usable memory), --pool-keep-bytes (an eighth of the budget),
// --max-shm-bytes (its usable memory).
void resolve_host_defaults(ServerConfig* config, const HostMemory& host);

// The trust flags that only make sense together, checked after parsing:
// "" when consistent, else the message (--tls-cert without --tls-key, a
// client CA without --tls-client-auth, ...). The files themselves are read
// at start (tls.h, auth.h).
std::string trust_config_error(const ServerConfig& config);

}  // namespace plsh::server
