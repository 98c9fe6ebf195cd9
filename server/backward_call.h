// AttendBackward (SPEC section 8; the proto documents both forms) and
// ReleaseContext. A backward goes through the same CallBase as a forward
// (call.h): token and method check, --max-concurrent and the client's
// max_streams, the header's checks against the limits, the charge against
// both budgets and the client's limits (kept contexts evicted for room),
// the stream watchdog, and one log line and metrics record
// (plsh_requests_total{method="AttendBackward"},
// plsh_backward_duration_seconds).
//
//   by context: the header names a kept context (contexts.h), checked out
//     at once so that no other backward, no eviction and no expiry touches
//     it meanwhile; the chunks carry dout only; the backward runs on the
//     context's own plan (its draws, its window) and tensors.
//   stateless: the header carries the forward's header; it is checked and
//     planned as a forward that will run its backward (check_request,
//     plan_kernels with PlanLimits::backward); the chunks carry q, k, v,
//     dout and out and lse, or with recompute_forward the server runs the
//     forward first (without estimates) for out and lse.
// Either way the Assembler checks every chunk as it does the forward's.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "plsh/attention.h"
#include "plsh/v1/plsh.grpc.pb.h"
#include "server/call.h"
#include "server/contexts.h"
#include "server/request.h"

namespace plsh::server {

// An AttendBackward request as the server holds it from its header on.
struct GradRequest {
  std::string id;                        // request id: the header's, or the server's
  std::string context_id;                // by context; empty: stateless
  bool keep_context = false;             // by context: keep it after a success
  bool recompute_forward = false;        // stateless: run the forward for out and lse
  DType grad_dtype = DType::kF32;        // of dq, dk, dv
  int64_t requested_chunk_bytes = 0;     // the header's out_chunk_bytes (0: the largest)
  std::shared_ptr<KeptContext> context;  // by context: checked out
  std::optional<Request> stateless;      // stateless: the forward, planned for its backward

  // Filled by size_backward.
  RequestShape shape;           // the forward's, with the gradients in grad_dtype
  int64_t out_chunk_bytes = 0;  // payload per gradient chunk, >= one row

  const Request& forward() const { return context ? context->request() : *stateless; }
  // What the client sends: dout, and the stateless form's inputs.
  int64_t input_bytes() const;
  // dout + dq + dk + dv, and the stateless forward's q, k, v, out, lse:
  // what --max-request-bytes bounds.
  int64_t tensor_bytes() const;
  // The block the admission grants it: the tensors above, and the host
  // workspace of what runs (by context the backward's alone: the forward
  // has run; stateless the larger of the two, which run one after the
  // other); its device workspace likewise.
  MemoryLayout memory_layout() const;
  Workspace workspace() const;
};

// The header's own checks: INVALID_ARGUMENT naming the field for a header
// without a source, an empty context id, flags that do not fit its form or
// a bad grad_dtype; stateless, the forward header's checks (check_request).
// Neither looks up a context nor plans.
StatusOr<GradRequest> check_backward_header(const v1::BackwardHeader& header, const RequestLimits& limits);
// Once the forward's plan is known (context checked out, or stateless
// planned): sizes and limits (RESOURCE_EXHAUSTED over --max-request-bytes
// or a row over a message).
Status size_backward(GradRequest* request, const RequestLimits& limits);

struct BackwardComputation {
  BackwardResult result;
  double forward_flops = 0;  // recompute_forward: the forward's
};

// On a worker: stateless, binds the received tensors (checking them) and
// with recompute_forward runs the forward; then run_backward on the plan,
// all in the granted memory.
StatusOr<BackwardComputation> compute_backward(GradRequest& request, const RequestMemory& memory,
                                               const ExecContext& ctx);

// The reactors, for AttentionService.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* start_attend_backward(ServiceContext& s,
                                                                                   grpc::CallbackServerContext* ctx);
grpc::ServerUnaryReactor* release_context(ServiceContext& s, grpc::CallbackServerContext* ctx,
                                          const v1::ReleaseContextRequest* request,
                                          v1::ReleaseContextResponse* response);

}  // namespace plsh::server
