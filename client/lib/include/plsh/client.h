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
//
// Tensor bytes are not copied on their way out: each chunk message points
// at the caller's q, k and v (proto/chunk_codec.h), and attend() returns
// only once gRPC has let go of them. Output chunks are copied once, from
// gRPC's received slices to reply.out, or to call.out when given.
//
// Same-host shared memory (a server with --shm-dir): put tensors in a file
// of the server's shared-memory directory (plsh/shared_memory.h), register
// a range of it once, and name (region, offset) per tensor instead of
// sending it:
//
//   c.register_shared_memory("inputs", "plsh-inputs", 0, bytes);
//   call.q_shm = {"inputs", 0}; call.k_shm = {"inputs", q_bytes}; ...
//   call.out_shm = {"outputs", 0};   // the server writes out there; reply.out stays empty
// Training (SPEC section 8): a forward with keep_context leaves its context
// on the server, and the backward sends only dout:
//
//   call.keep_context = true;
//   c.attend(call, &reply);                    // reply.context_id
//   plsh::client::BackwardCall bw;
//   bw.options = call.options; bw.context_id = reply.context_id; bw.dout = dout;
//   plsh::client::BackwardReply grads;
//   c.backward(bw, &grads);                    // grads.dq, grads.dk, grads.dv
//
// or statelessly with q, k, v, out and lse (bw.q ... bw.lse, no context_id);
// release_context() drops a context that no backward will use.
//
// A server with TLS, client certificates or bearer tokens (README, "Server
// settings"):
//
//   plsh::client::ChannelOptions o;
//   o.tls_ca = "ca.crt"; o.token_file = "plsh.token";     // and tls_cert/tls_key for client certificates
//   std::unique_ptr<plsh::client::Client> c;
//   grpc::Status s = plsh::client::Client::connect("plsh.example:50051", o, &c);
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plsh/params.h"
#include "plsh/result.h"
#include "plsh/v1/plsh.grpc.pb.h"

namespace plsh::client {

// A tensor's place in a registered shared-memory region; unset (empty
// region): the tensor travels in chunks.
struct SharedTensor {
  std::string region;  // the name it was registered under
  int64_t offset = 0;  // bytes from the region's start
  bool set() const { return !region.empty(); }
};

struct AttendCall {
  AttentionOptions options;  // shape, dtype of q/k/v on the wire, mode and its parameters
  const void* q = nullptr;   // [B, Nq, H, D]   options.dtype, host memory; not copied, read until attend returns
  const void* k = nullptr;   // [B, Nk, Hkv, D]
  const void* v = nullptr;   // [B, Nk, Hkv, D]
  bool return_lse = false;
  // Where attend() writes the output: [B, Nq, H, D] of out_dtype, and lse
  // [B, Nq, H] float32 with return_lse. Null: reply.out and reply.lse.
  void* out = nullptr;
  float* lse = nullptr;
  // Tensors in shared memory instead of q, k, v, out and lse (attend only;
  // a server with --shm-dir). lse_shm implies return_lse.
  SharedTensor q_shm, k_shm, v_shm, out_shm, lse_shm;
  std::string backend = "auto";  // auto | cpu | cuda: the server's backend
  int64_t chunk_bytes = 0;       // payload per message both ways; 0: the largest the server allows
  double deadline_seconds = 0;   // whole call; 0: none
  std::string request_id;        // empty: the server makes one
  bool keep_context = false;     // keep the context on the server for backward(): AttendReply::context_id
};

// The server's view of where the time went, seconds.
struct ServerTimings {
  double queued = 0, receiving = 0, computing = 0, sending = 0, total = 0;
};

struct AttendReply {
  std::vector<uint8_t> out;  // [B, Nq, H, D] of result out_dtype; empty with call.out or call.out_shm
  std::vector<float> lse;    // [B, Nq, H] with return_lse; empty with call.lse or call.lse_shm
  DType out_dtype = DType::kF32;
  AttentionResult result;  // backend, device, estimates, FLOPs, backend timings
  ServerTimings timings;
  std::string request_id;
  int64_t sent_bytes = 0;             // tensor payload this client sent
  int64_t received_bytes = 0;         // tensor payload this client received
  int64_t largest_message_bytes = 0;  // largest message either way (serialised size)
  int64_t messages = 0;               // messages either way
  std::string context_id;             // with keep_context: the kept context, for backward()
  double context_ttl_seconds = 0;     // it expires this long after its last use
  int64_t context_bytes = 0;          // host bytes it holds on the server
};

// The backward pass (AttendBackward): dq, dk, dv of a forward, from dout.
struct BackwardCall {
  AttentionOptions options;  // the forward's: shape, dtype of q/k/v, out_dtype, mode and its parameters
  // By context: a forward's AttendReply::context_id; only dout goes up.
  // Empty: stateless, with q, k, v and out and lse (or recompute_forward).
  std::string context_id;
  bool keep_context = false;        // by context: keep it for another backward; default: this one consumes it
  const void* q = nullptr;          // stateless: [B, Nq, H, D]   options.dtype
  const void* k = nullptr;          // stateless: [B, Nk, Hkv, D]
  const void* v = nullptr;          // stateless: [B, Nk, Hkv, D]
  const void* out = nullptr;        // stateless: the forward's output [B, Nq, H, D], out dtype
  const float* lse = nullptr;       // stateless: its lse [B, Nq, H]
  bool recompute_forward = false;   // stateless without out and lse: the server runs the forward for them
  const void* dout = nullptr;       // [B, Nq, H, D] in the forward's out dtype
  std::optional<DType> grad_dtype;  // of dq, dk, dv; default options.dtype
  std::string backend = "auto";     // stateless: the server's backend
  int64_t chunk_bytes = 0;          // payload per message both ways; 0: the largest the server allows
  double deadline_seconds = 0;      // whole call; 0: none
  std::string request_id;           // empty: the server makes one
};

struct BackwardReply {
  std::vector<uint8_t> dq;  // [B, Nq, H, D]   grad_dtype
  std::vector<uint8_t> dk;  // [B, Nk, Hkv, D] grad_dtype
  std::vector<uint8_t> dv;  // [B, Nk, Hkv, D] grad_dtype
  DType grad_dtype = DType::kF32;
  BackwardResult result;     // backend, device, FLOPs, workspace, backend timings
  double forward_flops = 0;  // recompute_forward: the forward's
  ServerTimings timings;
  std::string request_id;
  std::string context_id;      // the context used (empty: stateless)
  bool context_kept = false;   // still on the server (keep_context)
  int64_t sent_bytes = 0;      // tensor payload this client sent
  int64_t received_bytes = 0;  // tensor payload this client received
  int64_t largest_message_bytes = 0;
  int64_t messages = 0;
};

// How to reach a server: plaintext (all empty: the default), TLS, TLS with
// a client certificate; with a bearer token or without.
struct ChannelOptions {
  bool tls = false;             // TLS; implied by any tls_* field below (alone: the system's CA roots)
  std::string tls_ca;           // PEM file: the CA(s) the server's certificate must chain to
  std::string tls_cert;         // PEM file: this client's certificate chain (client certificates); needs tls_key
  std::string tls_key;          // PEM file: its private key
  std::string tls_server_name;  // the name the server's certificate must carry; "": the target's host
  std::string token;            // bearer token, sent as `authorization: Bearer <token>` with every call but health
  std::string token_file;       // or a file that holds it (surrounding whitespace ignored); not both

  bool uses_tls() const {
    return tls || !tls_ca.empty() || !tls_cert.empty() || !tls_key.empty() || !tls_server_name.empty();
  }
};

// What every plsh channel sets: no client-side message limits (the server
// enforces its own; the client should never be the one to refuse), and the
// transport settings measured for large tensors (client.cpp).
grpc::ChannelArguments default_channel_arguments();

// The channel to target with options' credentials, files read now, and
// the bearer token ("" without one). INVALID_ARGUMENT naming the option and
// the file when one cannot be read or holds no PEM/token; messages never
// hold the token or key bytes.
grpc::Status make_channel(const std::string& target, const ChannelOptions& options, grpc::ChannelArguments args,
                          std::shared_ptr<grpc::Channel>* channel, std::string* token);

class Client {
 public:
  // Plaintext, no token.
  explicit Client(const std::string& target);
  // A channel made elsewhere (make_channel, or your own arguments); token:
  // sent with every call but health checks (which need none). Must be
  // visible ASCII (make_channel checks it).
  explicit Client(std::shared_ptr<grpc::Channel> channel, std::string token = "");
  // make_channel(target, options, default_channel_arguments()) and a Client on it.
  static grpc::Status connect(const std::string& target, const ChannelOptions& options,
                              std::unique_ptr<Client>* client);

  // Streams the request (Attend). Checks that the server's output covers
  // every row exactly once.
  grpc::Status attend(const AttendCall& call, AttendReply* reply);
  // The same in one message each way (AttendUnary), for small requests.
  grpc::Status attend_unary(const AttendCall& call, AttendReply* reply);
  // The backward (AttendBackward), by context or stateless; streamed both
  // ways like attend(). Checks that dq, dk, dv arrive whole.
  // A reply passed again keeps its dq, dk and dv storage (their contents
  // are defined only when the call returns OK).
  grpc::Status backward(const BackwardCall& call, BackwardReply* reply);
  // ReleaseContext: drops a kept context now.
  grpc::Status release_context(const std::string& context_id, int64_t* released_bytes = nullptr,
                               double deadline_seconds = 10);
  grpc::Status info(v1::GetInfoResponse* info, double deadline_seconds = 10);
  // Same-host shared memory (plsh.proto: RegisterSharedMemory and the
  // rest): key is a file name in the server's --shm-dir.
  grpc::Status register_shared_memory(const std::string& name, const std::string& key, int64_t offset,
                                      int64_t byte_size, double deadline_seconds = 10);
  grpc::Status unregister_shared_memory(const std::string& name, double deadline_seconds = 10);
  grpc::Status list_shared_memory(std::vector<v1::SharedMemoryRegion>* regions, double deadline_seconds = 10);
  // grpc.health.v1 Check: status_name = "SERVING", "NOT_SERVING", ...
  grpc::Status health(const std::string& service, std::string* status_name, double deadline_seconds = 10);

 private:
  // Deadline and credentials of one call.
  void prepare(grpc::ClientContext* ctx, double deadline_seconds) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::string token_;
};

// The wire header for a call (what the Python client builds too).
v1::AttendHeader make_header(const AttendCall& call);

// "INVALID_ARGUMENT", "UNAVAILABLE", ...
std::string status_code_name(grpc::StatusCode code);
// "INVALID_ARGUMENT: samples = 0, expected in [1, 16777216]"
std::string status_string(const grpc::Status& status);

}  // namespace plsh::client
