// plsh-server: the whole wiring at a glance.
//   flags/config -> allocator -> metrics server -> trust (TLS, tokens) ->
//   backends -> buffer pool and shared memory -> service -> health and
//   reflection (and the health-only listener) -> serve -> drain on
//   SIGTERM/SIGINT.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "plsh/backend.h"
#include "server/admission.h"
#include "server/auth.h"
#include "server/buffer_pool.h"
#include "server/config.h"
#include "server/contexts.h"
#include "server/host_memory.h"
#include "server/logging.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/shm_registry.h"
#include "server/tls.h"
#include "server/watchdog.h"

namespace {

constexpr const char* kServiceName = "plsh.v1.Attention";

// SIGTERM/SIGINT only write a byte to a pipe that main waits on. A handler
// rather than sigwait: libraries may start threads before main (OpenBLAS's
// pool did, when the CPU backend linked it) that would otherwise take the
// signal with its default action and kill the process mid-drain.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_shutdown_signal(int signal_number) {
  const char byte = static_cast<char>(signal_number);
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

// A pipe, and `handler` (which writes to it) for `signals`.
bool install_pipe_handler(int (&pipe_fds)[2], void (*handler)(int), std::initializer_list<int> signals) {
  if (pipe(pipe_fds) != 0) return false;
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signal_number : signals)
    if (sigaction(signal_number, &action, nullptr) != 0) return false;
  return true;
}

bool install_shutdown_handlers() { return install_pipe_handler(g_signal_pipe, on_shutdown_signal, {SIGTERM, SIGINT}); }

// SIGHUP (with a token file only: otherwise it keeps its default action)
// writes a byte that wakes the token file's watcher (auth.h).
int g_reload_pipe[2] = {-1, -1};

extern "C" void on_reload_signal(int) {
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = write(g_reload_pipe[1], &byte, 1);
}

bool install_reload_handler() { return install_pipe_handler(g_reload_pipe, on_reload_signal, {SIGHUP}); }

// 127.0.0.1:port, localhost:port, [::1]:port.
bool is_loopback(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]";
}

// Refreshes plsh_device_memory_*_bytes until destroyed; does nothing for
// backends without a device.
class DeviceMemorySampler {
 public:
  DeviceMemorySampler(plsh::Backend* backend, plsh::server::Metrics* metrics) {
    if (!backend->device_memory()) return;
    thread_ = std::thread([this, backend, metrics] {
      std::unique_lock<std::mutex> lock(mutex_);
      do {
        if (const std::optional<plsh::DeviceMemory> m = backend->device_memory())
          metrics->device_memory(backend->device(), static_cast<double>(m->used_bytes),
                                 static_cast<double>(m->total_bytes));
      } while (!wake_.wait_for(lock, std::chrono::seconds(5), [this] { return stop_; }));
    });
  }
  ~DeviceMemorySampler() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// The hard bound on stopping (--exit-timeout): once armed after the drain,
// a detached thread waits that long and then ends the process with status 3,
// naming the step main was in. It touches only these trivially destructible
// globals and write(2), so that it still works while main's locals and the
// libraries' statics are being destroyed (gRPC's grpc_shutdown() has been
// seen to hang there: issue 24).
std::atomic<const char*> g_exit_step{"starting"};

void exit_step(const char* step) { g_exit_step.store(step); }

void arm_exit_timeout(double seconds) {
  std::thread([seconds] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    char line[512];
    const int n = std::snprintf(line, sizeof line,
                                "plsh-server: stopping took longer than --exit-timeout = %g s after the drain (still "
                                "%s); exiting with status 3\n",
                                seconds, g_exit_step.load());
    if (n > 0) [[maybe_unused]]
      const ssize_t written = write(STDERR_FILENO, line, static_cast<size_t>(std::min(n, 511)));
    _exit(3);
  }).detach();
}

// Blocks until the first SIGTERM or SIGINT; returns it.
int wait_for_shutdown_signal() {
  char byte = 0;
  while (read(g_signal_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

// gRPC's buffers (read slices, small messages) stay in the heap for reuse:
// with glibc's defaults, a freed multi-MiB buffer raises the dynamic mmap
// threshold only after the fact, and until then every one is mapped,
// faulted in page by page and unmapped again. 32 MiB is glibc's largest
// mmap threshold; the trim threshold keeps freed heap tops mapped.
// Measured as GLIBC_TUNABLES before (bench/RESULTS.md, "Ingest"): server
// gRPC CPU 0.57 -> 0.36 s per 256 MiB request. Set here, so operators
// need no environment variables.
void set_allocator_thresholds() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// Budgets by memory space: host from --memory-budget, device from
// --device-memory-budget or, by default, the device backends' own.
plsh::server::MemoryCharge memory_budgets(const plsh::server::ServerConfig& config, plsh::BackendRegistry& registry) {
  plsh::server::MemoryCharge budget{config.memory_budget, config.device_memory_budget};
  if (budget.device_bytes == 0)
    for (plsh::Backend* b : registry.backends())
      if (const std::optional<plsh::DeviceMemory> m = b->device_memory()) budget.device_bytes += m->budget_bytes;
  return budget;
}

// The budget gauges once, the reserved ones as they change (from 0, not absent).
void publish_memory(const plsh::server::MemoryCharge& budget, plsh::server::MemoryBudget* memory,
                    plsh::server::Metrics* metrics) {
  metrics->memory_budget("host", static_cast<double>(budget.host_bytes));
  metrics->memory_budget("device", static_cast<double>(budget.device_bytes));
  memory->set_listener([metrics](const plsh::server::MemoryCharge& reserved) {
    metrics->memory_reserved("host", static_cast<double>(reserved.host_bytes));
    metrics->memory_reserved("device", static_cast<double>(reserved.device_bytes));
  });
  memory->release({});
}

// A start that cannot go on: logged; returns the exit code it ends with.
int startup_failed(const std::string& error, int exit_code) {
  plsh::server::log_event(spdlog::level::err, "startup_failed", {{"error", error}});
  return exit_code;
}

// The token file, read and checked now so that a bad file stops the start
// with its flag named (exit 2), and watched from now on (SIGHUP and
// --token-reload-interval). Null without --token-file. Returns 0 or the
// exit code.
int load_tokens(const plsh::server::ServerConfig& config, plsh::server::Metrics* metrics,
                std::unique_ptr<plsh::server::Authenticator>* auth) {
  using plsh::server::log_event;
  if (!config.tokens_enabled()) return 0;
  plsh::StatusOr<std::unique_ptr<plsh::server::Authenticator>> loaded =
      plsh::server::Authenticator::load(config.token_file, metrics);
  if (!loaded.ok()) return startup_failed(loaded.status().to_string(), 2);
  *auth = std::move(loaded).value();
  log_event(spdlog::level::info, "token_file_loaded",
            {{"file", config.token_file}, {"clients", (*auth)->client_count()}});
  if (!install_reload_handler()) return startup_failed("cannot install the SIGHUP handler", 1);
  (*auth)->watch(config.token_reload_interval, g_reload_pipe[0]);
  if (!config.tls_enabled() && !is_loopback(config.listen))
    log_event(
        spdlog::level::warn, "tokens_in_clear",
        {{"listen", config.listen},
         {"note", "bearer tokens cross the network unencrypted: set --tls-cert and --tls-key, or listen on loopback"}});
  return 0;
}

// The gRPC server on --listen with the service; null when it cannot listen.
std::unique_ptr<grpc::Server> build_server(const plsh::server::ServerConfig& config,
                                           const std::shared_ptr<grpc::ServerCredentials>& credentials,
                                           plsh::server::AttentionService* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, credentials, port);
  // gRPC's own receive limit is twice ours: a message between the two is
  // refused by the service, which then knows the code its client got (gRPC's
  // refusal would reach the service as a bare cancellation); past twice, gRPC
  // refuses it before buffering it.
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(2 * config.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(service);
  // HTTP/2 flow control for tensors: a fixed stream window instead of BDP
  // probing. On loopback the BDP estimate stays small, so a sender waits for
  // a WINDOW_UPDATE whenever this server's reading thread is scheduled late;
  // on a busy 2-core machine that held a 256 MiB request's receiving phase
  // at 180 ms (median) against 89-105 ms with 32-64 MiB windows (16 MiB: 147
  // ms; bench/RESULTS.md, "Transport"). The window is at most 32 MiB and at
  // most 1/8 of the memory budget spread over --max-concurrent streams: what
  // clients may push ahead of the service's reads waits in gRPC's buffers,
  // outside --memory-budget, and stays under an eighth of it.
  const int64_t stream_window =
      std::clamp<int64_t>(config.memory_budget / (8 * config.max_concurrent), int64_t{64} << 10, int64_t{32} << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, static_cast<int>(stream_window));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return server != nullptr && *port != 0 ? std::move(server) : nullptr;
}

// The health-only listener: plaintext, for probes that speak neither TLS
// nor tokens (Kubernetes' gRPC probes). A server of its own with no
// service of ours, so Attend and GetInfo are UNIMPLEMENTED there; it has
// gRPC's default health service (and the reflection plugin, which every
// server gets: it lists only what this server has). Null when it cannot listen.
std::unique_ptr<grpc::Server> build_health_server(const std::string& address, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return server != nullptr && *port != 0 ? std::move(server) : nullptr;
}

// "host:port" of an address whose port was 0.
std::string bound(const std::string& address, int port) {
  return address.substr(0, address.rfind(':')) + ":" + std::to_string(port);
}

// 8. Drain: report NOT_SERVING, refuse new requests (UNAVAILABLE), let
// those in flight finish for up to --drain-timeout, then stop gRPC (which
// cancels what is left) and the workers, within --exit-timeout.
void drain(int signal_number, const plsh::server::ServerConfig& config,
           const std::vector<grpc::HealthCheckServiceInterface*>& health, plsh::server::AttentionService& service,
           const plsh::server::MemoryBudget& memory, plsh::server::Scheduler& scheduler,
           const plsh::server::ContextStore& contexts, grpc::Server* server, grpc::Server* health_server) {
  using plsh::server::log_event;
  log_event(spdlog::level::info, "draining",
            {{"signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT"},
             {"in_flight", service.open_requests()},
             {"reserved_host_bytes", memory.reserved().host_bytes},
             {"drain_timeout_s", config.drain_timeout}});
  for (grpc::HealthCheckServiceInterface* h : health) {
    h->SetServingStatus(kServiceName, false);
    h->SetServingStatus("", false);
  }
  service.begin_drain();
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::duration<double>(config.drain_timeout);
  while (service.open_requests() > 0 && std::chrono::steady_clock::now() < drain_until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // From here every step is bounded by --exit-timeout together.
  arm_exit_timeout(config.exit_timeout);
  exit_step("stopping gRPC (Server::Shutdown)");
  // A short grace for final statuses already on their way out. (Without a
  // deadline, Shutdown waits seconds on idle client connections.)
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  exit_step("stopping the workers (a computation that does not stop)");
  scheduler.stop();
  // Nothing held past the drain: tests read these.
  const plsh::server::ContextStore::Held held = contexts.held();
  log_event(spdlog::level::info, "stopped",
            {{"contexts", held.contexts},
             {"context_bytes", held.bytes},
             {"reserved_host_bytes", memory.reserved().host_bytes}});
  exit_step("releasing gRPC and the backends (destructors, grpc_shutdown)");
}

}  // namespace

int main(int argc, char** argv) {
  using plsh::server::log_event;

  // 1. Configuration.
  plsh::server::ParsedConfig parsed = plsh::server::parse_config(argc, argv);
  if (!parsed.config) return parsed.exit_code;
  const plsh::server::ServerConfig config = *parsed.config;
  if (plsh::Status s = plsh::server::init_logging(config.log_level, config.log_format); !s.ok()) {
    fprintf(stderr, "plsh-server: %s\n", s.to_string().c_str());
    return 2;
  }
  if (!install_shutdown_handlers()) return startup_failed("cannot install SIGTERM/SIGINT handlers", 1);

  set_allocator_thresholds();

  // 2. Metrics (/metrics on its own port, metrics_http.h). First, so that a
  // port already taken fails the start before any backend loads; the order
  // no longer matters to the HTTP server's threads.
  plsh::server::Metrics metrics;
  if (config.metrics_enabled()) {
    if (plsh::Status s = metrics.serve(config.metrics_listen); !s.ok()) return startup_failed(s.to_string(), 1);
  }

  // 3. Trust (SPEC section 9): the listener's credentials (plaintext, TLS,
  // or TLS with client certificates) and the token file, both read and
  // checked now, so that a bad file stops the start with its flag named.
  plsh::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = plsh::server::listener_credentials(config);
  if (!credentials.ok()) return startup_failed(credentials.status().to_string(), 2);
  std::unique_ptr<plsh::server::Authenticator> auth;
  if (const int failed = load_tokens(config, &metrics, &auth); failed != 0) return failed;

  // 4. Backends: CUDA when its library loads and a device is present, the CPU always.
  plsh::BackendRegistry& registry = plsh::BackendRegistry::global();
  for (plsh::Backend* b : registry.backends())
    log_event(spdlog::level::info, "backend", {{"name", b->name()}, {"device", b->device()}});
  for (const std::string& note : registry.notes())
    log_event(spdlog::level::info, "backend_unavailable", {{"note", note}});
  plsh::StatusOr<plsh::Backend*> chosen = registry.find(config.backend);
  if (!chosen.ok()) return startup_failed(chosen.status().to_string(), 1);
  metrics.set_build_info(PLSH_VERSION, (*chosen)->name(), (*chosen)->device());

  // Device memory gauges, sampled every 5 s on a thread of our own rather
  // than in the scrape handler (the metrics server's one thread must never
  // wait on the device driver), for backends with a device.
  DeviceMemorySampler sampler(*chosen, &metrics);

  // 5. The service: workers and queue, then the gRPC server.
  const plsh::server::MemoryCharge budget = memory_budgets(config, registry);
  plsh::server::MemoryBudget memory(budget);
  publish_memory(budget, &memory, &metrics);
  plsh::server::Scheduler scheduler(config.workers, config.queue_depth,
                                    [&metrics](int64_t depth) { metrics.queue_depth(static_cast<double>(depth)); });
  scheduler.set_busy_listener([&metrics](int64_t busy) { metrics.busy_workers(static_cast<double>(busy)); });
  // Streams waiting on their clients end after --stream-idle-timeout or below
  // --min-stream-rate (watchdog.h).
  plsh::server::StreamWatchdog watchdog(config.stream_idle_timeout, config.min_stream_rate, &metrics);
  // Requests' host tensors come from a pool of faulted-in blocks, bounded by
  // the host budget (buffer_pool.h); same-host clients may hand tensors over
  // in shared memory under --shm-dir (shm_registry.h).
  // Its pages come as data arrives; idle blocks keep at most
  // --pool-keep-bytes resident. Regions map at most --max-shm-bytes together.
  plsh::server::BufferPool pool(budget.host_bytes, config.pool_keep_bytes);
  plsh::StatusOr<std::unique_ptr<plsh::server::SharedMemoryRegistry>> shm = plsh::server::SharedMemoryRegistry::open(
      config.shm_enabled() ? config.shm_dir : "off", config.max_shm_bytes,
      [&metrics, max = config.max_shm_bytes](const plsh::server::SharedMemoryRegistry::Totals& t) {
        metrics.shared_memory(static_cast<double>(t.regions), static_cast<double>(t.mapped_bytes),
                              static_cast<double>(max));
      });
  if (!shm.ok()) return startup_failed(shm.status().to_string(), 2);
  // Kept contexts for AttendBackward, charged to the same host budget.
  plsh::server::ContextStore contexts({config.context_ttl, config.max_contexts}, &memory, &metrics);
  // The one owner of admission: tokens, limits, both budgets, the memory.
  plsh::server::Admission admission({config.max_concurrent}, &memory, &contexts, auth.get(), &pool);
  plsh::server::AttentionService service(config, &metrics, &scheduler, &admission, &watchdog, auth.get(), shm->get());

  // 6. Health checking (grpc.health.v1) and reflection. Neither needs a
  // token (they carry no data); with client certificates required, probes
  // that cannot present one use the health-only listener below.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  int port = 0, health_port = 0;
  std::unique_ptr<grpc::Server> server = build_server(config, *credentials, &service, &port);
  if (server == nullptr) return startup_failed("cannot listen on " + config.listen, 1);
  std::unique_ptr<grpc::Server> health_server;
  if (config.health_listen_enabled()) {
    health_server = build_health_server(config.health_listen, &health_port);
    if (health_server == nullptr) return startup_failed("cannot listen on " + config.health_listen, 1);
  }
  std::vector<grpc::HealthCheckServiceInterface*> health = {server->GetHealthCheckService()};
  if (health_server) health.push_back(health_server->GetHealthCheckService());
  for (grpc::HealthCheckServiceInterface* h : health) {
    h->SetServingStatus("", true);
    h->SetServingStatus(kServiceName, true);
  }

  // 7. Serve. Tests and scripts read the bound addresses from this line.
  log_event(spdlog::level::info, "serving",
            {{"grpc", bound(config.listen, port)},
             {"health", health_server ? bound(config.health_listen, health_port) : "off"},
             {"tls", plsh::server::tls_mode(config)},
             {"tokens", auth ? std::to_string(auth->client_count()) + " clients" : "off"},
             {"shared_memory", config.shm_enabled() ? "on" : "off"},
             {"metrics", config.metrics_enabled() ? metrics.bound_address() : "off"},
             {"backend", (*chosen)->name()},
             {"version", PLSH_VERSION},
             {"workers", config.workers},
             {"memory_budget", config.memory_budget},
             {"host_memory", plsh::server::host_memory().usable_bytes()},
             {"host_memory_source", plsh::server::host_memory().source()}});

  const int signal_number = wait_for_shutdown_signal();

  drain(signal_number, config, health, service, memory, scheduler, contexts, server.get(), health_server.get());
  return 0;
}
