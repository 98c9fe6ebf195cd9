#include "plsh/workspace.h"

#include <cstdint>
#include <new>

namespace plsh {

namespace {

Status check_space(const char* space, const void* base, int64_t given, int64_t needed, const char* step) {
  if (needed <= 0) return Status::Ok();
  const std::string field = std::string("workspace.") + space;
  if (given < needed)
    return invalid_argument(std::string(step) + ": " + field + "_bytes = " + std::to_string(given) +
                            ", expected >= " + std::to_string(needed) + " (what the plan sized for this step)");
  if (base == nullptr)
    return invalid_argument(std::string(step) + ": " + field + " = null, expected " + std::to_string(needed) +
                            " bytes");
  if (reinterpret_cast<uintptr_t>(base) % kWorkspaceAlignment != 0)
    return invalid_argument(std::string(step) + ": " + field + " is not aligned to " +
                            std::to_string(kWorkspaceAlignment) + " bytes (kWorkspaceAlignment)");
  return Status::Ok();
}

}  // namespace

Status check_workspace(const WorkspaceRef& given, const Workspace& needed, const char* step) {
  RETURN_IF_ERROR(check_space("host", given.host, given.host_bytes, needed.host_bytes, step));
  return check_space("device", given.device, given.device_bytes, needed.device_bytes, step);
}

void HostWorkspace::Free::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t{kWorkspaceAlignment});
}

StatusOr<HostWorkspace> HostWorkspace::allocate(int64_t bytes) {
  HostWorkspace w;
  if (bytes <= 0) return w;
  void* p = ::operator new[](static_cast<size_t>(bytes), std::align_val_t{kWorkspaceAlignment}, std::nothrow);
  if (p == nullptr)
    return resource_exhausted("a host workspace of " + std::to_string(bytes) + " bytes could not be allocated");
  w.data_.reset(static_cast<std::byte*>(p));
  w.bytes_ = bytes;
  return w;
}

}  // namespace plsh
