// The CUDA backend the GPU tests share: one per process (inline, so every
// test file gets the same one), creating the cuBLAS handles and the pool
// once; REQUIRE_CUDA skips a test, saying why, where there is no device.
#pragma once

#include <gtest/gtest.h>

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

}  // namespace plsh

#define REQUIRE_CUDA(backend_var)                         \
  std::string why_no_cuda;                                \
  ::plsh::Backend* backend_var = ::plsh::cuda_backend(&why_no_cuda); \
  if (backend_var == nullptr) GTEST_SKIP() << why_no_cuda
