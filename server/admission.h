// The one owner of admission (issue 22): whether a request may run, and the
// memory it holds, are decided here and nowhere else. Every Attend,
// AttendUnary and AttendBackward call holds one Ticket, which it passes
// through in order:
//   open()   before any message: the caller's credentials and the method
//            (auth.h), a draining server, --max-concurrent, the client's
//            max_streams;
//   plan()   at the header, while the request's plan is made: the planning
//            bound (the draws the plan allocates) held against the budget;
//   admit()  at the header, before the ack: the whole charge at once, taken
//            from the request (its tensors' block, its plan's workspace by
//            memory space and the draws the plan holds), against the
//            client's limits and both budgets, kept contexts evicted for
//            room; then that memory itself, allocated now: the host block
//            (BufferPool: the tensors and the host workspace) and the
//            device workspace (the backend's allocator). Nothing is refused
//            for memory after the ack.
// The ticket gives back everything it holds when the call closes (or when
// it is destroyed); a forward that keeps its context hands part of its
// charge over to the context first (hand_over).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "plsh/backend.h"
#include "plsh/status.h"
#include "server/auth.h"
#include "server/buffer_pool.h"
#include "server/contexts.h"
#include "server/memory_budget.h"
#include "server/request_memory.h"

namespace plsh::server {

class Admission {
 public:
  struct Options {
    int64_t max_concurrent = 64;  // --max-concurrent: calls open at once
  };
  // auth: null lets every call in (no token file); pool: null allocates
  // from the heap (tests); contexts: null keeps none and evicts none.
  Admission(Options options, MemoryBudget* budget, ContextStore* contexts, const Authenticator* auth, BufferPool* pool);

  // From now on open() refuses with UNAVAILABLE.
  void begin_drain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Calls opened and not yet closed.
  int64_t open_calls() const { return open_calls_.load(); }
  bool tokens() const { return auth_ != nullptr; }
  ContextStore* contexts() const { return contexts_; }
  MemoryBudget& budget() const { return *budget_; }

  class Ticket;

 private:
  friend class Ticket;
  // Both budgets, evicting kept contexts for room when there are any.
  Status reserve(const MemoryCharge& charge);
  Status reserve_for_client(ClientState& client, const MemoryCharge& charge);

  const Options options_;
  MemoryBudget* budget_;
  ContextStore* contexts_;
  const Authenticator* auth_;
  BufferPool* pool_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> open_calls_{0};
};

// One call's standing: what it was let in as, and what it holds.
class Admission::Ticket {
 public:
  explicit Ticket(Admission* admission) : admission_(admission) {}
  ~Ticket() { close(); }
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;

  // Counts the call as open, then UNAUTHENTICATED or PERMISSION_DENIED
  // (a token file: auth.h; `method` null when the name is not one a token
  // can allow), UNAVAILABLE while draining, RESOURCE_EXHAUSTED over
  // --max-concurrent or the client's max_streams.
  Status open(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, const std::optional<Method>& method,
              const std::string& method_name);
  // make_plan() with `planning_bytes` held against the budget meanwhile, so
  // that concurrent headers cannot allocate past it.
  Status plan(int64_t planning_bytes, const std::function<Status()>& make_plan);
  // The charge (host: the block and `plan_host_bytes`, what the plan itself
  // holds; device: `device_bytes` of `backend`'s workspace), all at once
  // against the client's limits and both budgets; then the memory. Once
  // per call.
  StatusOr<RequestMemory> admit(const MemoryLayout& layout, int64_t plan_host_bytes, int64_t device_bytes,
                                const Backend& backend);
  // Moves `host_bytes` of the held charge out of the ticket, for a kept
  // context that holds them from now on (charged once throughout).
  MemoryCharge hand_over(int64_t host_bytes);
  // Gives everything back; the call is no longer counted. Idempotent.
  // The last call to close after a large one returns the free heap.
  void close();

  // The token file's client (null without a token file, or before open,
  // or when refused).
  const std::shared_ptr<ClientState>& client() const { return client_; }
  // What logs and metrics call the caller: "" without a token file, the
  // client's name once its token is known (even when the method is not
  // allowed), "unauthenticated" otherwise.
  const std::string& label() const { return label_; }
  // Who owns the call's shared-memory regions and contexts: the client's
  // name, "" without a token file.
  std::string owner() const { return client_ ? client_->name() : ""; }

 private:
  Admission* admission_;
  bool counted_ = false;
  bool client_stream_open_ = false;
  // Admitted with at least kLargeCallBytes of host memory: its close, when
  // it leaves no call open, gives the free heap back (release_free_heap).
  static constexpr int64_t kLargeCallBytes = int64_t{32} << 20;
  bool large_ = false;
  std::shared_ptr<ClientState> client_;
  std::string label_;
  MemoryCharge reserved_;         // against the budgets
  MemoryCharge client_reserved_;  // against the client's limits
};

}  // namespace plsh::server
