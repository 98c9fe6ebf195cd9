#include "cuda/backward_plan.h"

#include <algorithm>
#include <string>
#include <vector>

#include "plsh/numeric.h"

namespace plsh::cuda {

Status check_backward_support(const AttentionParams& p) {
  if (p.memory != MemorySpace::kHost)
    return unimplemented(
        "the cuda backend's backward takes host tensors (staged), not memory = device; expected "
        "host tensors or backend = cpu");
  if (p.out_dtype != p.dtype)
    return unimplemented(std::string("the cuda backend's backward needs out_dtype = dtype (its GEMMs read dout in the "
                                     "dtype of q, k, v), got out_dtype = ") +
                         dtype_name(p.out_dtype) + ", dtype = " + dtype_name(p.dtype) + "; expected backend = cpu");
  return Status::Ok();
}

BackwardGemms backward_gemms(const OperandLayout& o, int64_t tile_rows, int64_t key_cols) {
  const int64_t T = tile_rows, Kc = key_cols, D = o.head_dim;
  const int64_t Kp = key_pitch(Kc), Dp = partial_pitch(D);
  BackwardGemms g;
  // Column-major S^T (Kc x T, ld Kp) = op_T(K: D x Kc, ld k_rs) . Q (D x T, ld q_rs): row-major S [T][Kp].
  g.scores = {true, false, Kc, T, D, o.k_rs, o.q_rs, Kp};
  // dP^T likewise from V and dO (staged in q's layout).
  g.dprob = {true, false, Kc, T, D, o.v_rs, o.q_rs, Kp};
  // dQs^T (D x T, ld Dp) = K (D x Kc, ld k_rs) . dS^T (Kc x T, ld Kp): row-major dQs [T][Dp] = dS K.
  g.dq = {false, false, D, T, Kc, o.k_rs, Kp, Dp};
  // dVs^T (D x Kc, ld Dp) = dO (D x T, ld q_rs) . op_T(P^T: Kc x T, ld Kp): row-major dVs [Kc][Dp] = P^T dO.
  g.dv = {false, true, D, Kc, T, o.q_rs, Kp, Dp};
  // dKs likewise from Q and dS.
  g.dk = {false, true, D, Kc, T, o.q_rs, Kp, Dp};
  return g;
}

int64_t carve_backward_work(int64_t slots, int64_t tile_rows, int64_t key_cols, int64_t head_dim, int64_t elem_bytes,
                            char* base, BackwardRoundBuffers* round, Accumulators* acc) {
  const int64_t S = slots, T = tile_rows, Kc = key_cols, D = head_dim;
  const int64_t Kp = key_pitch(Kc), Dp = partial_pitch(D);
  BackwardRoundBuffers r;
  Accumulators a;
  Carver c(base);
  carve_round_slices(c, S, T, Kp, elem_bytes, &r);
  r.ds = c.take<char>(S * T * Kp * elem_bytes);
  r.ds_ptr = c.take<void*>(S);
  r.dout_ptr = c.take<const void*>(S);
  r.dq_part = c.take<float>(S * T * Dp);
  r.dq_ptr = c.take<float*>(S);
  r.dk_part = c.take<float>(S * Kc * Dp);
  r.dk_ptr = c.take<float*>(S);
  r.dv_part = c.take<float>(S * Kc * Dp);
  r.dv_ptr = c.take<float*>(S);
  a.acc = c.take<float>(S * T * D);
  if (round != nullptr) *round = r;
  if (acc != nullptr) *acc = a;
  return c.bytes();
}

int64_t carve_backward_staging(const AttentionParams& p, int64_t grad_bytes, char* base, BackwardStaging* out) {
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  AttentionParams host = p;
  host.memory = MemorySpace::kHost;
  const OperandLayout o = operand_layout(host);
  BackwardStaging b;
  // Dense tensors padded per head (operand_layout): the extent is the whole.
  b.q_bytes = p.batch * o.q_bs * esz;
  b.kv_bytes = p.batch * o.k_bs * esz;
  b.rows = p.batch * p.heads * p.q_len;
  b.kv_elems = p.batch * p.kv_len * p.kv_heads * p.head_dim;
  b.dq_bytes = p.batch * p.q_len * p.heads * p.head_dim * grad_bytes;
  b.dkv_bytes = b.kv_elems * grad_bytes;
  Carver c(base);
  b.qkv.q = c.take<char>(b.q_bytes);
  b.qkv.k = c.take<char>(b.kv_bytes);
  b.qkv.v = c.take<char>(b.kv_bytes);
  b.dout = c.take<char>(b.q_bytes);
  b.row_d = c.take<float>(b.rows);
  b.row_lse = c.take<float>(b.rows);
  b.dk_acc = c.take<float>(b.kv_elems);
  b.dv_acc = c.take<float>(b.kv_elems);
  b.dq = c.take<char>(b.dq_bytes);
  b.dk = c.take<char>(b.dkv_bytes);
  b.dv = c.take<char>(b.dkv_bytes);
  if (out != nullptr) *out = b;
  return c.bytes();
}

void backward_row_stats(const AttentionParams& p, const BackwardParams& g, const std::vector<LaneSetup>& heads,
                        float* row_d, float* row_lse) {
  const int64_t D = p.head_dim;
  const SpanShape shape = span_shape(p);
  std::vector<float> o(static_cast<size_t>(D)), d_o(static_cast<size_t>(D));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const HeadLse terms = head_lse(p, heads[static_cast<size_t>(h)]);
      const int64_t g_row = (b * p.heads + h) * p.q_len;
      for (int64_t i = 0; i < p.q_len; ++i) {
        load_row(g.out, g.out_dtype, b * g.o_batch_stride + i * g.o_row_stride + h * g.o_head_stride, D, o.data());
        load_row(g.dout, g.out_dtype, b * g.do_batch_stride + i * g.do_row_stride + h * g.do_head_stride, D,
                 d_o.data());
        double dot = 0;
        for (int64_t x = 0; x < D; ++x)
          dot += static_cast<double>(o[static_cast<size_t>(x)]) * d_o[static_cast<size_t>(x)];
        row_d[g_row + i] = static_cast<float>(dot);
        row_lse[g_row + i] = row_lse_for(g.lse[b * g.lse_batch_stride + i * g.lse_row_stride + h], terms,
                                         nearest_key_distance(shape, i));
      }
    }
}

namespace {

int64_t backward_work_bytes(const WorkspaceSlots& w, const AttentionParams& p, int64_t slots) {
  return carve_backward_work(slots, w.tile_rows, w.key_cols, p.head_dim, static_cast<int64_t>(dtype_bytes(p.dtype)),
                             nullptr, nullptr, nullptr);
}

}  // namespace

StatusOr<CudaBackwardLayout> plan_backward_layout(const AttentionParams& p, const CudaLayout& forward,
                                                  int64_t device_cap_bytes) {
  RETURN_IF_ERROR(check_backward_support(p));
  CudaBackwardLayout b;
  b.staging_bytes = carve_backward_staging(p, 4, nullptr, nullptr);
  b.table_bytes = forward.table_bytes;  // the same head terms, lane table and cuBLAS workspace
  ASSIGN_OR_RETURN(const int64_t left,
                   work_budget("cuda backward workspace", device_cap_bytes, b.staging_bytes, b.table_bytes));
  const WorkspaceShape ws = workspace_shape(p);
  const int64_t T = std::min(kTileRows, p.q_len), Kc = std::min(kMaxKeyCols, p.kv_len);
  ASSIGN_OR_RETURN(b.work, size_workspace_for(ws, left, [&](int64_t slots) {
                     return carve_backward_work(slots, T, Kc, p.head_dim, ws.elem_bytes, nullptr, nullptr, nullptr);
                   }));
  b.work_bytes = backward_work_bytes(b.work, p, b.work.slots);
  return b;
}

Status check_backward_layout_fits(const CudaLayout& layout, const AttentionParams& p, int64_t grad_bytes) {
  if (!layout.has_backward)
    return failed_precondition(
        "cuda backend: the plan was made without PlanLimits::backward, expected a plan whose "
        "backward workspace is sized (and charged)");
  RETURN_IF_ERROR(check_layout_fits(layout, p));  // the tables and passes the rounds read
  const CudaBackwardLayout& b = layout.backward;
  auto over = [](const char* what, int64_t need, int64_t planned) {
    return internal_error(std::string("cuda backend: backward would carve ") + std::to_string(need) + " bytes of " +
                          what + " from the plan's " + std::to_string(planned) +
                          ": the plan was made for other params");
  };
  const int64_t staging = carve_backward_staging(p, grad_bytes, nullptr, nullptr);
  if (staging > b.staging_bytes) return over("staging", staging, b.staging_bytes);
  if (layout.table_bytes > b.table_bytes) return over("tables", layout.table_bytes, b.table_bytes);
  const WorkspaceSlots& w = b.work;
  if (w.tile_rows != std::min(kTileRows, p.q_len) || w.key_cols < std::min(kMaxKeyCols, p.kv_len))
    return internal_error("cuda backend: the backward plan's tiles (" + std::to_string(w.tile_rows) + " x " +
                          std::to_string(w.key_cols) + ") do not fit the params' q_len and kv_len");
  const int64_t work = backward_work_bytes(w, p, w.slots);
  if (work > b.work_bytes) return over("work", work, b.work_bytes);
  return Status::Ok();
}

}  // namespace plsh::cuda
