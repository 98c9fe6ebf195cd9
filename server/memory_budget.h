// The two memory budgets shared by every request in flight, one per memory
// space: host (--memory-budget: tensors, host workspace and kept contexts)
// and device (--device-memory-budget: a GPU backend's staging and
// workspace). Charges are all or nothing; a charge that does not fit is
// RESOURCE_EXHAUSTED at once rather than a wait: a client that is told to
// back off can retry elsewhere, a client that waits blindly cannot. Only
// the admission (admission.h) and kept contexts (contexts.h) charge it.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>

#include "plsh/status.h"

namespace plsh::server {

// Bytes by memory space: what a request is charged, or a budget.
struct MemoryCharge {
  int64_t host_bytes = 0;
  int64_t device_bytes = 0;
};

class MemoryBudget {
 public:
  explicit MemoryBudget(MemoryCharge budget) : budget_(budget) {}

  // Reserves both parts against their budgets, all or nothing, or
  // RESOURCE_EXHAUSTED naming the budget's flag.
  Status reserve(const MemoryCharge& charge);
  void release(const MemoryCharge& charge);
  MemoryCharge reserved() const;
  MemoryCharge budget() const { return budget_; }
  // Called with the new totals whenever reservations change (under the
  // lock, so a gauge sees the changes in order). Set before serving.
  void set_listener(std::function<void(const MemoryCharge&)> on_change) { on_change_ = std::move(on_change); }

 private:
  const MemoryCharge budget_;
  std::function<void(const MemoryCharge&)> on_change_;
  mutable std::mutex mutex_;
  MemoryCharge reserved_;
};

}  // namespace plsh::server
