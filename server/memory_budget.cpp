#include "server/memory_budget.h"

#include <string>

namespace plsh::server {

Status MemoryBudget::reserve(const MemoryCharge& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t host_free = budget_.host_bytes - reserved_.host_bytes;
  const int64_t device_free = budget_.device_bytes - reserved_.device_bytes;
  // A charge over the whole budget can never fit: say so, not "retry".
  if (c.host_bytes > host_free)
    return resource_exhausted("request needs " + std::to_string(c.host_bytes) + " bytes of host memory, " +
                              std::to_string(host_free) + " of the server's --memory-budget " +
                              std::to_string(budget_.host_bytes) + " are free; " +
                              (c.host_bytes > budget_.host_bytes ? "it can never fit" : "retry later"));
  if (c.device_bytes > device_free)
    return resource_exhausted("request needs " + std::to_string(c.device_bytes) + " bytes of device memory, " +
                              std::to_string(device_free) + " of the server's --device-memory-budget " +
                              std::to_string(budget_.device_bytes) + " are free; " +
                              (c.device_bytes > budget_.device_bytes ? "it can never fit" : "retry later"));
  reserved_.host_bytes += c.host_bytes;
  reserved_.device_bytes += c.device_bytes;
  if (on_change_) on_change_(reserved_);
  return Status::Ok();
}

void MemoryBudget::release(const MemoryCharge& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_.host_bytes -= c.host_bytes;
  reserved_.device_bytes -= c.device_bytes;
  if (on_change_) on_change_(reserved_);
}

MemoryCharge MemoryBudget::reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

}  // namespace plsh::server
