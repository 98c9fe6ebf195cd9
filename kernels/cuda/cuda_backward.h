// The CUDA backend's backward pass on the device: stages the tensors and
// the per-row terms, carves the plan's backward workspace, and runs the
// rounds of backward_plan.h (five batched GEMMs and five small kernels per
// round), paced like the forward so that cancel and deadline act within a
// step. CudaBackend::backward (cuda_backend.cpp) checks the plan, reserves
// its device bytes and lends a cuBLAS handle; this does the rest.
//
// dk and dv gather the shares of many tiles and heads with atomicAdd, so on
// the GPU they may differ between runs in the last float32 bits; dq is
// merged round by round in a fixed order and does not.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/device_memory.h"
#include "cuda/workspace_slots.h"
#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/plan.h"

namespace plsh::cuda {

Status run_cuda_backward(const Plan& plan, const CudaLayout& layout, const BackwardParams& g, const ExecContext& ctx,
                         DevicePool& pool, cublasHandle_t handle, cudaStream_t stream, BackwardStats* stats);

}  // namespace plsh::cuda
