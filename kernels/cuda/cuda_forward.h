// The CUDA backend's forward pass on the device: stages host tensors,
// carves the plan's workspace exactly as the plan sized it, and runs the
// rounds: build_round -> cuBLAS S = Q K^T -> masked softmax -> cuBLAS
// O = P V -> merge, then finalize per chunk, in steps paced on the GPU
// (step_pacer.h) so that cancel, deadline and progress follow the device.
// CudaBackend::forward (cuda_backend.cpp) checks the plan, reserves its
// device bytes and lends a cuBLAS handle; this does the rest. The kernels
// are in cuda_kernels.cu.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda/device_memory.h"
#include "cuda/workspace_slots.h"
#include "plsh/backend.h"
#include "plsh/plan.h"

namespace plsh::cuda {

Status run_cuda_forward(const Plan& plan, const CudaLayout& layout, const ExecContext& ctx, DevicePool& pool,
                        cublasHandle_t handle, cudaStream_t stream, ForwardStats* stats);

}  // namespace plsh::cuda
