// plsh info: what a plsh-server is (GetInfo) as JSON: version, backends and
// devices, limits, defaults.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "cli/connection_flags.h"
#include "plsh/client.h"

namespace plsh::cli {
namespace {

struct InfoArgs {
  std::string target = "127.0.0.1:50051";
  client::ChannelOptions channel;  // TLS and the bearer token
  double deadline = 10;
};

int info(const InfoArgs& args) {
  v1::GetInfoResponse response;
  std::unique_ptr<client::Client> c;
  grpc::Status s = client::Client::connect(args.target, args.channel, &c);
  if (s.ok()) s = c->info(&response, args.deadline);
  if (!s.ok()) {
    std::cerr << "plsh info: " << client::status_string(s) << std::endl;
    return s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? kExitUsage : kExitRuntime;
  }
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(response, &json, options).ok()) {
    std::cerr << "plsh info: INTERNAL: cannot print the reply as JSON" << std::endl;
    return kExitRuntime;
  }
  std::cout << json;
  return kExitOk;
}

RunFn setup_info(CLI::App& app) {
  auto args = std::make_shared<InfoArgs>();
  app.add_option("--target", args->target, "plsh-server address host:port")->capture_default_str();
  add_connection_flags(app, args->channel);
  app.add_option("--deadline", args->deadline, "seconds")->capture_default_str()->check(CLI::PositiveNumber);
  return [args] { return info(*args); };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(info, "Ask a plsh-server what it is: version, backends, limits, defaults (JSON)",
                      plsh::cli::setup_info);
