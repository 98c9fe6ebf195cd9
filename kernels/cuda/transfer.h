// Host <-> device copies of one call, through pinned bounce buffers on a
// copy stream of their own, so that they overlap the compute stream's
// kernels: a pageable host buffer is copied into a pinned one by the host
// (on the plan's threads), the DMA engine takes it from there while the
// host fills the next, and downloads run the other way. Every copy is 1-D
// (the fused path's device tensors are dense, so a slab of rows is one
// contiguous run). Between buffers the host polls ctx, so a cancel or a
// deadline stops the copies within one buffer's worth.
//
// The pinned memory belongs to the backend (PinnedPool, created on first
// use, a set per concurrent call, capped like the cuBLAS handles): pinning
// a request's own tensors (cudaHostRegister) would cost more than copying
// them, and pinned memory that outlives a call must not count against the
// request's host workspace.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "plsh/backend.h"
#include "plsh/status.h"

namespace plsh::cuda {

class PinnedPool {
 public:
  // 4 buffers of 16 MiB a call: two in flight each way keeps PCIe busy
  // (about 0.3 ms of DMA each at ~55 GB/s) while the host fills the next.
  static constexpr int64_t kBufferBytes = int64_t{16} << 20;
  static constexpr int kBuffers = 4;
  struct Set {
    std::array<void*, kBuffers> buffer{};
  };

  explicit PinnedPool(int max_sets) : max_sets_(max_sets < 1 ? 1 : max_sets) {}
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool();
  // A free set, or a new one (cudaHostAlloc) while fewer than max_sets
  // exist; RESOURCE_EXHAUSTED when all are lent (more concurrent calls than
  // the backend was sized for) or the host cannot pin more.
  StatusOr<Set*> acquire();
  void release(Set* set);
  // Leaves the memory to the process's end (a lost context, a runtime gone).
  void abandon();
  int64_t pinned_bytes() const;

 private:
  mutable std::mutex mutex_;
  int max_sets_;
  std::vector<std::unique_ptr<Set>> sets_;
  std::vector<Set*> free_;
  bool abandoned_ = false;
};

// A set lent for one call.
class PinnedLease {
 public:
  explicit PinnedLease(PinnedPool& pool) : pool_(pool) {}
  PinnedLease(const PinnedLease&) = delete;
  PinnedLease& operator=(const PinnedLease&) = delete;
  ~PinnedLease() {
    if (set_ != nullptr) pool_.release(set_);
  }
  Status take() {
    ASSIGN_OR_RETURN(set_, pool_.acquire());
    return Status::Ok();
  }
  PinnedPool::Set& set() { return *set_; }

 private:
  PinnedPool& pool_;
  PinnedPool::Set* set_ = nullptr;
};

class Transfers {
 public:
  // compute: the call's stream; threads: the host threads that fill and
  // empty the bounce buffers (the plan's).
  Transfers(const ExecContext& ctx, cudaStream_t compute, PinnedPool::Set& set, int threads)
      : ctx_(ctx), compute_(compute), set_(set), threads_(threads < 1 ? 1 : threads) {}
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  // Drains the copy stream; downloads not finished are dropped.
  ~Transfers();

  Status init();
  // bytes from host src to device dst, queued on the copy stream.
  Status upload(void* dst, const void* src, int64_t bytes);
  // The compute stream waits for every upload queued so far.
  Status compute_after_uploads();
  // bytes from device src to host dst after everything queued on the
  // compute stream so far; in host memory after finish() (or after later
  // copies needed the buffer).
  Status download(void* dst, const void* src, int64_t bytes);
  // Every download in host memory, the copy stream idle.
  Status finish();
  int64_t bytes_copied() const { return bytes_; }

 private:
  struct Slot {
    cudaEvent_t done = nullptr;  // the last DMA that used the buffer
    void* host_dst = nullptr;    // a download to copy out once done
    int64_t bytes = 0;
    bool used = false;
  };
  // The next buffer in turn, free: its last DMA waited for (polling ctx)
  // and its pending download copied out.
  StatusOr<int> next_slot();
  Status wait(cudaEvent_t e);
  Status settle(int slot);

  const ExecContext& ctx_;
  cudaStream_t compute_;
  PinnedPool::Set& set_;
  int threads_;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t uploads_ = nullptr;   // recorded on copy_ for the compute stream
  cudaEvent_t computed_ = nullptr;  // recorded on compute_ for the downloads
  std::array<Slot, PinnedPool::kBuffers> slots_{};
  int next_ = 0;
  int64_t bytes_ = 0;
};

// n bytes from src to dst on up to `threads` host threads (OpenMP).
void parallel_copy(void* dst, const void* src, int64_t n, int threads);

}  // namespace plsh::cuda
