#include "plsh/client.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/wire.h"

namespace plsh::client {

namespace {

void set_deadline(grpc::ClientContext* ctx, double seconds) {
  if (seconds > 0)
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds)));
}

grpc::Status invalid(const std::string& what) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what); }

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

grpc::Status protocol_error(const std::string& what) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "server broke the plsh.v1 protocol: " + what);
}

struct Sizes {
  int64_t q_rows, kv_rows, q_row_bytes, kv_row_bytes, out_row_bytes, lse_row_bytes;
  DType out_dtype;
};

Sizes sizes_of(const AttentionOptions& o) {
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  const DType out = o.out_dtype.value_or(o.dtype);
  const int64_t batch = std::max<int64_t>(1, o.batch);
  return Sizes{batch * o.q_len,
               batch * o.kv_len,
               o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype)),
               kv_heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype)),
               o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(out)),
               o.heads * static_cast<int64_t>(sizeof(float)),
               out};
}

grpc::Status fill_timings(const v1::Summary& s, AttendReply* reply) {
  reply->timings = ServerTimings{s.timings().queued_seconds(), s.timings().receiving_seconds(),
                                 s.timings().computing_seconds(), s.timings().sending_seconds(),
                                 s.timings().total_seconds()};
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
  static const char* const names[] = {"OK",
                                      "CANCELLED",
                                      "UNKNOWN",
                                      "INVALID_ARGUMENT",
                                      "DEADLINE_EXCEEDED",
                                      "NOT_FOUND",
                                      "ALREADY_EXISTS",
                                      "PERMISSION_DENIED",
                                      "RESOURCE_EXHAUSTED",
                                      "FAILED_PRECONDITION",
                                      "ABORTED",
                                      "OUT_OF_RANGE",
                                      "UNIMPLEMENTED",
                                      "INTERNAL",
                                      "UNAVAILABLE",
                                      "DATA_LOSS",
                                      "UNAUTHENTICATED"};
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
  h.set_batch(o.batch);
  h.set_q_len(o.q_len);
  h.set_kv_len(o.kv_len);
  h.set_heads(o.heads);
  h.set_kv_heads(o.kv_heads);
  h.set_head_dim(o.head_dim);
  h.set_dtype(wire::to_wire(o.dtype));
  if (o.out_dtype) h.set_out_dtype(wire::to_wire(*o.out_dtype));
  if (o.scale) h.set_scale(*o.scale);
  h.set_causal(o.causal);
  for (double s : o.slopes) h.add_slopes(s);
  if (o.q_pos0) h.set_q_pos0(*o.q_pos0);
  h.set_k_pos0(o.k_pos0);
  h.set_mode(wire::to_wire(o.mode));
  h.set_samples(o.samples);
  h.set_seed(o.seed);
  h.set_lsh_algorithm(wire::to_wire(o.lsh_algorithm));
  h.set_sampling(wire::to_wire(o.sampling));
  if (o.target_rel_err > 0) h.set_target_rel_err(o.target_rel_err);
  h.set_window_eps(o.window_eps);
  h.set_window_width(o.window_width);
  h.set_estimates(o.estimates);
  h.set_probe_rows(o.probe_rows);
  h.set_mask_row_budget(o.mask_row_budget);
  h.set_return_draws(o.return_draws);
  h.set_check_finite(o.check_finite);
  h.set_return_lse(call.return_lse);
  h.set_out_chunk_bytes(std::max<int64_t>(0, call.chunk_bytes));
  h.set_backend(call.backend);
  h.set_keep_context(call.keep_context);
  return h;
}

grpc::ChannelArguments default_channel_arguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return args;
}

grpc::Status make_channel(const std::string& target, const ChannelOptions& o, grpc::ChannelArguments args,
                          std::shared_ptr<grpc::Channel>* channel, std::string* token) {
  token->clear();
  if (!o.token.empty() && !o.token_file.empty())
    return invalid("token and token_file are both set, expected one");
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
      return invalid(std::string(o.token.empty() ? "token_file" : "token") + ": byte " + std::to_string(i) +
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

grpc::Status Client::connect(const std::string& target, const ChannelOptions& options, std::unique_ptr<Client>* client) {
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
  const Sizes z = sizes_of(call.options);
  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream = stub_->Attend(&ctx);

  auto note = [reply](const google::protobuf::Message& m) {
    reply->largest_message_bytes = std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(m.ByteSizeLong()));
    ++reply->messages;
  };
  // After a refused write or read the server has closed the stream: what
  // it said is in Finish.
  auto finish = [&stream]() {
    v1::AttendResponse ignored;
    while (stream->Read(&ignored)) {
    }
    return stream->Finish();
  };

  v1::AttendRequest request;
  *request.mutable_header() = make_header(call);
  note(request);
  if (!stream->Write(request)) return finish();

  // The ack says how large a message may be.
  v1::AttendResponse response;
  if (!stream->Read(&response)) return stream->Finish();
  note(response);
  if (!response.has_ack()) {
    ctx.TryCancel();
    stream->Finish();
    return protocol_error("first response is not an ack");
  }
  // The server says the largest payload per chunk. Servers older than that
  // field (0) said it only as out_chunk_bytes: the payload it cut from this
  // call's chunk_bytes, capped by the same limit.
  const v1::Ack& ack = response.ack();
  const int64_t cap = ack.max_chunk_payload_bytes() > 0 ? ack.max_chunk_payload_bytes() : ack.out_chunk_bytes();
  const int64_t payload = call.chunk_bytes > 0 ? std::min(call.chunk_bytes, cap) : cap;

  bool writing = true;
  const struct {
    v1::Tensor tensor;
    const void* data;
    int64_t rows, row_bytes;
  } inputs[] = {{v1::TENSOR_Q, call.q, z.q_rows, z.q_row_bytes},
                {v1::TENSOR_K, call.k, z.kv_rows, z.kv_row_bytes},
                {v1::TENSOR_V, call.v, z.kv_rows, z.kv_row_bytes}};
  for (const auto& in : inputs) {
    const int64_t per_chunk = std::max<int64_t>(1, payload / std::max<int64_t>(1, in.row_bytes));
    for (int64_t row = 0; writing && row < in.rows; row += per_chunk) {
      const int64_t rows = std::min(per_chunk, in.rows - row);
      request.Clear();
      v1::TensorChunk* c = request.mutable_chunk();
      c->set_tensor(in.tensor);
      c->set_row_start(row);
      c->set_row_count(rows);
      c->set_data(static_cast<const char*>(in.data) + row * in.row_bytes, static_cast<size_t>(rows * in.row_bytes));
      note(request);
      reply->sent_bytes += rows * in.row_bytes;
      writing = stream->Write(request);
    }
  }
  if (writing) {
    request.Clear();
    request.mutable_end();
    note(request);
    writing = stream->Write(request);
  }
  if (writing) stream->WritesDone();

  reply->out.assign(static_cast<size_t>(z.q_rows * z.out_row_bytes), 0);
  if (call.return_lse) reply->lse.assign(static_cast<size_t>(z.q_rows * call.options.heads), 0.0f);
  int64_t out_rows = 0, lse_rows = 0;
  bool have_summary = false;
  v1::Summary summary;
  while (stream->Read(&response)) {
    note(response);
    if (response.has_out_chunk()) {
      const v1::OutputChunk& c = response.out_chunk();
      const bool is_lse = c.tensor() == v1::TENSOR_LSE;
      if (!is_lse && c.tensor() != v1::TENSOR_OUT) return protocol_error("output chunk of tensor " + std::to_string(c.tensor()));
      if (is_lse && !call.return_lse) return protocol_error("lse chunk not asked for");
      const int64_t row_bytes = is_lse ? z.lse_row_bytes : z.out_row_bytes;
      int64_t& next = is_lse ? lse_rows : out_rows;
      // In row order, each row once: the server's contract.
      if (c.row_start() != next || c.row_count() < 1 || c.row_count() > z.q_rows - next ||
          static_cast<int64_t>(c.data().size()) != c.row_count() * row_bytes)
        return protocol_error("output chunk rows [" + std::to_string(c.row_start()) + ", +" +
                              std::to_string(c.row_count()) + ") with " + std::to_string(c.data().size()) + " bytes");
      uint8_t* dst = is_lse ? reinterpret_cast<uint8_t*>(reply->lse.data()) : reply->out.data();
      std::memcpy(dst + c.row_start() * row_bytes, c.data().data(), c.data().size());
      next += c.row_count();
      reply->received_bytes += static_cast<int64_t>(c.data().size());
    } else if (response.has_summary()) {
      summary = response.summary();
      have_summary = true;
    } else {
      return protocol_error("unexpected message after the ack");
    }
  }
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return status;
  if (!have_summary) return protocol_error("stream ended OK without a summary");
  if (out_rows != z.q_rows || (call.return_lse && lse_rows != z.q_rows))
    return protocol_error("output rows missing: " + std::to_string(out_rows) + " of " + std::to_string(z.q_rows));
  return fill_timings(summary, reply);
}

grpc::Status Client::attend_unary(const AttendCall& call, AttendReply* reply) {
  *reply = AttendReply{};
  const Sizes z = sizes_of(call.options);
  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  v1::AttendUnaryRequest request;
  *request.mutable_header() = make_header(call);
  request.set_q(call.q, static_cast<size_t>(z.q_rows * z.q_row_bytes));
  request.set_k(call.k, static_cast<size_t>(z.kv_rows * z.kv_row_bytes));
  request.set_v(call.v, static_cast<size_t>(z.kv_rows * z.kv_row_bytes));
  reply->sent_bytes = static_cast<int64_t>(request.q().size() + request.k().size() + request.v().size());
  reply->largest_message_bytes = static_cast<int64_t>(request.ByteSizeLong());
  v1::AttendUnaryResponse response;
  const grpc::Status status = stub_->AttendUnary(&ctx, request, &response);
  if (!status.ok()) return status;
  reply->messages = 2;
  reply->largest_message_bytes = std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(response.ByteSizeLong()));
  if (static_cast<int64_t>(response.out().size()) != z.q_rows * z.out_row_bytes)
    return protocol_error("out has " + std::to_string(response.out().size()) + " bytes");
  reply->out.assign(response.out().begin(), response.out().end());
  if (call.return_lse) {
    if (static_cast<int64_t>(response.lse().size()) != z.q_rows * z.lse_row_bytes)
      return protocol_error("lse has " + std::to_string(response.lse().size()) + " bytes");
    reply->lse.resize(static_cast<size_t>(z.q_rows * call.options.heads));
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
