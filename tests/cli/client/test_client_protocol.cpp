// The C++ client library (client/lib) against a scripted plsh.v1 server in
// this process: what it puts on the wire. It cuts input chunks by the ack's
// max_chunk_payload_bytes (the server's one word on message headroom), falls
// back to the ack's out_chunk_bytes for servers older than that field, and
// reads the resolved defaults from the summary. Linked with plsh_client
// alone: the binary is also the evidence that a client needs no maths
// library (tests/cli/CMakeLists.txt checks it with ldd).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plsh/client.h"

namespace plsh::client {
namespace {

struct Seen {
  v1::Tensor tensor;
  int64_t row_start, row_count, bytes;
};

// Acks with the given limits, records the chunks, answers zeros and a summary.
class Scripted final : public v1::Attention::Service {
 public:
  v1::Ack ack;
  std::mutex mu;
  v1::AttendHeader header;
  std::vector<Seen> chunks;

  grpc::Status Attend(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream) override {
    v1::AttendRequest request;
    if (!stream->Read(&request) || !request.has_header()) return {grpc::StatusCode::INVALID_ARGUMENT, "header first"};
    const v1::AttendHeader h = request.header();
    v1::AttendResponse response;
    *response.mutable_ack() = ack;
    stream->Write(response);
    while (stream->Read(&request) && !request.has_end()) {
      const v1::TensorChunk& c = request.chunk();
      std::lock_guard<std::mutex> lock(mu);
      chunks.push_back({c.tensor(), c.row_start(), c.row_count(), static_cast<int64_t>(c.data().size())});
    }
    const int64_t rows = h.batch() * h.q_len();
    response.Clear();
    v1::OutputChunk* out = response.mutable_out_chunk();
    out->set_tensor(v1::TENSOR_OUT);
    out->set_row_start(0);
    out->set_row_count(rows);
    out->set_data(std::string(static_cast<size_t>(rows * h.heads() * h.head_dim() * 4), '\0'));
    stream->Write(response);
    response.Clear();
    v1::Summary* s = response.mutable_summary();
    s->set_request_id("scripted");
    s->set_mode(v1::MODE_LSH);
    s->set_out_dtype(v1::DTYPE_F32);
    s->set_scale(0.25);
    s->set_q_pos0(7);
    s->set_k_pos0(3);
    stream->Write(response);
    std::lock_guard<std::mutex> lock(mu);
    header = h;
    return grpc::Status::OK;
  }
};

struct Running {
  Scripted service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  Running() {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~Running() { server->Shutdown(); }
};

// q [1, 40, 2, 16] and k, v [1, 50, 2, 16] float32: 128-byte rows.
struct Request {
  std::vector<float> q = std::vector<float>(40 * 2 * 16, 0.5f), kv = std::vector<float>(50 * 2 * 16, 0.25f);
  AttendCall call;
  Request() {
    call.options.q_len = 40;
    call.options.kv_len = 50;
    call.options.heads = 2;
    call.options.head_dim = 16;
    call.q = q.data();
    call.k = call.v = kv.data();
  }
};

// Every input row once, in chunks of `rows_per_chunk` rows (the last less).
void expect_chunks(const std::vector<Seen>& seen, int64_t rows_per_chunk) {
  ASSERT_FALSE(seen.empty());
  for (const auto& [tensor, rows] :
       {std::pair{v1::TENSOR_Q, int64_t{40}}, {v1::TENSOR_K, int64_t{50}}, {v1::TENSOR_V, int64_t{50}}}) {
    std::vector<std::pair<int64_t, int64_t>> got, want;
    for (const Seen& s : seen)
      if (s.tensor == tensor) got.emplace_back(s.row_start, s.row_count);
    for (int64_t r = 0; r < rows; r += rows_per_chunk) want.emplace_back(r, std::min(rows_per_chunk, rows - r));
    EXPECT_EQ(got, want) << "tensor " << tensor;
  }
}

TEST(ClientProtocol, ChunksFollowTheAcksPayloadCapNotTheMessageSize) {
  Running s;
  s.service.ack.set_max_message_bytes(4 << 20);
  s.service.ack.set_max_chunk_payload_bytes(1000);  // far below: a client using the message size would send more
  s.service.ack.set_out_chunk_bytes(4 << 20);
  Request r;
  AttendReply reply;
  const grpc::Status status = Client(s.address).attend(r.call, &reply);
  ASSERT_TRUE(status.ok()) << status_string(status);
  expect_chunks(s.service.chunks, 1000 / 128);
  for (const Seen& c : s.service.chunks) EXPECT_LE(c.bytes, 1000);
  // The defaults as the server resolved them.
  EXPECT_EQ(reply.result.scale, 0.25);
  EXPECT_EQ(reply.result.q_pos0, 7);
  EXPECT_EQ(reply.result.k_pos0, 3);

  // A smaller chunk_bytes of the caller's own wins.
  s.service.chunks.clear();
  r.call.chunk_bytes = 300;
  ASSERT_TRUE(Client(s.address).attend(r.call, &reply).ok());
  expect_chunks(s.service.chunks, 2);
}

TEST(ClientProtocol, ServersBeforeThePayloadFieldAreReadByTheirOutChunkBytes) {
  Running s;
  s.service.ack.set_max_message_bytes(4 << 20);
  s.service.ack.set_out_chunk_bytes(600);  // what such a server cut from chunk_bytes = 600
  Request r;
  r.call.chunk_bytes = 600;
  AttendReply reply;
  const grpc::Status status = Client(s.address).attend(r.call, &reply);
  ASSERT_TRUE(status.ok()) << status_string(status);
  expect_chunks(s.service.chunks, 600 / 128);
}

}  // namespace
}  // namespace plsh::client
