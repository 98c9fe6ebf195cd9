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

// Maps `bytes` of anonymous memory and faults it in now, so that the
// request that gets it does not fault page by page while its chunks arrive.
uint8_t* map_block(int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Not MADV_HUGEPAGE: with the kernel's usual defrag policy ("madvise") it
  // compacts memory synchronously, and faulting in 512 MiB took 22 ms on an
  // idle machine but 1.5 s on a busy one (4 KiB pages: 200-240 ms either
  // way), all of it before the request's ack.
  if (madvise(p, static_cast<size_t>(bytes), MADV_POPULATE_WRITE) != 0) {
    // Kernels before 5.14: touch one byte per page instead.
    const long page = sysconf(_SC_PAGESIZE);
    for (int64_t at = 0; at < bytes; at += page) static_cast<volatile uint8_t*>(p)[at] = 0;
  }
  return static_cast<uint8_t*>(p);
}

}  // namespace

struct BufferPool::State {
  explicit State(int64_t limit) : limit_bytes(limit) {}
  ~State() {
    for (const auto& [size, block] : idle) munmap(block, static_cast<size_t>(size));
  }

  // A block back from its request: kept while it fits the limit, else unmapped.
  void give_back(uint8_t* block, int64_t size) {
    bool keep = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      in_use_bytes -= size;
      if (in_use_bytes + idle_bytes + size <= limit_bytes) {
        idle.emplace(size, block);
        idle_bytes += size;
        keep = true;
      }
    }
    if (!keep) munmap(block, static_cast<size_t>(size));
  }

  const int64_t limit_bytes;
  std::mutex mu;
  std::multimap<int64_t, uint8_t*> idle;  // size -> block
  int64_t in_use_bytes = 0, idle_bytes = 0;
  int64_t mapped = 0, reused = 0;
};

BufferPool::BufferPool(int64_t limit_bytes) : state_(std::make_shared<State>(limit_bytes)) {}

BufferPool::~BufferPool() = default;

std::shared_ptr<uint8_t> BufferPool::acquire(int64_t bytes) {
  if (bytes < kPooledFromBytes) return std::shared_ptr<uint8_t>(new uint8_t[static_cast<size_t>(std::max<int64_t>(bytes, 1))], std::default_delete<uint8_t[]>());
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
      const auto [block_size, block] = *it;
      state->idle.erase(it);
      state->idle_bytes -= block_size;
      state->in_use_bytes += block_size;
      ++state->reused;
      return hand_out(block, block_size);
    }
    // Room for a new block: unmap idle ones, largest first.
    while (!state->idle.empty() && state->in_use_bytes + state->idle_bytes + size > state->limit_bytes) {
      auto largest = std::prev(state->idle.end());
      evicted.push_back(*largest);
      state->idle_bytes -= largest->first;
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
  return Stats{state_->in_use_bytes, state_->idle_bytes, state_->mapped, state_->reused};
}

}  // namespace plsh::server
