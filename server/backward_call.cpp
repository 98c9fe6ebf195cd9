#include "server/backward_call.h"

#include <algorithm>
#include <new>

#include "plsh/backend.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/logging.h"
#include "server/status_map.h"
#include "server/streamed_call.h"

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
  // The workspace the charge counted (size_backward; the admission step is
  // to hand it in).
  const Workspace charged = plan.stateless ? plan.forward().kernel.workspace() : plan.forward().kernel.backward_workspace;
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(charged.host_bytes));
  if (plan.stateless) {
    RequestPlan& f = *plan.stateless;
    RETURN_IF_ERROR(bind_tensors(&f.kernel.params, buffers.forward.refs()));
    if (plan.recompute_forward) {
      ASSIGN_OR_RETURN(const AttentionResult forward, run_attention(*f.backend, f.kernel, workspace.ref(), ctx));
      c.forward_flops = forward.flops;
      c.result.timings["forward"] = forward.timings.count("compute") ? forward.timings.at("compute") : 0.0;
    } else {
      // The client's out and lse: checked (finite) as inputs.
      grads.out = buffers.forward.out.get();
      grads.lse = buffers.forward.lse.get();
    }
  }
  const RequestPlan& f = plan.forward();
  ASSIGN_OR_RETURN(BackwardResult result, run_backward(*f.backend, f.kernel, grads, workspace.ref(), ctx));
  for (const auto& [name, seconds] : c.result.timings) result.timings[name] = seconds;
  c.result = std::move(result);
  return c;
}

namespace {

// ------------------------------------------------------- AttendBackward

class BackwardReactor final : public StreamedCall<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  using StreamedCall::StreamedCall;

 private:
  Status handle_message() override {
    return dispatch(request_, [this](const v1::BackwardHeader& header) { return on_header(header); });
  }

  Status on_header(const v1::BackwardHeader& header) {
    if (backward_)
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
      ASSIGN_OR_RETURN(const int64_t planning_host, planning_bytes(f));
      const MemoryCharge planning{planning_host, 0};
      RETURN_IF_ERROR(s_.contexts != nullptr ? s_.contexts->reserve(planning) : s_.scheduler->reserve(planning));
      const Status planned = plan_kernels(&f, s_.limits);
      s_.scheduler->release(planning);
      RETURN_IF_ERROR(planned);
    }
    const RequestPlan& f = b.forward();
    record_.mode = mode_name(f.options.mode);
    record_.backend = f.backend->name();
    record_.shape = shape_of(f) + " grad=" + dtype_name(b.grad_dtype);
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
    publish_ack(b.id, *f.backend, b.out_chunk_bytes);
    return Status::Ok();
  }

  void run() override {
    const BackwardPlan& b = *backward_;
    StatusOr<BackwardComputation> result = run_guarded<BackwardComputation>(
        end_at_, "backward request " + b.id,
        [this](const ExecContext& exec) { return compute_backward(*backward_, buffers_bw_, exec); });
    if (result.ok()) record_.backend = result->result.backend;
    computed(std::move(result), &result_, b.dq_bytes() + 2 * b.dkv_bytes());
  }

  // dq, then dk, then dv, in row order.
  bool next_output() override {
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
      sent(rows * g.row_bytes);
      *g.next += rows;
      return true;
    }
    return false;
  }

  void set_summary() override {
    response_.Clear();
    const BackwardPlan& b = *backward_;
    v1::BackwardSummary* s = response_.mutable_summary();
    wire::backward_result_to_summary(result_->result, s);
    s->set_request_id(b.id);
    s->set_context_id(b.context_id);
    s->set_context_kept(!b.context_id.empty() && b.keep_context);
    s->set_mode(wire::to_wire(b.forward().options.mode));
    s->set_grad_dtype(wire::to_wire(b.grad_dtype));
    s->set_forward_flops(result_->forward_flops);
    fill_timings(s->mutable_timings());
    s->set_received_bytes(record_.received_bytes);
    s->set_sent_bytes(record_.sent_bytes);
  }

  // Memory: close() gave the reservation back; so go the buffers. The
  // context goes back to the store (consumed when its client got OK and
  // did not ask to keep it); when it is consumed, its memory goes with the
  // last reference here.
  void after_close() override {
    buffers_bw_ = BackwardBuffers{};
    if (checked_out_) {
      s_.contexts->check_in(backward_->context_id, client_status_.ok() && !backward_->keep_context, backward_->id);
      backward_->context.reset();
    }
  }

  std::optional<BackwardPlan> backward_;
  bool checked_out_ = false;
  BackwardBuffers buffers_bw_;
  std::optional<BackwardComputation> result_;  // under mu_, as the outputs sent
  int64_t next_[3] = {0, 0, 0};                // dq, dk, dv rows sent
};

}  // namespace

grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* start_attend_backward(
    ServiceContext& s, grpc::CallbackServerContext* ctx) {
  return BackwardReactor::start<BackwardReactor>(s, ctx, "AttendBackward", "BackwardRequest");
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
