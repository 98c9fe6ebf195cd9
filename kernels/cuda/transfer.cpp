#include "cuda/transfer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "cuda/cuda_check.h"

namespace plsh::cuda {

PinnedPool::~PinnedPool() {
  if (abandoned_ || !cuda_runtime_alive()) return;
  for (const std::unique_ptr<Set>& s : sets_)
    for (void* b : s->buffer)
      if (b != nullptr) (void)cudaFreeHost(b);
}

StatusOr<PinnedPool::Set*> PinnedPool::acquire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!free_.empty()) {
    Set* s = free_.back();
    free_.pop_back();
    return s;
  }
  if (static_cast<int>(sets_.size()) >= max_sets_)
    return resource_exhausted("cuda backend: all " + std::to_string(max_sets_) +
                              " sets of pinned bounce buffers are in use, one per concurrent call");
  auto s = std::make_unique<Set>();
  for (void*& b : s->buffer) {
    const cudaError_t e = cudaHostAlloc(&b, static_cast<size_t>(kBufferBytes), cudaHostAllocDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      for (void* done : s->buffer)
        if (done != nullptr) (void)cudaFreeHost(done);
      return resource_exhausted("cuda backend: " + std::to_string(kBufferBytes * kBuffers) +
                                " bytes of pinned bounce buffers could not be allocated: " + cuda_error_text(e));
    }
  }
  sets_.push_back(std::move(s));
  return sets_.back().get();
}

void PinnedPool::release(Set* set) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(set);
}

void PinnedPool::abandon() {
  std::lock_guard<std::mutex> lock(mutex_);
  abandoned_ = true;
}

int64_t PinnedPool::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(sets_.size()) * kBuffers * kBufferBytes;
}

void parallel_copy(void* dst, const void* src, int64_t n, int threads) {
  // Below 1 MiB a thread team costs more than it saves.
  const int64_t pieces = std::min<int64_t>(threads, std::max<int64_t>(1, n >> 20));
  if (pieces <= 1) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return;
  }
  const int64_t each = (n + pieces - 1) / pieces;
#pragma omp parallel for num_threads(static_cast <int>(pieces)) schedule(static, 1)
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t at = i * each, len = std::min(each, n - at);
    if (len > 0)
      std::memcpy(static_cast<char*>(dst) + at, static_cast<const char*>(src) + at, static_cast<size_t>(len));
  }
}

Transfers::~Transfers() {
  if (copy_ != nullptr) (void)cudaStreamSynchronize(copy_);
  for (Slot& s : slots_)
    if (s.done != nullptr) (void)cudaEventDestroy(s.done);
  if (uploads_ != nullptr) (void)cudaEventDestroy(uploads_);
  if (computed_ != nullptr) (void)cudaEventDestroy(computed_);
  if (copy_ != nullptr) (void)cudaStreamDestroy(copy_);
}

Status Transfers::init() {
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&uploads_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&computed_, cudaEventDisableTiming));
  for (Slot& s : slots_) CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
  return Status::Ok();
}

Status Transfers::wait(cudaEvent_t e) {
  for (int polls = 0;; ++polls) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady) CUDA_RETURN_IF_ERROR(q);
    (void)cudaGetLastError();  // "not yet" is no error to keep
    RETURN_IF_ERROR(ctx_.check_stop());
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status Transfers::settle(int i) {
  Slot& s = slots_[static_cast<size_t>(i)];
  if (!s.used) return Status::Ok();
  RETURN_IF_ERROR(wait(s.done));
  if (s.host_dst != nullptr) parallel_copy(s.host_dst, set_.buffer[static_cast<size_t>(i)], s.bytes, threads_);
  s.host_dst = nullptr;
  s.used = false;
  return Status::Ok();
}

StatusOr<int> Transfers::next_slot() {
  RETURN_IF_ERROR(ctx_.check_stop());
  const int i = next_;
  next_ = (next_ + 1) % PinnedPool::kBuffers;
  RETURN_IF_ERROR(settle(i));
  return i;
}

Status Transfers::upload(void* dst, const void* src, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += PinnedPool::kBufferBytes) {
    const int64_t n = std::min(PinnedPool::kBufferBytes, bytes - at);
    ASSIGN_OR_RETURN(const int i, next_slot());
    void* pinned = set_.buffer[static_cast<size_t>(i)];
    parallel_copy(pinned, static_cast<const char*>(src) + at, n, threads_);
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(static_cast<char*>(dst) + at, pinned, static_cast<size_t>(n), cudaMemcpyHostToDevice, copy_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(slots_[static_cast<size_t>(i)].done, copy_));
    slots_[static_cast<size_t>(i)].used = true;
    bytes_ += n;
  }
  return Status::Ok();
}

Status Transfers::compute_after_uploads() {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(uploads_, copy_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, uploads_, 0));
  return Status::Ok();
}

Status Transfers::download(void* dst, const void* src, int64_t bytes) {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(computed_, compute_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, computed_, 0));
  for (int64_t at = 0; at < bytes; at += PinnedPool::kBufferBytes) {
    const int64_t n = std::min(PinnedPool::kBufferBytes, bytes - at);
    ASSIGN_OR_RETURN(const int i, next_slot());
    Slot& s = slots_[static_cast<size_t>(i)];
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(set_.buffer[static_cast<size_t>(i)], static_cast<const char*>(src) + at,
                                         static_cast<size_t>(n), cudaMemcpyDeviceToHost, copy_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(s.done, copy_));
    s.used = true;
    s.host_dst = static_cast<char*>(dst) + at;
    s.bytes = n;
    bytes_ += n;
  }
  return Status::Ok();
}

Status Transfers::finish() {
  // Oldest first, as they were queued.
  for (int k = 0; k < PinnedPool::kBuffers; ++k) RETURN_IF_ERROR(settle((next_ + k) % PinnedPool::kBuffers));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_));
  return Status::Ok();
}

}  // namespace plsh::cuda
