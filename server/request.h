// A forward request as the server holds it, from its header on: the header
// checked against the wire rules and the server's limits (check_request),
// its backend chosen and its plan made (plan_request: plsh::Plan, the one
// thing called a plan: draws, algorithm, workspace by memory space), the
// memory it asks the admission for (memory_layout), its shared-memory
// regions, and the way back from the library's AttentionResult to the wire
// Summary. No maths here: validation is plsh::validate_options, the plan
// and the computation a Backend's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/shape.h"
#include "plsh/status.h"
#include "plsh/v1/plsh.pb.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/request_memory.h"
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

struct Request {
  std::string id;
  std::string backend_name = "auto";  // as asked: the header's, or the server's --backend
  AttentionOptions options;           // validated
  bool return_lse = false;
  bool keep_context = false;    // the header's keep_context: its context stays for AttendBackward (contexts.h)
  bool backward = false;        // planned for the backward too (keep_context, or a stateless AttendBackward)
  RequestShape shape;           // rows and row bytes of every tensor (plsh/shape.h)
  int64_t out_chunk_bytes = 0;  // payload per output chunk, >= one row of out and of lse

  // Tensors the header placed in shared memory (AttendHeader.*_shm): no
  // chunks for them, no host memory for them.
  struct InShm {
    bool q = false, k = false, v = false, out = false, lse = false;
  } in_shm;
  // Their bytes, held from the header until the request closes
  // (use_shared_memory); empty uses for the tensors that are streamed.
  struct SharedUses {
    SharedMemoryRegistry::Use q, k, v, out, lse;
  } shared;

  Backend* backend = nullptr;  // chosen for these params (registry.select: auto falls back to the CPU)
  Plan plan;                   // the backend's plan; its tensors are bound on the worker

  int64_t lse_bytes() const { return return_lse ? shape.lse.bytes() : 0; }  // sent
  // An lse buffer: to send, or for the backward (which reads the forward's).
  bool holds_lse() const { return return_lse || backward; }
  int64_t tokens() const { return shape.q.rows; }
  // q + k + v + out (+ the lse buffer): what --max-request-bytes bounds.
  int64_t tensor_bytes() const {
    return shape.q.bytes() + shape.k.bytes() + shape.v.bytes() + shape.out.bytes() +
           (holds_lse() ? shape.lse.bytes() : 0);
  }
  // What goes over the wire, each way: the tensors not in shared memory.
  int64_t streamed_input_bytes() const {
    return (in_shm.q ? 0 : shape.q.bytes()) + (in_shm.k ? 0 : shape.k.bytes()) + (in_shm.v ? 0 : shape.v.bytes());
  }
  int64_t streamed_output_bytes() const {
    return (in_shm.out ? 0 : shape.out.bytes()) + (in_shm.lse ? 0 : lse_bytes());
  }
  // The block the admission grants it: the tensors the server holds
  // itself (the rest are in shared memory) and the plan's host workspace.
  MemoryLayout memory_layout() const;
  // The host bytes it is charged: that block and what its plan holds (the
  // draws); the device bytes: the plan's device workspace.
  int64_t host_charge() const { return memory_layout().total_bytes() + plan.own_host_bytes; }
  // What a kept context holds of that: the tensors and the plan (its
  // workspace goes with the forward).
  int64_t kept_bytes() const { return memory_layout().tensor_bytes() + plan.own_host_bytes; }
  int64_t device_charge() const { return plan.workspace().device_bytes; }
  // The granted memory with the shared-memory tensors pointed at their regions.
  void place_shared(RequestMemory* memory) const;
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

// The header's checks: INVALID_ARGUMENT naming the wire field for
// malformed headers, RESOURCE_EXHAUSTED for sizes over the server's
// limits. No backend, no plan, no memory.
StatusOr<Request> check_request(const v1::AttendHeader& header, const RequestLimits& limits);
// Picks the backend and makes the plan (FAILED_PRECONDITION for a backend
// that is not there; the plan's own errors).
Status plan_request(Request* request, const RequestLimits& limits);
// check_request then plan_request, for callers without a budget to hold
// while planning (tests, tools).
StatusOr<Request> check_and_plan(const v1::AttendHeader& header, const RequestLimits& limits);
// The host bytes plan_request allocates at most (the draws of every head,
// every attempt's: plsh::planning_host_bytes of the backend it will choose):
// held against the budget while the plan is made.
StatusOr<int64_t> planning_bytes(const Request& request);
// The header's *_shm references, resolved in the owner's regions and held
// (request->shared); out and lse must not overlap each other or an input.
// UNIMPLEMENTED when the header has one and shared memory is off (registry
// null or disabled).
Status use_shared_memory(const v1::AttendHeader& header, Request* request, SharedMemoryRegistry* registry,
                         const std::string& owner);
// OK unless a region's file shrank while the request used it.
Status check_shared_memory_intact(const Request& request);

// The Assembler of a forward's streamed inputs (q, k, v; those in shared
// memory take no chunks) into its granted memory.
std::unique_ptr<Assembler> assemble_inputs(const Request& request, const RequestMemory& memory);

// On a worker: binds the received tensors to the plan (which checks every
// input value is finite) and runs plsh::run_attention on the plan's backend
// in the granted workspace.
StatusOr<AttentionResult> compute_request(Request& request, const RequestMemory& memory, const ExecContext& ctx);

void fill_summary(const AttentionResult& result, const Request& request, v1::Summary* summary);

}  // namespace plsh::server
