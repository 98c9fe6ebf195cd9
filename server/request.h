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
#include "server/buffer_pool.h"
#include "server/scheduler.h"
#include "server/shm_registry.h"

namespace plsh::server {

// The server's configured limits that apply to one request.
struct RequestLimits {
  int64_t max_tokens = 0;
  int64_t max_request_bytes = 0;
  int64_t max_samples = 0;
  // lsh draws (heads x samples, every attempt's for a targeted request):
  // they are made at the header, 16 bytes each, before any tensor byte, so
  // that this bounds what a header alone holds (64 MiB).
  int64_t max_draws = int64_t{1} << 22;
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

  // Tensors the header placed in shared memory (AttendHeader.*_shm): no
  // chunks for them, no host memory charged for them.
  struct InShm {
    bool q = false, k = false, v = false, out = false, lse = false;
  } in_shm;
  // Their bytes, held from the header until the request closes
  // (use_shared_memory); empty uses for the tensors that are streamed.
  struct SharedUses {
    SharedMemoryRegistry::Use q, k, v, out, lse;
  } shared;

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
  // What goes over the wire, each way: the tensors not in shared memory.
  int64_t streamed_input_bytes() const {
    return (in_shm.q ? 0 : q_bytes()) + (in_shm.k ? 0 : kv_bytes()) + (in_shm.v ? 0 : kv_bytes());
  }
  int64_t streamed_output_bytes() const { return (in_shm.out ? 0 : out_bytes()) + (in_shm.lse ? 0 : lse_bytes()); }
  // Host bytes of the tensors the server holds itself (the rest are in shared memory).
  int64_t host_tensor_bytes() const {
    return streamed_input_bytes() + (in_shm.out ? 0 : out_bytes()) + (in_shm.lse ? 0 : held_lse_bytes());
  }
  int64_t held_lse_bytes() const { return holds_lse() ? q_rows * lse_row_bytes : 0; }
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
// The header's *_shm references, resolved in the owner's regions and held
// (plan->shared); out and lse must not overlap each other or an input.
// UNIMPLEMENTED when the header has one and shared memory is off (registry
// null or disabled).
Status use_shared_memory(const v1::AttendHeader& header, RequestPlan* plan, SharedMemoryRegistry* registry,
                         const std::string& owner);
// OK unless a region's file shrank while the request used it.
Status check_shared_memory_intact(const RequestPlan& plan);
// An upper bound of the host bytes plan_kernels allocates (the lsh draws of
// every head and what the backend derives from them, as the backend that
// will plan it says: plsh::planning_host_bytes): charged to the budget while
// the plan is made, since the real charge is known only after.
StatusOr<int64_t> planning_bytes(const RequestPlan& plan);

// Where a tensor of a request lies (not owning): in the request's block or
// in a shared-memory region.
template <typename T>
struct TensorMemory {
  T* ptr = nullptr;
  T* get() const { return ptr; }
};

// The host memory of one request's tensors: one block for the tensors the
// server holds (from the BufferPool: reused across requests, faulted in
// once), and the shared-memory regions' bytes for the others.
struct RequestBuffers {
  TensorMemory<uint8_t> q, k, v, out;  // [B, Nq, H, D], [B, Nk, Hkv, D] x2, [B, Nq, H, D]
  TensorMemory<float> lse;             // [B, Nq, H] with holds_lse()
  // The block; output chunks being sent hold a copy of it, so that it goes
  // back to the pool only once gRPC is done with them.
  std::shared_ptr<uint8_t> block;

  // pool null: plain heap memory (tests, tools).
  static RequestBuffers allocate(const RequestPlan& plan, BufferPool* pool = nullptr);
  TensorRefs refs() const;
};

// On a worker: binds the received tensors to the plan (which checks every
// input value is finite) and runs plsh::run_attention on the plan's backend.
StatusOr<AttentionResult> compute_request(RequestPlan& plan, const RequestBuffers& buffers, const ExecContext& ctx);

void fill_summary(const AttentionResult& result, const RequestPlan& plan, v1::Summary* summary);

}  // namespace plsh::server
