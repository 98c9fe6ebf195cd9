// The CUDA backend's device memory: one stream-ordered memory pool per
// backend, a reservation counter over it (so that concurrent requests
// together never exceed the backend's budget, whatever the server charges),
// and buffers freed on the stream that used them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "plsh/status.h"

namespace plsh::cuda {

// Stream-ordered allocations from one CUDA memory pool that keeps up to the
// budget cached between calls, and a reservation counter so that concurrent
// requests together never exceed the budget.
class DevicePool {
 public:
  Status init(int device, int64_t budget) {
    budget_ = budget;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
    uint64_t threshold = static_cast<uint64_t>(budget);
    CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    return Status::Ok();
  }
  ~DevicePool() {
    if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
  }
  // Leaves the pool to the driver: for a destructor that runs when the
  // runtime is gone or the context lost (CudaBackend's).
  void abandon() { pool_ = nullptr; }
  int64_t budget() const { return budget_; }
  int64_t available() const { return budget_ - reserved_.load(); }

  Status reserve(int64_t bytes) {
    int64_t cur = reserved_.load();
    do {
      if (cur + bytes > budget_)
        return resource_exhausted("cuda memory budget: request needs " + std::to_string(bytes) + " bytes, " +
                                  std::to_string(cur) + " of " + std::to_string(budget_) +
                                  " bytes are held by other requests (set PLSH_CUDA_MEMORY_MB to change the budget)");
    } while (!reserved_.compare_exchange_weak(cur, cur + bytes));
    return Status::Ok();
  }
  void unreserve(int64_t bytes) { reserved_.fetch_sub(bytes); }

  Status allocate(int64_t bytes, cudaStream_t stream, void** ptr) {
    CUDA_RETURN_IF_ERROR(cudaMallocFromPoolAsync(ptr, static_cast<size_t>(std::max<int64_t>(bytes, 1)), pool_, stream));
    return Status::Ok();
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  int64_t budget_ = 0;
  std::atomic<int64_t> reserved_{0};
};

// A stream-ordered buffer from the pool, freed on the same stream.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  Status allocate(DevicePool& pool, int64_t bytes, cudaStream_t stream) {
    stream_ = stream;
    return pool.allocate(bytes, stream, &ptr_);
  }
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Holds a budget reservation for the length of one forward().
class Reservation {
 public:
  explicit Reservation(DevicePool& pool) : pool_(pool) {}
  ~Reservation() { pool_.unreserve(bytes_); }
  Status take(int64_t bytes) {
    RETURN_IF_ERROR(pool_.reserve(bytes));
    bytes_ += bytes;
    return Status::Ok();
  }

 private:
  DevicePool& pool_;
  int64_t bytes_ = 0;
};

}  // namespace plsh::cuda
