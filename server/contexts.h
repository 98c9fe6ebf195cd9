// Kept contexts (SPEC section 8): what a forward leaves on the server so
// that its backward needs only dout on the wire. A forward whose header
// sets keep_context is planned for its backward too; when it finishes OK
// its tensors (q, k, v, out, lse, in the request's dtypes) and its plan
// (the backend's, with the lsh draws and the window: the backward reuses
// them, nothing is planned twice) move into this store under a fresh id.
//
// The rules, in one place:
//   - Ids are 128 random bits from the OS's CSPRNG (OpenSSL RAND_bytes):
//     "ctx-" and 32 hex digits, never sequential.
//   - With a token file, a context belongs to the client that made it:
//     another client's backward or release gets NOT_FOUND, with no more
//     said (NOT_FOUND rather than PERMISSION_DENIED: the caller is allowed
//     the method; this context is simply not one of its own).
//   - Memory: a context's bytes stay charged to the host budget
//     (--memory-budget) and to its client's max_reserved_bytes; they move
//     from the forward's reservation to the store when the forward ends, so
//     they are never counted twice nor dropped in between, and go back when
//     the last holder lets go (a backward may hold it past its removal).
//     The charge is the tensors' bytes; the plan's draws (16 bytes per head
//     and sample) ride along uncharged, as they do for every request.
//     Contexts hold no device memory.
//   - A request that does not fit the host budget evicts the least
//     recently used idle contexts (anyone's) until it fits, when evicting
//     can make it fit; one over its client's max_reserved_bytes evicts that
//     client's own contexts likewise. Over --max-contexts, a new context
//     evicts the least recently used idle one.
//   - Time-to-live: --context-ttl seconds after its last use (its forward,
//     or a backward that kept it); a sweeper thread removes expired ones
//     even without traffic.
//   - A backward checks a context out (no other backward, no eviction, no
//     expiry meanwhile) and checks it in at its end: consumed when it
//     succeeded without keep_context; otherwise back in, its TTL restarted.
//   - A forward that does not finish OK (cancelled, failed while sending)
//     leaves no context. A draining server drops every context at once, and
//     checked-out ones when their backward ends.
//   - Ids of gone contexts are remembered with why (the last 65536), so that
//     a backward that finds its own context gone is told: expired, evicted,
//     released, consumed, cancelled or drained (FAILED_PRECONDITION). An id
//     not among the caller's own (never made, forgotten, another client's)
//     is NOT_FOUND with one message, whichever it is.
// Gauges: plsh_contexts, plsh_context_bytes; removals by reason:
// plsh_context_evictions_total{reason}.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "plsh/status.h"
#include "server/auth.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/request.h"

namespace plsh::server {

// Why a context left the store: the reason label of
// plsh_context_evictions_total and what a backward that misses it is told.
enum class ContextEnd { kExpired, kEvicted, kReleased, kConsumed, kCancelled, kDrained };
const char* context_end_name(ContextEnd end);  // "expired", "evicted", ...
inline constexpr ContextEnd kContextEnds[] = {ContextEnd::kExpired,  ContextEnd::kEvicted,   ContextEnd::kReleased,
                                              ContextEnd::kConsumed, ContextEnd::kCancelled, ContextEnd::kDrained};

// One forward's context: its request (the plan bound to this memory) and
// its tensors. Holds `charge` of the budget and of its client's limits
// until destroyed.
class KeptContext {
 public:
  KeptContext(Request request, RequestMemory memory, MemoryCharge charge, MemoryBudget* budget,
              std::shared_ptr<ClientState> client);
  ~KeptContext();
  KeptContext(const KeptContext&) = delete;
  KeptContext& operator=(const KeptContext&) = delete;

  const Request& request() const { return request_; }
  const RequestMemory& memory() const { return memory_; }
  const MemoryCharge& charge() const { return charge_; }

 private:
  Request request_;
  RequestMemory memory_;  // q, k, v, out, lse (its workspace is not kept: the backward brings its own)
  MemoryCharge charge_;
  MemoryBudget* budget_;
  std::shared_ptr<ClientState> client_;
};

struct ContextStoreOptions {
  double ttl_seconds = 300;     // --context-ttl: seconds after the last use; 0: contexts are not kept
  int64_t max_contexts = 1024;  // --max-contexts: held at once
  size_t remembered = 65536;    // ids of gone contexts remembered with why
};

class ContextStore {
 public:
  // Contexts are charged to `budget`; metrics may be null (tests).
  ContextStore(ContextStoreOptions options, MemoryBudget* budget, Metrics* metrics);
  ~ContextStore();
  ContextStore(const ContextStore&) = delete;
  ContextStore& operator=(const ContextStore&) = delete;

  bool enabled() const { return options_.ttl_seconds > 0 && options_.max_contexts > 0; }
  const ContextStoreOptions& options() const { return options_; }

  // --- The forward that keeps its context.
  // A fresh id, pending until put() or abandon(); UNAVAILABLE once closed.
  StatusOr<std::string> reserve_id(const std::string& owner);
  // The forward finished OK: its context enters the store, charged as its
  // KeptContext says (already reserved: the forward's reservation moved to
  // it). A closed store drops it (drained).
  void put(const std::string& id, std::shared_ptr<KeptContext> context);
  // The forward did not finish OK: the id is remembered as cancelled.
  void abandon(const std::string& id);

  // --- AttendBackward.
  // The context, checked out for `request_id`: FAILED_PRECONDITION when
  // gone (saying why), pending or in use; NOT_FOUND when another client's.
  StatusOr<std::shared_ptr<KeptContext>> check_out(const std::string& id, const std::string& owner,
                                                   const std::string& request_id);
  // The backward ended: consumed (consume), or back in with its TTL
  // restarted. A closed store drops it (drained).
  void check_in(const std::string& id, bool consume, const std::string& request_id);

  // --- ReleaseContext: the bytes given back; NOT_FOUND when this owner
  // has no such context (saying why when it had one), FAILED_PRECONDITION
  // while pending or in use.
  StatusOr<int64_t> release(const std::string& id, const std::string& owner);

  // --- Room for requests (the admission's, admission.h). Reserves charge
  // on the budget, evicting the least recently used idle contexts while the
  // host budget falls short and evicting can make it fit; the budget's
  // RESOURCE_EXHAUSTED otherwise.
  Status reserve(const MemoryCharge& charge);
  // The same against a client's own limits, evicting only its contexts.
  Status reserve_for_client(ClientState& client, const MemoryCharge& charge);

  // Drain: drops every idle context now, checked-out ones at check-in, and
  // refuses new ids.
  void close();

  // The contexts in the store (idle or checked out) and their charged host
  // bytes, read together.
  struct Held {
    int64_t contexts = 0, bytes = 0;
  };
  Held held() const;

 private:
  using Clock = std::chrono::steady_clock;
  enum class State { kPending, kIdle, kInUse };
  struct Entry {
    State state = State::kPending;
    std::string owner;
    std::shared_ptr<KeptContext> context;  // null while pending
    Clock::time_point last_used;
    std::string user;  // request id of the backward that has it checked out
  };
  struct Gone {
    ContextEnd why;
    std::string owner;
    Clock::time_point when;
    std::string detail;
  };

  // All with mutex_ held. remove_locked returns the context so that the
  // caller drops it (and its memory) after unlocking.
  std::shared_ptr<KeptContext> remove_locked(std::unordered_map<std::string, Entry>::iterator it, ContextEnd why,
                                             std::string detail);
  // The least recently used idle context (of `owner` unless empty), or end().
  std::unordered_map<std::string, Entry>::iterator oldest_idle_locked(const std::string* owner);
  int64_t idle_bytes_locked(const std::string* owner) const;
  Status gone_status_locked(const std::string& id, const std::string& owner) const;
  void publish_locked() const;
  void sweep();

  const ContextStoreOptions options_;
  MemoryBudget* budget_;
  Metrics* metrics_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::unordered_map<std::string, Entry> entries_;
  std::unordered_map<std::string, Gone> gone_;
  std::deque<std::string> gone_order_;  // oldest first, for the bound
  int64_t held_ = 0, bytes_ = 0;
  bool closed_ = false;
  bool stop_ = false;
  std::thread sweeper_;
};

// "ctx-" and 32 hex digits of 128 random bits (RAND_bytes).
std::string new_context_id();

}  // namespace plsh::server
