// The CUDA backend the GPU tests share: one per process (inline, so every
// test file gets the same one), creating the cuBLAS handles and the pool
// once; REQUIRE_CUDA skips a test, saying why, where there is no device.
// REQUIRE_CUDA_BUDGET makes a backend of the test's own with a given device
// memory budget, and skips likewise.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/cuda_backend.h"
#include "plsh/backend.h"

namespace plsh {

inline Backend* cuda_backend(std::string* why) {
  static std::string reason;
  static std::unique_ptr<Backend> backend = cuda::make_cuda_backend(&reason);
  *why = reason;
  return backend.get();
}

inline std::unique_ptr<Backend> cuda_backend_with_budget(int64_t budget_bytes, std::string* why) {
  cuda::CudaBackendOptions options;
  options.memory_budget_bytes = budget_bytes;
  return cuda::make_cuda_backend(why, options);
}

}  // namespace plsh

#define REQUIRE_CUDA(backend_var)                                    \
  std::string why_no_cuda;                                           \
  ::plsh::Backend* backend_var = ::plsh::cuda_backend(&why_no_cuda); \
  if (backend_var == nullptr) GTEST_SKIP() << why_no_cuda

#define REQUIRE_CUDA_BUDGET(backend_var, budget_bytes)                                                         \
  std::string why_no_cuda;                                                                                     \
  std::unique_ptr<::plsh::Backend> backend_var = ::plsh::cuda_backend_with_budget(budget_bytes, &why_no_cuda); \
  if (backend_var == nullptr) GTEST_SKIP() << why_no_cuda
