#include "plsh/client.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "chunk_stream.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "invalid.h"
#include "plsh/shape.h"
#include "proto/wire.h"

namespace plsh::client {

namespace {

void set_deadline(grpc::ClientContext* ctx, double seconds) {
  if (seconds > 0)
    ctx->set_deadline(
        std::chrono::system_clock::now() +
        std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds)));
}

// A credentials file (PEM, a token): small; its bytes never go in a message.
grpc::Status read_small_file(const char* name, const std::string& path, std::string* bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid(std::string(name) + " = '" + path + "': cannot read: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return invalid(std::string(name) + " = '" + path + "': cannot read: " + std::strerror(errno));
  *bytes = text.str();
  if (bytes->size() > (size_t{1} << 20)) return invalid(std::string(name) + " = '" + path + "': larger than 1 MiB");
  return grpc::Status::OK;
}

grpc::Status fill_timings(const v1::Summary& s, AttendReply* reply) {
  reply->timings =
      ServerTimings{s.timings().queued_seconds(), s.timings().receiving_seconds(), s.timings().computing_seconds(),
                    s.timings().sending_seconds(), s.timings().total_seconds()};
  StatusOr<AttentionResult> result = wire::result_from_summary(s);
  if (!result.ok()) return protocol_error("summary: " + result.status().message());
  reply->result = std::move(result).value();
  StatusOr<DType> out_dtype = wire::dtype_from_wire("out_dtype", s.out_dtype(), std::nullopt);
  if (!out_dtype.ok()) return protocol_error("summary: " + out_dtype.status().message());
  reply->out_dtype = *out_dtype;
  reply->request_id = s.request_id();
  reply->context_id = s.context_id();
  reply->context_ttl_seconds = s.context_ttl_seconds();
  reply->context_bytes = s.context_bytes();
  return grpc::Status::OK;
}

}  // namespace

std::string status_code_name(grpc::StatusCode code) {
  static const char* const names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < static_cast<int>(std::size(names)) ? names[c] : "UNKNOWN";
}

std::string status_string(const grpc::Status& status) {
  return status.ok() ? "OK" : status_code_name(status.error_code()) + ": " + status.error_message();
}

v1::AttendHeader make_header(const AttendCall& call) {
  const AttentionOptions& o = call.options;
  v1::AttendHeader h;
  h.set_request_id(call.request_id);
  wire::options_to_header(o, &h);
  h.set_return_lse(call.return_lse || call.lse_shm.set());
  h.set_out_chunk_bytes(std::max<int64_t>(0, call.chunk_bytes));
  h.set_backend(call.backend);
  // Tensors in shared memory: their place and exact size.
  const RequestShape z = RequestShape::of(o);
  const struct {
    const SharedTensor& tensor;
    v1::SharedMemoryRef* (v1::AttendHeader::*field)();
    int64_t bytes;
  } shared[] = {{call.q_shm, &v1::AttendHeader::mutable_q_shm, z.q.bytes()},
                {call.k_shm, &v1::AttendHeader::mutable_k_shm, z.k.bytes()},
                {call.v_shm, &v1::AttendHeader::mutable_v_shm, z.v.bytes()},
                {call.out_shm, &v1::AttendHeader::mutable_out_shm, z.out.bytes()},
                {call.lse_shm, &v1::AttendHeader::mutable_lse_shm, z.lse.bytes()}};
  for (const auto& t : shared) {
    if (!t.tensor.set()) continue;
    v1::SharedMemoryRef* ref = (h.*t.field)();
    ref->set_region(t.tensor.region);
    ref->set_offset(t.tensor.offset);
    ref->set_byte_size(t.bytes);
  }
  h.set_keep_context(call.keep_context);
  return h;
}

grpc::ChannelArguments default_channel_arguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A fixed 32 MiB stream window instead of BDP probing, for output
  // chunks: on loopback the BDP estimate stays small and the server waits
  // for this client's window updates whenever its reading thread runs late
  // (bench/RESULTS.md, "Transport": the sending phase of 128 MiB, 98 -> 66-74
  // ms median on a busy machine). The memory is the client's own.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 32 << 20);
  return args;
}

grpc::Status make_channel(const std::string& target, const ChannelOptions& o, grpc::ChannelArguments args,
                          std::shared_ptr<grpc::Channel>* channel, std::string* token) {
  token->clear();
  if (!o.token.empty() && !o.token_file.empty()) return invalid("token and token_file are both set, expected one");
  if (!o.token.empty()) {
    *token = o.token;
  } else if (!o.token_file.empty()) {
    std::string text;
    if (grpc::Status s = read_small_file("token_file", o.token_file, &text); !s.ok()) return s;
    const size_t begin = text.find_first_not_of(" \t\r\n");
    const size_t end = text.find_last_not_of(" \t\r\n");
    *token = begin == std::string::npos ? "" : text.substr(begin, end - begin + 1);
    if (token->empty()) return invalid("token_file = '" + o.token_file + "' is empty, expected a bearer token");
  }
  // gRPC refuses metadata values outside visible ASCII; say so here, and
  // where, without the token.
  for (size_t i = 0; i < token->size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>((*token)[i]);
    if (ch < 0x21 || ch > 0x7e)
      return invalid(
          std::string(o.token.empty() ? "token_file" : "token") + ": byte " + std::to_string(i) +
          " of the token is not visible ASCII (a space, a control character or non-ASCII), expected one word");
  }

  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (o.uses_tls()) {
    if (o.tls_cert.empty() != o.tls_key.empty())
      return invalid(o.tls_cert.empty() ? "tls_key is set without tls_cert, expected both or neither"
                                        : "tls_cert is set without tls_key, expected both or neither");
    grpc::SslCredentialsOptions ssl;
    const struct {
      const char* name;
      const std::string& path;
      std::string* pem;
      const char* begin;
    } files[] = {{"tls_ca", o.tls_ca, &ssl.pem_root_certs, "-----BEGIN CERTIFICATE-----"},
                 {"tls_cert", o.tls_cert, &ssl.pem_cert_chain, "-----BEGIN CERTIFICATE-----"},
                 {"tls_key", o.tls_key, &ssl.pem_private_key, "PRIVATE KEY-----"}};
    for (const auto& f : files) {
      if (f.path.empty()) continue;
      if (grpc::Status s = read_small_file(f.name, f.path, f.pem); !s.ok()) return s;
      if (f.pem->find(f.begin) == std::string::npos)
        return invalid(std::string(f.name) + " = '" + f.path + "': no PEM block with '" + f.begin + "'");
    }
    credentials = grpc::SslCredentials(ssl);
    if (!o.tls_server_name.empty()) args.SetSslTargetNameOverride(o.tls_server_name);
  }
  *channel = grpc::CreateCustomChannel(target, credentials, args);
  return grpc::Status::OK;
}

Client::Client(const std::string& target)
    : Client(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), default_channel_arguments())) {}

Client::Client(std::shared_ptr<grpc::Channel> channel, std::string token)
    : channel_(std::move(channel)), token_(std::move(token)) {
  stub_ = v1::Attention::NewStub(channel_);
}

grpc::Status Client::connect(const std::string& target, const ChannelOptions& options,
                             std::unique_ptr<Client>* client) {
  std::shared_ptr<grpc::Channel> channel;
  std::string token;
  if (grpc::Status s = make_channel(target, options, default_channel_arguments(), &channel, &token); !s.ok()) return s;
  *client = std::make_unique<Client>(std::move(channel), std::move(token));
  return grpc::Status::OK;
}

void Client::prepare(grpc::ClientContext* ctx, double deadline_seconds) const {
  set_deadline(ctx, deadline_seconds);
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
}

grpc::Status Client::attend(const AttendCall& call, AttendReply* reply) {
  *reply = AttendReply{};
  const RequestShape z = RequestShape::of(call.options);
  const bool return_lse = call.return_lse || call.lse_shm.set();
  // What goes up, and where what comes down goes: the tensors not in shared memory.
  std::vector<ChunkStream::Input> inputs;
  if (!call.q_shm.set()) inputs.push_back({v1::TENSOR_Q, call.q, z.q});
  if (!call.k_shm.set()) inputs.push_back({v1::TENSOR_K, call.k, z.k});
  if (!call.v_shm.set()) inputs.push_back({v1::TENSOR_V, call.v, z.v});
  std::vector<ChunkStream::Output> outputs;
  if (!call.out_shm.set()) {
    void* out = call.out;
    if (out == nullptr) {
      reply->out.resize(static_cast<size_t>(z.out.bytes()));
      out = reply->out.data();
    }
    outputs.push_back({v1::TENSOR_OUT, out, z.out});
  }
  if (return_lse && !call.lse_shm.set()) {
    void* lse = call.lse;
    if (lse == nullptr) {
      reply->lse.resize(static_cast<size_t>(z.lse.rows * call.options.heads));
      lse = reply->lse.data();
    }
    outputs.push_back({v1::TENSOR_LSE, lse, z.lse});
  }
  v1::AttendRequest header;
  *header.mutable_header() = make_header(call);
  std::optional<v1::Summary> summary;
  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  ChunkStream stream(channel_, "/plsh.v1.Attention/Attend", call.chunk_bytes);
  const grpc::Status status =
      stream.run(&ctx, serialize_message(header), std::move(inputs), &outputs,
                 response_reader<v1::AttendResponse>("an AttendResponse", &summary, [](const v1::AttendResponse& r) {
                   return r.has_out_chunk() ? &r.out_chunk() : nullptr;
                 }));
  stream.traffic().copy_to(&reply->sent_bytes, &reply->received_bytes, &reply->messages, &reply->largest_message_bytes);
  if (!status.ok()) return status;
  if (!summary) return protocol_error("stream ended OK without a summary");
  return fill_timings(*summary, reply);
}

grpc::Status Client::attend_unary(const AttendCall& call, AttendReply* reply) {
  *reply = AttendReply{};
  const RequestShape z = RequestShape::of(call.options);
  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  v1::AttendUnaryRequest request;
  *request.mutable_header() = make_header(call);
  // Tensors in shared memory are named in the header, not sent.
  if (!call.q_shm.set()) request.set_q(call.q, static_cast<size_t>(z.q.bytes()));
  if (!call.k_shm.set()) request.set_k(call.k, static_cast<size_t>(z.k.bytes()));
  if (!call.v_shm.set()) request.set_v(call.v, static_cast<size_t>(z.v.bytes()));
  reply->sent_bytes = static_cast<int64_t>(request.q().size() + request.k().size() + request.v().size());
  reply->largest_message_bytes = static_cast<int64_t>(request.ByteSizeLong());
  v1::AttendUnaryResponse response;
  const grpc::Status status = stub_->AttendUnary(&ctx, request, &response);
  if (!status.ok()) return status;
  reply->messages = 2;
  reply->largest_message_bytes =
      std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(response.ByteSizeLong()));
  const bool out_streamed = !call.out_shm.set();
  const bool lse_streamed = call.return_lse && !call.lse_shm.set();
  if (static_cast<int64_t>(response.out().size()) != (out_streamed ? z.out.bytes() : 0))
    return protocol_error("out has " + std::to_string(response.out().size()) + " bytes");
  reply->out.assign(response.out().begin(), response.out().end());
  if (lse_streamed) {
    if (static_cast<int64_t>(response.lse().size()) != z.lse.bytes())
      return protocol_error("lse has " + std::to_string(response.lse().size()) + " bytes");
    reply->lse.resize(static_cast<size_t>(z.lse.rows * call.options.heads));
    std::memcpy(reply->lse.data(), response.lse().data(), response.lse().size());
  }
  reply->received_bytes = static_cast<int64_t>(response.out().size() + response.lse().size());
  return fill_timings(response.summary(), reply);
}

grpc::Status Client::info(v1::GetInfoResponse* info, double deadline_seconds) {
  grpc::ClientContext ctx;
  prepare(&ctx, deadline_seconds);
  return stub_->GetInfo(&ctx, v1::GetInfoRequest{}, info);
}

grpc::Status Client::health(const std::string& service, std::string* status_name, double deadline_seconds) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  set_deadline(&ctx, deadline_seconds);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&ctx, request, &response);
  if (status.ok()) *status_name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  return status;
}

}  // namespace plsh::client
