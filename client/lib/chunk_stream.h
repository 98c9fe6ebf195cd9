// The client's one stream engine, for both streamed calls (Attend and
// AttendBackward share one message shape: proto/chunk_codec.h). A call runs
// on its own completion queue, driven by the calling thread (no hand-off to
// another thread per message), with one write and one read outstanding:
//   the header; once the ack says how large a chunk may be, the inputs in
//   order, each chunk a slice of the caller's memory (no copy; run() returns
//   only once gRPC has let go of them all); the end; WritesDone.
//   Output chunks are read from gRPC's slices and copied once into their
//   rows, in row order and each row once (the server's contract; anything
//   else is a protocol error and the call is cancelled).
// What is not a chunk the slice reader takes (the ack, the summary, a chunk
// in an encoding left to protobuf) goes to the call's Reader, which parses
// its own response type and hands the parts back (ack(), output()).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plsh/shape.h"
#include "plsh/v1/plsh.pb.h"

namespace plsh::client {

class ChunkStream {
 public:
  struct Input {
    v1::Tensor tensor;
    const void* data;  // shape.bytes(), the caller's, until run() returns
    TensorShape shape;
  };
  struct Output {
    v1::Tensor tensor;
    void* data;  // shape.bytes()
    TensorShape shape;
    int64_t rows_received = 0;
  };
  // What crossed the wire, for the reply.
  struct Traffic {
    int64_t sent_bytes = 0, received_bytes = 0;  // tensor payload
    int64_t messages = 0, largest_message_bytes = 0;
    void copy_to(int64_t* sent, int64_t* received, int64_t* messages_out, int64_t* largest) const {
      *sent = sent_bytes;
      *received = received_bytes;
      *messages_out = messages;
      *largest = largest_message_bytes;
    }
  };
  // Reads one message that is not a fast-path chunk: calls ack() for the
  // ack, output() for a parsed chunk, keeps the summary itself. A non-OK
  // status (a protocol error) cancels the call.
  using Reader = std::function<grpc::Status(grpc::ByteBuffer* message, ChunkStream& stream)>;

  // method: "/plsh.v1.Attention/Attend". chunk_bytes: the largest payload
  // the caller wants per input chunk (0: what the ack allows).
  ChunkStream(std::shared_ptr<grpc::Channel> channel, const char* method, int64_t chunk_bytes);

  // The whole call. outputs: every tensor the server may send; each must
  // arrive whole. The status is the server's, a protocol error's, or OK.
  grpc::Status run(grpc::ClientContext* ctx, const grpc::ByteBuffer& header, std::vector<Input> inputs,
                   std::vector<Output>* outputs, const Reader& reader);

  // For the Reader.
  // The ack's payload cap (max_chunk_payload_bytes, or out_chunk_bytes from
  // servers before that field): inputs may go from now on.
  grpc::Status ack(const v1::Ack& ack);
  bool acked() const { return payload_ > 0; }
  // A parsed output chunk, into its rows.
  grpc::Status output(const v1::OutputChunk& chunk);

  const Traffic& traffic() const { return traffic_; }

 private:
  struct Lent;
  grpc::Status take(int tensor, int64_t row_start, int64_t row_count, size_t bytes,
                    const std::function<void(uint8_t*)>& copy_to);
  grpc::Status stream(grpc::ClientContext* ctx, grpc::CompletionQueue* cq, Lent* lent, const grpc::ByteBuffer& header,
                      const Reader& reader);
  // The next write due, if any: a chunk, the end, then WritesDone.
  void write_next(Lent* lent);

  std::shared_ptr<grpc::Channel> channel_;
  const char* method_;
  const int64_t chunk_bytes_;
  std::vector<Input> inputs_;
  std::vector<Output>* outputs_ = nullptr;
  int64_t payload_ = 0;
  Traffic traffic_;

  // The stream's state while it runs.
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  grpc::ByteBuffer out_message_;
  size_t input_ = 0;
  int64_t next_row_ = 0;
  bool write_pending_ = false, end_sent_ = false, writes_done_ = false, failed_write_ = false;
};

// "server broke the plsh.v1 protocol: ..." (INTERNAL).
grpc::Status protocol_error(const std::string& what);
// A message (a header) as the raw call sends it.
grpc::ByteBuffer serialize_message(const google::protobuf::Message& message);

// The Reader of an RPC whose server sends one ack, then chunks, then one
// Summary, each in a Response (`type` names it in errors): `chunk(r)`
// gives the message's chunk or null; the summary goes to *summary.
template <typename Response, typename Summary, typename ChunkOf>
ChunkStream::Reader response_reader(const char* type, std::optional<Summary>* summary, ChunkOf chunk) {
  return [type, summary, chunk](grpc::ByteBuffer* m, ChunkStream& s) {
    Response response;
    if (!grpc::SerializationTraits<Response>::Deserialize(m, &response).ok())
      return protocol_error(std::string("a message that is not ") + type);
    if (response.has_ack()) return s.acked() ? protocol_error("a second ack") : s.ack(response.ack());
    if (!s.acked()) return protocol_error("first response is not an ack");
    if (const auto* c = chunk(response)) return s.output(*c);  // an encoding the slice reader leaves
    if (!response.has_summary()) return protocol_error("unexpected message after the ack");
    *summary = std::move(*response.mutable_summary());
    return grpc::Status::OK;
  };
}

}  // namespace plsh::client
