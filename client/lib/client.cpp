#include "plsh/client.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/generic/generic_stub.h>

#include <condition_variable>
#include <functional>
#include <mutex>

#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/chunk_codec.h"
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
  wire::options_to_header(o, &h);
  h.set_return_lse(call.return_lse || call.lse_shm.set());
  h.set_out_chunk_bytes(std::max<int64_t>(0, call.chunk_bytes));
  h.set_backend(call.backend);
  // Tensors in shared memory: their place and exact size.
  const Sizes z = sizes_of(o);
  const struct {
    const SharedTensor& tensor;
    v1::SharedMemoryRef* (v1::AttendHeader::*field)();
    int64_t bytes;
  } shared[] = {{call.q_shm, &v1::AttendHeader::mutable_q_shm, z.q_rows * z.q_row_bytes},
                {call.k_shm, &v1::AttendHeader::mutable_k_shm, z.kv_rows * z.kv_row_bytes},
                {call.v_shm, &v1::AttendHeader::mutable_v_shm, z.kv_rows * z.kv_row_bytes},
                {call.out_shm, &v1::AttendHeader::mutable_out_shm, z.q_rows * z.out_row_bytes},
                {call.lse_shm, &v1::AttendHeader::mutable_lse_shm, z.q_rows * z.lse_row_bytes}};
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

namespace {

// Counts the chunk slices gRPC still holds that point at the caller's
// tensors; attend() waits for none before it returns, so the caller may free
// them then.
class LentSlices {
 public:
  void* lend() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
    return this;
  }
  static void give_back(void* arg) {
    auto* self = static_cast<LentSlices*>(arg);
    std::lock_guard<std::mutex> lock(self->mu_);
    if (--self->count_ == 0) self->none_.notify_all();
  }
  void wait_for_none() {
    std::unique_lock<std::mutex> lock(mu_);
    none_.wait(lock, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable none_;
  int64_t count_ = 0;
};

grpc::ByteBuffer serialize(const google::protobuf::Message& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  grpc::SerializationTraits<v1::AttendRequest>::Serialize(message, &buffer, &own);
  return buffer;
}

// The events of one streamed call on its own completion queue, driven by
// the calling thread (no hand-off to another thread per message).
enum Event : intptr_t { kStarted = 1, kWritten, kRead, kWritesDone, kFinished };

}  // namespace

grpc::Status Client::attend(const AttendCall& call, AttendReply* reply) {
  *reply = AttendReply{};
  LentSlices lent;
  grpc::Status status;
  {
    grpc::ClientContext ctx;
    prepare(&ctx, call.deadline_seconds);
    grpc::CompletionQueue cq;
    status = stream_attend(call, reply, &ctx, &cq, &lent);
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
  }
  lent.wait_for_none();  // the call is gone: gRPC drops what it still held of q, k, v
  return status;
}

grpc::Status Client::stream_attend(const AttendCall& call, AttendReply* reply, grpc::ClientContext* ctx,
                                   grpc::CompletionQueue* cq, void* lent_slices) {
  LentSlices& lent = *static_cast<LentSlices*>(lent_slices);
  const Sizes z = sizes_of(call.options);
  const bool return_lse = call.return_lse || call.lse_shm.set();
  grpc::GenericStub generic(channel_);
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream =
      generic.PrepareCall(ctx, "/plsh.v1.Attention/Attend", cq);

  // Waits for the next event; false once the queue is shut down.
  auto next = [cq](Event* event, bool* ok) {
    void* tag = nullptr;
    if (!cq->Next(&tag, ok)) return false;
    *event = static_cast<Event>(reinterpret_cast<intptr_t>(tag));
    return true;
  };
  auto tag = [](Event e) { return reinterpret_cast<void*>(static_cast<intptr_t>(e)); };
  auto note = [reply](size_t bytes) {
    reply->largest_message_bytes = std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(bytes));
    ++reply->messages;
  };

  // Ends the call: waits for the outstanding operations, then Finish.
  bool write_pending = false, read_pending = false;
  auto finish = [&](grpc::Status* status) {
    stream->Finish(status, tag(kFinished));
    Event e{};
    bool ok = false;
    while (next(&e, &ok) && e != kFinished) {
    }
  };
  stream->StartCall(tag(kStarted));
  {
    Event e{};
    bool ok = false;
    if (!next(&e, &ok) || !ok) {
      grpc::Status status;
      finish(&status);
      return status;
    }
  }

  // The header, and the ack that says how large a chunk may be.
  v1::AttendRequest header_message;
  *header_message.mutable_header() = make_header(call);
  grpc::ByteBuffer out_message = serialize(header_message);
  note(out_message.Length());
  stream->Write(out_message, tag(kWritten));
  write_pending = true;
  grpc::ByteBuffer in_message;
  stream->Read(&in_message, tag(kRead));
  read_pending = true;

  // The inputs to send, as (tensor, data, rows, row bytes), in order.
  struct Input {
    v1::Tensor tensor;
    const uint8_t* data;
    int64_t rows, row_bytes;
  };
  std::vector<Input> inputs;
  if (!call.q_shm.set()) inputs.push_back({v1::TENSOR_Q, static_cast<const uint8_t*>(call.q), z.q_rows, z.q_row_bytes});
  if (!call.k_shm.set()) inputs.push_back({v1::TENSOR_K, static_cast<const uint8_t*>(call.k), z.kv_rows, z.kv_row_bytes});
  if (!call.v_shm.set()) inputs.push_back({v1::TENSOR_V, static_cast<const uint8_t*>(call.v), z.kv_rows, z.kv_row_bytes});
  size_t input = 0;
  int64_t next_row = 0, payload = 0;
  bool acked = false, end_sent = false, writes_done = false, failed_write = false;

  // Where the output goes.
  const bool out_streamed = !call.out_shm.set();
  const bool lse_streamed = return_lse && !call.lse_shm.set();
  uint8_t* out_dst = static_cast<uint8_t*>(call.out);
  if (out_streamed && out_dst == nullptr) {
    reply->out.resize(static_cast<size_t>(z.q_rows * z.out_row_bytes));
    out_dst = reply->out.data();
  }
  uint8_t* lse_dst = reinterpret_cast<uint8_t*>(call.lse);
  if (lse_streamed && lse_dst == nullptr) {
    reply->lse.resize(static_cast<size_t>(z.q_rows * call.options.heads));
    lse_dst = reinterpret_cast<uint8_t*>(reply->lse.data());
  }
  int64_t out_rows = 0, lse_rows = 0;
  bool have_summary = false;
  v1::Summary summary;
  grpc::Status protocol;  // set on a broken protocol: the call is cancelled
  wire::ChunkReader chunk;

  // Starts the next write, if one is due: a chunk, the end, then WritesDone.
  auto write_next = [&]() {
    if (write_pending || failed_write || !acked || writes_done) return;
    while (input < inputs.size() && next_row >= inputs[input].rows) {
      ++input;
      next_row = 0;
    }
    if (input < inputs.size()) {
      const Input& in = inputs[input];
      const int64_t per_chunk = std::max<int64_t>(1, payload / std::max<int64_t>(1, in.row_bytes));
      const int64_t rows = std::min(per_chunk, in.rows - next_row);
      const size_t bytes = static_cast<size_t>(rows * in.row_bytes);
      out_message = wire::encode_chunk(in.tensor, next_row, rows, in.data + next_row * in.row_bytes, bytes,
                                       LentSlices::give_back, lent.lend());
      note(out_message.Length());
      reply->sent_bytes += static_cast<int64_t>(bytes);
      next_row += rows;
      stream->Write(out_message, tag(kWritten));
    } else if (!end_sent) {
      v1::AttendRequest end;
      end.mutable_end();
      out_message = serialize(end);
      note(out_message.Length());
      end_sent = true;
      stream->Write(out_message, tag(kWritten));
    } else {
      writes_done = true;
      stream->WritesDone(tag(kWritesDone));
    }
    write_pending = true;
  };

  // An output chunk: checked, then copied by copy_to(dst). False when it
  // breaks the protocol.
  auto take_chunk = [&](int tensor, int64_t row_start, int64_t row_count, size_t bytes,
                        const std::function<void(uint8_t*)>& copy_to) -> bool {
    const bool is_lse = tensor == v1::TENSOR_LSE;
    if (!is_lse && tensor != v1::TENSOR_OUT) {
      protocol = protocol_error("output chunk of tensor " + std::to_string(tensor));
      return false;
    }
    if (is_lse ? !lse_streamed : !out_streamed) {
      protocol = protocol_error(std::string(is_lse ? "lse" : "out") + " chunk not asked for");
      return false;
    }
    const int64_t row_bytes = is_lse ? z.lse_row_bytes : z.out_row_bytes;
    int64_t& next_out = is_lse ? lse_rows : out_rows;
    // In row order, each row once: the server's contract.
    if (row_start != next_out || row_count < 1 || row_count > z.q_rows - next_out ||
        static_cast<int64_t>(bytes) != row_count * row_bytes) {
      protocol = protocol_error("output chunk rows [" + std::to_string(row_start) + ", +" + std::to_string(row_count) +
                                ") with " + std::to_string(bytes) + " bytes");
      return false;
    }
    copy_to((is_lse ? lse_dst : out_dst) + row_start * row_bytes);
    next_out += row_count;
    reply->received_bytes += static_cast<int64_t>(bytes);
    return true;
  };

  // One message from the server: false when it breaks the protocol. Output
  // chunks are copied once, from gRPC's slices to their rows.
  auto on_message = [&]() -> bool {
    note(in_message.Length());
    if (acked && chunk.read(in_message)) {
      const bool fine = take_chunk(chunk.tensor(), chunk.row_start(), chunk.row_count(), chunk.data_bytes(),
                                   [&chunk](uint8_t* dst) { chunk.copy_data(dst); });
      chunk.clear();
      return fine;
    }
    v1::AttendResponse response;
    if (!grpc::SerializationTraits<v1::AttendResponse>::Deserialize(&in_message, &response).ok()) {
      protocol = protocol_error("a message that is not an AttendResponse");
      return false;
    }
    if (!acked) {
      if (!response.has_ack()) {
        protocol = protocol_error("first response is not an ack");
        return false;
      }
      // The server says the largest payload per chunk. Servers older than
      // that field (0) said it only as out_chunk_bytes: the payload it cut
      // from this call's chunk_bytes, capped by the same limit.
      const v1::Ack& ack = response.ack();
      const int64_t cap = ack.max_chunk_payload_bytes() > 0 ? ack.max_chunk_payload_bytes() : ack.out_chunk_bytes();
      payload = call.chunk_bytes > 0 ? std::min(call.chunk_bytes, cap) : cap;
      acked = true;
      return true;
    }
    if (response.has_out_chunk()) {  // an encoding the slice reader leaves to protobuf
      const v1::OutputChunk& c = response.out_chunk();
      return take_chunk(c.tensor(), c.row_start(), c.row_count(), c.data().size(),
                        [&c](uint8_t* dst) { std::memcpy(dst, c.data().data(), c.data().size()); });
    }
    if (response.has_summary()) {
      summary = std::move(*response.mutable_summary());
      have_summary = true;
      return true;
    }
    protocol = protocol_error("unexpected message after the ack");
    return false;
  };

  // The loop: one write and one read outstanding at a time, each
  // restarted as it completes, until the server closes the stream.
  bool reading = true;
  while (write_pending || read_pending) {
    Event e{};
    bool ok = false;
    if (!next(&e, &ok)) break;
    if (e == kWritten || e == kWritesDone) {
      write_pending = false;
      out_message.Clear();
      if (!ok) failed_write = true;  // the server closed the stream: its status says why
      else if (reading && protocol.ok()) write_next();
    } else if (e == kRead) {
      read_pending = false;
      if (!ok) {
        reading = false;  // the stream is closed: the status follows
        continue;
      }
      const bool fine = on_message();
      in_message.Clear();
      if (!fine) {
        ctx->TryCancel();
        reading = false;
        continue;
      }
      stream->Read(&in_message, tag(kRead));
      read_pending = true;
      write_next();
    }
  }
  grpc::Status status;
  finish(&status);
  if (!protocol.ok()) return protocol;
  if (!status.ok()) return status;
  if (!have_summary) return protocol_error("stream ended OK without a summary");
  if ((out_streamed && out_rows != z.q_rows) || (lse_streamed && lse_rows != z.q_rows))
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
  // Tensors in shared memory are named in the header, not sent.
  if (!call.q_shm.set()) request.set_q(call.q, static_cast<size_t>(z.q_rows * z.q_row_bytes));
  if (!call.k_shm.set()) request.set_k(call.k, static_cast<size_t>(z.kv_rows * z.kv_row_bytes));
  if (!call.v_shm.set()) request.set_v(call.v, static_cast<size_t>(z.kv_rows * z.kv_row_bytes));
  reply->sent_bytes = static_cast<int64_t>(request.q().size() + request.k().size() + request.v().size());
  reply->largest_message_bytes = static_cast<int64_t>(request.ByteSizeLong());
  v1::AttendUnaryResponse response;
  const grpc::Status status = stub_->AttendUnary(&ctx, request, &response);
  if (!status.ok()) return status;
  reply->messages = 2;
  reply->largest_message_bytes = std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(response.ByteSizeLong()));
  const bool out_streamed = !call.out_shm.set();
  const bool lse_streamed = call.return_lse && !call.lse_shm.set();
  if (static_cast<int64_t>(response.out().size()) != (out_streamed ? z.q_rows * z.out_row_bytes : 0))
    return protocol_error("out has " + std::to_string(response.out().size()) + " bytes");
  reply->out.assign(response.out().begin(), response.out().end());
  if (lse_streamed) {
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
