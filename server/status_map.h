// The one place where plsh::Status becomes grpc::Status (Triton's
// GrpcStatusUtil habit): plsh's codes mirror gRPC's, so this is a cast plus
// the message.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "plsh/status.h"

namespace plsh::server {

grpc::Status to_grpc_status(const Status& status);

// "OK", "INVALID_ARGUMENT", ...: the label of plsh_requests_total{code}.
std::string grpc_code_name(grpc::StatusCode code);

}  // namespace plsh::server
