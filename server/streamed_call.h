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
// The two calls differ only in their messages: Attend is a raw method
// (gRPC's ByteBuffer, chunks read from its slices), AttendBackward typed.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "plsh/backend.h"
#include "plsh/v1/plsh.grpc.pb.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/call.h"
#include "server/status_map.h"

namespace plsh::server {

// The ack as the response type carries it: serialized for the raw Attend,
// a field of AttendBackward's response.
// A message as the raw Attend method sends it (ack, summary).
inline grpc::ByteBuffer serialize_message(const v1::AttendResponse& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  grpc::SerializationTraits<v1::AttendResponse>::Serialize(message, &buffer, &own_buffer);
  return buffer;
}
inline void set_ack_message(const v1::Ack& ack, grpc::ByteBuffer* response) {
  v1::AttendResponse message;
  *message.mutable_ack() = ack;
  *response = serialize_message(message);
}
inline void set_ack_message(const v1::Ack& ack, v1::BackwardResponse* response) {
  response->Clear();
  *response->mutable_ack() = ack;
}
inline size_t message_bytes(const grpc::ByteBuffer& m) { return m.Length(); }
inline size_t message_bytes(const google::protobuf::Message& m) { return m.ByteSizeLong(); }

template <class Request, class Response>
class StreamedCall : public grpc::ServerBidiReactor<Request, Response>, protected CallBase {
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
      call->StartRead(&call->request_);
    }
    return call;
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (cancel_.load() || ctx_->IsCancelled()) {
        fail(cancelled("cancelled by the client"));
      } else {
        // A half-close, or bytes that do not parse as the request type.
        fail(invalid_argument(std::string("the stream ended before the end message (closed by the client, or a "
                                          "message that is not ") +
                              (std::strchr("AEIOU", request_type_[0]) != nullptr ? "an " : "a ") + request_type_ +
                              "), expected " + expected_next()));
      }
      return;
    }
    progress();
    Status status = check_message_size(message_bytes(request_));
    if (status.ok()) status = handle_message();
    request_.Clear();  // the message's memory goes back before the next read
    if (!status.ok()) {
      fail(status);
      return;
    }
    if (!end_received_) this->StartRead(&request_);
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


  // One message, in request_.
  virtual Status handle_message() = 0;
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
  const char* expected_next() const { return header_received() ? "chunks then end" : "header, chunks, then end"; }

  // A parsed message to its step: the header to on_header, a chunk into
  // its tensor, the end to end_of_input.
  template <class Message, class OnHeader>
  Status dispatch(const Message& message, OnHeader&& on_header) {
    switch (message.kind_case()) {
      case Message::kHeader: return on_header(message.header());
      case Message::kChunk: return add_chunk(message.chunk());
      case Message::kEnd: return end_of_input();
      default: break;
    }
    return invalid_argument(std::string(request_type_) + " with no kind set, expected header, chunk or end");
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

  // Reading side (reactions run one at a time).
  Request request_;
  bool end_received_ = false;
  Clock::time_point end_at_;
  std::unique_ptr<Assembler> assembler_;

  // Writing side, shared by reactions and the worker: under mu_.
  std::mutex mu_;
  Clock::time_point send_start_;
  Response response_;

 private:
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
        set_ack_message(ack_, &response_);
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

}  // namespace plsh::server
