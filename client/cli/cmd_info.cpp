// plsh info: what a plsh-server is (GetInfo) as JSON: version, backends and
// devices, limits, defaults, the backend constants clients read.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

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

// protobuf's JSON writes 64-bit integers as strings (JavaScript numbers
// hold 53 bits); limits are numbers to whoever reads them (jq, a script
// comparing max_samples), so they are turned back into numbers here,
// field by field from the message's descriptor.
void int64_as_numbers(const google::protobuf::Message& m, nlohmann::ordered_json* j) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (!j->contains(f->name()) || f->is_map()) continue;
    nlohmann::ordered_json& value = (*j)[f->name()];
    auto number = [f](const nlohmann::ordered_json& text) {
      return f->cpp_type() == FieldDescriptor::CPPTYPE_INT64
                 ? nlohmann::ordered_json(std::stoll(text.get<std::string>()))
                 : nlohmann::ordered_json(std::stoull(text.get<std::string>()));
    };
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (!f->is_repeated()) {
        int64_as_numbers(r->GetMessage(m, f), &value);
        continue;
      }
      for (int k = 0; k < r->FieldSize(m, f) && k < static_cast<int>(value.size()); ++k)
        int64_as_numbers(r->GetRepeatedMessage(m, f, k), &value[static_cast<size_t>(k)]);
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_INT64 || f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64) {
      if (!f->is_repeated()) {
        value = number(value);
        continue;
      }
      for (nlohmann::ordered_json& item : value) item = number(item);
    }
  }
}

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
  nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(json);
  int64_as_numbers(response, &parsed);
  std::cout << parsed.dump(1) << "\n";
  return kExitOk;
}

RunFn setup_info(CLI::App& app) {
  auto args = std::make_shared<InfoArgs>();
  app.add_option("--target", args->target, "plsh-server address host:port (or $PLSH_TARGET)")
      ->envname("PLSH_TARGET")
      ->capture_default_str();
  add_connection_flags(app, args->channel);
  app.add_option("--deadline", args->deadline, "seconds")->capture_default_str()->check(CLI::PositiveNumber);
  return [args] { return info(*args); };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(info, "Ask a plsh-server what it is: version, backends, limits, defaults (JSON)",
                      plsh::cli::setup_info);
