// plsh health: grpc.health.v1 Check against a plsh-server. Prints the
// status; exits 0 only when SERVING (for probes and scripts). Takes the TLS
// flags (a server with TLS answers health on its main port over TLS only)
// but no token: health checks need none.
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "cli/connection_flags.h"
#include "plsh/client.h"

namespace plsh::cli {
namespace {

struct HealthArgs {
  std::string target = "127.0.0.1:50051";
  client::ChannelOptions channel;  // TLS
  std::string service;             // "": the whole server; or "plsh.v1.Attention"
  double deadline = 5;
};

int health(const HealthArgs& args) {
  std::string status;
  std::unique_ptr<client::Client> c;
  grpc::Status s = client::Client::connect(args.target, args.channel, &c);
  if (s.ok()) s = c->health(args.service, &status, args.deadline);
  if (!s.ok()) {
    std::cerr << "plsh health: " << client::status_string(s) << std::endl;
    return s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? kExitUsage : kExitRuntime;
  }
  std::cout << status << std::endl;
  return status == "SERVING" ? kExitOk : kExitRuntime;
}

RunFn setup_health(CLI::App& app) {
  auto args = std::make_shared<HealthArgs>();
  app.add_option("--target", args->target, "plsh-server address host:port (or $PLSH_TARGET)")
      ->envname("PLSH_TARGET")
      ->capture_default_str();
  add_connection_flags(app, args->channel, /*tokens=*/false);
  app.add_option("--service", args->service, "service to check (\"\": the whole server, or plsh.v1.Attention)");
  app.add_option("--deadline", args->deadline, "seconds")->capture_default_str()->check(CLI::PositiveNumber);
  return [args] { return health(*args); };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(health, "Check a plsh-server's health; exit 0 only when SERVING", plsh::cli::setup_health);
