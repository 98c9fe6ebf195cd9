#include "problem.h"
#include "shaped.h"

#include <cmath>

namespace plsh::testing {

AttentionOptions options_of(const AttentionCase& c, uint64_t seed) {
  return shaped({c.batch, c.q_len, c.kv_len, c.heads, c.kv_heads, c.head_dim},
                {.dtype = c.dtype,
                 .out_dtype = c.out_dtype,
                 .scale = std::nullopt,
                 .causal = c.causal,
                 .slopes = c.slopes,
                 .q_pos0 = c.q_pos0,
                 .k_pos0 = c.k_pos0,
                 .mode = c.mode,
                 .samples = c.samples > 0 ? c.samples : kDefaultSamples,
                 .seed = seed,
                 .lsh_algorithm = c.algorithm,
                 .sampling = c.sampling,
                 .window_width = c.window_width,
                 .estimates = false});
}

Problem make_problem(const AttentionOptions& o, uint64_t seed, bool with_lse) {
  Problem pr;
  pr.qkv = random_qkv(o, seed);
  pr.out = output_buffer(o);
  if (with_lse) pr.lse.assign(static_cast<size_t>(o.batch * o.q_len * o.heads), std::nanf(""));
  StatusOr<AttentionParams> p = make_params(o, {pr.qkv.q.data(), pr.qkv.k.data(), pr.qkv.v.data(), pr.out.data(),
                                                with_lse ? pr.lse.data() : nullptr, MemorySpace::kHost});
  pr.status = p.status();
  EXPECT_TRUE(p.ok()) << pr.status.to_string();
  if (p.ok()) pr.params = *p;
  return pr;
}

GradientRefs GradTensors::refs() {
  return {.dout = dout.data(), .dq = dq.data(), .dk = dk.data(), .dv = dv.data(), .grad_dtype = grad_dtype};
}

GradTensors grad_tensors(const AttentionOptions& o, DType grad_dtype, uint64_t seed, uint8_t poison) {
  GradTensors g;
  g.dout_dtype = o.out_dtype.value_or(o.dtype);
  g.grad_dtype = grad_dtype;
  const int64_t q_elems = o.batch * o.q_len * o.heads * o.head_dim;
  const int64_t kv_elems = o.batch * o.kv_len * resolved_kv_heads(o.heads, o.kv_heads) * o.head_dim;
  g.dout = random_tensor(q_elems, g.dout_dtype, seed);
  g.dq.assign(static_cast<size_t>(q_elems) * dtype_bytes(grad_dtype), poison);
  g.dk.assign(static_cast<size_t>(kv_elems) * dtype_bytes(grad_dtype), poison);
  g.dv.assign(g.dk.size(), poison);
  return g;
}

}  // namespace plsh::testing
