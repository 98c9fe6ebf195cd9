// The CUDA backend's backward pass (SPEC section 8), planned on the host.
// It reuses the forward's cut as it is (tile_plan.h): the same lanes, passes
// (lsh: one per hash of the plan's draws), chunks of lanes and tiles,
// rounds and slots, since the gradient is linear in P and the forward's
// per-sample decomposition P = sum_k P_k (P_k = exp(s - lse - log s) on
// hash k's blocks) carries over pass by pass. Per round, for every slot (a
// query tile of T rows against a chunk of Kc keys):
//   S   = scale Q K^T          cuBLAS                 [T][Kp] float32
//   P   = exp(logit - lse')    backward_probs         [T][Kp] input dtype
//   dP  = dO V^T               cuBLAS, over S         [T][Kp] float32
//   dS  = P * (dP - D)         backward_ds            [T][Kp] input dtype
//   dQs = scale dS K           cuBLAS                 [T][Dp]  float32, dq_merge: into the chunk's accumulators
//   dVs = P^T dO               cuBLAS                 [Kc][Dp] float32
//   dKs = scale dS^T Q         cuBLAS                 [Kc][Dp] float32, kv_scatter: both atomicAdd into dK, dV
// then per chunk dq from its accumulators, and at the end dk and dv from
// theirs. lse' = lse - offset + slope * nearest per row (row_lse_for), and
// D_i = dO_i . O_i, are computed on the host before the rounds.
//
// Every index and every cuBLAS argument comes from here, so that the host
// emulation (tests/gpu/test_cuda_host_backward.cpp) runs the same code
// with the same pointers and GEMM arguments, the GEMMs as column-major
// loops.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/workspace_slots.h"
#include "plsh/backward.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// What the CUDA backward supports beyond the forward: host tensors (staged;
// device tensors are not yet), and dout in the dtype of q, k, v (the GEMMs
// take one input type), i.e. out_dtype == dtype. UNIMPLEMENTED otherwise.
Status check_backward_support(const AttentionParams& p);

// The five GEMMs of a backward round; row-major views of the results.
// dout is staged in q's layout (o.q_*), P and dS are [T][Kp] like the
// forward's probabilities.
struct BackwardGemms {
  GemmArgs scores;  // S   [T][Kp]  = K^T Q  (alpha scale)   A = K,  B = Q
  GemmArgs dprob;   // dP  [T][Kp]  = V^T dO (alpha 1)       A = V,  B = dO
  GemmArgs dq;      // dQs [T][Dp]  = dS K   (alpha scale)   A = K,  B = dS
  GemmArgs dv;      // dVs [Kc][Dp] = P^T dO (alpha 1)       A = dO, B = P
  GemmArgs dk;      // dKs [Kc][Dp] = dS^T Q (alpha scale)   A = Q,  B = dS
};
BackwardGemms backward_gemms(const OperandLayout& o, int64_t tile_rows, int64_t key_cols);

// One round's slices of the backward work buffer (device pointers on the GPU).
struct BackwardRoundBuffers {
  TileDesc* desc = nullptr;
  const void** q_ptr = nullptr;  // cuBLAS pointer arrays, one entry per slot
  const void** k_ptr = nullptr;
  const void** v_ptr = nullptr;
  const void** dout_ptr = nullptr;
  float** score_ptr = nullptr;  // S, then dP
  void** prob_ptr = nullptr;    // P
  void** ds_ptr = nullptr;      // dS
  float** dq_ptr = nullptr;     // dQ shares
  float** dk_ptr = nullptr;     // dK shares
  float** dv_ptr = nullptr;     // dV shares
  float* scores = nullptr;      // [slot][T][Kp] float32
  char* probs = nullptr;        // [slot][T][Kp] input dtype
  char* ds = nullptr;           // [slot][T][Kp] input dtype
  float* dq_part = nullptr;     // [slot][T][Dp]
  float* dk_part = nullptr;     // [slot][Kc][Dp]
  float* dv_part = nullptr;     // [slot][Kc][Dp]
};

// The backward work buffer for `slots` slots: the round's slices and the
// chunk's dq accumulators (acc->acc, [slots][T][D] float32; acc_max and
// acc_sum unused). Returns its bytes, alignment included.
int64_t carve_backward_work(int64_t slots, int64_t tile_rows, int64_t key_cols, int64_t head_dim, int64_t elem_bytes,
                            char* base, BackwardRoundBuffers* round, Accumulators* acc);

// Byte offsets of one slot's operands: q, k, v, dout from their staged
// tensors' bases, the rest from their round slices.
struct BackwardSlotOperands {
  int64_t q, k, v, dout;
  int64_t scores, probs, ds, dq, dk, dv;
};
PLSH_HD inline BackwardSlotOperands backward_slot_operands(const OperandLayout& o, const LanePass& l, const TileDesc& d,
                                                           int64_t slot, int64_t tile_rows, int64_t key_cols) {
  const SlotOperands f = slot_operands(o, l, d, slot, tile_rows, key_cols);
  const int64_t dp = partial_pitch(o.head_dim);
  BackwardSlotOperands s;
  s.q = f.q;
  s.k = f.k;
  s.v = f.v;
  s.dout = f.q;  // dout is staged in q's layout
  s.scores = f.scores;
  s.probs = f.probs;
  s.ds = f.probs;
  s.dq = f.partial;
  s.dk = slot * key_cols * dp * 4;
  s.dv = s.dk;
  return s;
}

// The device copies the backward works on: q, k, v and dout staged in the
// operand layout (padded rows, dout in q's); per lane g = b * H + h and
// query row i, D_i and the lse the logits are measured against
// (row_lse_for) at g * Nq + i; dK and dV accumulators, dense [B, Nk, Hkv,
// D] float32; dq, dk, dv dense in the gradients' dtype (grad_bytes per
// element: the plan sizes 4, the widest).
struct BackwardStaging {
  StagedQkv qkv;
  char* dout = nullptr;
  float* row_d = nullptr;
  float* row_lse = nullptr;
  float *dk_acc = nullptr, *dv_acc = nullptr;
  char *dq = nullptr, *dk = nullptr, *dv = nullptr;  // the gradients, in their dtype
  int64_t q_bytes = 0, kv_bytes = 0, dq_bytes = 0, dkv_bytes = 0, rows = 0, kv_elems = 0;
};
int64_t carve_backward_staging(const AttentionParams& p, int64_t grad_bytes, char* base, BackwardStaging* out);

// The lse a row's logits (slot_logit) are measured against: the forward's
// lse wrote m + log(l) + offset - slope * nearest (row_lse), so
// P = exp(logit - (lse - offset + slope * nearest)); for lsh's passes that
// is exp(s - lse - log s) per hash, whose sum over the hashes is
// (c / s) exp(s - lse). In double, rounded once.
inline float row_lse_for(float lse, const HeadLse& h, int64_t nearest) {
  return static_cast<float>(static_cast<double>(lse) - h.offset + h.slope * static_cast<double>(nearest));
}

// D_i = dO_i . O_i (float64 sums, rounded once) and row_lse_for of every
// lane g = b * H + h and row i, at g * Nq + i, from g's host tensors; heads
// are the plan's passes (head_lse).
void backward_row_stats(const AttentionParams& p, const BackwardParams& g, const std::vector<LaneSetup>& heads,
                        float* row_d, float* row_lse);

// P of an allowed logit (the kernel and the emulation share it).
PLSH_HD inline float backward_prob(float logit, float row_lse) {
  const float x = logit - row_lse;
  return expf(x < 80.0f ? x : 80.0f);  // a logit may pass lse by rounding, never far
}

// The layout of the backward for these params, against a device-memory
// cap: staging and tables first, the work buffer gets the rest.
// RESOURCE_EXHAUSTED when even one tile does not fit.
StatusOr<CudaBackwardLayout> plan_backward_layout(const AttentionParams& p, const CudaLayout& forward,
                                                  int64_t device_cap_bytes);

// INTERNAL unless backward, carving for the bound params p and gradients
// of grad_bytes per element, stays inside every buffer the layout sized.
Status check_backward_layout_fits(const CudaLayout& layout, const AttentionParams& p, int64_t grad_bytes);

}  // namespace plsh::cuda
