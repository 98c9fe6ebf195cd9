#include "chunk_stream.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "proto/chunk_codec.h"

namespace plsh::client {

grpc::Status protocol_error(const std::string& what) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "server broke the plsh.v1 protocol: " + what);
}

grpc::ByteBuffer serialize_message(const google::protobuf::Message& message) {
  // A header or an end: small, so one copy through a string costs nothing.
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Counts the chunk slices gRPC still holds that point at the caller's
// tensors; run() waits for none before it returns, so the caller may free
// them then.
struct ChunkStream::Lent {
  void* lend() {
    std::lock_guard<std::mutex> lock(mu);
    ++count;
    return this;
  }
  static void give_back(void* arg) {
    auto* self = static_cast<Lent*>(arg);
    std::lock_guard<std::mutex> lock(self->mu);
    if (--self->count == 0) self->none.notify_all();
  }
  void wait_for_none() {
    std::unique_lock<std::mutex> lock(mu);
    none.wait(lock, [this] { return count == 0; });
  }
  std::mutex mu;
  std::condition_variable none;
  int64_t count = 0;
};

namespace {

// The events of the call on its completion queue.
enum Event : intptr_t { kStarted = 1, kWritten, kRead, kWritesDone, kFinished };
void* tag(Event e) { return reinterpret_cast<void*>(static_cast<intptr_t>(e)); }

// The next event; false once the queue is shut down.
bool next(grpc::CompletionQueue* cq, Event* event, bool* ok) {
  void* t = nullptr;
  if (!cq->Next(&t, ok)) return false;
  *event = static_cast<Event>(reinterpret_cast<intptr_t>(t));
  return true;
}

}  // namespace

ChunkStream::ChunkStream(std::shared_ptr<grpc::Channel> channel, const char* method, int64_t chunk_bytes)
    : channel_(std::move(channel)), method_(method), chunk_bytes_(chunk_bytes) {}

grpc::Status ChunkStream::run(grpc::ClientContext* ctx, const grpc::ByteBuffer& header, std::vector<Input> inputs,
                              std::vector<Output>* outputs, const Reader& reader) {
  inputs_ = std::move(inputs);
  outputs_ = outputs;
  Lent lent;
  grpc::Status status;
  {
    grpc::CompletionQueue cq;
    status = stream(ctx, &cq, &lent, header, reader);
    call_.reset();
    cq.Shutdown();
    void* t = nullptr;
    bool ok = false;
    while (cq.Next(&t, &ok)) {
    }
  }
  lent.wait_for_none();  // the call is gone: gRPC drops what it still held of the inputs
  return status;
}

grpc::Status ChunkStream::ack(const v1::Ack& ack) {
  const int64_t cap = ack.max_chunk_payload_bytes() > 0 ? ack.max_chunk_payload_bytes() : ack.out_chunk_bytes();
  if (cap < 1) return protocol_error("the ack allows no payload");
  payload_ = chunk_bytes_ > 0 ? std::min(chunk_bytes_, cap) : cap;
  return grpc::Status::OK;
}

grpc::Status ChunkStream::output(const v1::OutputChunk& c) {
  return take(c.tensor(), c.row_start(), c.row_count(), c.data().size(),
              [&c](uint8_t* dst) { std::copy(c.data().begin(), c.data().end(), dst); });
}

grpc::Status ChunkStream::take(int tensor, int64_t row_start, int64_t row_count, size_t bytes,
                               const std::function<void(uint8_t*)>& copy_to) {
  Output* out = nullptr;
  for (Output& o : *outputs_)
    if (o.tensor == tensor) out = &o;
  if (out == nullptr)
    return protocol_error("an output chunk of " + v1::Tensor_Name(static_cast<v1::Tensor>(tensor)) +
                          ", which this call does not take");
  // In row order, each row once: the server's contract.
  if (row_start != out->rows_received || row_count < 1 || row_count > out->shape.rows - out->rows_received ||
      static_cast<int64_t>(bytes) != row_count * out->shape.row_bytes)
    return protocol_error(v1::Tensor_Name(out->tensor) + " chunk rows [" + std::to_string(row_start) + ", +" +
                          std::to_string(row_count) + ") with " + std::to_string(bytes) + " bytes");
  copy_to(static_cast<uint8_t*>(out->data) + row_start * out->shape.row_bytes);
  out->rows_received += row_count;
  traffic_.received_bytes += static_cast<int64_t>(bytes);
  return grpc::Status::OK;
}

void ChunkStream::write_next(Lent* lent) {
  if (write_pending_ || failed_write_ || !acked() || writes_done_) return;
  while (input_ < inputs_.size() && next_row_ >= inputs_[input_].shape.rows) {
    ++input_;
    next_row_ = 0;
  }
  if (input_ < inputs_.size()) {
    const Input& in = inputs_[input_];
    const int64_t per_chunk = std::max<int64_t>(1, payload_ / std::max<int64_t>(1, in.shape.row_bytes));
    const int64_t rows = std::min(per_chunk, in.shape.rows - next_row_);
    const size_t bytes = static_cast<size_t>(rows * in.shape.row_bytes);
    out_message_ = wire::encode_chunk(in.tensor, next_row_, rows,
                                      static_cast<const uint8_t*>(in.data) + next_row_ * in.shape.row_bytes, bytes,
                                      Lent::give_back, lent->lend());
    traffic_.sent_bytes += static_cast<int64_t>(bytes);
    next_row_ += rows;
  } else if (!end_sent_) {
    // AttendRequest.end and BackwardRequest.end: field 3, an empty message.
    static const char kEnd[] = {0x1a, 0x00};
    grpc::Slice slice(kEnd, sizeof kEnd);
    out_message_ = grpc::ByteBuffer(&slice, 1);
    end_sent_ = true;
  } else {
    writes_done_ = true;
    write_pending_ = true;
    call_->WritesDone(tag(kWritesDone));
    return;
  }
  ++traffic_.messages;
  traffic_.largest_message_bytes = std::max<int64_t>(traffic_.largest_message_bytes, out_message_.Length());
  write_pending_ = true;
  call_->Write(out_message_, tag(kWritten));
}

grpc::Status ChunkStream::stream(grpc::ClientContext* ctx, grpc::CompletionQueue* cq, Lent* lent,
                                 const grpc::ByteBuffer& header, const Reader& reader) {
  grpc::GenericStub generic(channel_);
  call_ = generic.PrepareCall(ctx, method_, cq);
  // Ends the call: waits for the outstanding operations, then Finish.
  auto finish = [&](grpc::Status* status) {
    call_->Finish(status, tag(kFinished));
    Event e{};
    bool ok = false;
    while (next(cq, &e, &ok) && e != kFinished) {
    }
  };
  call_->StartCall(tag(kStarted));
  {
    Event e{};
    bool ok = false;
    if (!next(cq, &e, &ok) || !ok) {
      grpc::Status status;
      finish(&status);
      return status;
    }
  }
  // The header, and the read of the ack that says how large a chunk may be.
  out_message_ = header;
  ++traffic_.messages;
  traffic_.largest_message_bytes = std::max<int64_t>(traffic_.largest_message_bytes, out_message_.Length());
  write_pending_ = true;
  call_->Write(out_message_, tag(kWritten));
  grpc::ByteBuffer in_message;
  bool read_pending = true;
  call_->Read(&in_message, tag(kRead));

  grpc::Status protocol;  // set on a broken protocol: the call is cancelled
  wire::ChunkReader chunk;
  // One message from the server. Output chunks are copied once, from
  // gRPC's slices to their rows.
  auto on_message = [&]() -> grpc::Status {
    ++traffic_.messages;
    traffic_.largest_message_bytes = std::max<int64_t>(traffic_.largest_message_bytes, in_message.Length());
    if (acked() && chunk.read(in_message)) {
      const grpc::Status taken = take(chunk.tensor(), chunk.row_start(), chunk.row_count(), chunk.data_bytes(),
                                      [&chunk](uint8_t* dst) { chunk.copy_data(dst); });
      chunk.clear();
      return taken;
    }
    const bool was_acked = acked();
    grpc::Status read = reader(&in_message, *this);
    if (read.ok() && !was_acked && !acked()) read = protocol_error("first response is not an ack");
    return read;
  };

  // The loop: one write and one read outstanding at a time, each restarted
  // as it completes, until the server closes the stream.
  bool reading = true;
  while (write_pending_ || read_pending) {
    Event e{};
    bool ok = false;
    if (!next(cq, &e, &ok)) break;
    if (e == kWritten || e == kWritesDone) {
      write_pending_ = false;
      out_message_.Clear();
      if (!ok)
        failed_write_ = true;  // the server closed the stream: its status says why
      else if (reading && protocol.ok())
        write_next(lent);
    } else if (e == kRead) {
      read_pending = false;
      if (!ok) {
        reading = false;  // the stream is closed: the status follows
        continue;
      }
      protocol = on_message();
      in_message.Clear();
      if (!protocol.ok()) {
        ctx->TryCancel();
        reading = false;
        continue;
      }
      call_->Read(&in_message, tag(kRead));
      read_pending = true;
      write_next(lent);
    }
  }
  grpc::Status status;
  finish(&status);
  if (!protocol.ok()) return protocol;
  if (!status.ok()) return status;
  for (const Output& o : *outputs_)
    if (o.rows_received != o.shape.rows)
      return protocol_error(v1::Tensor_Name(o.tensor) + " rows missing: " + std::to_string(o.rows_received) + " of " +
                            std::to_string(o.shape.rows));
  return grpc::Status::OK;
}

}  // namespace plsh::client
