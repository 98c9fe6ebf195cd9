#include "server/backward_call.h"

#include <algorithm>
#include <exception>
#include <mutex>
#include <new>

#include "plsh/backend.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/logging.h"
#include "server/status_map.h"

namespace plsh::server {

// ------------------------------------------------------------ planning

int64_t BackwardPlan::input_bytes() const {
  int64_t bytes = dout_bytes();
  if (stateless) {
    const RequestPlan& f = *stateless;
    bytes += f.q_bytes() + 2 * f.kv_bytes();
    if (!recompute_forward) bytes += f.out_bytes() + f.q_rows * f.lse_row_bytes;
  }
  return bytes;
}

StatusOr<BackwardPlan> check_backward_header(const v1::BackwardHeader& h, const RequestLimits& limits) {
  BackwardPlan plan;
  RETURN_IF_ERROR(check_request_id(h.request_id()));
  plan.id = h.request_id().empty() ? next_request_id() : h.request_id();
  plan.keep_context = h.keep_context();
  plan.recompute_forward = h.recompute_forward();
  if (h.out_chunk_bytes() < 0)
    return invalid_argument("out_chunk_bytes = " + std::to_string(h.out_chunk_bytes()) + ", expected >= 0 (0: server's largest)");
  plan.requested_chunk_bytes = h.out_chunk_bytes();
  switch (h.source_case()) {
    case v1::BackwardHeader::kContextId:
      if (h.context_id().empty())
        return invalid_argument("context_id is empty, expected the context_id of a forward's summary (keep_context)");
      if (plan.recompute_forward)
        return invalid_argument("recompute_forward = true with context_id: the context holds out and lse; expected it "
                                "only with a stateless forward header");
      plan.context_id = h.context_id();
      break;
    case v1::BackwardHeader::kForward: {
      if (plan.keep_context)
        return invalid_argument("keep_context = true with a stateless backward (forward header): there is no context "
                                "to keep; expected it only with context_id");
      ASSIGN_OR_RETURN(RequestPlan forward, check_request(h.forward(), limits));
      // The forward's header as the backward reads it: planned for its
      // backward, out and lse in host buffers, no estimates, nothing kept.
      forward.id = plan.id;
      forward.keep_context = false;
      forward.return_lse = false;
      forward.backward = true;
      forward.options.estimates = false;
      plan.stateless = std::move(forward);
      break;
    }
    default:
      return invalid_argument("BackwardHeader has neither context_id nor forward, expected one of them");
  }
  if (plan.stateless) {
    const DType dtype = plan.stateless->options.dtype;
    ASSIGN_OR_RETURN(plan.grad_dtype, wire::dtype_from_wire("grad_dtype", h.grad_dtype(), dtype));
  } else if (h.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
    // The context's dtype is known only once it is found: checked there.
    ASSIGN_OR_RETURN(plan.grad_dtype, wire::dtype_from_wire("grad_dtype", h.grad_dtype(), std::nullopt));
  }
  return plan;
}

Status size_backward(BackwardPlan* plan, const RequestLimits& limits) {
  BackwardPlan& b = *plan;
  const RequestPlan& f = b.forward();
  const AttentionOptions& o = f.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  const int64_t grad_bytes = static_cast<int64_t>(dtype_bytes(b.grad_dtype));
  b.dout_row_bytes = f.out_row_bytes;
  b.dq_row_bytes = o.heads * o.head_dim * grad_bytes;
  b.dkv_row_bytes = kv_heads * o.head_dim * grad_bytes;
  b.total_bytes = b.dout_bytes() + b.dq_bytes() + 2 * b.dkv_bytes();
  if (b.stateless) b.total_bytes += f.q_bytes() + 2 * f.kv_bytes() + f.out_bytes() + f.q_rows * f.lse_row_bytes;
  if (b.total_bytes > limits.max_request_bytes)
    return resource_exhausted("backward needs " + std::to_string(b.total_bytes) + " bytes (dout + dq + dk + dv" +
                              (b.stateless ? " + q + k + v + out + lse" : "") + "), expected <= " +
                              std::to_string(limits.max_request_bytes) + " (the server's --max-request-bytes)");
  const int64_t payload_cap = limits.max_message_bytes - kMessageHeadroom;
  const int64_t widest_row = std::max({b.dout_row_bytes, b.dq_row_bytes, b.dkv_row_bytes, f.q_row_bytes, f.kv_row_bytes});
  if (widest_row > payload_cap)
    return resource_exhausted("heads = " + std::to_string(o.heads) + ", head_dim = " + std::to_string(o.head_dim) +
                              ": one row is " + std::to_string(widest_row) + " bytes, expected <= " +
                              std::to_string(payload_cap) + " (the server's --max-message-bytes less framing)");
  const int64_t wanted = b.requested_chunk_bytes == 0 ? payload_cap : std::min(b.requested_chunk_bytes, payload_cap);
  b.out_chunk_bytes = std::max({wanted, b.dq_row_bytes, b.dkv_row_bytes});
  // By context only the backward's own workspace: the forward has run. A
  // stateless request may run both, one after the other: the larger.
  const Workspace w = b.stateless ? f.kernel.workspace() : f.kernel.backward_workspace;
  b.charge.host_bytes = b.total_bytes + w.host_bytes;
  b.charge.device_bytes = w.device_bytes;
  return Status::Ok();
}

BackwardBuffers BackwardBuffers::allocate(const BackwardPlan& plan) {
  BackwardBuffers b;
  // Left uninitialised: the assembler checks that every input row is
  // written, the backward writes every row of dq, dk, dv.
  b.dout.reset(new uint8_t[static_cast<size_t>(plan.dout_bytes())]);
  b.dq.reset(new uint8_t[static_cast<size_t>(plan.dq_bytes())]);
  b.dk.reset(new uint8_t[static_cast<size_t>(plan.dkv_bytes())]);
  b.dv.reset(new uint8_t[static_cast<size_t>(plan.dkv_bytes())]);
  if (plan.stateless) b.forward = RequestBuffers::allocate(*plan.stateless);
  return b;
}

StatusOr<BackwardComputation> compute_backward(BackwardPlan& plan, BackwardBuffers& buffers, const ExecContext& ctx) {
  RETURN_IF_ERROR(ctx.check_stop());
  BackwardComputation c;
  GradientRefs grads;
  grads.dout = buffers.dout.get();
  grads.dq = buffers.dq.get();
  grads.dk = buffers.dk.get();
  grads.dv = buffers.dv.get();
  grads.grad_dtype = plan.grad_dtype;
  if (plan.stateless) {
    RequestPlan& f = *plan.stateless;
    RETURN_IF_ERROR(bind_tensors(&f.kernel.params, buffers.forward.refs()));
    if (plan.recompute_forward) {
      ASSIGN_OR_RETURN(const AttentionResult forward, run_attention(*f.backend, f.kernel, ctx));
      c.forward_flops = forward.flops;
      c.result.timings["forward"] = forward.timings.count("compute") ? forward.timings.at("compute") : 0.0;
    } else {
      // The client's out and lse: checked (finite) as inputs.
      grads.out = buffers.forward.out.get();
      grads.lse = buffers.forward.lse.get();
    }
  }
  const RequestPlan& f = plan.forward();
  ASSIGN_OR_RETURN(BackwardResult result, run_backward(*f.backend, f.kernel, grads, ctx));
  for (const auto& [name, seconds] : c.result.timings) result.timings[name] = seconds;
  c.result = std::move(result);
  return c;
}

namespace {

std::string shape_text(const RequestPlan& p, DType grad_dtype) {
  const AttentionOptions& o = p.options;
  return "B=" + std::to_string(o.batch) + " Nq=" + std::to_string(o.q_len) + " Nk=" + std::to_string(o.kv_len) +
         " H=" + std::to_string(o.heads) + " Hkv=" + std::to_string(resolved_kv_heads(o.heads, o.kv_heads)) +
         " D=" + std::to_string(o.head_dim) + " " + dtype_name(o.dtype) + " grad=" + dtype_name(grad_dtype);
}

// ------------------------------------------------------- AttendBackward

class BackwardReactor final : public grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>,
                              private CallBase {
 public:
  BackwardReactor(ServiceContext& s, grpc::CallbackServerContext* ctx) : CallBase(s, ctx, "AttendBackward") {
    const Status opened = open(/*watched=*/true);
    if (!opened.ok()) {
      fail(opened);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (cancel_.load() || ctx_->IsCancelled()) {
        fail(cancelled("cancelled by the client"));
      } else {
        fail(invalid_argument(std::string("the stream ended before the end message (closed by the client, or a "
                                          "message that is not a BackwardRequest), expected ") +
                              (plan_ready_ ? "chunks then end" : "header, chunks, then end")));
      }
      return;
    }
    progress();
    Status status = check_message_size(request_.ByteSizeLong());
    if (status.ok()) status = handle(request_);
    if (!status.ok()) {
      fail(status);
      return;
    }
    if (!end_received_) StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    if (ok) progress();
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      if (!ok) {
        if (!finish_) finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "client went away during output");
        cancel_.store(true);
      }
    }
    pump();
  }

  void OnCancel() override { cancel_.store(true); }
  void OnDone() override { delete this; }

  // The watchdog's, as AttendReactor's (service.cpp).
  void expire(const grpc::Status& status, const char* reason) override {
    phase.store(static_cast<int>(Phase::kDone));
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

 private:
  enum class Stage { kReading, kComputing, kSending, kFailed };

  Status handle(const v1::BackwardRequest& request) {
    switch (request.kind_case()) {
      case v1::BackwardRequest::kHeader: return on_header(request.header());
      case v1::BackwardRequest::kChunk: {
        if (!plan_ready_) return invalid_argument("chunk before header, expected the header as the first message");
        RETURN_IF_ERROR(assembler_->add(request.chunk()));
        const auto bytes = static_cast<int64_t>(request.chunk().data().size());
        record_.received_bytes += bytes;
        s_.metrics->received_bytes(static_cast<double>(bytes));
        return Status::Ok();
      }
      case v1::BackwardRequest::kEnd: {
        if (!plan_ready_) return invalid_argument("end before header, expected the header as the first message");
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
      default: break;
    }
    return invalid_argument("BackwardRequest with no kind set, expected header, chunk or end");
  }

  Status on_header(const v1::BackwardHeader& header) {
    if (plan_ready_ || backward_)
      return invalid_argument("header received twice, expected exactly one header as the first message");
    if (header.has_forward()) record_.mode = wire::mode_label(header.forward().mode());
    ASSIGN_OR_RETURN(BackwardPlan plan, check_backward_header(header, s_.limits));
    backward_ = std::move(plan);
    BackwardPlan& b = *backward_;
    record_.id = b.id;
    if (!b.context_id.empty()) {
      if (s_.contexts == nullptr || !s_.contexts->enabled())
        return failed_precondition("context_id = " + echo_value(b.context_id) +
                                   ": this server keeps no contexts (--context-ttl 0); expected a stateless backward");
      ASSIGN_OR_RETURN(b.context, s_.contexts->check_out(b.context_id, record_.client, b.id));
      checked_out_ = true;
      if (header.grad_dtype() == v1::DTYPE_UNSPECIFIED) b.grad_dtype = b.context->plan().options.dtype;
    } else {
      // Planning allocates the draws: held against the budget meanwhile, as
      // for a forward (CallBase::plan).
      RequestPlan& f = *b.stateless;
      const MemoryCharge planning{planning_bytes(f), 0};
      RETURN_IF_ERROR(s_.contexts != nullptr ? s_.contexts->reserve(planning) : s_.scheduler->reserve(planning));
      const Status planned = plan_kernels(&f, s_.limits);
      s_.scheduler->release(planning);
      RETURN_IF_ERROR(planned);
    }
    const RequestPlan& f = b.forward();
    record_.mode = mode_name(f.options.mode);
    record_.backend = f.backend->name();
    record_.shape = shape_text(f, b.grad_dtype);
    RETURN_IF_ERROR(size_backward(&b, s_.limits));
    phase_bytes.store(b.input_bytes());
    RETURN_IF_ERROR(reserve(b.charge));
    try {
      buffers_bw_ = BackwardBuffers::allocate(b);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("out of host memory for the backward's " + std::to_string(b.total_bytes) + " bytes");
    }
    const int64_t q_rows = f.q_rows, kv_rows = f.kv_rows;
    const AssemblyTarget dout{v1::TENSOR_DOUT, "dout", buffers_bw_.dout.get(), q_rows, b.dout_row_bytes, "batch * q_len"};
    if (!b.stateless) {
      assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{dout});
    } else {
      RequestBuffers& in = buffers_bw_.forward;
      const AssemblyTarget q{v1::TENSOR_Q, "q", in.q.get(), q_rows, f.q_row_bytes, "batch * q_len"};
      const AssemblyTarget k{v1::TENSOR_K, "k", in.k.get(), kv_rows, f.kv_row_bytes, "batch * kv_len"};
      const AssemblyTarget v{v1::TENSOR_V, "v", in.v.get(), kv_rows, f.kv_row_bytes, "batch * kv_len"};
      if (b.recompute_forward) {
        assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{q, k, v, dout});
      } else {
        const AssemblyTarget out{v1::TENSOR_OUT, "out", in.out.get(), q_rows, f.out_row_bytes, "batch * q_len"};
        const AssemblyTarget lse{v1::TENSOR_LSE, "lse", reinterpret_cast<uint8_t*>(in.lse.get()), q_rows,
                                 f.lse_row_bytes, "batch * q_len"};
        assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{q, k, v, out, lse, dout});
      }
    }
    plan_ready_ = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ack_.set_request_id(b.id);
      ack_.set_backend(f.backend->name());
      ack_.set_device(f.backend->device());
      ack_.set_out_chunk_bytes(b.out_chunk_bytes);
      ack_.set_max_message_bytes(s_.limits.max_message_bytes);
      ack_.set_max_chunk_payload_bytes(wire::max_chunk_payload_bytes(s_.limits.max_message_bytes));
      ack_ready_ = true;
    }
    pump();
    return Status::Ok();
  }

  // On a worker.
  void run() {
    const Clock::time_point started = Clock::now();
    record_.queued = seconds_between(end_at_, started);
    StatusOr<BackwardComputation> result = cancelled("cancelled by the client while queued");
    if (!cancel_.load()) {
      ExecContext exec;
      exec.cancel = &cancel_;
      exec.deadline = deadline_;
      try {
        result = compute_backward(*backward_, buffers_bw_, exec);
      } catch (const std::bad_alloc&) {
        result = resource_exhausted("out of host memory while computing backward request " + backward_->id);
      } catch (const std::exception& e) {
        result = internal_error(std::string("backward request ") + backward_->id + ": " + e.what());
      }
    }
    record_.computing = seconds_between(started, Clock::now());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result.ok()) {
        result_ = std::move(result).value();
        record_.backend = result_->result.backend;
        stage_ = Stage::kSending;
        send_start_ = Clock::now();
        enter(Phase::kSending, backward_->dq_bytes() + 2 * backward_->dkv_bytes());
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

  // dq, then dk, then dv, in row order. Called with mu_ held.
  bool next_output() {
    const BackwardPlan& b = *backward_;
    const struct {
      v1::Tensor tensor;
      const uint8_t* data;
      int64_t rows, row_bytes;
      int64_t* next;
    } grads[] = {{v1::TENSOR_DQ, buffers_bw_.dq.get(), b.forward().q_rows, b.dq_row_bytes, &next_[0]},
                 {v1::TENSOR_DK, buffers_bw_.dk.get(), b.forward().kv_rows, b.dkv_row_bytes, &next_[1]},
                 {v1::TENSOR_DV, buffers_bw_.dv.get(), b.forward().kv_rows, b.dkv_row_bytes, &next_[2]}};
    for (const auto& g : grads) {
      if (*g.next >= g.rows) continue;
      const int64_t rows = std::min(g.rows - *g.next, std::max<int64_t>(1, b.out_chunk_bytes / g.row_bytes));
      response_.Clear();
      v1::OutputChunk* c = response_.mutable_grad_chunk();
      c->set_tensor(g.tensor);
      c->set_row_start(*g.next);
      c->set_row_count(rows);
      c->set_data(g.data + *g.next * g.row_bytes, static_cast<size_t>(rows * g.row_bytes));
      record_.sent_bytes += rows * g.row_bytes;
      s_.metrics->sent_bytes(static_cast<double>(rows * g.row_bytes));
      *g.next += rows;
      return true;
    }
    return false;
  }

  void set_summary() {
    response_.Clear();
    record_.sending = seconds_between(send_start_, Clock::now());
    const BackwardPlan& b = *backward_;
    v1::BackwardSummary* s = response_.mutable_summary();
    wire::backward_result_to_summary(result_->result, s);
    s->set_request_id(b.id);
    s->set_context_id(b.context_id);
    s->set_context_kept(!b.context_id.empty() && b.keep_context);
    s->set_mode(wire::to_wire(b.forward().options.mode));
    s->set_grad_dtype(wire::to_wire(b.grad_dtype));
    s->set_forward_flops(result_->forward_flops);
    v1::Timings* t = s->mutable_timings();
    t->set_queued_seconds(record_.queued);
    t->set_receiving_seconds(record_.receiving);
    t->set_computing_seconds(record_.computing);
    t->set_sending_seconds(record_.sending);
    t->set_total_seconds(seconds_between(record_.start, Clock::now()));
    s->set_received_bytes(record_.received_bytes);
    s->set_sent_bytes(record_.sent_bytes);
  }

  // As AttendReactor's pump (service.cpp): the next write or the finish,
  // one write at a time, the call itself after the lock is released.
  void pump() {
    enum class Action { kNone, kWrite, kFinish } action = Action::kNone;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || (write_in_flight_ && !abandon_write_)) return;
      if (finish_) {
        if (stage_ == Stage::kComputing) return;  // the worker holds the buffers; run() pumps again
        action = Action::kFinish;
        status = *finish_;
      } else if (write_in_flight_) {
        return;
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
    const grpc::Status final_status = close(std::move(status));
    // Memory: close() gave the reservation back; so go the buffers. The
    // context goes back to the store (consumed when its client got OK and
    // did not ask to keep it); when it is consumed, its memory goes with
    // the last reference here.
    buffers_bw_ = BackwardBuffers{};
    if (checked_out_) {
      s_.contexts->check_in(backward_->context_id, client_status_.ok() && !backward_->keep_context, backward_->id);
      backward_->context.reset();
    }
    Finish(final_status);  // last: OnDone may delete this at once
  }

  // Reading side.
  v1::BackwardRequest request_;
  bool plan_ready_ = false;
  bool end_received_ = false;
  Clock::time_point end_at_;
  std::optional<BackwardPlan> backward_;
  bool checked_out_ = false;
  BackwardBuffers buffers_bw_;
  std::unique_ptr<Assembler> assembler_;

  // Writing side, shared by reactions and the worker.
  std::mutex mu_;
  Stage stage_ = Stage::kReading;
  v1::Ack ack_;
  bool ack_ready_ = false, ack_sent_ = false;
  bool write_in_flight_ = false;
  bool abandon_write_ = false;
  std::optional<grpc::Status> finish_;
  bool finished_ = false;
  std::optional<BackwardComputation> result_;
  Clock::time_point send_start_;
  int64_t next_[3] = {0, 0, 0};  // dq, dk, dv rows sent
  bool summary_sent_ = false;
  v1::BackwardResponse response_;
};

}  // namespace

grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* start_attend_backward(
    ServiceContext& s, grpc::CallbackServerContext* ctx) {
  return new BackwardReactor(s, ctx);
}

// ------------------------------------------------------- ReleaseContext

grpc::ServerUnaryReactor* release_context(ServiceContext& s, grpc::CallbackServerContext* ctx,
                                          const v1::ReleaseContextRequest* request,
                                          v1::ReleaseContextResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // Holds nothing, so no CallBase: the token check here, as GetInfo's.
  std::string client;
  Status status = Status::Ok();
  if (s.auth != nullptr) {
    const Authorization a = s.auth->authorize(ctx->client_metadata(), Method::kReleaseContext);
    client = a.client ? a.client->name() : "unauthenticated";
    status = a.status;
  }
  int64_t released = 0;
  if (status.ok()) {
    if (s.contexts == nullptr || !s.contexts->enabled()) {
      status = not_found("context_id = " + echo_value(request->context_id()) +
                         ": this server keeps no contexts (--context-ttl 0)");
    } else {
      StatusOr<int64_t> bytes = s.contexts->release(request->context_id(), client);
      if (bytes.ok())
        released = *bytes;
      else
        status = bytes.status();
    }
  }
  const grpc::Status g = to_grpc_status(status);
  if (s.auth != nullptr) s.metrics->client_request(client, "ReleaseContext", grpc_code_name(g.error_code()), 0, 0);
  nlohmann::json fields = {{"method", "ReleaseContext"},
                           {"peer", ctx->peer()},
                           {"context_id", echo_value(request->context_id())},
                           {"status", grpc_code_name(g.error_code())},
                           {"released_bytes", released}};
  if (s.auth != nullptr) fields["client"] = client;
  if (!g.ok()) fields["message"] = g.error_message();
  log_event(spdlog::level::info, "request", fields);
  if (g.ok()) response->set_released_bytes(released);
  reactor->Finish(g);
  return reactor;
}

}  // namespace plsh::server
