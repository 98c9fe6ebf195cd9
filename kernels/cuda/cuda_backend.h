// The CUDA backend (kernels/cuda): exact, window and lsh through cuBLAS
// batched GEMMs over the tiles of tile_plan.h, a masked row softmax and a
// log-sum-exp merge, fp32 accumulation for f32, f16 and bf16 inputs; and
// their backward on the same tiles (backward_plan.h). Built into
// libplsh_cuda.so, which the registry dlopens, and into a static library
// that tests and benchmarks call directly.
//   tile_plan.h           the tile arithmetic the device and the host tests share
//   workspace_slots.h, tile_plan.cpp   host planning: reach, lanes, rounds, the workspace layout
//   cuda_kernels.h/.cu    device kernels and their launchers
//   device_memory.h       the memory pool, its reservations, stream-ordered buffers
//   cuda_backend.cpp      the Backend: plan, then forward over the rounds
//   backward_plan.h/.cpp  host planning of the backward: its GEMMs, buffers, staging, per-row terms
//   cuda_backward_kernels.h/.cu, cuda_backward.h/.cpp   the backward's kernels and rounds
//   device_types.cuh, step_events.h                    shared by both directions
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/status.h"

namespace plsh::cuda {

struct CudaBackendOptions {
  int device = 0;
  // Device memory the backend may hold at once (staging plus workspace);
  // 0: $PLSH_CUDA_MEMORY_MB, else 3/4 of the memory free at creation.
  int64_t memory_budget_bytes = 0;
};

// nullptr, with the reason in *why_not, when no CUDA device can be used.
std::unique_ptr<Backend> make_cuda_backend(std::string* why_not, const CudaBackendOptions& options = {});

// OK when the runtime finds a CUDA device; otherwise FAILED_PRECONDITION,
// with the reason also in *why (cudaGetDeviceCount's error, or no devices).
Status no_device_reason(std::string* why);

// bin(pos) of every position under one draw, evaluated on the device the way
// the lsh masks evaluate it; for tests that the device agrees with bin_of.
StatusOr<std::vector<int64_t>> device_bins(const Draw& draw, const std::vector<int64_t>& positions, int device = 0);

}  // namespace plsh::cuda

// The registry's entry point (plsh/backend.h, kBackendPluginSymbol).
extern "C" const plsh::PlshBackendPlugin* plsh_backend_plugin();
