// Every CUDA and cuBLAS call becomes a plsh::Status naming the call and its
// file:line; the server never aborts on a device error.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "plsh/status.h"

namespace plsh::cuda {

inline Status cuda_status(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return Status::Ok();
  const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted : StatusCode::kInternal;
  return Status(code, std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                          cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

inline Status cublas_status(cublasStatus_t e, const char* call, const char* file, int line) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  const StatusCode code = e == CUBLAS_STATUS_ALLOC_FAILED ? StatusCode::kResourceExhausted : StatusCode::kInternal;
  return Status(code, std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                          cublasGetStatusName(e) + " (" + cublasGetStatusString(e) + ")");
}

}  // namespace plsh::cuda

#define CUDA_RETURN_IF_ERROR(expr) RETURN_IF_ERROR(::plsh::cuda::cuda_status((expr), #expr, __FILE__, __LINE__))
#define CUBLAS_RETURN_IF_ERROR(expr) RETURN_IF_ERROR(::plsh::cuda::cublas_status((expr), #expr, __FILE__, __LINE__))
// After every launch: a bad configuration shows here, a fault at the next sync.
#define LAUNCH_RETURN_IF_ERROR(kernel) \
  RETURN_IF_ERROR(::plsh::cuda::cuda_status(cudaGetLastError(), "launch of " kernel, __FILE__, __LINE__))
