#include "server/buffer_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <new>
#include <vector>

namespace plsh::server {

namespace {

int64_t round_up(int64_t n, int64_t granule) { return (n + granule - 1) / granule * granule; }

// Maps `bytes` of anonymous memory, not faulted in: the pages come as the
// request's chunks arrive (fault_in). Not MADV_HUGEPAGE: with the kernel's
// usual defrag policy ("madvise") it compacts memory synchronously, and
// faulting in 512 MiB took 22 ms on an idle machine but 1.5 s on a busy one
// (4 KiB pages: 200-240 ms either way).
uint8_t* map_block(int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

}  // namespace

std::shared_ptr<uint8_t> BufferPool::heap_block(int64_t bytes) {
  const std::align_val_t alignment{kHeapAlignment};
  auto* p = static_cast<uint8_t*>(::operator new[](static_cast<size_t>(std::max<int64_t>(bytes, 1)), alignment));
  return std::shared_ptr<uint8_t>(p, [alignment](uint8_t* q) { ::operator delete[](q, alignment); });
}

void BufferPool::fault_in(void* p, int64_t bytes) {
  if (bytes <= 0) return;
  static const long page = sysconf(_SC_PAGESIZE);
  const auto begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0) return;
  // Kernels before 5.14 (EINVAL), or memory madvise cannot populate: the
  // copy faults the pages itself.
}

struct BufferPool::State {
  State(int64_t limit, int64_t keep) : limit_bytes(limit), keep_resident_bytes(keep) {}
  ~State() {
    for (const auto& [size, block] : idle) munmap(block.base, static_cast<size_t>(size));
  }

  struct Idle {
    uint8_t* base = nullptr;
    bool resident = false;  // its pages may be resident (not given back since its last use)
  };

  // A block back from its request: kept while it fits the limit, else
  // unmapped; kept resident while under the high-water mark, else its pages
  // go back to the kernel first.
  void give_back(uint8_t* block, int64_t size) {
    enum { kKeep, kKeepReleased, kUnmap } what = kUnmap;
    {
      std::lock_guard<std::mutex> lock(mu);
      in_use_bytes -= size;
      if (in_use_bytes + idle_bytes + size <= limit_bytes)
        what = idle_resident_bytes + size <= keep_resident_bytes ? kKeep : kKeepReleased;
    }
    if (what == kUnmap) {
      munmap(block, static_cast<size_t>(size));
      return;
    }
    // Outside the lock: giving back a few GiB of pages takes milliseconds.
    if (what == kKeepReleased) madvise(block, static_cast<size_t>(size), MADV_DONTNEED);
    std::lock_guard<std::mutex> lock(mu);
    idle.emplace(size, Idle{block, what == kKeep});
    idle_bytes += size;
    if (what == kKeep) idle_resident_bytes += size;
    if (what == kKeepReleased) ++released;
  }

  const int64_t limit_bytes;
  const int64_t keep_resident_bytes;
  std::mutex mu;
  std::multimap<int64_t, Idle> idle;  // size -> block
  int64_t in_use_bytes = 0, idle_bytes = 0, idle_resident_bytes = 0;
  int64_t mapped = 0, reused = 0, released = 0;
};

BufferPool::BufferPool(int64_t limit_bytes, int64_t keep_resident_bytes)
    : state_(std::make_shared<State>(limit_bytes, keep_resident_bytes)) {}

BufferPool::~BufferPool() = default;

std::shared_ptr<uint8_t> BufferPool::acquire(int64_t bytes) {
  if (bytes < kPooledFromBytes) return heap_block(bytes);
  const int64_t size = round_up(bytes, kBlockGranule);
  std::shared_ptr<State> state = state_;
  auto hand_out = [&state](uint8_t* block, int64_t block_size) {
    // The deleter holds the state, so a block given back after the pool is
    // gone (gRPC letting go of an output slice late) still finds it.
    return std::shared_ptr<uint8_t>(block, [state, block_size](uint8_t* b) { state->give_back(b, block_size); });
  };
  std::vector<std::pair<int64_t, uint8_t*>> evicted;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    // The smallest idle block that fits, unless it is much larger than
    // asked (a 1 GiB block would sit under a 4 MiB request).
    auto it = state->idle.lower_bound(size);
    if (it != state->idle.end() && it->first <= size + size / 4 + kBlockGranule) {
      const int64_t block_size = it->first;
      const State::Idle block = it->second;
      state->idle.erase(it);
      state->idle_bytes -= block_size;
      if (block.resident) state->idle_resident_bytes -= block_size;
      state->in_use_bytes += block_size;
      ++state->reused;
      return hand_out(block.base, block_size);
    }
    // Room for a new block: unmap idle ones, largest first.
    while (!state->idle.empty() && state->in_use_bytes + state->idle_bytes + size > state->limit_bytes) {
      auto largest = std::prev(state->idle.end());
      evicted.emplace_back(largest->first, largest->second.base);
      state->idle_bytes -= largest->first;
      if (largest->second.resident) state->idle_resident_bytes -= largest->first;
      state->idle.erase(largest);
    }
    state->in_use_bytes += size;  // counted now: concurrent acquires see it
    ++state->mapped;
  }
  for (const auto& [block_size, block] : evicted) munmap(block, static_cast<size_t>(block_size));
  uint8_t* block = map_block(size);
  if (block == nullptr) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->in_use_bytes -= size;
    throw std::bad_alloc();
  }
  return hand_out(block, size);
}

BufferPool::Stats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return Stats{state_->in_use_bytes, state_->idle_bytes, state_->idle_resident_bytes,
               state_->mapped,       state_->reused,     state_->released};
}

}  // namespace plsh::server
