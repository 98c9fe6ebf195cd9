// plsh-server: the whole wiring at a glance.
//   flags/config -> metrics exposer -> backends -> service -> health and
//   reflection -> serve -> drain on SIGTERM/SIGINT.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <csignal>
#include <memory>

#include "plsh/backend.h"
#include "server/config.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/service.h"

namespace {

constexpr const char* kServiceName = "plsh.v1.Attention";

// Signals are taken by sigwait in main, so every thread (gRPC's, civetweb's,
// the workers) is started with them blocked.
sigset_t block_shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

}  // namespace

int main(int argc, char** argv) {
  using plsh::server::log_event;
  const sigset_t shutdown_signals = block_shutdown_signals();

  // 1. Configuration.
  plsh::server::ParsedConfig parsed = plsh::server::parse_config(argc, argv);
  if (!parsed.config) return parsed.exit_code;
  const plsh::server::ServerConfig config = *parsed.config;
  if (plsh::Status s = plsh::server::init_logging(config.log_level, config.log_format); !s.ok()) {
    fprintf(stderr, "plsh-server: %s\n", s.to_string().c_str());
    return 2;
  }

  // 2. Metrics, before any backend: civetweb's small-stack threads must
  // exist before cuBLAS's thread-local storage is mapped (see metrics.h).
  plsh::server::Metrics metrics;
  if (config.metrics_enabled()) {
    if (plsh::Status s = metrics.serve(config.metrics_listen); !s.ok()) {
      log_event(spdlog::level::err, "startup_failed", {{"error", s.to_string()}});
      return 1;
    }
  }

  // 3. Backends: CUDA when its library loads and a device is present, the CPU always.
  plsh::BackendRegistry& registry = plsh::BackendRegistry::global();
  for (plsh::Backend* b : registry.backends())
    log_event(spdlog::level::info, "backend", {{"name", b->name()}, {"device", b->device()}});
  for (const std::string& note : registry.notes()) log_event(spdlog::level::info, "backend_unavailable", {{"note", note}});
  plsh::StatusOr<plsh::Backend*> chosen = registry.find(config.backend);
  if (!chosen.ok()) {
    log_event(spdlog::level::err, "startup_failed", {{"error", chosen.status().to_string()}});
    return 1;
  }
  metrics.set_build_info(PLSH_VERSION, (*chosen)->name(), (*chosen)->device());

  // 4. The service: workers and queue, then the gRPC server.
  plsh::server::Scheduler scheduler(config.workers, config.queue_depth, config.memory_budget,
                                    [&metrics](int64_t depth) { metrics.queue_depth(static_cast<double>(depth)); });
  plsh::server::AttentionService service(config, &metrics, &scheduler);

  // 5. Health checking (grpc.health.v1) and reflection.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    log_event(spdlog::level::err, "startup_failed", {{"error", "cannot listen on " + config.listen}});
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);

  // 6. Serve. Tests and scripts read the bound addresses from this line.
  const std::string grpc_addr = config.listen.substr(0, config.listen.rfind(':')) + ":" + std::to_string(port);
  log_event(spdlog::level::info, "serving",
            {{"grpc", grpc_addr},
             {"metrics", config.metrics_enabled() ? metrics.bound_address() : "off"},
             {"backend", (*chosen)->name()},
             {"version", PLSH_VERSION},
             {"workers", config.workers}});

  int signal_number = 0;
  sigwait(&shutdown_signals, &signal_number);

  // 7. Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish
  // (cancelling them after --drain-timeout), then stop the workers.
  log_event(spdlog::level::info, "draining", {{"signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT"},
                                             {"drain_timeout_s", config.drain_timeout}});
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus("", false);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(config.drain_timeout));
  server->Shutdown(deadline);
  scheduler.stop();
  log_event(spdlog::level::info, "stopped");
  return 0;
}
