// A request as the server holds it: the wire header turned into
// plsh::AttentionOptions and checked against the server's limits (the plan),
// the host buffers its tensors live in, and the way back from the library's
// AttentionResult to the wire Summary. No maths here: the options'
// validation is plsh::validate_options, the computation a Backend's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "plsh/attention.h"
#include "plsh/params.h"
#include "plsh/status.h"
#include "plsh/v1/plsh.pb.h"

namespace plsh::server {

// The server's configured limits that apply to one request.
struct RequestLimits {
  int64_t max_tokens = 0;
  int64_t max_request_bytes = 0;
  int64_t max_samples = 0;
  int64_t max_message_bytes = 0;
  std::string default_backend = "auto";  // --backend: what a header's "" or "auto" means
};

// Bytes per response message kept free for the message's own fields, so
// that a chunk's payload plus framing never exceeds max_message_bytes
// (an OutputChunk's fields take < 40 bytes).
inline constexpr int64_t kMessageHeadroom = 1024;

struct RequestPlan {
  std::string id;
  std::string backend = "auto";  // the backend to run on: the header's, or the server's --backend
  AttentionOptions options;      // validated
  bool return_lse = false;
  int64_t q_rows = 0, kv_rows = 0;   // B * Nq, B * Nk: flat rows of q and of k, v
  int64_t q_row_bytes = 0;           // H * D * dtype bytes
  int64_t kv_row_bytes = 0;          // Hkv * D * dtype bytes
  int64_t out_row_bytes = 0;         // H * D * out_dtype bytes
  int64_t lse_row_bytes = 0;         // H * 4
  int64_t out_chunk_bytes = 0;       // payload per output chunk, >= one row of out and of lse
  int64_t total_bytes = 0;           // q + k + v + out + lse

  int64_t q_bytes() const { return q_rows * q_row_bytes; }
  int64_t kv_bytes() const { return kv_rows * kv_row_bytes; }
  int64_t out_bytes() const { return q_rows * out_row_bytes; }
  int64_t lse_bytes() const { return return_lse ? q_rows * lse_row_bytes : 0; }
  int64_t tokens() const { return q_rows; }
};

// Header -> plan: INVALID_ARGUMENT naming the wire field for malformed
// headers, RESOURCE_EXHAUSTED for sizes over the server's limits.
StatusOr<RequestPlan> plan_request(const v1::AttendHeader& header, const RequestLimits& limits);

// The host memory of one request's tensors.
struct RequestBuffers {
  std::unique_ptr<uint8_t[]> q, k, v, out;  // [B, Nq, H, D], [B, Nk, Hkv, D] x2, [B, Nq, H, D]
  std::unique_ptr<float[]> lse;             // [B, Nq, H] with return_lse

  static RequestBuffers allocate(const RequestPlan& plan);
  TensorRefs refs() const;
};

// The whole of what a worker does for one request: params (which checks
// every input value is finite), the backend, its workspace against the
// memory budget, then plsh::run_attention.
struct ComputeHooks {
  // Reserves extra bytes (the backend's workspace) against the memory
  // budget, or RESOURCE_EXHAUSTED; release() undoes it.
  std::function<Status(int64_t)> reserve;
  std::function<void(int64_t)> release;
};
StatusOr<AttentionResult> compute_request(const RequestPlan& plan, const RequestBuffers& buffers,
                                          const ExecContext& ctx, const ComputeHooks& hooks);

void fill_summary(const AttentionResult& result, const RequestPlan& plan, v1::Summary* summary);

}  // namespace plsh::server
