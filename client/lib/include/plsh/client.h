// The C++ client of plsh-server: one call, tensors in, output and
// estimates out. Attend streams q, k, v to the server in chunks of rows
// that fit the server's message limit (learnt from its ack) and puts the
// output chunks back together, so a request of any length goes through.
//
//   plsh::client::Client c("127.0.0.1:50051");
//   plsh::client::AttendCall call;
//   call.options = ...;               // shapes, dtype, mode, ... as for plsh::make_params
//   call.q = q; call.k = k; call.v = v;
//   plsh::client::AttendReply reply;
//   grpc::Status s = c.attend(call, &reply);   // reply.out, reply.result, reply.timings
//
// Errors are the server's (or the channel's) grpc::Status, unchanged.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plsh/params.h"
#include "plsh/result.h"
#include "plsh/v1/plsh.grpc.pb.h"

namespace plsh::client {

struct AttendCall {
  AttentionOptions options;      // shape, dtype of q/k/v on the wire, mode and its parameters
  const void* q = nullptr;       // [B, Nq, H, D]   options.dtype, host memory
  const void* k = nullptr;       // [B, Nk, Hkv, D]
  const void* v = nullptr;       // [B, Nk, Hkv, D]
  bool return_lse = false;
  std::string backend = "auto";  // auto | cpu | cuda: the server's backend
  int64_t chunk_bytes = 0;       // payload per message both ways; 0: the largest the server allows
  double deadline_seconds = 0;   // whole call; 0: none
  std::string request_id;        // empty: the server makes one
};

// The server's view of where the time went, seconds.
struct ServerTimings {
  double queued = 0, receiving = 0, computing = 0, sending = 0, total = 0;
};

struct AttendReply {
  std::vector<uint8_t> out;    // [B, Nq, H, D] of result out_dtype
  std::vector<float> lse;      // [B, Nq, H] with return_lse
  DType out_dtype = DType::kF32;
  AttentionResult result;      // backend, device, estimates, FLOPs, backend timings
  ServerTimings timings;
  std::string request_id;
  int64_t sent_bytes = 0;      // tensor payload this client sent
  int64_t received_bytes = 0;  // tensor payload this client received
  int64_t largest_message_bytes = 0;  // largest message either way (serialised size)
  int64_t messages = 0;               // messages either way
};

class Client {
 public:
  explicit Client(const std::string& target);
  explicit Client(std::shared_ptr<grpc::Channel> channel);

  // Streams the request (Attend). Checks that the server's output covers
  // every row exactly once.
  grpc::Status attend(const AttendCall& call, AttendReply* reply);
  // The same in one message each way (AttendUnary), for small requests.
  grpc::Status attend_unary(const AttendCall& call, AttendReply* reply);
  grpc::Status info(v1::GetInfoResponse* info, double deadline_seconds = 10);
  // grpc.health.v1 Check: status_name = "SERVING", "NOT_SERVING", ...
  grpc::Status health(const std::string& service, std::string* status_name, double deadline_seconds = 10);

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

// The wire header for a call (what the Python client builds too).
v1::AttendHeader make_header(const AttendCall& call);

// "INVALID_ARGUMENT", "UNAVAILABLE", ...
std::string status_code_name(grpc::StatusCode code);
// "INVALID_ARGUMENT: samples = 0, expected in [1, 16777216]"
std::string status_string(const grpc::Status& status);

}  // namespace plsh::client
