// Host memory for requests' tensors, reused across requests (SPEC section 9:
// tensor bytes are the main cost). A fresh `new uint8_t[]` per request is
// mapped, page-faulted and zeroed by the kernel page by page while the
// chunks arrive, and unmapped again at the end: bench/RESULTS.md ("Ingest")
// measured page faults at about 40% of the server's receiving CPU. The pool
// maps large blocks once and keeps blocks that requests give back for the
// next request of a similar size.
//
// Memory follows data, not headers: a block is mapped but not faulted in
// when it is handed out, so a header alone (with its reservation) costs no
// resident memory. The receiving path faults in each chunk's destination
// with one call (fault_in: MADV_POPULATE_WRITE) just before copying it, so
// that the pages come in a batch rather than one trap at a time.
//
// Bounded twice:
//   - address space: blocks in use and blocks kept idle together stay
//     within `limit_bytes` (--memory-budget) wherever the requests in use
//     allow; idle blocks are unmapped, largest first, to make room;
//   - resident memory kept between requests: idle blocks whose pages may be
//     resident stay under `keep_resident_bytes` (the high-water mark,
//     --pool-keep-bytes); a block given back above it has its pages given
//     to the kernel (MADV_DONTNEED) and is kept only as address space.
// Requests themselves are charged to the budget by the Scheduler, as
// before; the pool only decides what is kept between them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace plsh::server {

class BufferPool {
 public:
  // Blocks below this are plain heap memory (operator new), not pooled:
  // small requests fault in few pages and are done fast anyway.
  static constexpr int64_t kPooledFromBytes = int64_t{1} << 20;
  // Pooled blocks are multiples of this (a transparent huge page).
  static constexpr int64_t kBlockGranule = int64_t{2} << 20;
  // Every block starts at a multiple of this at least (pooled ones at a
  // page): a workspace carved from one needs kWorkspaceAlignment (64).
  static constexpr size_t kHeapAlignment = 64;

  BufferPool(int64_t limit_bytes, int64_t keep_resident_bytes);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // At least `bytes` bytes of host memory, not necessarily faulted in (its
  // content is whatever the last user left, or zeros: callers write before
  // they read). Given back to the pool when the last copy of the pointer
  // goes, on any thread, also after the pool itself is gone. Throws
  // std::bad_alloc when the memory cannot be mapped.
  std::shared_ptr<uint8_t> acquire(int64_t bytes);

  // Faults in the pages under [p, p + bytes) for writing in one call, ahead
  // of a copy there (any memory: pooled, heap or shared; pages already in
  // are left as they are).
  static void fault_in(void* p, int64_t bytes);
  // `bytes` of plain heap memory (at least 1), aligned to kHeapAlignment:
  // the unpooled blocks, and callers without a pool.
  static std::shared_ptr<uint8_t> heap_block(int64_t bytes);

  struct Stats {
    int64_t in_use_bytes = 0;         // pooled blocks held by requests (or by gRPC, for output being sent)
    int64_t idle_bytes = 0;           // pooled blocks kept for reuse (address space)
    int64_t idle_resident_bytes = 0;  // of those, the ones whose pages may still be resident
    int64_t mapped = 0;               // blocks mapped since start
    int64_t reused = 0;               // acquisitions served by an idle block
    int64_t released = 0;             // blocks whose pages were given back to the kernel (above the mark)
  };
  Stats stats() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace plsh::server
