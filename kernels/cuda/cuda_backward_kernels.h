// The CUDA backward's device kernels and their launchers (backward_plan.h
// describes the round they make up): per round the cuBLAS pointer arrays,
// P from lse, dS, the merge of dQ shares into the chunk's accumulators and
// the atomic scatter of dK and dV shares; per chunk dq, at the end dk and dv
// in the gradients' dtype. Every index comes from tile_plan.h and
// backward_plan.h, which the host tests run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/backward_plan.h"
#include "cuda/workspace_slots.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// The staged tensors and per-row terms as the kernels see them (device
// pointers; BackwardStaging).
struct BackwardProblem {
  const char* q = nullptr;     // [B, Nq, H, Dpad] input dtype
  const char* k = nullptr;     // [B, Nk, Hkv, Dpad]
  const char* v = nullptr;     // [B, Nk, Hkv, Dpad]
  const char* dout = nullptr;  // [B, Nq, H, Dpad], q's layout
  OperandLayout operands;
  const float* row_d = nullptr;    // [B * H][Nq] D_i
  const float* row_lse = nullptr;  // [B * H][Nq] row_lse_for
  float* dk_acc = nullptr;         // [B, Nk, Hkv, D] float32
  float* dv_acc = nullptr;         // [B, Nk, Hkv, D] float32
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_pos0 = 0, k_pos0 = 0;
  SpanShape shape;
};

Status launch_backward_build_round(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                                   const BackwardRoundBuffers& rb, cudaStream_t stream);
// P = backward_prob(slot_logit, row_lse) where allowed, 0 elsewhere and on
// rows another tile owns; in the input dtype.
Status launch_backward_probs(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                             const BackwardRoundBuffers& rb, cudaStream_t stream);
// dS = P * (dP - D_i) (dP in the scores slice), in the input dtype.
Status launch_backward_ds(DType dtype, const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                          const BackwardRoundBuffers& rb, cudaStream_t stream);
// acc += dQ share over the rows each slot owns (one owner per row and round).
Status launch_dq_merge(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                       const BackwardRoundBuffers& rb, const Accumulators& acc, cudaStream_t stream);
// dk_acc, dv_acc += the dK, dV shares of each slot's valid keys (atomicAdd:
// tiles and the heads of a GQA group meet on the same keys).
Status launch_kv_scatter(const BackwardProblem& pr, const Round& round, const LanePass* lanes,
                         const BackwardRoundBuffers& rb, cudaStream_t stream);
// dq rows [acc.row0, + rows_per_lane) of lanes [lane0, lane0 + lanes), dense
// [B, Nq, H, D] in grad_dtype.
Status launch_dq_finalize(DType grad_dtype, void* dq, int64_t q_len, int64_t heads, int64_t head_dim, int64_t lane0,
                          int64_t lanes, const Accumulators& acc, cudaStream_t stream);
// out[i] = acc[i] in grad_dtype, n elements.
Status launch_to_dtype(DType grad_dtype, const float* acc, void* out, int64_t n, cudaStream_t stream);

}  // namespace plsh::cuda
