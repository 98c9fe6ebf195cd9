// plsh health: grpc.health.v1 Check against a plsh-server. Prints the
// status; exits 0 only when SERVING (for probes and scripts).
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "plsh/client.h"

namespace plsh::cli {
namespace {

struct HealthArgs {
  std::string target = "127.0.0.1:50051";
  std::string service;  // "": the whole server; or "plsh.v1.Attention"
  double deadline = 5;
};

int health(const HealthArgs& args) {
  std::string status;
  const grpc::Status s = client::Client(args.target).health(args.service, &status, args.deadline);
  if (!s.ok()) {
    std::cerr << "plsh health: " << client::status_string(s) << std::endl;
    return kExitRuntime;
  }
  std::cout << status << std::endl;
  return status == "SERVING" ? kExitOk : kExitRuntime;
}

RunFn setup_health(CLI::App& app) {
  auto args = std::make_shared<HealthArgs>();
  app.add_option("--target", args->target, "plsh-server address host:port")->capture_default_str();
  app.add_option("--service", args->service, "service to check (\"\": the whole server, or plsh.v1.Attention)");
  app.add_option("--deadline", args->deadline, "seconds")->capture_default_str()->check(CLI::PositiveNumber);
  return [args] { return health(*args); };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(health, "Check a plsh-server's health; exit 0 only when SERVING", plsh::cli::setup_health);
