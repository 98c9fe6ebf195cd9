// What the two streamed calls, Attend (service.cpp) and AttendBackward
// (backward_call.cpp), share above CallBase: the stream's life.
//
//   read:  header -> chunks -> end, one message at a time; the header
//          plans, reserves and publishes the ack; end submits the work.
//   work:  run() on a worker, which ends in computed().
//   write: the ack, then the outputs (next_output), then the summary, then
//          the finish; one write at a time, from whichever thread is due
//          (pump()).
//
// A failure at any point (a bad message, the client's cancel, the
// watchdog's expiry, the worker's error) is recorded once as the finish
// status; the finish waits for a worker that holds the buffers.
// Both are raw methods (gRPC's ByteBuffer each way) over one message shape
// (proto/chunk_codec.h): input chunks are read from the received slices and
// copied once, straight into their tensor (the Assembler says where);
// output chunks are slices of the request's own block, sent without a copy.
// The two calls differ only in their header, their tensors and their
// summary.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "plsh/backend.h"
#include "plsh/shape.h"
#include "plsh/v1/plsh.grpc.pb.h"
#include "proto/chunk_codec.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/call.h"
#include "server/status_map.h"

namespace plsh::server {

// A message as the raw methods send it (ack, summary): serialized.
template <class Message>
grpc::ByteBuffer serialize_message(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  grpc::SerializationTraits<Message>::Serialize(message, &buffer, &own_buffer);
  return buffer;
}
// gRPC's ByteBuffer -> a protobuf message, for the small messages (header,
// end) that the chunk reader leaves to protobuf.
template <class Message>
bool parse_message(grpc::ByteBuffer* buffer, Message* message) {
  return grpc::SerializationTraits<Message>::Deserialize(buffer, message).ok();
}

class StreamedCall : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>, protected CallBase {
 public:
  // method: Attend or AttendBackward; request_type: the message's name
  // (AttendRequest), for errors. Calls are made by start(), not directly.
  StreamedCall(ServiceContext& s, grpc::CallbackServerContext* ctx, const char* method, const char* request_type)
      : CallBase(s, ctx, method), request_type_(request_type) {}

  // A new call of type Call, started: open, then the first read (which may
  // complete at once, on another thread, so only once it is constructed).
  template <class Call>
  static Call* start(ServiceContext& s, grpc::CallbackServerContext* ctx, const char* method,
                     const char* request_type) {
    Call* call = new Call(s, ctx, method, request_type);
    const Status opened = call->open(/*watched=*/true);
    if (!opened.ok()) {
      call->fail(opened);  // may finish the call: gRPC deletes it once it is done
    } else {
      call->StartRead(&call->message_);
    }
    return call;
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (cancel_.load() || ctx_->IsCancelled()) {
        fail(cancelled("cancelled by the client"));
      } else {
        // A half-close, or bytes that do not parse as the request type.
        fail(
            invalid_argument("the stream ended before the end message (closed by the client, or a message "
                             "that is not " +
                             request_type_article() + "), expected " + expected_next()));
      }
      return;
    }
    progress();
    Status status = check_message_size(message_.Length());
    if (status.ok()) status = handle_message();
    message_.Clear();  // the message's memory goes back before the next read
    if (!status.ok()) {
      fail(status);
      return;
    }
    if (!end_received_) this->StartRead(&message_);
  }

  void OnWriteDone(bool ok) override {
    if (ok) progress();
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      if (!ok) {
        if (!finish_) finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "client went away during output");
        // A failed write can come while a worker computes: stop it; its
        // run() pumps again and finishes the call then.
        cancel_.store(true);
      }
    }
    pump();
  }

  void OnCancel() override { cancel_.store(true); }

  void OnDone() override { delete this; }

  // The watchdog's (watchdog.h): ends the stream now. A read outstanding is
  // fine (Finish sends the status; the read then fails). A write the client
  // does not take completes only seconds after a cancel: the call is
  // cancelled and finished without waiting for it (the write holds its own
  // reference to the bytes it sends; OnDone waits for it).
  void expire(const grpc::Status& status, const char* reason) override {
    phase.store(static_cast<int>(Phase::kDone));  // once: the watchdog looks no more
    bool write_stuck = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      if (!finish_) finish_ = status;
      stop_reason_.store(reason);
      write_stuck = write_in_flight_;
      abandon_write_ = write_stuck;
    }
    cancel_.store(true);
    if (write_stuck) {
      server_cancelled_.store(true);
      ctx_->TryCancel();
    }
    pump();
  }

 protected:
  enum class Stage { kReading, kComputing, kSending, kFailed };

  // One message that is not a chunk the slice reader takes (a header, an
  // end, or a chunk in an encoding left to protobuf), in message_: parsed as
  // the call's request type and passed to dispatch().
  virtual Status handle_parsed() = 0;
  // The ack, serialized as the call's response type.
  virtual grpc::ByteBuffer ack_message(const v1::Ack& ack) const = 0;
  // On a worker, once end has come: computes and calls computed().
  virtual void run() = 0;
  // The next output message into response_, or false when all are sent.
  // Called with mu_ held.
  virtual bool next_output() = 0;
  // The summary into response_ (record_.sending set). Called with mu_ held.
  virtual void set_summary() = 0;
  // After close(), before Finish: what the call gives back besides CallBase's.
  virtual void after_close() {}

  bool header_received() const { return assembler_ != nullptr; }
  // "an AttendRequest", "a BackwardRequest".
  std::string request_type_article() const {
    return std::string(std::strchr("AEIOU", request_type_[0]) != nullptr ? "an " : "a ") + request_type_;
  }
  const char* expected_next() const { return header_received() ? "chunks then end" : "header, chunks, then end"; }

  // A parsed message to its step: the header to on_header, a chunk into
  // its tensor, the end to end_of_input.
  template <class Message, class OnHeader>
  Status dispatch(const Message& message, OnHeader&& on_header) {
    switch (message.kind_case()) {
      case Message::kHeader:
        return on_header(message.header());
      case Message::kChunk:
        return add_chunk(message.chunk());
      case Message::kEnd:
        return end_of_input();
      default:
        break;
    }
    return invalid_argument(std::string(request_type_) + " with no kind set, expected header, chunk or end");
  }

  // One received message. Chunks, the bulk of a stream, are read from the
  // slices gRPC received and copied once, straight into the tensor; the
  // rest is parsed.
  Status handle_message() {
    if (header_received() && chunk_.read(message_)) {
      StatusOr<uint8_t*> dst =
          assembler_->accept(chunk_.tensor(), chunk_.row_start(), chunk_.row_count(), chunk_.data_bytes());
      if (dst.ok()) {
        chunk_.copy_data(*dst);
        received(static_cast<int64_t>(chunk_.data_bytes()));
      }
      chunk_.clear();
      return dst.status();
    }
    return handle_parsed();
  }

  // A parsed chunk, into its tensor.
  Status add_chunk(const v1::TensorChunk& chunk) {
    if (!header_received()) return invalid_argument("chunk before header, expected the header as the first message");
    RETURN_IF_ERROR(assembler_->add(chunk));
    received(static_cast<int64_t>(chunk.data().size()));
    return Status::Ok();
  }
  void received(int64_t bytes) {
    record_.received_bytes += bytes;
    s_.metrics->received_bytes(static_cast<double>(bytes));
  }
  void sent(int64_t bytes) {
    record_.sent_bytes += bytes;
    s_.metrics->sent_bytes(static_cast<double>(bytes));
  }

  // The end message: every tensor complete, then the work goes to the
  // scheduler (RESOURCE_EXHAUSTED when its queue is full).
  Status end_of_input() {
    if (!header_received()) return invalid_argument("end before header, expected the header as the first message");
    RETURN_IF_ERROR(assembler_->complete());
    end_received_ = true;
    end_at_ = Clock::now();
    record_.receiving = seconds_between(record_.start, end_at_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stage_ = Stage::kComputing;
    }
    enter(Phase::kComputing, 0);
    const Status submitted = s_.scheduler->submit([this] { run(); });
    if (!submitted.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      stage_ = Stage::kReading;
    }
    return submitted;
  }

  // The header's last step: the ack goes out as soon as no write is in flight.
  void publish_ack(const std::string& id, const Backend& backend, int64_t out_chunk_bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ack_.set_request_id(id);
      ack_.set_backend(backend.name());
      ack_.set_device(backend.device());
      ack_.set_out_chunk_bytes(out_chunk_bytes);
      ack_.set_max_message_bytes(s_.limits.max_message_bytes);
      ack_.set_max_chunk_payload_bytes(wire::max_chunk_payload_bytes(s_.limits.max_message_bytes));
      ack_ready_ = true;
    }
    pump();
  }

  // run()'s last step: the result kept in *slot and the outputs (bytes in
  // all) sent, or the failure finished. Nothing of `this` may be touched
  // after it.
  template <class T>
  void computed(StatusOr<T> result, std::optional<T>* slot, int64_t output_bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result.ok()) {
        *slot = std::move(result).value();
        stage_ = Stage::kSending;
        send_start_ = Clock::now();
        enter(Phase::kSending, output_bytes);
      } else {
        stage_ = Stage::kFailed;
        if (!finish_) finish_ = to_grpc_status(result.status());
      }
    }
    pump();
  }

  void fail(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finish_) finish_ = to_grpc_status(status);
    }
    pump();
  }

  // An output chunk into response_ whose data is a slice of `block` (the
  // request's memory), not a copy: the slice holds the block until gRPC is
  // done with it. Called with mu_ held, from next_output().
  // An output tensor as next_output() sends it: `next` is its next row.
  struct Output {
    bool sent;  // false: not sent (in shared memory, or not asked for)
    v1::Tensor tensor;
    const uint8_t* data;
    const TensorShape& shape;
    int64_t* next;
  };
  // The next chunk of the first output with rows left, in row order, of
  // about `chunk_bytes` (one row at the least), sliced from `block`; false
  // when all are sent.
  bool next_output_chunk(std::initializer_list<Output> outputs, int64_t chunk_bytes,
                         const std::shared_ptr<uint8_t>& block) {
    for (const Output& o : outputs) {
      if (!o.sent || *o.next >= o.shape.rows) continue;
      const int64_t rows = std::min(o.shape.rows - *o.next, std::max<int64_t>(1, chunk_bytes / o.shape.row_bytes));
      set_output_chunk(o.tensor, *o.next, rows, o.data + *o.next * o.shape.row_bytes, rows * o.shape.row_bytes, block);
      *o.next += rows;
      return true;
    }
    return false;
  }

  void set_output_chunk(v1::Tensor tensor, int64_t row_start, int64_t rows, const uint8_t* data, int64_t bytes,
                        const std::shared_ptr<uint8_t>& block) {
    response_ = wire::encode_chunk(tensor, row_start, rows, data, static_cast<size_t>(bytes), release_block,
                                   new std::shared_ptr<uint8_t>(block));
    sent(bytes);
  }

  // Reading side (reactions run one at a time).
  grpc::ByteBuffer message_;
  wire::ChunkReader chunk_;
  bool end_received_ = false;
  Clock::time_point end_at_;
  std::unique_ptr<Assembler> assembler_;

  // Writing side, shared by reactions and the worker: under mu_.
  std::mutex mu_;
  Clock::time_point send_start_;
  grpc::ByteBuffer response_;

 private:
  // The keep-alive of an output chunk's slice: a reference to the request's
  // block, dropped when gRPC lets go of the slice.
  static void release_block(void* arg) { delete static_cast<std::shared_ptr<uint8_t>*>(arg); }

  // Starts the next write or the finish, whichever is due; one write at a
  // time. gRPC may run a reaction inline, so the call itself happens after
  // the lock is released.
  void pump() {
    enum class Action { kNone, kWrite, kFinish } action = Action::kNone;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || (write_in_flight_ && !abandon_write_)) return;
      if (finish_) {
        // Never while a worker holds the buffers: finishing frees them and
        // the call; run() pumps again when the worker is done.
        if (stage_ == Stage::kComputing) return;
        action = Action::kFinish;
        status = *finish_;
      } else if (write_in_flight_) {
        return;
      } else if (ack_ready_ && !ack_sent_) {
        response_ = ack_message(ack_);
        ack_sent_ = true;
        action = Action::kWrite;
      } else if (stage_ == Stage::kSending) {
        if (next_output()) {
          action = Action::kWrite;
        } else if (!summary_sent_) {
          record_.sending = seconds_between(send_start_, Clock::now());
          set_summary();
          summary_sent_ = true;
          action = Action::kWrite;
        } else {
          action = Action::kFinish;
          status = grpc::Status::OK;
        }
      }
      if (action == Action::kWrite) write_in_flight_ = true;
      if (action == Action::kFinish) finished_ = true;
    }
    if (action == Action::kWrite) this->StartWrite(&response_);
    if (action == Action::kFinish) {
      const grpc::Status final_status = close(std::move(status));
      after_close();
      this->Finish(final_status);  // last: OnDone may delete this at once
    }
  }

  const char* request_type_;
  Stage stage_ = Stage::kReading;
  v1::Ack ack_;
  bool ack_ready_ = false, ack_sent_ = false;
  bool write_in_flight_ = false;
  bool abandon_write_ = false;  // expire: finish without waiting for the write in flight
  std::optional<grpc::Status> finish_;
  bool finished_ = false;
  bool summary_sent_ = false;
};

// StreamedCall's typed ends for one RPC: every parsed message is a
// Request, the ack goes out in a Response; the call takes the header.
template <class Request, class Response>
class TypedStreamedCall : public StreamedCall {
 public:
  using StreamedCall::StreamedCall;

 protected:
  using Header = std::decay_t<decltype(std::declval<Request>().header())>;
  virtual Status on_header(const Header& header) = 0;

 private:
  Status handle_parsed() final {
    Request request;
    if (!parse_message(&message_, &request))
      return invalid_argument("a message that is not " + request_type_article() + ", expected " + expected_next());
    return dispatch(request, [this](const Header& header) { return on_header(header); });
  }

  grpc::ByteBuffer ack_message(const v1::Ack& ack) const final {
    Response message;
    *message.mutable_ack() = ack;
    return serialize_message(message);
  }
};

}  // namespace plsh::server
