// The host memory one request holds from its admission until it closes (or,
// for a forward that keeps its context, until the context goes): a block
// from the BufferPool with every tensor the server holds, each at a 4 KiB
// boundary; a second block for the plan's host workspace (apart, so that a
// kept context keeps its tensors and not its workspace); the plan's device
// workspace from its backend; and, for tensors in shared memory, the
// regions' bytes.
// The admission (admission.h) reserves all of it at the header, before the
// ack, and allocates it at once: nothing is allocated for a request after.
#pragma once

#include <cstdint>
#include <memory>

#include "plsh/params.h"
#include "plsh/workspace.h"
#include "server/buffer_pool.h"

namespace plsh::server {

// Bytes of each part of a request's block; 0: the request does not hold it
// (not used by its form, or in shared memory).
struct MemoryLayout {
  // The forward's tensors.
  int64_t q = 0, k = 0, v = 0, out = 0, lse = 0;
  // The backward's.
  int64_t dout = 0, dq = 0, dk = 0, dv = 0;
  // The plan's host workspace (the largest step's: plsh::Plan::workspace).
  int64_t workspace = 0;

  // Every part at a 4 KiB boundary.
  static constexpr int64_t kAlignment = 4096;
  int64_t tensor_bytes() const;  // the tensors' block
  int64_t total_bytes() const { return tensor_bytes() + workspace; }
};

// Where each tensor lies; null where the request holds none.
struct RequestMemory {
  uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;  // [B, Nq, H, D], [B, Nk, Hkv, D] x2, [B, Nq, H, D]
  float* lse = nullptr;                                              // [B, Nq, H]
  uint8_t *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  WorkspaceRef workspace;  // host part in the block; device part from the backend
  // The tensors' block; output chunks being sent hold a copy of it, so that
  // it goes back to the pool only once gRPC is done with them.
  std::shared_ptr<uint8_t> block;
  std::shared_ptr<uint8_t> workspace_block;  // the host workspace
  std::shared_ptr<void> device;              // owns the device workspace

  // The parts as `layout` says, from `pool` (null: plain heap memory, for
  // tests and tools). Throws std::bad_alloc when it cannot be mapped.
  static RequestMemory allocate(const MemoryLayout& layout, BufferPool* pool);
  // q, k, v, out, lse for the kernels (host memory).
  TensorRefs refs() const;
};

}  // namespace plsh::server
