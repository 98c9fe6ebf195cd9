#include "server/config.h"

#include <CLI/CLI.hpp>

#include <cstdio>

#include "plsh/params.h"

namespace plsh::server {

std::string trust_config_error(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty())
    return c.tls_cert.empty() ? "--tls-key is set without --tls-cert, expected both or neither"
                              : "--tls-cert is set without --tls-key, expected both or neither";
  if (c.tls_client_auth != "none" && c.tls_client_ca.empty())
    return "--tls-client-auth = " + c.tls_client_auth + " needs --tls-client-ca (the CA that signs client certificates)";
  if (!c.tls_client_ca.empty() && c.tls_client_auth == "none")
    return "--tls-client-ca is set with --tls-client-auth = none, expected optional or require (or no --tls-client-ca)";
  if (c.tls_client_auth != "none" && !c.tls_enabled())
    return "--tls-client-auth = " + c.tls_client_auth + " needs TLS: set --tls-cert and --tls-key";
  return "";
}

ParsedConfig parse_config(int argc, char** argv) {
  ServerConfig c;
  CLI::App app{"plsh-server: ALiBi attention (exact, positional LSH, window) over gRPC"};
  app.option_defaults()->always_capture_default();
  const auto positive = CLI::Range(int64_t{1}, INT64_MAX);
  const auto non_negative = CLI::Range(int64_t{0}, INT64_MAX);

  app.add_option("--listen", c.listen, "gRPC listen address (port 0: pick a free port)")->envname("PLSH_LISTEN");
  app.add_option("--metrics-listen", c.metrics_listen, "Prometheus /metrics address; \"\" or off disables")
      ->envname("PLSH_METRICS_LISTEN");
  app.add_option("--backend", c.backend, "auto|cpu|cuda")
      ->envname("PLSH_BACKEND")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--workers", c.workers, "requests computed at once")->envname("PLSH_WORKERS")->check(positive);
  app.add_option("--threads", c.threads, "CPU threads per request; 0: all cores")
      ->envname("PLSH_THREADS")
      ->check(non_negative);
  app.add_option("--max-concurrent", c.max_concurrent, "streams open at once, queued ones included")
      ->envname("PLSH_MAX_CONCURRENT")
      ->check(positive);
  app.add_option("--queue-depth", c.queue_depth, "requests waiting for a worker")
      ->envname("PLSH_QUEUE_DEPTH")
      ->check(non_negative);
  app.add_option("--max-tokens", c.max_tokens, "per request: batch * max(q_len, kv_len)")
      ->envname("PLSH_MAX_TOKENS")
      ->check(positive);
  app.add_option("--max-request-bytes", c.max_request_bytes, "per request: q + k + v + out (+ lse) bytes")
      ->envname("PLSH_MAX_REQUEST_BYTES")
      ->check(positive);
  app.add_option("--memory-budget", c.memory_budget,
                 "host bytes of all in-flight requests together (tensors and host workspace)")
      ->envname("PLSH_MEMORY_BUDGET")
      ->check(positive);
  app.add_option("--device-memory-budget", c.device_memory_budget,
                 "device bytes of all in-flight requests together (GPU staging and workspace); 0: the GPU "
                 "backend's own budget (3/4 of the device's free memory at start, or PLSH_CUDA_MEMORY_MB); each of "
                 "the --workers requests computed at once may take an equal share")
      ->envname("PLSH_DEVICE_MEMORY_BUDGET")
      ->check(non_negative);
  // The library's bound is the draws' index field (2^24 samples per head);
  // the default keeps one request's draws and per-sample passes modest.
  app.add_option("--max-samples", c.max_samples, "lsh samples per request, at most 2^24")
      ->envname("PLSH_MAX_SAMPLES")
      ->check(CLI::Range(int64_t{1}, plsh::kMaxSamples));
  // 64 KiB floor: every message carries at least one row plus framing.
  app.add_option("--max-message-bytes", c.max_message_bytes, "gRPC max receive/send message bytes")
      ->envname("PLSH_MAX_MESSAGE_BYTES")
      ->check(CLI::Range(int64_t{64} << 10, int64_t{INT32_MAX}));
  app.add_option("--log-level", c.log_level, "trace|debug|info|warn|error")
      ->envname("PLSH_LOG_LEVEL")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  app.add_option("--log-format", c.log_format, "text|json")
      ->envname("PLSH_LOG_FORMAT")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--stream-idle-timeout", c.stream_idle_timeout,
                 "seconds an Attend stream may wait on its client: for its next message while receiving (the "
                 "header included), for a write to complete while sending; then it ends and its memory is "
                 "released; 0: never")
      ->envname("PLSH_STREAM_IDLE_TIMEOUT")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--min-stream-rate", c.min_stream_rate,
                 "bytes per second a stream's input, and its output, must average: receiving N bytes may take "
                 "--stream-idle-timeout + N / rate seconds, sending likewise; 0: no minimum")
      ->envname("PLSH_MIN_STREAM_RATE")
      ->check(non_negative);
  // Kept contexts (AttendHeader.keep_context, server/contexts.h): a few
  // minutes covers a training step's forward-to-backward gap with room.
  app.add_option("--context-ttl", c.context_ttl,
                 "seconds a kept context (keep_context, for AttendBackward) lives after its last use; its bytes "
                 "count against --memory-budget, least recently used evicted first when requests need room; 0: "
                 "keep none")
      ->envname("PLSH_CONTEXT_TTL")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--max-contexts", c.max_contexts, "kept contexts held at once (least recently used evicted first)")
      ->envname("PLSH_MAX_CONTEXTS")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--drain-timeout", c.drain_timeout, "seconds to finish in-flight requests on SIGTERM/SIGINT")
      ->envname("PLSH_DRAIN_TIMEOUT")
      ->check(CLI::Range(0.0, 86400.0));

  // Trust: TLS on --listen, client certificates, bearer tokens, and a
  // plaintext health-only listener for probes that speak neither.
  app.add_option("--tls-cert", c.tls_cert,
                 "PEM certificate (chain) for --listen: serve TLS; needs --tls-key. Unset: plaintext")
      ->envname("PLSH_TLS_CERT");
  app.add_option("--tls-key", c.tls_key, "PEM private key (unencrypted) of --tls-cert")->envname("PLSH_TLS_KEY");
  app.add_option("--tls-client-ca", c.tls_client_ca,
                 "PEM CA certificates that client certificates must chain to (with --tls-client-auth optional|require)")
      ->envname("PLSH_TLS_CLIENT_CA");
  app.add_option("--tls-client-auth", c.tls_client_auth,
                 "client certificates: none; optional (verified when sent); require (the handshake fails without one)")
      ->envname("PLSH_TLS_CLIENT_AUTH")
      ->check(CLI::IsMember({"none", "optional", "require"}));
  app.add_option("--token-file", c.token_file,
                 "JSON file of the clients and the SHA-256 digests of their bearer tokens (README: Server settings); "
                 "every Attend, AttendUnary, AttendBackward, ReleaseContext and GetInfo call then needs "
                 "'authorization: Bearer <token>'. Unset: no tokens")
      ->envname("PLSH_TOKEN_FILE");
  app.add_option("--token-reload-interval", c.token_reload_interval,
                 "seconds between checks of --token-file for changes (also reloaded on SIGHUP); 0: on SIGHUP only")
      ->envname("PLSH_TOKEN_RELOAD_INTERVAL")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--health-listen", c.health_listen,
                 "plaintext address serving only grpc.health.v1 (for probes that cannot speak TLS or send "
                 "tokens); \"\" or off disables")
      ->envname("PLSH_HEALTH_LISTEN");

  // Same-host shared memory: off unless named (server/shm_registry.h).
  app.add_option("--shm-dir", c.shm_dir,
                 "directory (e.g. /dev/shm, or a memory-backed volume shared with a sidecar) whose regular files, "
                 "owned by the server's user, same-host clients may register as shared-memory regions and name in "
                 "requests instead of sending tensors; \"\" or off: no shared memory")
      ->envname("PLSH_SHM_DIR");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ParsedConfig{std::nullopt, app.exit(e)};
  }
  if (const std::string error = trust_config_error(c); !error.empty()) {
    fprintf(stderr, "plsh-server: %s\n", error.c_str());
    return ParsedConfig{std::nullopt, 2};
  }
  return ParsedConfig{c, 0};
}

}  // namespace plsh::server
