// The backward pass's tensors (SPEC section 8), in the habit of params.h:
// what a caller hands over (GradientRefs), resolved and validated once by
// make_backward_params() into BackwardParams, which a backend takes by const
// reference next to the plan whose forward it differentiates. q, k and v
// are the plan's (plan.params); out and lse are inputs here, as in
// FlashAttention's backward: P is recomputed from lse, never stored.
//
// Layout (SPEC section 1): out, dout, dq [B, Nq, H, D]; dk, dv
// [B, Nk, Hkv, D]; lse [B, Nq, H] float32; all row-major, strides in
// elements.
//
// Dtypes: out and dout have the forward's out_dtype; dq, dk and dv have
// grad_dtype, by default the dtype of q, k and v (what an autograd engine
// expects of a gradient), or float32 when asked. Arithmetic accumulates in
// float32 whatever the dtypes.
#pragma once

#include <cstdint>
#include <optional>

#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh {

// Pointers to the caller's tensors; all dense row-major in the layout above.
struct GradientRefs {
  const void* out = nullptr;   // [B, Nq, H, D] out_dtype: the forward's output; null: the plan's params.out
  const float* lse = nullptr;  // [B, Nq, H] the forward's lse (natural log, bias included); null: the plan's params.lse
  const void* dout = nullptr;  // [B, Nq, H, D] out_dtype: dLoss/dout
  void* dq = nullptr;          // [B, Nq, H, D]   grad_dtype
  void* dk = nullptr;          // [B, Nk, Hkv, D] grad_dtype: summed over each kv head's query heads
  void* dv = nullptr;          // [B, Nk, Hkv, D] grad_dtype: summed likewise
  std::optional<DType> grad_dtype;          // default: the dtype of q, k, v
  MemorySpace memory = MemorySpace::kHost;  // must be the plan's
};

// Resolved and validated: no nulls, no defaults left to apply.
struct BackwardParams {
  const void* out = nullptr;   // [B, Nq, H, D]   out_dtype
  const float* lse = nullptr;  // [B, Nq, H]
  const void* dout = nullptr;  // [B, Nq, H, D]   out_dtype
  void* dq = nullptr;          // [B, Nq, H, D]   grad_dtype
  void* dk = nullptr;          // [B, Nk, Hkv, D] grad_dtype
  void* dv = nullptr;          // [B, Nk, Hkv, D] grad_dtype
  MemorySpace memory = MemorySpace::kHost;

  // Element strides.
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;     // out
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;  // dout
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_row_stride = 0;  // lse head stride is 1

  DType out_dtype = DType::kF32;   // of out and dout: the forward's out_dtype
  DType grad_dtype = DType::kF32;  // of dq, dk, dv
};

// Checks the tensors against the plan's params p (whose q, k, v must be
// bound), fills the defaults (out and lse from p when not given) and, with
// p.check_finite, the values of dout and of the out and lse given here
// (host memory; the plan's own are its forward's outputs, which may not be
// written yet): the message names the tensor, the position and what was
// expected.
StatusOr<BackwardParams> make_backward_params(const AttentionParams& p, const GradientRefs& g);

}  // namespace plsh
