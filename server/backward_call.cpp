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

int64_t GradRequest::input_bytes() const {
  int64_t bytes = shape.dout.bytes();
  if (stateless) {
    bytes += shape.q.bytes() + shape.k.bytes() + shape.v.bytes();
    if (!recompute_forward) bytes += shape.out.bytes() + shape.lse.bytes();
  }
  return bytes;
}

int64_t GradRequest::tensor_bytes() const {
  int64_t bytes = shape.dout.bytes() + shape.dq.bytes() + shape.dk.bytes() + shape.dv.bytes();
  if (stateless) bytes += shape.q.bytes() + shape.k.bytes() + shape.v.bytes() + shape.out.bytes() + shape.lse.bytes();
  return bytes;
}

Workspace GradRequest::workspace() const {
  const Plan& plan = forward().plan;
  return stateless ? plan.workspace() : plan.backward_workspace;
}

MemoryLayout GradRequest::memory_layout() const {
  // The forward's tensors come with a stateless backward; a context holds its own.
  const auto forward = [&](const TensorShape& t) { return stateless ? t.bytes() : 0; };
  return MemoryLayout{.q = forward(shape.q),
                      .k = forward(shape.k),
                      .v = forward(shape.v),
                      .out = forward(shape.out),
                      .lse = forward(shape.lse),
                      .dout = shape.dout.bytes(),
                      .dq = shape.dq.bytes(),
                      .dk = shape.dk.bytes(),
                      .dv = shape.dv.bytes(),
                      .workspace = workspace().host_bytes};
}

StatusOr<GradRequest> check_backward_header(const v1::BackwardHeader& h, const RequestLimits& limits) {
  GradRequest g;
  RETURN_IF_ERROR(check_request_id(h.request_id()));
  g.id = h.request_id().empty() ? next_request_id() : h.request_id();
  g.keep_context = h.keep_context();
  g.recompute_forward = h.recompute_forward();
  if (h.out_chunk_bytes() < 0)
    return invalid_argument("out_chunk_bytes = " + std::to_string(h.out_chunk_bytes()) +
                            ", expected >= 0 (0: server's largest)");
  g.requested_chunk_bytes = h.out_chunk_bytes();
  switch (h.source_case()) {
    case v1::BackwardHeader::kContextId:
      if (h.context_id().empty())
        return invalid_argument("context_id is empty, expected the context_id of a forward's summary (keep_context)");
      if (g.recompute_forward)
        return invalid_argument(
            "recompute_forward = true with context_id: the context holds out and lse; expected it "
            "only with a stateless forward header");
      g.context_id = h.context_id();
      break;
    case v1::BackwardHeader::kForward: {
      if (g.keep_context)
        return invalid_argument(
            "keep_context = true with a stateless backward (forward header): there is no context "
            "to keep; expected it only with context_id");
      ASSIGN_OR_RETURN(Request forward, check_request(h.forward(), limits));
      // The forward's header as the backward reads it: planned for its
      // backward, out and lse in host buffers, no estimates, nothing kept.
      forward.id = g.id;
      forward.keep_context = false;
      forward.return_lse = false;
      forward.backward = true;
      forward.options.estimates = false;
      g.stateless = std::move(forward);
      break;
    }
    default:
      return invalid_argument("BackwardHeader has neither context_id nor forward, expected one of them");
  }
  if (g.stateless) {
    const DType dtype = g.stateless->options.dtype;
    ASSIGN_OR_RETURN(g.grad_dtype, wire::dtype_from_wire("grad_dtype", h.grad_dtype(), dtype));
  } else if (h.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
    // The context's dtype is known only once it is found: checked there.
    ASSIGN_OR_RETURN(g.grad_dtype, wire::dtype_from_wire("grad_dtype", h.grad_dtype(), std::nullopt));
  }
  return g;
}

Status size_backward(GradRequest* request, const RequestLimits& limits) {
  GradRequest& g = *request;
  const AttentionOptions& o = g.forward().options;
  g.shape = RequestShape::of(o, g.grad_dtype);
  const RequestShape& z = g.shape;
  if (g.tensor_bytes() > limits.max_request_bytes)
    return resource_exhausted("backward needs " + std::to_string(g.tensor_bytes()) + " bytes (dout + dq + dk + dv" +
                              (g.stateless ? " + q + k + v + out + lse" : "") + "), expected <= " +
                              std::to_string(limits.max_request_bytes) + " (the server's --max-request-bytes)");
  const int64_t payload_cap = limits.max_message_bytes - kMessageHeadroom;
  const int64_t widest_row = std::max({z.dout.row_bytes, z.dq.row_bytes, z.dk.row_bytes, z.q.row_bytes, z.k.row_bytes});
  if (widest_row > payload_cap)
    return resource_exhausted("heads = " + std::to_string(o.heads) + ", head_dim = " + std::to_string(o.head_dim) +
                              ": one row is " + std::to_string(widest_row) + " bytes, expected <= " +
                              std::to_string(payload_cap) + " (the server's --max-message-bytes less framing)");
  const int64_t wanted = g.requested_chunk_bytes == 0 ? payload_cap : std::min(g.requested_chunk_bytes, payload_cap);
  g.out_chunk_bytes = std::max({wanted, z.dq.row_bytes, z.dk.row_bytes});
  return Status::Ok();
}

StatusOr<BackwardComputation> compute_backward(GradRequest& g, const RequestMemory& memory, const ExecContext& ctx) {
  RETURN_IF_ERROR(ctx.check_stop());
  BackwardComputation c;
  GradientRefs grads;
  grads.dout = memory.dout;
  grads.dq = memory.dq;
  grads.dk = memory.dk;
  grads.dv = memory.dv;
  grads.grad_dtype = g.grad_dtype;
  if (g.stateless) {
    Request& f = *g.stateless;
    RETURN_IF_ERROR(bind_tensors(&f.plan.params, memory.refs()));
    if (g.recompute_forward) {
      ASSIGN_OR_RETURN(const AttentionResult forward, run_attention(*f.backend, f.plan, memory.workspace, ctx));
      c.forward_flops = forward.flops;
      c.result.timings["forward"] = forward.timings.count("compute") ? forward.timings.at("compute") : 0.0;
    } else {
      // The client's out and lse: checked (finite) as inputs.
      grads.out = memory.out;
      grads.lse = memory.lse;
    }
  }
  const Request& f = g.forward();
  ASSIGN_OR_RETURN(BackwardResult result, run_backward(*f.backend, f.plan, grads, memory.workspace, ctx));
  for (const auto& [name, seconds] : c.result.timings) result.timings[name] = seconds;
  c.result = std::move(result);
  return c;
}

namespace {

// ------------------------------------------------------- AttendBackward

class BackwardReactor final : public TypedStreamedCall<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  using TypedStreamedCall::TypedStreamedCall;

 private:
  // The forward this backward differentiates: the context, checked out at
  // once (no other backward, eviction or expiry meanwhile), or the
  // stateless header planned for its backward (the planning bound held).
  Status find_forward(const v1::BackwardHeader& header) {
    GradRequest& g = *grad_;
    if (!g.context_id.empty()) {
      if (s_.contexts == nullptr || !s_.contexts->enabled())
        return failed_precondition("context_id = " + echo_value(g.context_id) +
                                   ": this server keeps no contexts (--context-ttl 0); expected a stateless backward");
      ASSIGN_OR_RETURN(g.context, s_.contexts->check_out(g.context_id, record_.client, g.id));
      checked_out_ = true;
      if (header.grad_dtype() == v1::DTYPE_UNSPECIFIED) g.grad_dtype = g.context->request().options.dtype;
      return Status::Ok();
    }
    Request& f = *g.stateless;
    ASSIGN_OR_RETURN(const int64_t planning, planning_bytes(f));
    return ticket_.plan(planning, [&] { return plan_request(&f, s_.limits); });
  }

  Status on_header(const v1::BackwardHeader& header) override {
    if (grad_) return invalid_argument("header received twice, expected exactly one header as the first message");
    if (header.has_forward()) record_.mode = wire::mode_label(header.forward().mode());
    ASSIGN_OR_RETURN(grad_, check_backward_header(header, s_.limits));
    GradRequest& g = *grad_;
    record_.id = g.id;
    RETURN_IF_ERROR(find_forward(header));
    const Request& f = g.forward();
    record_.mode = mode_name(f.options.mode);
    record_.backend = f.backend->name();
    record_.shape = shape_of(f) + " grad=" + dtype_name(g.grad_dtype);
    RETURN_IF_ERROR(size_backward(&g, s_.limits));
    phase_bytes.store(g.input_bytes());
    // A stateless forward's plan holds its draws; a context's are charged to it.
    ASSIGN_OR_RETURN(memory_, ticket_.admit(g.memory_layout(), g.stateless ? f.plan.own_host_bytes : 0,
                                            g.workspace().device_bytes, *f.backend));
    const RequestShape& z = g.shape;
    const AssemblyTarget dout{v1::TENSOR_DOUT, "dout", memory_.dout, z.dout, "batch * q_len"};
    if (!g.stateless) {
      assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{dout});
    } else {
      const AssemblyTarget q{v1::TENSOR_Q, "q", memory_.q, z.q, "batch * q_len"};
      const AssemblyTarget k{v1::TENSOR_K, "k", memory_.k, z.k, "batch * kv_len"};
      const AssemblyTarget v{v1::TENSOR_V, "v", memory_.v, z.v, "batch * kv_len"};
      if (g.recompute_forward) {
        assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{q, k, v, dout});
      } else {
        const AssemblyTarget out{v1::TENSOR_OUT, "out", memory_.out, z.out, "batch * q_len"};
        const AssemblyTarget lse{v1::TENSOR_LSE, "lse", reinterpret_cast<uint8_t*>(memory_.lse), z.lse,
                                 "batch * q_len"};
        assembler_ = std::make_unique<Assembler>(std::initializer_list<AssemblyTarget>{q, k, v, out, lse, dout});
      }
    }
    publish_ack(g.id, *f.backend, g.out_chunk_bytes);
    return Status::Ok();
  }

  void run() override {
    const GradRequest& g = *grad_;
    StatusOr<BackwardComputation> result = run_guarded<BackwardComputation>(
        end_at_, "backward request " + g.id,
        [this](const ExecContext& exec) { return compute_backward(*grad_, memory_, exec); });
    if (result.ok()) record_.backend = result->result.backend;
    computed(std::move(result), &result_, g.shape.dq.bytes() + g.shape.dk.bytes() + g.shape.dv.bytes());
  }

  // dq, then dk, then dv, in row order: slices of the granted block.
  bool next_output() override {
    const GradRequest& g = *grad_;
    return next_output_chunk({{true, v1::TENSOR_DQ, memory_.dq, g.shape.dq, &next_[0]},
                              {true, v1::TENSOR_DK, memory_.dk, g.shape.dk, &next_[1]},
                              {true, v1::TENSOR_DV, memory_.dv, g.shape.dv, &next_[2]}},
                             g.out_chunk_bytes, memory_.block);
  }

  void set_summary() override {
    const GradRequest& g = *grad_;
    v1::BackwardResponse message;
    v1::BackwardSummary* s = message.mutable_summary();
    wire::backward_result_to_summary(result_->result, s);
    s->set_request_id(g.id);
    s->set_context_id(g.context_id);
    s->set_context_kept(!g.context_id.empty() && g.keep_context);
    s->set_mode(wire::to_wire(g.forward().options.mode));
    s->set_grad_dtype(wire::to_wire(g.grad_dtype));
    s->set_forward_flops(result_->forward_flops);
    fill_timings(s->mutable_timings());
    s->set_received_bytes(record_.received_bytes);
    s->set_sent_bytes(record_.sent_bytes);
    response_ = serialize_message(message);
  }

  // close() gave the memory back. The context goes back to the store
  // (consumed when its client got OK and did not ask to keep it); when it
  // is consumed, its memory goes with the last reference here.
  void after_close() override {
    if (checked_out_) {
      s_.contexts->check_in(grad_->context_id, client_status_.ok() && !grad_->keep_context, grad_->id);
      grad_->context.reset();
    }
  }

  std::optional<GradRequest> grad_;
  bool checked_out_ = false;
  std::optional<BackwardComputation> result_;  // under mu_, as the outputs sent
  int64_t next_[3] = {0, 0, 0};                // dq, dk, dv rows sent
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* start_attend_backward(ServiceContext& s,
                                                                                   grpc::CallbackServerContext* ctx) {
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
