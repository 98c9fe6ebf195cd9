// The server's default limits, as the fuzz targets of server/ use them.
#pragma once

#include <google/protobuf/stubs/logging.h>

#include "fuzz_check.h"
#include "server/config.h"
#include "server/request.h"

namespace plsh::fuzz {

// Inputs that do not parse are the common case: protobuf's complaints about
// them (invalid UTF-8 in a string field) would drown libFuzzer's output.
inline const bool kProtobufLogsOff = [] {
  google::protobuf::SetLogHandler(nullptr);
  return true;
}();

// RequestLimits as plsh-server fills them from a default ServerConfig
// (service.cpp), on the CPU backend with one thread per request.
inline server::RequestLimits server_default_limits() {
  const server::ServerConfig config;
  server::RequestLimits l;
  l.max_tokens = config.max_tokens;
  l.max_request_bytes = config.max_request_bytes;
  l.max_samples = config.max_samples;
  l.max_message_bytes = config.max_message_bytes;
  l.default_backend = "cpu";
  l.threads = 1;
  return l;
}

// What CallBase::admit_header (server/call.cpp) does with a header, against a
// memory budget of `budget_bytes` for this request alone: the header's
// checks, its shared-memory references (a default server has no
// --shm-dir: UNIMPLEMENTED), then the planning bound held against the
// budget, then the kernels' plan. Checks that the bound holds for the draws
// actually made.
inline StatusOr<server::Request> plan_like_server(const v1::AttendHeader& header, const server::RequestLimits& limits,
                                                  int64_t budget_bytes) {
  ASSIGN_OR_RETURN(server::Request plan, server::check_request(header, limits));
  RETURN_IF_ERROR(server::use_shared_memory(header, &plan, nullptr, ""));
  ASSIGN_OR_RETURN(const int64_t bound, server::planning_bytes(plan));
  PLSH_FUZZ_CHECK(bound >= 0, "negative planning_bytes");
  if (bound > budget_bytes) return resource_exhausted("planning bound over the budget");
  RETURN_IF_ERROR(server::plan_request(&plan, limits));
  int64_t draw_bytes = 0;
  for (const auto& head : plan.plan.draws) draw_bytes += static_cast<int64_t>(head.size() * sizeof(head[0]));
  PLSH_FUZZ_CHECK(draw_bytes <= bound, "plan_request made more draws than planning_bytes allows for");
  PLSH_FUZZ_CHECK(plan.plan.own_host_bytes <= bound, "the plan holds more than planning_bytes allows for");
  return plan;
}

}  // namespace plsh::fuzz
