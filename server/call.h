// What every Attend, AttendUnary and AttendBackward call shares, whatever its
// transport (Triton's InferHandler base): one path
//   open (the admission's ticket) -> the header's checks and plan -> admit
//   (the admission reserves and allocates its memory) -> ... -> compute on
//   a worker -> close (the ticket gives everything back)
// and one record that becomes the request's log line and metrics, with one
// timings fill for the summary. The reactors (service.cpp, backward_call.cpp;
// the two streamed calls over streamed_call.h) only move messages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <string>

#include "plsh/attention.h"
#include "plsh/v1/plsh.pb.h"
#include "server/admission.h"
#include "server/auth.h"
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
  Admission* admission = nullptr;       // who runs, with what memory (admission.h)
  StreamWatchdog* watchdog = nullptr;   // null: streams are not watched
  const Authenticator* auth = nullptr;  // for the unary calls outside CallBase; null: no token file
  SharedMemoryRegistry* shm = nullptr;  // null (or disabled): no shared memory
  ContextStore* contexts = nullptr;     // kept contexts (contexts.h); null: none are kept
};

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b);

// A request's shape for the log: "B=.. Nq=.. Nk=.. H=.. Hkv=.. D=.. dtype".
std::string shape_of(const Request& request);

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

  // The admission's first step (Admission::Ticket::open). A streamed call
  // is watched (watchdog.h) from here until close().
  Status open(bool watched);
  // A forward's header: its checks (check_request), its shared-memory
  // regions, its plan (the planning bound held meanwhile), `before_memory`
  // (the call's own checks, when given), then its memory from the
  // admission. Sets request_ and memory_.
  Status admit_header(const v1::AttendHeader& header,
                      const std::function<Status(const Request&)>& before_memory = nullptr);
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
  // Who owns the shared-memory regions and contexts this call may use:
  // the token file's client name, "" without a token file.
  std::string owner() const { return ticket_.owner(); }
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
  std::atomic<bool> server_cancelled_{false};      // ...by cancelling it (TryCancel): the client gets CANCELLED
  RequestRecord record_;
  Admission::Ticket ticket_;
  std::optional<Request> request_;
  RequestMemory memory_;
  std::string context_id_;      // keep_context: the id its context gets once the call ends OK
  grpc::Status client_status_;  // set by close(): the status the client got

 private:
  std::optional<Method> method_;  // none: a name the token file cannot allow
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
