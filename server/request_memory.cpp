#include "server/request_memory.h"

#include <new>

namespace plsh::server {

namespace {

int64_t aligned(int64_t n) {
  return (n + MemoryLayout::kAlignment - 1) / MemoryLayout::kAlignment * MemoryLayout::kAlignment;
}

// `bytes` of host memory, uninitialised: the assembler checks that every
// input row is written, the kernels write every output row, and nothing
// reads a workspace before writing it. Null for 0 bytes.
std::shared_ptr<uint8_t> acquire(int64_t bytes, BufferPool* pool) {
  if (bytes <= 0) return nullptr;
  return pool != nullptr ? pool->acquire(bytes) : BufferPool::heap_block(bytes);
}

}  // namespace

int64_t MemoryLayout::tensor_bytes() const {
  int64_t total = 0;
  for (int64_t part : {q, k, v, out, lse, dout, dq, dk, dv}) total += aligned(part);
  return total;
}

RequestMemory RequestMemory::allocate(const MemoryLayout& layout, BufferPool* pool) {
  RequestMemory m;
  m.block = acquire(layout.tensor_bytes(), pool);
  m.workspace_block = acquire(layout.workspace, pool);
  uint8_t* at = m.block.get();
  auto take = [&at](int64_t part) {
    uint8_t* p = part > 0 ? at : nullptr;
    at += aligned(part);
    return p;
  };
  m.q = take(layout.q);
  m.k = take(layout.k);
  m.v = take(layout.v);
  m.out = take(layout.out);
  m.lse = reinterpret_cast<float*>(take(layout.lse));
  m.dout = take(layout.dout);
  m.dq = take(layout.dq);
  m.dk = take(layout.dk);
  m.dv = take(layout.dv);
  m.workspace.host = m.workspace_block.get();
  m.workspace.host_bytes = layout.workspace;
  return m;
}

TensorRefs RequestMemory::refs() const {
  TensorRefs t;
  t.q = q;
  t.k = k;
  t.v = v;
  t.out = out;
  t.lse = lse;
  t.memory = MemorySpace::kHost;
  return t;
}

}  // namespace plsh::server
