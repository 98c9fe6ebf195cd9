// The caller owns the memory (CUTLASS's initialize(args, workspace)): a plan
// sizes the workspace of each step by memory space (plsh/plan.h), the caller
// reserves it and hands it to Backend::forward, Backend::backward and
// compute_estimates as a WorkspaceRef, and they work inside it and allocate
// nothing beyond it. A step given less than its plan sized is refused
// (INVALID_ARGUMENT) before it touches anything.
//
// Carver slices a workspace into aligned buffers in order; with no base it
// only counts, so that a plan's sizing and a step's slicing run the same
// code and cannot disagree (the CUDA layout's carve_* habit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "plsh/status.h"

namespace plsh {

// Extra memory beyond the request's own tensors, by memory space.
struct Workspace {
  int64_t host_bytes = 0;    // host memory: per-thread tiles, tables, staging lists
  int64_t device_bytes = 0;  // device memory: staging copies of host tensors, GEMM workspace
};

// Every workspace base, and every buffer carved from one, starts at a
// multiple of this (a cache line, and AVX-512's vector width).
inline constexpr int64_t kWorkspaceAlignment = 64;

// Memory a caller lends to one step. Contents on entry are arbitrary and on
// return undefined; the callee keeps no pointer into it.
struct WorkspaceRef {
  void* host = nullptr;  // host memory, kWorkspaceAlignment-aligned
  int64_t host_bytes = 0;
  void* device = nullptr;  // device memory of the backend's device, likewise aligned
  int64_t device_bytes = 0;
};

// OK when `given` holds at least `needed` in each memory space, with aligned,
// non-null bases where bytes are needed; otherwise INVALID_ARGUMENT naming
// `step` ("cpu backend forward"), the bytes given and the bytes planned.
Status check_workspace(const WorkspaceRef& given, const Workspace& needed, const char* step);

// Host memory for a workspace, for callers without a pool of their own (plsh
// compute and demo, tests, the convenience overloads of plsh/attention.h).
// Left uninitialised: nothing may read a workspace before writing it.
class HostWorkspace {
 public:
  HostWorkspace() = default;
  // RESOURCE_EXHAUSTED when `bytes` cannot be allocated.
  static StatusOr<HostWorkspace> allocate(int64_t bytes);
  // The host part of a WorkspaceRef (no device memory).
  WorkspaceRef ref() const { return {data_.get(), bytes_, nullptr, 0}; }
  int64_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], Free> data_;
  int64_t bytes_ = 0;
};

// Slices [base, base + capacity) into buffers, each aligned to
// kWorkspaceAlignment, in the order take() is called. Counting only (base
// null): take() returns null and used() says how many bytes the same calls
// would need. Past the capacity take() returns null and overflowed() turns
// true, so that a caller finds a sizing bug before writing anywhere.
class Carver {
 public:
  Carver() = default;
  Carver(void* base, int64_t capacity) : base_(static_cast<std::byte*>(base)), capacity_(capacity) {}
  explicit Carver(const WorkspaceRef& w) : Carver(w.host, w.host_bytes) {}

  template <typename T>
  T* take(int64_t count) {
    const int64_t at = used_;
    const int64_t bytes = count > 0 ? count * static_cast<int64_t>(sizeof(T)) : 0;
    used_ += (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
    if (used_ > capacity_) overflowed_ = true;
    if (base_ == nullptr || overflowed_ || bytes == 0) return nullptr;
    return reinterpret_cast<T*>(base_ + at);
  }
  // A sub-carver over the next `bytes` bytes (rounded up to the alignment).
  Carver split(int64_t bytes) {
    std::byte* at = take<std::byte>(bytes);
    return at == nullptr ? Carver(nullptr, base_ == nullptr ? std::numeric_limits<int64_t>::max() : 0)
                         : Carver(at, bytes);
  }
  int64_t used() const { return used_; }
  bool counting() const { return base_ == nullptr; }
  bool overflowed() const { return overflowed_; }

 private:
  std::byte* base_ = nullptr;
  int64_t capacity_ = std::numeric_limits<int64_t>::max();
  int64_t used_ = 0;
  bool overflowed_ = false;
};

}  // namespace plsh
