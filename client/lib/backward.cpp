// Client::backward (AttendBackward) and Client::release_context: the
// training half of the client, beside client.cpp's forward, on the same
// stream engine (chunk_stream.h): q, k, v and dout go up as slices of the
// caller's memory, dq, dk and dv come down copied once into the reply.
#include <algorithm>
#include <optional>
#include <vector>

#include "chunk_stream.h"
#include "invalid.h"
#include "plsh/client.h"
#include "plsh/shape.h"
#include "proto/wire.h"

namespace plsh::client {

namespace {

v1::BackwardRequest header_of(const BackwardCall& call, bool stateless) {
  v1::BackwardRequest request;
  v1::BackwardHeader* h = request.mutable_header();
  h->set_request_id(call.request_id);
  if (stateless) {
    AttendCall forward;
    forward.options = call.options;
    forward.backend = call.backend;
    *h->mutable_forward() = make_header(forward);
    h->set_recompute_forward(call.recompute_forward);
  } else {
    h->set_context_id(call.context_id);
  }
  h->set_keep_context(call.keep_context);  // the server refuses it without a context
  if (call.grad_dtype) h->set_grad_dtype(wire::to_wire(*call.grad_dtype));
  h->set_out_chunk_bytes(std::max<int64_t>(0, call.chunk_bytes));
  return request;
}

}  // namespace

grpc::Status Client::backward(const BackwardCall& call, BackwardReply* reply) {
  // A reply used again keeps its gradients' storage: resizing it to the
  // same shape writes nothing, where fresh vectors would be zero-filled
  // page by page before the chunks overwrite them (a training loop's
  // steps, plsh bench --backward).
  std::vector<uint8_t> dq = std::move(reply->dq), dk = std::move(reply->dk), dv = std::move(reply->dv);
  *reply = BackwardReply{};
  reply->dq = std::move(dq);
  reply->dk = std::move(dk);
  reply->dv = std::move(dv);
  const bool stateless = call.context_id.empty();
  if (call.dout == nullptr) return invalid("dout = null, expected the upstream gradient [B, Nq, H, D]");
  if (stateless && (call.q == nullptr || call.k == nullptr || call.v == nullptr))
    return invalid("a stateless backward (no context_id) needs q, k and v");
  if (stateless && !call.recompute_forward && (call.out == nullptr || call.lse == nullptr))
    return invalid("a stateless backward needs out and lse, or recompute_forward");
  const DType grad_dtype = call.grad_dtype.value_or(call.options.dtype);
  const RequestShape z = RequestShape::of(call.options, grad_dtype);

  std::vector<ChunkStream::Input> inputs;
  if (stateless) {
    inputs.push_back({v1::TENSOR_Q, call.q, z.q});
    inputs.push_back({v1::TENSOR_K, call.k, z.k});
    inputs.push_back({v1::TENSOR_V, call.v, z.v});
    if (!call.recompute_forward) {
      inputs.push_back({v1::TENSOR_OUT, call.out, z.out});
      inputs.push_back({v1::TENSOR_LSE, call.lse, z.lse});
    }
  }
  inputs.push_back({v1::TENSOR_DOUT, call.dout, z.dout});
  reply->dq.resize(static_cast<size_t>(z.dq.bytes()));
  reply->dk.resize(static_cast<size_t>(z.dk.bytes()));
  reply->dv.resize(static_cast<size_t>(z.dv.bytes()));
  std::vector<ChunkStream::Output> outputs = {{v1::TENSOR_DQ, reply->dq.data(), z.dq},
                                              {v1::TENSOR_DK, reply->dk.data(), z.dk},
                                              {v1::TENSOR_DV, reply->dv.data(), z.dv}};
  std::optional<v1::BackwardSummary> summary;
  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  ChunkStream stream(channel_, "/plsh.v1.Attention/AttendBackward", call.chunk_bytes);
  const grpc::Status status = stream.run(
      &ctx, serialize_message(header_of(call, stateless)), std::move(inputs), &outputs,
      response_reader<v1::BackwardResponse>("a BackwardResponse", &summary, [](const v1::BackwardResponse& r) {
        return r.has_grad_chunk() ? &r.grad_chunk() : nullptr;
      }));
  stream.traffic().copy_to(&reply->sent_bytes, &reply->received_bytes, &reply->messages, &reply->largest_message_bytes);
  if (!status.ok()) return status;
  if (!summary) return protocol_error("stream ended OK without a summary");
  StatusOr<DType> got = wire::dtype_from_wire("grad_dtype", summary->grad_dtype(), std::nullopt);
  if (!got.ok() || *got != grad_dtype)
    return protocol_error("summary: grad_dtype " + std::to_string(summary->grad_dtype()));
  reply->grad_dtype = grad_dtype;
  reply->result = wire::backward_result_from_summary(*summary);
  reply->forward_flops = summary->forward_flops();
  const v1::Timings& t = summary->timings();
  reply->timings = ServerTimings{t.queued_seconds(), t.receiving_seconds(), t.computing_seconds(), t.sending_seconds(),
                                 t.total_seconds()};
  reply->request_id = summary->request_id();
  reply->context_id = summary->context_id();
  reply->context_kept = summary->context_kept();
  return grpc::Status::OK;
}

grpc::Status Client::release_context(const std::string& context_id, int64_t* released_bytes, double deadline_seconds) {
  grpc::ClientContext ctx;
  prepare(&ctx, deadline_seconds);
  v1::ReleaseContextRequest request;
  request.set_context_id(context_id);
  v1::ReleaseContextResponse response;
  const grpc::Status status = stub_->ReleaseContext(&ctx, request, &response);
  if (status.ok() && released_bytes != nullptr) *released_bytes = response.released_bytes();
  return status;
}

}  // namespace plsh::client
