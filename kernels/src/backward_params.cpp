#include "plsh/backward.h"

#include "plsh/backend.h"

#include <string>

#include "plsh/numeric.h"

namespace plsh {

namespace {

// "dout has a non-finite value (nan) at [b=0, n=3, h=1, d=7], expected finite values"
Status check_finite_tensor(const char* name, const void* data, DType t, int64_t batch, int64_t rows, int64_t heads,
                           int64_t dim) {
  const int64_t bad = first_non_finite(data, t, batch * rows * heads * dim);
  if (bad < 0) return Status::Ok();
  const int64_t d = bad % dim;
  const int64_t h = (bad / dim) % heads;
  const int64_t r = (bad / (dim * heads)) % rows;
  const int64_t b = bad / (dim * heads * rows);
  std::string where = "[b=" + std::to_string(b) + ", n=" + std::to_string(r) + ", h=" + std::to_string(h);
  if (dim > 1) where += ", d=" + std::to_string(d);
  return invalid_argument(std::string(name) + " has a non-finite value (" + std::to_string(load_element(data, t, bad)) +
                          ") at " + where + "], expected finite values" +
                          (std::string(name) == "lse" ? " (the forward's lse: every row sees at least one key)" : ""));
}

}  // namespace

StatusOr<BackwardParams> make_backward_params(const AttentionParams& p, const GradientRefs& g) {
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr)
    return failed_precondition("backward: the plan's q, k, v are not bound, expected bind_tensors first");
  if (g.memory != p.memory)
    return invalid_argument(std::string("gradient memory = ") + (g.memory == MemorySpace::kHost ? "host" : "device") +
                            ", expected the plan's (" + (p.memory == MemorySpace::kHost ? "host" : "device") + ")");
  BackwardParams b{};
  b.out = g.out != nullptr ? g.out : p.out;
  b.lse = g.lse != nullptr ? g.lse : p.lse;
  b.dout = g.dout;
  b.dq = g.dq;
  b.dk = g.dk;
  b.dv = g.dv;
  b.memory = g.memory;
  if (b.out == nullptr) return invalid_argument("out = null, expected the forward's output [B, Nq, H, D]");
  if (b.lse == nullptr)
    return invalid_argument("lse = null, expected the forward's lse [B, Nq, H] (float32, natural log, bias included)");
  if (b.dout == nullptr) return invalid_argument("dout = null, expected the upstream gradient [B, Nq, H, D]");
  if (b.dq == nullptr) return invalid_argument("dq = null, expected a tensor [B, Nq, H, D]");
  if (b.dk == nullptr) return invalid_argument("dk = null, expected a tensor [B, Nk, Hkv, D]");
  if (b.dv == nullptr) return invalid_argument("dv = null, expected a tensor [B, Nk, Hkv, D]");

  b.out_dtype = p.out_dtype;
  b.grad_dtype = g.grad_dtype.value_or(p.dtype);
  // Dense strides, as AttentionParams' (resolve_params).
  b.o_head_stride = b.do_head_stride = b.dq_head_stride = p.head_dim;
  b.o_row_stride = b.do_row_stride = b.dq_row_stride = p.heads * p.head_dim;
  b.o_batch_stride = b.do_batch_stride = b.dq_batch_stride = p.q_len * p.heads * p.head_dim;
  b.dk_head_stride = b.dv_head_stride = p.head_dim;
  b.dk_row_stride = b.dv_row_stride = p.kv_heads * p.head_dim;
  b.dk_batch_stride = b.dv_batch_stride = p.kv_len * p.kv_heads * p.head_dim;
  b.lse_row_stride = p.heads;
  b.lse_batch_stride = p.q_len * p.heads;

  // out and lse that default to the plan's own are what its forward writes
  // (possibly after this call): only the caller's are checked.
  if (p.check_finite && b.memory == MemorySpace::kHost) {
    RETURN_IF_ERROR(check_finite_tensor("dout", b.dout, b.out_dtype, p.batch, p.q_len, p.heads, p.head_dim));
    if (g.out != nullptr)
      RETURN_IF_ERROR(check_finite_tensor("out", b.out, b.out_dtype, p.batch, p.q_len, p.heads, p.head_dim));
    if (g.lse != nullptr) RETURN_IF_ERROR(check_finite_tensor("lse", b.lse, DType::kF32, p.batch, p.q_len, p.heads, 1));
  }
  return b;
}

Status Backend::check_backward_inputs(const Plan& plan, const BackwardParams& g) const {
  const AttentionParams& p = plan.params;
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr)
    return failed_precondition(name() + " backend: the plan's tensors are not bound, expected bind_tensors first");
  RETURN_IF_ERROR(supports_backward(p));
  if (g.memory != MemorySpace::kHost || g.out == nullptr || g.lse == nullptr || g.dout == nullptr || g.dq == nullptr ||
      g.dk == nullptr || g.dv == nullptr)
    return invalid_argument(name() +
                            " backend: backward tensors missing or not in host memory, expected "
                            "make_backward_params' for this plan");
  return Status::Ok();
}

}  // namespace plsh
