// The fused kernels' launchers (fused_forward_kernels.cu,
// fused_backward_kernels.cu): the device side of fused_forward.h and
// fused_backward.h, instantiated through fused_dispatch.h for the shapes
// fused_supported accepts. Each checks its grid, raises the kernel's
// dynamic shared-memory limit, launches on `stream` and returns the
// launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "cuda/fused_probe.h"
#include "cuda/fused_steps.h"
#include "cuda/fused_tile.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// INTERNAL unless grid (x, y, z) is within CUDA's limits and smem within a
// CTA's 227 KiB (the kernels then raise their dynamic limit to it).
Status fused_launch_check(const char* kernel, int64_t x, int64_t y, int64_t z, int64_t smem);

// The forward (or, with a.stats_only, the statistics pass) over query tiles
// [tile_begin, tile_end) of batch items [batch_begin, batch_end), every head.
Status launch_fused_forward(DType dtype, int64_t head_dim, const FusedArgs& a, int64_t tile_begin, int64_t tile_end,
                            int64_t batch_begin, int64_t batch_end, cudaStream_t stream);

// The estimates' probe rows (fused_probe.h): `groups` CTAs by pa.splits,
// then the merge of the splits into pa.result.
Status launch_fused_probe(DType dtype, int64_t head_dim, const FusedArgs& a, const ProbeArgs& pa, int64_t groups,
                          cudaStream_t stream);

// The backward's steps (fused_steps.h) on `stream`: spans into `spans`
// ([H][tiles][2] int32), the row terms, the statistics pass far from the
// keys, dq's accumulator zeroed, the backward's CTAs in `chunks` launches
// over the key tiles with between(chunk, chunks) after each (the caller's
// pacing and stop), and dq (dense, in a.grad_dtype) from the accumulator.
Status launch_fused_backward(DType dtype, int64_t head_dim, const FusedArgs& a, const FusedRowTermsArgs& terms,
                             int32_t* spans, void* dq, int64_t chunks,
                             const std::function<Status(int64_t chunk, int64_t chunks)>& between, cudaStream_t stream);

}  // namespace plsh::cuda
