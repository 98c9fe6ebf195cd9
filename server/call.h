// What every Attend, AttendUnary and AttendBackward call shares, whatever its transport
// (Triton's InferHandler base): one path
//   open -> admit (plan_request: limits, backend, plan) -> reserve (host and
//   device budgets) -> allocate -> ... -> compute on a worker -> close
// and one record that becomes the request's log line and metrics, with one
// timings fill for the summary. The reactors (service.cpp, backward_call.cpp;
// the two streamed calls over streamed_call.h) only move messages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>

#include "plsh/attention.h"
#include "plsh/v1/plsh.pb.h"
#include "server/auth.h"
#include "server/buffer_pool.h"
#include "server/config.h"
#include "server/contexts.h"
#include "server/metrics.h"
#include "server/request.h"
#include "server/scheduler.h"
#include "server/shm_registry.h"
#include "server/watchdog.h"

namespace plsh::server {

// What every request's reactor shares.
struct ServiceContext {
  const ServerConfig* config = nullptr;
  RequestLimits limits;
  Metrics* metrics = nullptr;
  Scheduler* scheduler = nullptr;
  StreamWatchdog* watchdog = nullptr;  // null: streams are not watched
  const Authenticator* auth = nullptr;  // null: no token file, every call is let in
  BufferPool* pool = nullptr;           // requests' host tensors; null: plain heap memory
  SharedMemoryRegistry* shm = nullptr;  // null (or disabled): no shared memory
  ContextStore* contexts = nullptr;     // kept contexts (contexts.h); null: none are kept
  std::atomic<int64_t> open_streams{0};
  std::atomic<bool> draining{false};  // new requests get UNAVAILABLE
};

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b);

// A request's shape for the log: "B=.. Nq=.. Nk=.. H=.. Hkv=.. D=.. dtype".
std::string shape_of(const RequestPlan& plan);

// What one request leaves behind in the log and the metrics.
struct RequestRecord {
  std::string method;
  std::string client;  // the token file's name for the caller; "" without a token file
  std::string id;
  std::string peer;
  std::string shape;
  std::string mode = "unknown";
  std::string backend = "none";
  Clock::time_point start = Clock::now();
  double queued = -1, receiving = -1, computing = -1, sending = -1;  // < 0: phase not reached
  int64_t received_bytes = 0, sent_bytes = 0, tokens = 0;
  std::optional<double> probe_rel_err, mask_max_err;
};

class CallBase : public WatchedCall {
 protected:
  // method: Attend, AttendUnary or AttendBackward (the token file's names for them).
  CallBase(ServiceContext& s, grpc::CallbackServerContext* ctx, const char* method);

  // Counts the call as open: UNAVAILABLE while draining; with a token file
  // UNAUTHENTICATED or PERMISSION_DENIED (auth.h); RESOURCE_EXHAUSTED over
  // --max-concurrent or the client's max_streams. A streamed call is watched
  // (watchdog.h) from here until close().
  Status open(bool watched);
  // The header: plan_request (limits, shared-memory regions, backend,
  // plan). Sets plan_.
  Status plan(const v1::AttendHeader& header);
  // Then the plan's memory charge against the client's limits and both
  // budgets, and the host buffers (from the pool). Sets buffers_.
  Status reserve_and_allocate();
  // A charge against the client's limits and both budgets, held until
  // close(); kept contexts are evicted for room (contexts.h).
  Status reserve(const MemoryCharge& charge);
  // On a worker: the computation unless the client left while the request
  // was queued; fills the queued and computing times. A shared-memory
  // region whose file shrank meanwhile fails it (FAILED_PRECONDITION).
  // With keep_context, also the context's id (the context itself enters
  // the store at close()).
  StatusOr<AttentionResult> compute(Clock::time_point queued_at);
  // On a worker: work(exec) with the call's cancel flag and deadline, unless
  // the client left while the request was queued; what it throws becomes
  // RESOURCE_EXHAUSTED (bad_alloc) or INTERNAL, naming `what` (the request).
  // Fills the queued and computing times.
  template <class T, class Work>
  StatusOr<T> run_guarded(Clock::time_point queued_at, const std::string& what, Work&& work);
  // Who owns the shared-memory regions this call may use: the token
  // file's client name, "" without a token file.
  std::string owner() const;
  // The summary of a computed request, timings and byte counts included.
  void fill_summary_message(const AttentionResult& result, v1::Summary* summary);
  // The record's phase times, and the total so far.
  void fill_timings(v1::Timings* timings) const;
  // Logs and counts the request with the status its client gets (a
  // cancellation when gRPC ended the call first: IsCancelled), gives its
  // memory back and closes it; returns the status to finish with (the
  // deadline's or a cancel's when the client stopped it; expire's when the
  // server ended it on purpose).
  grpc::Status close(grpc::Status status);
  // A message over --max-message-bytes: gRPC's own limit is set higher
  // (main.cpp), so that the server, not gRPC, refuses it and knows the code.
  Status check_message_size(size_t bytes) const;

  ServiceContext& s_;
  grpc::CallbackServerContext* ctx_;
  const Clock::time_point deadline_;
  std::atomic<bool> cancel_{false};
  std::atomic<const char*> stop_reason_{nullptr};  // set when the server ended the call on purpose
  std::atomic<bool> server_cancelled_{false};       // ...by cancelling it (TryCancel): the client gets CANCELLED
  RequestRecord record_;
  std::optional<RequestPlan> plan_;
  RequestBuffers buffers_;
  std::string context_id_;      // keep_context: the id its context gets once the call ends OK
  grpc::Status client_status_;  // set by close(): the status the client got

 private:
  std::optional<Method> method_;  // none: a name the token file cannot allow
  std::shared_ptr<ClientState> client_;  // with a token file, once authorized
  bool client_stream_open_ = false;
  MemoryCharge client_reserved_;
  MemoryCharge reserved_;
  bool counted_open_ = false;
  std::shared_ptr<CallWatch> watch_;
};

template <class T, class Work>
StatusOr<T> CallBase::run_guarded(Clock::time_point queued_at, const std::string& what, Work&& work) {
  const Clock::time_point started = Clock::now();
  record_.queued = seconds_between(queued_at, started);
  if (cancel_.load()) return cancelled("cancelled by the client while queued");
  ExecContext exec;
  exec.cancel = &cancel_;
  exec.deadline = deadline_;
  StatusOr<T> result = cancelled("not run");
  try {
    result = work(static_cast<const ExecContext&>(exec));
  } catch (const std::bad_alloc&) {
    result = resource_exhausted("out of host memory while computing " + what);
  } catch (const std::exception& e) {
    result = internal_error(what + ": " + e.what());
  }
  record_.computing = seconds_between(started, Clock::now());
  return result;
}

}  // namespace plsh::server
