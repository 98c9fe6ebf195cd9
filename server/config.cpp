#include "server/config.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <string>

#include "plsh/params.h"
#include "server/host_memory.h"

namespace plsh::server {

std::string trust_config_error(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty())
    return c.tls_cert.empty() ? "--tls-key is set without --tls-cert, expected both or neither"
                              : "--tls-cert is set without --tls-key, expected both or neither";
  if (c.tls_client_auth != "none" && c.tls_client_ca.empty())
    return "--tls-client-auth = " + c.tls_client_auth +
           " needs --tls-client-ca (the CA that signs client certificates)";
  if (!c.tls_client_ca.empty() && c.tls_client_auth == "none")
    return "--tls-client-ca is set with --tls-client-auth = none, expected optional or require (or no --tls-client-ca)";
  if (c.tls_client_auth != "none" && !c.tls_enabled())
    return "--tls-client-auth = " + c.tls_client_auth + " needs TLS: set --tls-cert and --tls-key";
  return "";
}

void resolve_host_defaults(ServerConfig* c, const HostMemory& host) {
  const int64_t usable = host.usable_bytes();
  if (c->memory_budget == 0) c->memory_budget = usable / 2;
  if (c->pool_keep_bytes == 0) c->pool_keep_bytes = c->memory_budget / 8;
  if (c->max_shm_bytes == 0) c->max_shm_bytes = usable;
}

namespace {

// A flag that PLSH_<NAME> (the flag's name in capitals, '-' as '_') sets
// too: every server setting has both, named alike.
template <typename T>
CLI::Option* setting(CLI::App& app, const std::string& flag, T& value, const std::string& help) {
  std::string env = "PLSH_" + flag.substr(2);
  for (char& ch : env) ch = ch == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return app.add_option(flag, value, help)->envname(env);
}

}  // namespace

ParsedConfig parse_config(int argc, char** argv) {
  ServerConfig c;
  CLI::App app{"plsh-server: ALiBi attention (exact, positional LSH, window) over gRPC"};
  app.option_defaults()->always_capture_default();
  const auto positive = CLI::Range(int64_t{1}, INT64_MAX);
  const auto non_negative = CLI::Range(int64_t{0}, INT64_MAX);

  setting(app, "--listen", c.listen, "gRPC listen address (port 0: pick a free port)");
  setting(app, "--metrics-listen", c.metrics_listen, "Prometheus /metrics address; \"\" or off disables");
  setting(app, "--backend", c.backend, "auto|cpu|cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  setting(app, "--workers", c.workers, "requests computed at once")->check(positive);
  setting(app, "--threads", c.threads, "CPU threads per request; 0: all cores")->check(non_negative);
  setting(app, "--max-concurrent", c.max_concurrent, "streams open at once, queued ones included")->check(positive);
  setting(app, "--queue-depth", c.queue_depth, "requests waiting for a worker")->check(non_negative);
  setting(app, "--max-tokens", c.max_tokens, "per request: batch * max(q_len, kv_len)")->check(positive);
  setting(app, "--max-request-bytes", c.max_request_bytes, "per request: q + k + v + out (+ lse) bytes")
      ->check(positive);
  setting(app, "--memory-budget", c.memory_budget,
          "host bytes of all in-flight requests together (tensors, host workspace and kept contexts); 0: half of "
          "the memory this host gives the server (the smaller of its RAM and its cgroup's limit), which plsh "
          "info shows")
      ->check(non_negative);
  setting(app, "--pool-keep-bytes", c.pool_keep_bytes,
          "resident bytes that idle request buffers keep between requests for reuse (the high-water mark); "
          "above it a buffer given back returns its pages to the kernel; 0: --memory-budget / 8")
      ->check(non_negative);
  setting(app, "--device-memory-budget", c.device_memory_budget,
          "device bytes of all in-flight requests together (GPU staging and workspace); 0: the GPU "
          "backend's own budget (3/4 of the device's free memory at start, or PLSH_CUDA_MEMORY_MB); each of "
          "the --workers requests computed at once may take an equal share")
      ->check(non_negative);
  // The library's bound is the draws' index field (2^24 samples per head);
  // the default keeps one request's draws and per-sample passes modest.
  setting(app, "--max-samples", c.max_samples, "lsh samples per request, at most 2^24")
      ->check(CLI::Range(int64_t{1}, plsh::kMaxSamples));
  // 64 KiB floor: every message carries at least one row plus framing.
  setting(app, "--max-message-bytes", c.max_message_bytes, "gRPC max receive/send message bytes")
      ->check(CLI::Range(int64_t{64} << 10, int64_t{INT32_MAX}));
  setting(app, "--log-level", c.log_level, "trace|debug|info|warn|error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  setting(app, "--log-format", c.log_format, "text|json")->check(CLI::IsMember({"text", "json"}));
  setting(app, "--stream-idle-timeout", c.stream_idle_timeout,
          "seconds an Attend stream may wait on its client: for its next message while receiving (the "
          "header included), for a write to complete while sending; then it ends and its memory is "
          "released; 0: never")
      ->check(CLI::Range(0.0, 86400.0));
  setting(app, "--min-stream-rate", c.min_stream_rate,
          "bytes per second a stream's input, and its output, must average: receiving N bytes may take "
          "--stream-idle-timeout + N / rate seconds, sending likewise; 0: no minimum")
      ->check(non_negative);
  // Kept contexts (AttendHeader.keep_context, server/contexts.h): a few
  // minutes covers a training step's forward-to-backward gap with room.
  setting(app, "--context-ttl", c.context_ttl,
          "seconds a kept context (keep_context, for AttendBackward) lives after its last use; its bytes "
          "count against --memory-budget, least recently used evicted first when requests need room; 0: "
          "keep none")
      ->check(CLI::Range(0.0, 86400.0));
  setting(app, "--max-contexts", c.max_contexts, "kept contexts held at once (least recently used evicted first)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  setting(app, "--drain-timeout", c.drain_timeout, "seconds to finish in-flight requests on SIGTERM/SIGINT")
      ->check(CLI::Range(0.0, 86400.0));
  setting(app, "--exit-timeout", c.exit_timeout,
          "seconds after the drain for stopping gRPC and the workers; past them the process logs what it was "
          "waiting for and exits with status 3 (so a shutdown always ends within --drain-timeout + this)")
      ->check(CLI::Range(0.1, 86400.0));

  // Trust: TLS on --listen, client certificates, bearer tokens, and a
  // plaintext health-only listener for probes that speak neither.
  setting(app, "--tls-cert", c.tls_cert,
          "PEM certificate (chain) for --listen: serve TLS; needs --tls-key. Unset: plaintext");
  setting(app, "--tls-key", c.tls_key, "PEM private key (unencrypted) of --tls-cert");
  setting(app, "--tls-client-ca", c.tls_client_ca,
          "PEM CA certificates that client certificates must chain to (with --tls-client-auth optional|require)");
  setting(app, "--tls-client-auth", c.tls_client_auth,
          "client certificates: none; optional (verified when sent); require (the handshake fails without one)")
      ->check(CLI::IsMember({"none", "optional", "require"}));
  setting(app, "--token-file", c.token_file,
          "JSON file of the clients and the SHA-256 digests of their bearer tokens (README: Server settings); "
          "every Attend, AttendUnary, AttendBackward, ReleaseContext, GetInfo, RegisterSharedMemory, "
          "UnregisterSharedMemory and ListSharedMemory call then needs 'authorization: Bearer <token>' (a "
          "token entry may allow each by name; health checks and reflection need none). Unset: no tokens");
  setting(app, "--token-reload-interval", c.token_reload_interval,
          "seconds between checks of --token-file for changes (also reloaded on SIGHUP); 0: on SIGHUP only")
      ->check(CLI::Range(0.0, 86400.0));
  setting(app, "--health-listen", c.health_listen,
          "plaintext address serving only grpc.health.v1 (for probes that cannot speak TLS or send "
          "tokens); \"\" or off disables");

  // Same-host shared memory: off unless named (server/shm_registry.h).
  setting(app, "--shm-dir", c.shm_dir,
          "directory (e.g. /dev/shm, or a memory-backed volume shared with a sidecar) whose regular files, "
          "owned by the server's user, same-host clients may register as shared-memory regions and name in "
          "requests instead of sending tensors; \"\" or off: no shared memory");
  setting(app, "--max-shm-bytes", c.max_shm_bytes,
          "bytes that all registered shared-memory regions may map together (a registration past it is "
          "RESOURCE_EXHAUSTED before anything is mapped); 0: the memory this host gives the server")
      ->check(non_negative);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ParsedConfig{std::nullopt, app.exit(e)};
  }
  if (const std::string error = trust_config_error(c); !error.empty()) {
    fprintf(stderr, "plsh-server: %s\n", error.c_str());
    return ParsedConfig{std::nullopt, 2};
  }
  resolve_host_defaults(&c, host_memory());
  if (c.memory_budget < 1) {
    fprintf(stderr, "plsh-server: --memory-budget = 0 and this host's memory cannot be read; set --memory-budget\n");
    return ParsedConfig{std::nullopt, 2};
  }
  return ParsedConfig{c, 0};
}

}  // namespace plsh::server
