// The rows and row bytes of every tensor of a request, in SPEC section 1's
// layout ([B, N, H, D] row-major: a row is one (batch item, position) with
// all its heads), derived from the options in this one place, for the
// server's sizes and limits and both clients' chunking. In plsh_core, so
// that the thin clients have it without the maths.
#pragma once

#include <cstdint>
#include <optional>

#include "plsh/params.h"

namespace plsh {

struct TensorShape {
  int64_t rows = 0;       // B * N
  int64_t row_bytes = 0;  // heads * D * element bytes (lse: heads * 4)
  int64_t bytes() const { return rows * row_bytes; }
};

struct RequestShape {
  TensorShape q;     // [B, Nq, H, D]   dtype
  TensorShape k, v;  // [B, Nk, Hkv, D] dtype
  TensorShape out;   // [B, Nq, H, D]   out_dtype (default dtype)
  TensorShape lse;   // [B, Nq, H]      float32
  // The backward's (SPEC section 8): dout is in out's dtype, the gradients
  // in grad_dtype (default dtype).
  TensorShape dout;    // [B, Nq, H, D]
  TensorShape dq;      // [B, Nq, H, D]   grad_dtype
  TensorShape dk, dv;  // [B, Nk, Hkv, D] grad_dtype

  // batch 0 counts as 1 (an unset batch); kv_heads 0 as heads.
  static RequestShape of(const AttentionOptions& options, std::optional<DType> grad_dtype = std::nullopt);
};

}  // namespace plsh
