#include "server/contexts.h"

#include <openssl/rand.h>

#include <algorithm>
#include <iterator>
#include <stdexcept>

#include "plsh/text.h"

namespace plsh::server {

namespace {

constexpr EnumName<ContextEnd> kContextEndNames[] = {
    {ContextEnd::kExpired, "expired"},   {ContextEnd::kEvicted, "evicted"},     {ContextEnd::kReleased, "released"},
    {ContextEnd::kConsumed, "consumed"}, {ContextEnd::kCancelled, "cancelled"}, {ContextEnd::kDrained, "drained"}};

// kContextEnds (contexts.h, for the metrics' labels) lists the same values
// in the same order; a value added to one and not the other fails here.
constexpr bool same_ends() {
  if (std::size(kContextEnds) != std::size(kContextEndNames)) return false;
  for (size_t i = 0; i < std::size(kContextEnds); ++i)
    if (kContextEnds[i] != kContextEndNames[i].value) return false;
  return true;
}
static_assert(same_ends(), "kContextEnds and kContextEndNames disagree");

}  // namespace

const char* context_end_name(ContextEnd end) { return name_of(kContextEndNames, end, "unknown"); }

std::string new_context_id() {
  unsigned char bytes[16];
  // RAND_bytes draws from OpenSSL's CSPRNG, seeded by the OS: ids cannot be
  // predicted from earlier ones. It fails only when the OS has no entropy to
  // give, where no id is safe to hand out.
  if (RAND_bytes(bytes, sizeof bytes) != 1) throw std::runtime_error("RAND_bytes failed: no context id can be made");
  static const char* const kHex = "0123456789abcdef";
  std::string id = "ctx-";
  for (unsigned char b : bytes) {
    id += kHex[b >> 4];
    id += kHex[b & 15];
  }
  return id;
}

// ------------------------------------------------------------ KeptContext

KeptContext::KeptContext(Request request, RequestMemory memory, MemoryCharge charge, MemoryBudget* budget,
                         std::shared_ptr<ClientState> client)
    : request_(std::move(request)),
      memory_(std::move(memory)),
      charge_(charge),
      budget_(budget),
      client_(std::move(client)) {
  // The forward's workspace is not part of a context (the backward brings
  // its own, charged with it).
  memory_.workspace_block.reset();
  memory_.device.reset();
  memory_.workspace = WorkspaceRef{};
}

KeptContext::~KeptContext() {
  // The memory goes with the block right after this; give its charge back.
  if (budget_ != nullptr) budget_->release(charge_);
  if (client_) client_->release(charge_);
}

// ----------------------------------------------------------- ContextStore

ContextStore::ContextStore(ContextStoreOptions options, MemoryBudget* budget, Metrics* metrics)
    : options_(options), budget_(budget), metrics_(metrics) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    publish_locked();
  }
  if (!enabled()) return;
  // Expired contexts go even without traffic: a sweep every quarter of the
  // TTL, at least every second, at most 20 times a second.
  const double interval = std::clamp(options_.ttl_seconds / 4, 0.05, 1.0);
  sweeper_ = std::thread([this, interval] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::duration<double>(interval), [this] { return stop_; })) {
      lock.unlock();
      sweep();
      lock.lock();
    }
  });
}

ContextStore::~ContextStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  close();
}

void ContextStore::publish_locked() const {
  if (metrics_ != nullptr) metrics_->contexts(static_cast<double>(held_), static_cast<double>(bytes_));
}

std::shared_ptr<KeptContext> ContextStore::remove_locked(std::unordered_map<std::string, Entry>::iterator it,
                                                         ContextEnd why, std::string detail) {
  std::shared_ptr<KeptContext> context = std::move(it->second.context);
  if (context) {
    --held_;
    bytes_ -= context->charge().host_bytes;
    if (metrics_ != nullptr) metrics_->context_removed(context_end_name(why));
  }
  gone_[it->first] = Gone{why, it->second.owner, Clock::now(), std::move(detail)};
  gone_order_.push_back(it->first);
  while (gone_order_.size() > options_.remembered) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  entries_.erase(it);
  publish_locked();
  return context;
}

std::unordered_map<std::string, ContextStore::Entry>::iterator ContextStore::oldest_idle_locked(
    const std::string* owner) {
  auto oldest = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->second.state != State::kIdle || (owner != nullptr && it->second.owner != *owner)) continue;
    if (oldest == entries_.end() || it->second.last_used < oldest->second.last_used) oldest = it;
  }
  return oldest;
}

int64_t ContextStore::idle_bytes_locked(const std::string* owner) const {
  int64_t total = 0;
  for (const auto& [id, e] : entries_)
    if (e.state == State::kIdle && (owner == nullptr || e.owner == *owner)) total += e.context->charge().host_bytes;
  return total;
}

StatusOr<std::string> ContextStore::reserve_id(const std::string& owner) {
  std::string id = new_context_id();
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return unavailable("server is shutting down: no context is kept; retry on another replica");
  Entry& e = entries_[id];
  e.state = State::kPending;
  e.owner = owner;
  return id;
}

void ContextStore::put(const std::string& id, std::shared_ptr<KeptContext> context) {
  std::vector<std::shared_ptr<KeptContext>> dropped;  // freed after the lock
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.state != State::kPending) return;  // not reserved: dropped here
    it->second.context = std::move(context);
    it->second.state = State::kIdle;
    it->second.last_used = Clock::now();
    ++held_;
    bytes_ += it->second.context->charge().host_bytes;
    if (metrics_ != nullptr) metrics_->context_added();
    if (closed_) {
      dropped.push_back(remove_locked(it, ContextEnd::kDrained, "the server is shutting down"));
    } else {
      while (held_ > options_.max_contexts) {
        auto oldest = oldest_idle_locked(nullptr);
        if (oldest == entries_.end()) break;
        dropped.push_back(remove_locked(
            oldest, ContextEnd::kEvicted,
            "--max-contexts = " + std::to_string(options_.max_contexts) + " were held (least recently used go first)"));
      }
    }
    publish_locked();
  }
}

void ContextStore::abandon(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.state != State::kPending) return;
  remove_locked(it, ContextEnd::kCancelled, "the forward that was to keep it did not finish OK (cancelled or failed)");
}

namespace {

// An id that is not among the caller's contexts, live or gone: one code and
// one message whether it never existed, is forgotten, or is another
// client's (live or gone), so that no caller learns of another's ids.
Status not_among_own(const std::string& id) {
  return not_found("context_id = " + echo_value(id) +
                   ": no such context for this client; run the forward with keep_context");
}

}  // namespace

Status ContextStore::gone_status_locked(const std::string& id, const std::string& owner) const {
  const std::string name = "context_id = " + echo_value(id);
  auto g = gone_.find(id);
  if (g == gone_.end() || g->second.owner != owner) return not_among_own(id);
  const double ago = std::chrono::duration<double>(Clock::now() - g->second.when).count();
  return failed_precondition(name + ": " + context_end_name(g->second.why) + " " + g_text(ago, 3) +
                             " s ago: " + g->second.detail);
}

StatusOr<std::shared_ptr<KeptContext>> ContextStore::check_out(const std::string& id, const std::string& owner,
                                                               const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return gone_status_locked(id, owner);
  Entry& e = it->second;
  const std::string name = "context_id = " + echo_value(id);
  if (e.owner != owner) return not_among_own(id);
  if (e.state == State::kPending)
    return failed_precondition(name + ": its forward has not finished yet; expected the forward's summary first");
  if (e.state == State::kInUse)
    return failed_precondition(name + ": in use by backward request " + echo_value(e.user) +
                               "; expected one backward at a time per context");
  e.state = State::kInUse;
  e.user = request_id;
  return e.context;
}

void ContextStore::check_in(const std::string& id, bool consume, const std::string& request_id) {
  std::shared_ptr<KeptContext> dropped;  // freed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.state != State::kInUse || it->second.user != request_id) return;
  if (closed_) {
    dropped = remove_locked(it, ContextEnd::kDrained, "the server is shutting down");
  } else if (consume) {
    dropped = remove_locked(it, ContextEnd::kConsumed,
                            "by backward request " + echo_value(request_id) +
                                " (set keep_context in a backward's header to keep it for another)");
  } else {
    it->second.state = State::kIdle;
    it->second.user.clear();
    it->second.last_used = Clock::now();
  }
}

StatusOr<int64_t> ContextStore::release(const std::string& id, const std::string& owner) {
  std::shared_ptr<KeptContext> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    const std::string name = "context_id = " + echo_value(id);
    if (it == entries_.end()) {
      const Status gone = gone_status_locked(id, owner);
      // Nothing to release: NOT_FOUND, with the reason when it was this owner's.
      return not_found(gone.message());
    }
    Entry& e = it->second;
    if (e.owner != owner) return not_among_own(id);
    if (e.state == State::kPending) return failed_precondition(name + ": its forward has not finished yet");
    if (e.state == State::kInUse)
      return failed_precondition(name + ": in use by backward request " + echo_value(e.user) +
                                 "; release it after that backward (which consumes it unless it keeps it)");
    dropped = remove_locked(it, ContextEnd::kReleased, "by ReleaseContext");
  }
  return dropped->charge().host_bytes;
}

Status ContextStore::reserve(const MemoryCharge& charge) {
  Status status = budget_->reserve(charge);
  while (!status.ok() && status.code() == StatusCode::kResourceExhausted) {
    std::shared_ptr<KeptContext> victim;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Evict only when it can help: contexts hold host bytes alone, and all
      // the idle ones together must cover the shortfall.
      const MemoryCharge budget = budget_->budget();
      const MemoryCharge reserved = budget_->reserved();
      const bool device_fits =
          charge.device_bytes <= 0 || reserved.device_bytes + charge.device_bytes <= budget.device_bytes;
      const bool host_can_fit =
          reserved.host_bytes - idle_bytes_locked(nullptr) + charge.host_bytes <= budget.host_bytes;
      if (!device_fits || !host_can_fit) return status;
      auto oldest = oldest_idle_locked(nullptr);
      if (oldest == entries_.end()) return status;
      victim = remove_locked(oldest, ContextEnd::kEvicted,
                             "the memory budget (--memory-budget) needed its room for another request (least recently "
                             "used contexts go first)");
    }
    victim.reset();  // gives its charge back
    status = budget_->reserve(charge);
  }
  return status;
}

Status ContextStore::reserve_for_client(ClientState& client, const MemoryCharge& charge) {
  Status status = client.reserve(charge);
  const std::string owner = client.name();
  while (!status.ok() && status.code() == StatusCode::kResourceExhausted) {
    std::shared_ptr<KeptContext> victim;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const ClientLimits limits = client.limits();
      const MemoryCharge reserved = client.reserved();
      const bool device_fits = limits.max_reserved_device_bytes <= 0 || charge.device_bytes <= 0 ||
                               reserved.device_bytes + charge.device_bytes <= limits.max_reserved_device_bytes;
      const bool host_can_fit =
          limits.max_reserved_bytes <= 0 ||
          reserved.host_bytes - idle_bytes_locked(&owner) + charge.host_bytes <= limits.max_reserved_bytes;
      if (!device_fits || !host_can_fit) return status;
      auto oldest = oldest_idle_locked(&owner);
      if (oldest == entries_.end()) return status;
      victim = remove_locked(oldest, ContextEnd::kEvicted,
                             "its client's max_reserved_bytes needed its room for another of its requests (least "
                             "recently used contexts go first)");
    }
    victim.reset();
    status = client.reserve(charge);
  }
  return status;
}

void ContextStore::close() {
  std::vector<std::shared_ptr<KeptContext>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (it->second.state == State::kIdle)
        dropped.push_back(remove_locked(it, ContextEnd::kDrained, "the server is shutting down"));
      it = next;
    }
  }
}

void ContextStore::sweep() {
  std::vector<std::shared_ptr<KeptContext>> dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  const Clock::time_point now = Clock::now();
  const auto ttl = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.ttl_seconds));
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second.state == State::kIdle && now - it->second.last_used >= ttl)
      dropped.push_back(remove_locked(it, ContextEnd::kExpired,
                                      "unused for --context-ttl = " + g_text(options_.ttl_seconds, 3) +
                                          " s; run the forward again with keep_context"));
    it = next;
  }
}

ContextStore::Held ContextStore::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {held_, bytes_};
}

}  // namespace plsh::server
