#include "server/call.h"

#include <exception>
#include <new>

#include "plsh/backend.h"
#include "proto/wire.h"
#include "server/logging.h"
#include "server/status_map.h"

namespace plsh::server {

namespace {

// gRPC reports deadlines on the system clock; the backends check the steady one.
Clock::time_point steady_deadline(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  const auto left = deadline - std::chrono::system_clock::now();
  if (deadline == std::chrono::system_clock::time_point::max() || left > std::chrono::hours(24 * 365))
    return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

}  // namespace

std::string shape_of(const Request& r) {
  const AttentionOptions& o = r.options;
  return "B=" + std::to_string(o.batch) + " Nq=" + std::to_string(o.q_len) + " Nk=" + std::to_string(o.kv_len) +
         " H=" + std::to_string(o.heads) + " Hkv=" + std::to_string(resolved_kv_heads(o.heads, o.kv_heads)) +
         " D=" + std::to_string(o.head_dim) + " " + dtype_name(o.dtype);
}

namespace {

void record_request(ServiceContext& s, const RequestRecord& r, const grpc::Status& status, const char* stop_reason) {
  const double total = seconds_between(r.start, Clock::now());
  const std::string code = grpc_code_name(status.error_code());
  Metrics& m = *s.metrics;
  m.request_done(r.method, r.mode, r.backend, code, total);
  if (r.queued >= 0) m.phase("queued", r.queued);
  if (r.receiving >= 0) m.phase("receiving", r.receiving);
  if (r.computing >= 0) m.phase("computing", r.computing);
  if (r.sending >= 0) m.phase("sending", r.sending);
  if (status.ok()) {
    m.tokens(r.mode, static_cast<double>(r.tokens));
    if (r.probe_rel_err) m.probe_relative_error(r.mode, *r.probe_rel_err);
    if (r.mask_max_err) m.mask_max_error(r.mode, *r.mask_max_err);
  }
  nlohmann::json fields = {{"method", r.method},
                           {"id", r.id},
                           {"peer", r.peer},
                           {"shape", r.shape},
                           {"mode", r.mode},
                           {"backend", r.backend},
                           {"status", code},
                           {"total_s", total},
                           {"received_bytes", r.received_bytes},
                           {"sent_bytes", r.sent_bytes}};
  if (r.queued >= 0) fields["queued_s"] = r.queued;
  if (r.receiving >= 0) fields["receiving_s"] = r.receiving;
  if (r.computing >= 0) fields["computing_s"] = r.computing;
  if (r.sending >= 0) fields["sending_s"] = r.sending;
  if (!status.ok()) fields["message"] = status.error_message();
  if (stop_reason != nullptr) fields["stop_reason"] = stop_reason;
  if (s.auth != nullptr) {
    fields["client"] = r.client;
    m.client_request(r.client, r.method, code, static_cast<double>(r.received_bytes),
                     static_cast<double>(r.sent_bytes));
  }
  const auto level = status.error_code() == grpc::StatusCode::INTERNAL ? spdlog::level::err : spdlog::level::info;
  log_event(level, "request", fields);
}

// A cancelled request's code: the deadline's when it has passed.
grpc::Status stopped_status(const Clock::time_point deadline) {
  if (deadline != Clock::time_point::max() && Clock::now() >= deadline)
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed");
  return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
}

}  // namespace

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

CallBase::CallBase(ServiceContext& s, grpc::CallbackServerContext* ctx, const char* method)
    : s_(s), ctx_(ctx), deadline_(steady_deadline(ctx)), ticket_(s.admission) {
  record_.method = method;
  if (Method m{}; parse_method(method, &m)) method_ = m;
  if (s_.admission->tokens()) record_.client = "unauthenticated";
  record_.peer = ctx->peer();
  s_.metrics->inflight_add(1);
}

Status CallBase::open(bool watched) {
  enter(Phase::kReading, 0);
  if (watched && s_.watchdog != nullptr) watch_ = s_.watchdog->watch(this);
  Status opened = ticket_.open(ctx_->client_metadata(), method_, record_.method);
  if (s_.admission->tokens()) record_.client = ticket_.label();
  return opened;
}

Status CallBase::admit_header(const v1::AttendHeader& header,
                              const std::function<Status(const Request&)>& before_memory) {
  record_.mode = wire::mode_label(header.mode());  // labels a refused request too
  ASSIGN_OR_RETURN(Request request, check_request(header, s_.limits));
  // The regions first: they are held from here until close().
  RETURN_IF_ERROR(use_shared_memory(header, &request, s_.shm, owner()));
  if (request.keep_context && (s_.contexts == nullptr || !s_.contexts->enabled()))
    return failed_precondition(
        "keep_context = true, but this server keeps no contexts (--context-ttl 0); expected "
        "keep_context = false, or a stateless AttendBackward");
  ASSIGN_OR_RETURN(const int64_t planning, planning_bytes(request));
  RETURN_IF_ERROR(ticket_.plan(planning, [&] { return plan_request(&request, s_.limits); }));
  record_.id = request.id;
  record_.shape = shape_of(request);
  record_.mode = mode_name(request.options.mode);
  record_.tokens = request.tokens();
  record_.backend = request.backend->name();
  if (before_memory) RETURN_IF_ERROR(before_memory(request));
  ASSIGN_OR_RETURN(memory_, ticket_.admit(request.memory_layout(), request.plan.own_host_bytes, request.device_charge(),
                                          *request.backend));
  request.place_shared(&memory_);
  // What the rest of the receiving phase moves.
  phase_bytes.store(request.streamed_input_bytes());
  request_ = std::move(request);
  return Status::Ok();
}

StatusOr<AttentionResult> CallBase::compute(Clock::time_point queued_at) {
  StatusOr<AttentionResult> result =
      run_guarded<AttentionResult>(queued_at, "request " + request_->id, [this](const ExecContext& exec) {
        StatusOr<AttentionResult> r = compute_request(*request_, memory_, exec);
        // A region whose file shrank while it was read or written: the
        // result is not what the client sent (server/shm_registry.h).
        if (r.ok()) {
          if (const Status intact = check_shared_memory_intact(*request_); !intact.ok()) r = intact;
        }
        return r;
      });
  if (result.ok() && request_->keep_context) {
    StatusOr<std::string> id = s_.contexts->reserve_id(record_.client);
    if (id.ok())
      context_id_ = *id;
    else
      result = id.status();
  }
  if (result.ok()) {
    record_.backend = result->backend;
    if (result->mode != Mode::kExact && request_->options.estimates) {
      if (result->probe.rows > 0) record_.probe_rel_err = result->probe.rel_err;
      record_.mask_max_err = result->mask_max_err;
    }
  }
  return result;
}

void CallBase::fill_summary_message(const AttentionResult& result, v1::Summary* s) {
  fill_summary(result, *request_, s);
  fill_timings(s->mutable_timings());
  s->set_received_bytes(record_.received_bytes);
  s->set_sent_bytes(record_.sent_bytes);
  if (!context_id_.empty()) {
    s->set_context_id(context_id_);
    s->set_context_ttl_seconds(s_.contexts->options().ttl_seconds);
    s->set_context_bytes(request_->kept_bytes());
  }
}

void CallBase::fill_timings(v1::Timings* t) const {
  t->set_queued_seconds(record_.queued);
  t->set_receiving_seconds(record_.receiving);
  t->set_computing_seconds(record_.computing);
  t->set_sending_seconds(record_.sending);
  t->set_total_seconds(seconds_between(record_.start, Clock::now()));
}

grpc::Status CallBase::close(grpc::Status status) {
  if (watch_) {
    std::lock_guard<std::recursive_mutex> lock(watch_->mu);
    watch_->call = nullptr;
  }
  phase.store(static_cast<int>(Phase::kDone));
  const char* reason = stop_reason_.load();
  if (!status.ok() && reason == nullptr && (cancel_.load() || ctx_->IsCancelled())) status = stopped_status(deadline_);
  // What the client gets: this status, unless gRPC has ended the call
  // already (a cancel, a deadline, a lost connection, a message over gRPC's
  // own limit: IsCancelled); then a cancellation or its deadline.
  grpc::Status seen = status;
  if (ctx_->IsCancelled() || server_cancelled_.load()) {
    if (deadline_ != Clock::time_point::max() && Clock::now() >= deadline_)
      seen = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed");
    else if (reason != nullptr)
      seen = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the server: " + status.error_message());
    else
      seen = grpc::Status(grpc::StatusCode::CANCELLED,
                          "cancelled by the client, or by gRPC (a lost connection, a message over gRPC's own limit) "
                          "before the server's status");
  }
  record_request(s_, record_, seen, reason);
  client_status_ = seen;
  if (!context_id_.empty()) {
    if (seen.ok()) {
      // The context's bytes (its tensors and plan) move from this call's
      // reservation to the store's: charged once throughout.
      const MemoryCharge kept = ticket_.hand_over(request_->kept_bytes());
      s_.contexts->put(context_id_, std::make_shared<KeptContext>(std::move(*request_), std::move(memory_), kept,
                                                                  &s_.admission->budget(), ticket_.client()));
    } else {
      s_.contexts->abandon(context_id_);
    }
  }
  memory_ = RequestMemory{};
  if (request_) request_->shared = Request::SharedUses{};  // the regions may be unregistered from now on
  ticket_.close();
  s_.metrics->inflight_add(-1);
  return status;
}

Status CallBase::check_message_size(size_t bytes) const {
  if (static_cast<int64_t>(bytes) <= s_.limits.max_message_bytes) return Status::Ok();
  return resource_exhausted("a message of " + std::to_string(bytes) + " bytes, expected <= " +
                            std::to_string(s_.limits.max_message_bytes) + " (the server's --max-message-bytes)");
}

}  // namespace plsh::server
