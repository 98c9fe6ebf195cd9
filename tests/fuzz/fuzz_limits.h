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

}  // namespace plsh::fuzz
