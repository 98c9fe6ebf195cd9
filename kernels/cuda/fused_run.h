// The fused path's forward and backward on the device (CudaBackend's
// run_forward / run_backward when the plan's layout is fused): the pool
// buffer the plan sized (carve_fused_forward / carve_fused_backward), the
// tables, the transfers of host tensors through pinned bounce buffers
// overlapped with the kernels (transfer.h), the launches (fused_kernels.h)
// in steps paced on the GPU (step_events.h), so that cancel, deadline and
// progress follow the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>
#include "cuda/device_memory.h"
#include "cuda/fused_plan.h"
#include "cuda/transfer.h"

#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/plan.h"
#include "plsh/status.h"

namespace plsh::cuda {

// With probe_rows (a plan whose layout has the probe): the estimates'
// probe rows too (fused_probe.h), after the forward's kernels, into
// probe_out (Backend::forward_with_probe).
Status run_fused_forward(const Plan& plan, const FusedLayout& fused, const ExecContext& ctx, DevicePool& pool,
                         PinnedPool& pinned, cudaStream_t stream, ForwardStats* stats,
                         const std::vector<std::vector<int64_t>>* probe_rows = nullptr,
                         ProbeRowsOut* probe_out = nullptr);

Status run_fused_backward(const Plan& plan, const FusedLayout& fused, const BackwardParams& g, const ExecContext& ctx,
                          DevicePool& pool, PinnedPool& pinned, cudaStream_t stream, BackwardStats* stats);

}  // namespace plsh::cuda
