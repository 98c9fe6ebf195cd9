// The client library's refusal of a call it will not send: INVALID_ARGUMENT
// with the message that names the bad argument (client.cpp, backward.cpp,
// shared_memory.cpp).
#pragma once

#include <grpcpp/support/status.h>

#include <string>

namespace plsh::client {

inline grpc::Status invalid(const std::string& what) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what); }

}  // namespace plsh::client
