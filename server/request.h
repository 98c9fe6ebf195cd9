// A request as the server holds it, from its header on: the header checked
// against the wire rules and the server's limits, its backend chosen and its
// kernels' plan made (plsh::Plan: draws, algorithm, workspace by memory
// space), what it will be charged by memory space, the host buffers its
// tensors live in, and the way back from the library's AttentionResult to
// the wire Summary. No maths here: validation is plsh::validate_options, the
// plan and the computation a Backend's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/status.h"
#include "plsh/v1/plsh.pb.h"
#include "proto/wire.h"
#include "server/scheduler.h"

namespace plsh::server {

// The server's configured limits that apply to one request.
struct RequestLimits {
  int64_t max_tokens = 0;
  int64_t max_request_bytes = 0;
  int64_t max_samples = 0;
  int64_t max_message_bytes = 0;
  std::string default_backend = "auto";  // --backend: what a header's "" or "auto" means
  int threads = 0;                       // --threads: CPU threads per request (0: all cores)
  int64_t device_bytes_per_request = 0;  // a request's share of --device-memory-budget (0: the backend's own cap)
};

using wire::kMessageHeadroom;

struct RequestPlan {
  std::string id;
  std::string backend_name = "auto";  // as asked: the header's, or the server's --backend
  AttentionOptions options;           // validated
  bool return_lse = false;
  bool keep_context = false;          // the header's keep_context: its context stays for AttendBackward (contexts.h)
  bool backward = false;              // planned for the backward too (keep_context, or a stateless AttendBackward)
  int64_t q_rows = 0, kv_rows = 0;   // B * Nq, B * Nk: flat rows of q and of k, v
  int64_t q_row_bytes = 0;           // H * D * dtype bytes
  int64_t kv_row_bytes = 0;          // Hkv * D * dtype bytes
  int64_t out_row_bytes = 0;         // H * D * out_dtype bytes
  int64_t lse_row_bytes = 0;         // H * 4
  int64_t out_chunk_bytes = 0;       // payload per output chunk, >= one row of out and of lse
  int64_t total_bytes = 0;           // q + k + v + out + lse (the lse buffer: holds_lse())

  Backend* backend = nullptr;  // chosen for these params (registry.select: auto falls back to the CPU)
  Plan kernel;                 // the backend's plan; its tensors are bound on the worker
  MemoryCharge charge;         // host: tensors + host workspace; device: device workspace

  int64_t q_bytes() const { return q_rows * q_row_bytes; }
  int64_t kv_bytes() const { return kv_rows * kv_row_bytes; }
  int64_t out_bytes() const { return q_rows * out_row_bytes; }
  int64_t lse_bytes() const { return return_lse ? q_rows * lse_row_bytes : 0; }  // sent
  // An lse buffer: to send, or for the backward (which reads the forward's).
  bool holds_lse() const { return return_lse || backward; }
  int64_t tokens() const { return q_rows; }
};

// Bytes of a successful request's per-head summary entries: ~200 per head,
// ~20 per draw (two doubles and framing) with return_draws; the fixed fields
// fit in kMessageHeadroom. The one estimate both the streamed summary and
// the unary response are checked against.
int64_t summary_bytes(const AttentionOptions& options);

// A client's request_id: at most 128 printable characters (INVALID_ARGUMENT
// otherwise); the server's own ("r1", "r2", ...) when a header has none.
Status check_request_id(const std::string& id);
std::string next_request_id();

// Header -> plan: INVALID_ARGUMENT naming the wire field for malformed
// headers, RESOURCE_EXHAUSTED for sizes over the server's limits,
// FAILED_PRECONDITION for a backend that is not there; then the backend and
// its plan, and the request's charge. Touches no tensor memory.
// check_request then plan_kernels.
StatusOr<RequestPlan> plan_request(const v1::AttendHeader& header, const RequestLimits& limits);
// The header's checks alone (no backend, no plan).
StatusOr<RequestPlan> check_request(const v1::AttendHeader& header, const RequestLimits& limits);
// Picks the backend and makes the kernels' plan and the charge.
Status plan_kernels(RequestPlan* plan, const RequestLimits& limits);
// An upper bound of the host bytes plan_kernels allocates (the lsh draws of
// every head and what backends derive from them): charged to the budget
// while the plan is made, since the real charge is known only after.
int64_t planning_bytes(const RequestPlan& plan);

// The host memory of one request's tensors.
struct RequestBuffers {
  std::unique_ptr<uint8_t[]> q, k, v, out;  // [B, Nq, H, D], [B, Nk, Hkv, D] x2, [B, Nq, H, D]
  std::unique_ptr<float[]> lse;             // [B, Nq, H] with holds_lse()

  static RequestBuffers allocate(const RequestPlan& plan);
  TensorRefs refs() const;
};

// On a worker: binds the received tensors to the plan (which checks every
// input value is finite) and runs plsh::run_attention on the plan's backend.
StatusOr<AttentionResult> compute_request(RequestPlan& plan, const RequestBuffers& buffers, const ExecContext& ctx);

void fill_summary(const AttentionResult& result, const RequestPlan& plan, v1::Summary* summary);

}  // namespace plsh::server
