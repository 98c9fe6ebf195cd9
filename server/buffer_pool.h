// Host memory for requests' tensors, reused across requests (SPEC section 9:
// tensor bytes are the main cost). A fresh `new uint8_t[]` per request is
// mapped, page-faulted and zeroed by the kernel page by page while the
// chunks arrive, and unmapped again at the end: bench/RESULTS.md ("Ingest")
// measured page faults at about 40% of the server's receiving CPU. The pool
// maps large blocks once, faults them in when mapped (MADV_POPULATE_WRITE,
// on transparent huge pages where the kernel allows), and keeps blocks
// that requests give back for the next request of a similar size.
//
// Bounded by the memory budget: blocks in use and blocks kept idle together
// stay within `limit_bytes` (--memory-budget) wherever the requests in use
// allow; idle blocks are unmapped, largest first, to make room for a new
// one. Requests themselves are charged to the budget by the Scheduler, as
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

  explicit BufferPool(int64_t limit_bytes);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // At least `bytes` bytes of host memory, faulted in (its content is
  // whatever the last user left: callers write before they read). Given
  // back to the pool when the last copy of the pointer goes, on any thread,
  // also after the pool itself is gone. Throws std::bad_alloc when the
  // memory cannot be mapped.
  std::shared_ptr<uint8_t> acquire(int64_t bytes);

  struct Stats {
    int64_t in_use_bytes = 0;  // pooled blocks held by requests (or by gRPC, for output being sent)
    int64_t idle_bytes = 0;    // pooled blocks kept for reuse
    int64_t mapped = 0;        // blocks mapped since start
    int64_t reused = 0;        // acquisitions served by an idle block
  };
  Stats stats() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace plsh::server
