#include "plsh/shape.h"

#include <algorithm>

namespace plsh {

RequestShape RequestShape::of(const AttentionOptions& o, std::optional<DType> grad_dtype) {
  const int64_t batch = std::max<int64_t>(1, o.batch);
  const int64_t q_rows = batch * o.q_len, kv_rows = batch * o.kv_len;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  auto row = [&o](int64_t heads, DType dtype) { return heads * o.head_dim * static_cast<int64_t>(dtype_bytes(dtype)); };
  const DType out = o.out_dtype.value_or(o.dtype);
  const DType grad = grad_dtype.value_or(o.dtype);
  RequestShape s;
  s.q = {q_rows, row(o.heads, o.dtype)};
  s.k = s.v = {kv_rows, row(kv_heads, o.dtype)};
  s.out = {q_rows, row(o.heads, out)};
  s.lse = {q_rows, o.heads * static_cast<int64_t>(sizeof(float))};
  s.dout = s.out;
  s.dq = {q_rows, row(o.heads, grad)};
  s.dk = s.dv = {kv_rows, row(kv_heads, grad)};
  return s;
}

}  // namespace plsh
