// Client::backward (AttendBackward) and Client::release_context: the
// training half of the client, beside client.cpp's forward.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "plsh/client.h"
#include "proto/wire.h"

namespace plsh::client {

namespace {

grpc::Status invalid(const std::string& what) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what); }

grpc::Status protocol_error(const std::string& what) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "server broke the plsh.v1 protocol: " + what);
}

}  // namespace

grpc::Status Client::backward(const BackwardCall& call, BackwardReply* reply) {
  *reply = BackwardReply{};
  const AttentionOptions& o = call.options;
  const bool stateless = call.context_id.empty();
  if (call.dout == nullptr) return invalid("dout = null, expected the upstream gradient [B, Nq, H, D]");
  if (stateless && (call.q == nullptr || call.k == nullptr || call.v == nullptr))
    return invalid("a stateless backward (no context_id) needs q, k and v");
  if (stateless && !call.recompute_forward && (call.out == nullptr || call.lse == nullptr))
    return invalid("a stateless backward needs out and lse, or recompute_forward");

  const int64_t batch = std::max<int64_t>(1, o.batch);
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  const DType out_dtype = o.out_dtype.value_or(o.dtype);
  const DType grad_dtype = call.grad_dtype.value_or(o.dtype);
  const int64_t q_rows = batch * o.q_len, kv_rows = batch * o.kv_len;
  const int64_t q_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  const int64_t kv_row_bytes = kv_heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  const int64_t out_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(out_dtype));
  const int64_t lse_row_bytes = o.heads * static_cast<int64_t>(sizeof(float));
  const int64_t dq_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(grad_dtype));
  const int64_t dkv_row_bytes = kv_heads * o.head_dim * static_cast<int64_t>(dtype_bytes(grad_dtype));

  grpc::ClientContext ctx;
  prepare(&ctx, call.deadline_seconds);
  auto stream = stub_->AttendBackward(&ctx);
  auto note = [reply](const google::protobuf::Message& m) {
    reply->largest_message_bytes = std::max<int64_t>(reply->largest_message_bytes, static_cast<int64_t>(m.ByteSizeLong()));
    ++reply->messages;
  };
  auto finish = [&stream]() {
    v1::BackwardResponse ignored;
    while (stream->Read(&ignored)) {
    }
    return stream->Finish();
  };

  v1::BackwardRequest request;
  v1::BackwardHeader* h = request.mutable_header();
  h->set_request_id(call.request_id);
  if (stateless) {
    AttendCall forward;
    forward.options = o;
    forward.backend = call.backend;
    *h->mutable_forward() = make_header(forward);
    h->set_recompute_forward(call.recompute_forward);
  } else {
    h->set_context_id(call.context_id);
  }
  h->set_keep_context(call.keep_context);  // the server refuses it without a context
  if (call.grad_dtype) h->set_grad_dtype(wire::to_wire(*call.grad_dtype));
  h->set_out_chunk_bytes(std::max<int64_t>(0, call.chunk_bytes));
  note(request);
  if (!stream->Write(request)) return finish();

  v1::BackwardResponse response;
  if (!stream->Read(&response)) return stream->Finish();
  note(response);
  if (!response.has_ack()) {
    ctx.TryCancel();
    stream->Finish();
    return protocol_error("first response is not an ack");
  }
  const v1::Ack& ack = response.ack();
  const int64_t cap = ack.max_chunk_payload_bytes() > 0 ? ack.max_chunk_payload_bytes() : ack.out_chunk_bytes();
  const int64_t payload = call.chunk_bytes > 0 ? std::min(call.chunk_bytes, cap) : cap;

  struct Input {
    v1::Tensor tensor;
    const void* data;
    int64_t rows, row_bytes;
  };
  std::vector<Input> inputs;
  if (stateless) {
    inputs.push_back({v1::TENSOR_Q, call.q, q_rows, q_row_bytes});
    inputs.push_back({v1::TENSOR_K, call.k, kv_rows, kv_row_bytes});
    inputs.push_back({v1::TENSOR_V, call.v, kv_rows, kv_row_bytes});
    if (!call.recompute_forward) {
      inputs.push_back({v1::TENSOR_OUT, call.out, q_rows, out_row_bytes});
      inputs.push_back({v1::TENSOR_LSE, call.lse, q_rows, lse_row_bytes});
    }
  }
  inputs.push_back({v1::TENSOR_DOUT, call.dout, q_rows, out_row_bytes});
  bool writing = true;
  for (const Input& in : inputs) {
    const int64_t per_chunk = std::max<int64_t>(1, payload / std::max<int64_t>(1, in.row_bytes));
    for (int64_t row = 0; writing && row < in.rows; row += per_chunk) {
      const int64_t rows = std::min(per_chunk, in.rows - row);
      request.Clear();
      v1::TensorChunk* c = request.mutable_chunk();
      c->set_tensor(in.tensor);
      c->set_row_start(row);
      c->set_row_count(rows);
      c->set_data(static_cast<const char*>(in.data) + row * in.row_bytes, static_cast<size_t>(rows * in.row_bytes));
      note(request);
      reply->sent_bytes += rows * in.row_bytes;
      writing = stream->Write(request);
    }
  }
  if (writing) {
    request.Clear();
    request.mutable_end();
    note(request);
    writing = stream->Write(request);
  }
  if (writing) stream->WritesDone();

  reply->dq.assign(static_cast<size_t>(q_rows * dq_row_bytes), 0);
  reply->dk.assign(static_cast<size_t>(kv_rows * dkv_row_bytes), 0);
  reply->dv.assign(static_cast<size_t>(kv_rows * dkv_row_bytes), 0);
  struct Output {
    v1::Tensor tensor;
    std::vector<uint8_t>* data;
    int64_t rows, row_bytes, next;
  } outputs[] = {{v1::TENSOR_DQ, &reply->dq, q_rows, dq_row_bytes, 0},
                 {v1::TENSOR_DK, &reply->dk, kv_rows, dkv_row_bytes, 0},
                 {v1::TENSOR_DV, &reply->dv, kv_rows, dkv_row_bytes, 0}};
  bool have_summary = false;
  v1::BackwardSummary summary;
  while (stream->Read(&response)) {
    note(response);
    if (response.has_grad_chunk()) {
      const v1::OutputChunk& c = response.grad_chunk();
      Output* out = nullptr;
      for (Output& candidate : outputs)
        if (candidate.tensor == c.tensor()) out = &candidate;
      if (out == nullptr) return protocol_error("gradient chunk of tensor " + std::to_string(c.tensor()));
      // In row order, each row once: the server's contract.
      if (c.row_start() != out->next || c.row_count() < 1 || c.row_count() > out->rows - out->next ||
          static_cast<int64_t>(c.data().size()) != c.row_count() * out->row_bytes)
        return protocol_error(v1::Tensor_Name(c.tensor()) + " chunk rows [" + std::to_string(c.row_start()) + ", +" +
                              std::to_string(c.row_count()) + ") with " + std::to_string(c.data().size()) + " bytes");
      std::memcpy(out->data->data() + c.row_start() * out->row_bytes, c.data().data(), c.data().size());
      out->next += c.row_count();
      reply->received_bytes += static_cast<int64_t>(c.data().size());
    } else if (response.has_summary()) {
      summary = response.summary();
      have_summary = true;
    } else {
      return protocol_error("unexpected message after the ack");
    }
  }
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return status;
  if (!have_summary) return protocol_error("stream ended OK without a summary");
  for (const Output& out : outputs)
    if (out.next != out.rows)
      return protocol_error(v1::Tensor_Name(out.tensor) + " rows missing: " + std::to_string(out.next) + " of " +
                            std::to_string(out.rows));
  StatusOr<DType> got = wire::dtype_from_wire("grad_dtype", summary.grad_dtype(), std::nullopt);
  if (!got.ok() || *got != grad_dtype) return protocol_error("summary: grad_dtype " + std::to_string(summary.grad_dtype()));
  reply->grad_dtype = grad_dtype;
  reply->result = wire::backward_result_from_summary(summary);
  reply->forward_flops = summary.forward_flops();
  const v1::Timings& t = summary.timings();
  reply->timings = ServerTimings{t.queued_seconds(), t.receiving_seconds(), t.computing_seconds(), t.sending_seconds(),
                                 t.total_seconds()};
  reply->request_id = summary.request_id();
  reply->context_id = summary.context_id();
  reply->context_kept = summary.context_kept();
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
