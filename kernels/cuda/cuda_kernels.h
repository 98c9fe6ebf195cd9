// The CUDA backend's device kernels and their launchers: per round, the
// cuBLAS pointer arrays (build_round), the masked row softmax between the
// two GEMMs, the log-sum-exp merge into the accumulators, and per chunk the
// finalize into out and lse. Host code calls the launchers only; every
// index the kernels compute comes from tile_plan.h, which the host tests
// check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/workspace_slots.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// The tensors as the kernels see them (device pointers; strides and the
// rest of the GEMM operands' layout in `operands`, tile_plan.h).
struct DeviceProblem {
  const char* q = nullptr;  // [B, Nq, H, D] (rows padded when staged)
  const char* k = nullptr;  // [B, Nk, Hkv, D]
  const char* v = nullptr;  // [B, Nk, Hkv, D]
  OperandLayout operands;
  int64_t head_dim = 0;
  int64_t q_pos0 = 0, k_pos0 = 0;
  SpanShape shape;
};

struct DeviceOutput {
  void* out = nullptr;   // [B, Nq, H, D] out dtype
  float* lse = nullptr;  // [B, Nq, H] or null
  int64_t o_bs = 0, o_rs = 0, o_hs = 0;
  int64_t lse_bs = 0, lse_rs = 0;
  int64_t heads = 0;
  SpanShape shape;  // for each row's nearest key (row_lse)
};

// Each returns the launch's error (configuration errors; faults surface at
// the next synchronisation), or INTERNAL before launching a grid beyond
// CUDA's limits (grid.x <= 2^31 - 1, grid.y <= 65535).
Status launch_build_round(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                          cudaStream_t stream);
Status launch_masked_softmax(DType dtype, const DeviceProblem& pr, const Round& round, const LanePass* lanes,
                             const RoundBuffers& rb, cudaStream_t stream);
Status launch_merge(const DeviceProblem& pr, const Round& round, const LanePass* lanes, const RoundBuffers& rb,
                    const Accumulators& acc, cudaStream_t stream);
// Lanes [lane0, lane0 + lanes) of the chunk whose accumulators acc holds.
Status launch_finalize(DType out_dtype, const DeviceOutput& out, int64_t q_len, int64_t head_dim, int64_t lane0,
                       int64_t lanes, const HeadLse* head_lse, const Accumulators& acc, cudaStream_t stream);
Status launch_bins(const long long* positions, long long* bins, int64_t n, double pitch, double shift,
                   cudaStream_t stream);

}  // namespace plsh::cuda
