#include "server/service.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>

#include "plsh/backend.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/logging.h"
#include "server/status_map.h"

#ifndef PLSH_VERSION
#define PLSH_VERSION "unknown"
#endif

namespace plsh::server {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// gRPC reports deadlines on the system clock; the backends check the steady one.
Clock::time_point steady_deadline(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  const auto left = deadline - std::chrono::system_clock::now();
  if (deadline == std::chrono::system_clock::time_point::max() || left > std::chrono::hours(24 * 365))
    return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

std::string shape_of(const RequestPlan& p) {
  const AttentionOptions& o = p.options;
  return "B=" + std::to_string(o.batch) + " Nq=" + std::to_string(o.q_len) + " Nk=" + std::to_string(o.kv_len) +
         " H=" + std::to_string(o.heads) + " Hkv=" + std::to_string(o.kv_heads == 0 ? o.heads : o.kv_heads) +
         " D=" + std::to_string(o.head_dim) + " " + dtype_name(o.dtype);
}

// What one request leaves behind in the log and the metrics.
struct RequestRecord {
  std::string method;
  std::string id;
  std::string peer;
  std::string shape;
  std::string mode = "unknown";
  std::string backend = "none";
  Clock::time_point start = Clock::now();
  double queued = -1, receiving = -1, computing = -1, sending = -1;  // < 0: phase not reached
  int64_t received_bytes = 0, sent_bytes = 0, tokens = 0;
  std::optional<double> probe_rel_err, mask_max_err;

  void note_plan(const RequestPlan& plan) {
    id = plan.id;
    shape = shape_of(plan);
    mode = mode_name(plan.options.mode);
    tokens = plan.tokens();
  }
  void note_result(const AttentionResult& r, const RequestPlan& plan) {
    backend = r.backend;
    if (r.mode != Mode::kExact && plan.options.estimates) {
      if (r.probe.rows > 0) probe_rel_err = r.probe.rel_err;
      mask_max_err = r.mask_max_err;
    }
  }
};

void record_request(ServiceContext& s, const RequestRecord& r, const grpc::Status& status) {
  const double total = seconds_between(r.start, Clock::now());
  const std::string code = grpc_code_name(status.error_code());
  Metrics& m = *s.metrics;
  m.request_done(r.mode, r.backend, code, total);
  if (r.queued >= 0) m.phase("queued", r.queued);
  if (r.receiving >= 0) m.phase("receiving", r.receiving);
  if (r.computing >= 0) m.phase("computing", r.computing);
  if (r.sending >= 0) m.phase("sending", r.sending);
  if (status.ok()) {
    m.tokens(r.mode, static_cast<double>(r.tokens));
    if (r.probe_rel_err) m.probe_relative_error(r.mode, *r.probe_rel_err);
    if (r.mask_max_err) m.mask_max_error(r.mode, *r.mask_max_err);
  }
  nlohmann::json fields = {{"method", r.method}, {"id", r.id},           {"peer", r.peer},
                           {"shape", r.shape},   {"mode", r.mode},       {"backend", r.backend},
                           {"status", code},     {"total_s", total},     {"received_bytes", r.received_bytes},
                           {"sent_bytes", r.sent_bytes}};
  if (r.queued >= 0) fields["queued_s"] = r.queued;
  if (r.receiving >= 0) fields["receiving_s"] = r.receiving;
  if (r.computing >= 0) fields["computing_s"] = r.computing;
  if (r.sending >= 0) fields["sending_s"] = r.sending;
  if (!status.ok()) fields["message"] = status.error_message();
  const auto level = status.error_code() == grpc::StatusCode::INTERNAL ? spdlog::level::err : spdlog::level::info;
  log_event(level, "request", fields);
}

// A cancelled request's code: the deadline's when it has passed.
grpc::Status stopped_status(const Clock::time_point deadline) {
  if (deadline != Clock::time_point::max() && Clock::now() >= deadline)
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed");
  return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
}

// On a worker, for both reactors: the computation unless the client left
// while the request was queued; fills the queued and computing times.
StatusOr<AttentionResult> compute_on_worker(ServiceContext& s, const RequestPlan& plan, const RequestBuffers& buffers,
                                            const std::atomic<bool>& cancel, Clock::time_point deadline,
                                            Clock::time_point queued_at, RequestRecord* record) {
  const Clock::time_point started = Clock::now();
  record->queued = seconds_between(queued_at, started);
  if (cancel.load()) return cancelled("cancelled by the client while queued");
  ExecContext exec;
  exec.cancel = &cancel;
  exec.deadline = deadline;
  exec.threads = static_cast<int>(s.config->threads);
  ComputeHooks hooks{[&s](int64_t b) { return s.scheduler->reserve(b); },
                     [&s](int64_t b) { s.scheduler->release(b); }};
  StatusOr<AttentionResult> result = cancelled("not run");
  try {
    result = compute_request(plan, buffers, exec, hooks);
  } catch (const std::bad_alloc&) {
    result = resource_exhausted("out of host memory while computing request " + plan.id);
  } catch (const std::exception& e) {
    result = internal_error(std::string("request ") + plan.id + ": " + e.what());
  }
  record->computing = seconds_between(started, Clock::now());
  return result;
}

// ---------------------------------------------------------------- Attend

class AttendReactor final : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  AttendReactor(ServiceContext& s, grpc::CallbackServerContext* ctx)
      : s_(s), ctx_(ctx), deadline_(steady_deadline(ctx)) {
    record_.method = "Attend";
    record_.peer = ctx->peer();
    s_.metrics->inflight_add(1);
    const int64_t open = s_.open_streams.fetch_add(1) + 1;
    if (s_.draining.load()) {
      fail(unavailable("server is shutting down; retry on another replica"));
      return;
    }
    if (open > s_.config->max_concurrent) {
      fail(resource_exhausted("open requests = " + std::to_string(open) + ", expected <= " +
                              std::to_string(s_.config->max_concurrent) + " (the server's --max-concurrent); retry later"));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (cancel_.load() || ctx_->IsCancelled()) {
        fail(cancelled("cancelled by the client"));
      } else {
        fail(invalid_argument(std::string("stream closed before the end message, expected ") +
                              (plan_ ? "chunks then end" : "header, chunks, then end")));
      }
      return;
    }
    const Status status = handle(request_);
    if (!status.ok()) {
      fail(status);
      return;
    }
    if (!end_received_) StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      if (!ok) {
        if (!finish_) finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "client went away during output");
        // A failed ack can come while a worker computes: stop it; its run()
        // pumps again and finishes the call then.
        cancel_.store(true);
      }
    }
    pump();
  }

  void OnCancel() override { cancel_.store(true); }

  void OnDone() override { delete this; }

 private:
  enum class Stage { kReading, kComputing, kSending, kFailed };

  Status handle(const v1::AttendRequest& request) {
    switch (request.kind_case()) {
      case v1::AttendRequest::kHeader: return on_header(request.header());
      case v1::AttendRequest::kChunk: {
        if (!plan_) return invalid_argument("chunk before header, expected the header as the first message");
        RETURN_IF_ERROR(assembler_->add(request.chunk()));
        const auto bytes = static_cast<int64_t>(request.chunk().data().size());
        record_.received_bytes += bytes;
        s_.metrics->received_bytes(static_cast<double>(bytes));
        return Status::Ok();
      }
      case v1::AttendRequest::kEnd: {
        if (!plan_) return invalid_argument("end before header, expected the header as the first message");
        RETURN_IF_ERROR(assembler_->complete());
        end_received_ = true;
        end_at_ = Clock::now();
        record_.receiving = seconds_between(record_.start, end_at_);
        {
          std::lock_guard<std::mutex> lock(mu_);
          stage_ = Stage::kComputing;
        }
        const Status submitted = s_.scheduler->submit([this] { run(); });
        if (!submitted.ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          stage_ = Stage::kReading;
        }
        return submitted;
      }
      default: break;
    }
    return invalid_argument("AttendRequest with no kind set, expected header, chunk or end");
  }

  Status on_header(const v1::AttendHeader& header) {
    if (plan_) return invalid_argument("header received twice, expected exactly one header as the first message");
    record_.mode = wire::mode_label(header.mode());  // labels a refused request too
    ASSIGN_OR_RETURN(RequestPlan plan, plan_request(header, s_.limits));
    record_.note_plan(plan);
    ASSIGN_OR_RETURN(Backend * backend, BackendRegistry::global().find(plan.backend));
    record_.backend = backend->name();
    RETURN_IF_ERROR(s_.scheduler->reserve(plan.total_bytes));
    reserved_ = plan.total_bytes;
    try {
      buffers_ = RequestBuffers::allocate(plan);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("out of host memory for the request's " + std::to_string(plan.total_bytes) + " bytes");
    }
    plan_ = std::move(plan);
    assembler_ = std::make_unique<Assembler>(*plan_, &buffers_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ack_.set_request_id(plan_->id);
      ack_.set_backend(backend->name());
      ack_.set_device(backend->device());
      ack_.set_out_chunk_bytes(plan_->out_chunk_bytes);
      ack_.set_max_message_bytes(s_.limits.max_message_bytes);
      ack_ready_ = true;
    }
    pump();
    return Status::Ok();
  }

  // On a worker.
  void run() {
    StatusOr<AttentionResult> result = compute_on_worker(s_, *plan_, buffers_, cancel_, deadline_, end_at_, &record_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result.ok()) {
        record_.note_result(*result, *plan_);
        result_ = std::move(result).value();
        stage_ = Stage::kSending;
        send_start_ = Clock::now();
      } else {
        stage_ = Stage::kFailed;
        if (!finish_) finish_ = to_grpc_status(result.status());
      }
    }
    pump();  // may finish the call: nothing of `this` may be touched after it
  }

  void fail(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finish_) finish_ = to_grpc_status(status);
    }
    pump();
  }

  // The next output message into response_, or false when all are sent.
  // Called with mu_ held.
  bool next_output() {
    const RequestPlan& p = *plan_;
    if (out_next_ < p.q_rows) {
      const int64_t rows = std::min(p.q_rows - out_next_, std::max<int64_t>(1, p.out_chunk_bytes / p.out_row_bytes));
      set_chunk(v1::TENSOR_OUT, out_next_, rows, buffers_.out.get() + out_next_ * p.out_row_bytes, rows * p.out_row_bytes);
      out_next_ += rows;
      return true;
    }
    if (p.return_lse && lse_next_ < p.q_rows) {
      const int64_t rows = std::min(p.q_rows - lse_next_, std::max<int64_t>(1, p.out_chunk_bytes / p.lse_row_bytes));
      set_chunk(v1::TENSOR_LSE, lse_next_, rows,
                reinterpret_cast<const uint8_t*>(buffers_.lse.get()) + lse_next_ * p.lse_row_bytes,
                rows * p.lse_row_bytes);
      lse_next_ += rows;
      return true;
    }
    return false;
  }

  void set_chunk(v1::Tensor tensor, int64_t row_start, int64_t rows, const uint8_t* data, int64_t bytes) {
    response_.Clear();
    v1::OutputChunk* c = response_.mutable_out_chunk();
    c->set_tensor(tensor);
    c->set_row_start(row_start);
    c->set_row_count(rows);
    c->set_data(data, static_cast<size_t>(bytes));
    record_.sent_bytes += bytes;
    s_.metrics->sent_bytes(static_cast<double>(bytes));
  }

  void set_summary() {
    response_.Clear();
    v1::Summary* s = response_.mutable_summary();
    fill_summary(*result_, *plan_, s);
    const Clock::time_point now = Clock::now();
    record_.sending = seconds_between(send_start_, now);
    v1::Timings* t = s->mutable_timings();
    t->set_queued_seconds(record_.queued);
    t->set_receiving_seconds(record_.receiving);
    t->set_computing_seconds(record_.computing);
    t->set_sending_seconds(record_.sending);
    t->set_total_seconds(seconds_between(record_.start, now));
    s->set_received_bytes(record_.received_bytes);
    s->set_sent_bytes(record_.sent_bytes);
  }

  // Starts the next write or the finish, whichever is due; one write at a
  // time. gRPC may run a reaction inline, so the call itself happens after
  // the lock is released.
  void pump() {
    enum class Action { kNone, kWrite, kFinish } action = Action::kNone;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || write_in_flight_) return;
      if (finish_) {
        // Never while a worker holds the buffers: finish() frees them and
        // the call; run() pumps again when the worker is done.
        if (stage_ == Stage::kComputing) return;
        action = Action::kFinish;
        status = *finish_;
      } else if (ack_ready_ && !ack_sent_) {
        response_.Clear();
        *response_.mutable_ack() = ack_;
        ack_sent_ = true;
        action = Action::kWrite;
      } else if (stage_ == Stage::kSending) {
        if (next_output()) {
          action = Action::kWrite;
        } else if (!summary_sent_) {
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
    if (action == Action::kWrite) StartWrite(&response_);
    if (action == Action::kFinish) finish(status);
  }

  void finish(grpc::Status status) {
    if (!status.ok() && (cancel_.load() || ctx_->IsCancelled())) status = stopped_status(deadline_);
    record_request(s_, record_, status);
    if (reserved_ > 0) s_.scheduler->release(reserved_);
    reserved_ = 0;
    buffers_ = RequestBuffers{};
    s_.open_streams.fetch_sub(1);
    s_.metrics->inflight_add(-1);
    Finish(status);  // last: OnDone may delete this at once
  }

  ServiceContext& s_;
  grpc::CallbackServerContext* ctx_;
  const Clock::time_point deadline_;
  std::atomic<bool> cancel_{false};
  RequestRecord record_;

  // Reading side (reactions run one at a time).
  v1::AttendRequest request_;
  bool end_received_ = false;
  Clock::time_point end_at_;
  std::optional<RequestPlan> plan_;
  RequestBuffers buffers_;
  std::unique_ptr<Assembler> assembler_;
  int64_t reserved_ = 0;

  // Writing side, shared by reactions and the worker.
  std::mutex mu_;
  Stage stage_ = Stage::kReading;
  v1::Ack ack_;
  bool ack_ready_ = false, ack_sent_ = false;
  bool write_in_flight_ = false;
  std::optional<grpc::Status> finish_;
  bool finished_ = false;
  std::optional<AttentionResult> result_;
  Clock::time_point send_start_;
  int64_t out_next_ = 0, lse_next_ = 0;
  bool summary_sent_ = false;
  v1::AttendResponse response_;
};

// ----------------------------------------------------------- AttendUnary

class UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  UnaryReactor(ServiceContext& s, grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* request,
               v1::AttendUnaryResponse* response)
      : s_(s), ctx_(ctx), deadline_(steady_deadline(ctx)), request_(request), response_(response) {
    record_.method = "AttendUnary";
    record_.peer = ctx->peer();
    s_.metrics->inflight_add(1);
    const Status status = start();
    if (!status.ok()) finish(to_grpc_status(status));
  }

  void OnCancel() override { cancel_.store(true); }
  void OnDone() override { delete this; }

 private:
  Status start() {
    const int64_t open = s_.open_streams.fetch_add(1) + 1;
    counted_open_ = true;
    if (s_.draining.load()) return unavailable("server is shutting down; retry on another replica");
    if (open > s_.config->max_concurrent)
      return resource_exhausted("open requests = " + std::to_string(open) + ", expected <= " +
                                std::to_string(s_.config->max_concurrent) + " (the server's --max-concurrent); retry later");
    record_.mode = wire::mode_label(request_->header().mode());  // labels a refused request too
    ASSIGN_OR_RETURN(RequestPlan plan, plan_request(request_->header(), s_.limits));
    record_.note_plan(plan);
    ASSIGN_OR_RETURN(Backend * backend, BackendRegistry::global().find(plan.backend));
    record_.backend = backend->name();
    const struct {
      const char* name;
      const std::string& data;
      int64_t expected;
      const char* shape;
    } inputs[] = {{"q", request_->q(), plan.q_bytes(), "batch * q_len * heads * head_dim"},
                  {"k", request_->k(), plan.kv_bytes(), "batch * kv_len * kv_heads * head_dim"},
                  {"v", request_->v(), plan.kv_bytes(), "batch * kv_len * kv_heads * head_dim"}};
    for (const auto& in : inputs) {
      if (static_cast<int64_t>(in.data.size()) != in.expected)
        return invalid_argument(std::string(in.name) + " = " + std::to_string(in.data.size()) + " bytes, expected " +
                                std::to_string(in.expected) + " (" + in.shape + " * dtype bytes)");
    }
    const int64_t response_bytes = plan.out_bytes() + plan.lse_bytes() + kMessageHeadroom +
                                   plan.options.heads * (200 + (plan.options.return_draws ? 20 * plan.options.samples : 0));
    if (response_bytes > s_.limits.max_message_bytes)
      return resource_exhausted("the response needs ~" + std::to_string(response_bytes) + " bytes, expected <= " +
                                std::to_string(s_.limits.max_message_bytes) +
                                " (the server's --max-message-bytes); use the streaming Attend");
    RETURN_IF_ERROR(s_.scheduler->reserve(plan.total_bytes));
    reserved_ = plan.total_bytes;
    try {
      buffers_ = RequestBuffers::allocate(plan);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("out of host memory for the request's " + std::to_string(plan.total_bytes) + " bytes");
    }
    std::memcpy(buffers_.q.get(), request_->q().data(), request_->q().size());
    std::memcpy(buffers_.k.get(), request_->k().data(), request_->k().size());
    std::memcpy(buffers_.v.get(), request_->v().data(), request_->v().size());
    record_.received_bytes = plan.q_bytes() + 2 * plan.kv_bytes();
    s_.metrics->received_bytes(static_cast<double>(record_.received_bytes));
    plan_ = std::move(plan);
    record_.receiving = seconds_between(record_.start, Clock::now());
    queued_at_ = Clock::now();
    return s_.scheduler->submit([this] { run(); });
  }

  void run() {
    StatusOr<AttentionResult> result = compute_on_worker(s_, *plan_, buffers_, cancel_, deadline_, queued_at_, &record_);
    if (!result.ok()) {
      finish(to_grpc_status(result.status()));
      return;
    }
    record_.note_result(*result, *plan_);
    const Clock::time_point send_start = Clock::now();
    v1::Summary* s = response_->mutable_summary();
    fill_summary(*result, *plan_, s);
    response_->set_out(buffers_.out.get(), static_cast<size_t>(plan_->out_bytes()));
    if (plan_->return_lse)
      response_->set_lse(reinterpret_cast<const char*>(buffers_.lse.get()), static_cast<size_t>(plan_->lse_bytes()));
    record_.sent_bytes = plan_->out_bytes() + plan_->lse_bytes();
    s_.metrics->sent_bytes(static_cast<double>(record_.sent_bytes));
    record_.sending = seconds_between(send_start, Clock::now());
    v1::Timings* t = s->mutable_timings();
    t->set_queued_seconds(record_.queued);
    t->set_receiving_seconds(record_.receiving);
    t->set_computing_seconds(record_.computing);
    t->set_sending_seconds(record_.sending);
    t->set_total_seconds(seconds_between(record_.start, Clock::now()));
    s->set_received_bytes(record_.received_bytes);
    s->set_sent_bytes(record_.sent_bytes);
    finish(grpc::Status::OK);
  }

  void finish(grpc::Status status) {
    if (!status.ok() && (cancel_.load() || ctx_->IsCancelled())) status = stopped_status(deadline_);
    record_request(s_, record_, status);
    if (reserved_ > 0) s_.scheduler->release(reserved_);
    reserved_ = 0;
    buffers_ = RequestBuffers{};
    if (counted_open_) s_.open_streams.fetch_sub(1);
    s_.metrics->inflight_add(-1);
    Finish(status);  // last: OnDone may delete this at once
  }

  ServiceContext& s_;
  grpc::CallbackServerContext* ctx_;
  const Clock::time_point deadline_;
  const v1::AttendUnaryRequest* request_;
  v1::AttendUnaryResponse* response_;
  std::atomic<bool> cancel_{false};
  RequestRecord record_;
  bool counted_open_ = false;
  std::optional<RequestPlan> plan_;
  RequestBuffers buffers_;
  int64_t reserved_ = 0;
  Clock::time_point queued_at_;
};

}  // namespace

AttentionService::AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler) {
  shared_.config = &config;
  shared_.limits = RequestLimits{config.max_tokens, config.max_request_bytes, config.max_samples, config.max_message_bytes,
                                 config.backend};
  shared_.metrics = metrics;
  shared_.scheduler = scheduler;
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionService::Attend(
    grpc::CallbackServerContext* ctx) {
  return new AttendReactor(shared_, ctx);
}

grpc::ServerUnaryReactor* AttentionService::AttendUnary(grpc::CallbackServerContext* ctx,
                                                        const v1::AttendUnaryRequest* request,
                                                        v1::AttendUnaryResponse* response) {
  return new UnaryReactor(shared_, ctx, request, response);
}

grpc::ServerUnaryReactor* AttentionService::GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest*,
                                                    v1::GetInfoResponse* response) {
  const ServerConfig& c = *shared_.config;
  response->set_version(PLSH_VERSION);
  for (Backend* b : BackendRegistry::global().backends()) {
    v1::BackendInfo* info = response->add_backends();
    info->set_name(b->name());
    info->set_device(b->device());
  }
  for (const std::string& note : BackendRegistry::global().notes()) response->add_backend_notes(note);
  v1::Limits* l = response->mutable_limits();
  l->set_max_tokens(c.max_tokens);
  l->set_max_request_bytes(c.max_request_bytes);
  l->set_memory_budget(c.memory_budget);
  l->set_max_samples(c.max_samples);
  l->set_max_message_bytes(c.max_message_bytes);
  l->set_max_concurrent(c.max_concurrent);
  l->set_queue_depth(c.queue_depth);
  l->set_workers(c.workers);
  const AttentionOptions defaults;
  v1::Defaults* d = response->mutable_defaults();
  d->set_mode(v1::MODE_LSH);
  d->set_samples(defaults.samples);
  d->set_seed(defaults.seed);
  d->set_window_eps(defaults.window_eps);
  d->set_probe_rows(defaults.probe_rows);
  d->set_mask_row_budget(defaults.mask_row_budget);
  d->set_estimates(defaults.estimates);
  d->set_check_finite(defaults.check_finite);
  d->set_out_chunk_bytes(c.max_message_bytes - kMessageHeadroom);
  d->set_backend(c.backend);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace plsh::server
