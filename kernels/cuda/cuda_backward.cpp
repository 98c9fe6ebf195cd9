#include "cuda/cuda_backward.h"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "cuda/backward_plan.h"
#include "cuda/cuda_backward_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/device_round.h"
#include "cuda/step_events.h"

namespace plsh::cuda {

Status run_cuda_backward(const Plan& plan, const CudaLayout& layout, const BackwardParams& g, const ExecContext& ctx,
                         DevicePool& pool, cublasHandle_t handle, cudaStream_t stream, BackwardStats* stats) {
  const AttentionParams& p = plan.params;
  const CudaBackwardLayout& bl = layout.backward;
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t grad_bytes = static_cast<int64_t>(dtype_bytes(g.grad_dtype));
  const int64_t D = p.head_dim;

  // The per-row terms, on the host (a pass over out and dout).
  std::vector<float> row_terms;
  try {
    row_terms.resize(static_cast<size_t>(2 * p.batch * p.heads * p.q_len));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("cuda backend: the backward's per-row terms (" + std::to_string(row_terms.size()) +
                              " floats) could not be allocated on the host");
  }
  const int64_t rows = p.batch * p.heads * p.q_len;
  backward_row_stats(p, g, layout.heads, row_terms.data(), row_terms.data() + rows);
  // Whatever path leaves, the queued work drains before row_terms (a copy
  // source) goes; the buffers below free in stream order before that.
  struct Drain {
    cudaStream_t stream;
    ~Drain() { (void)cudaStreamSynchronize(stream); }
  } drain{stream};

  // Staging: q, k, v and dout with each head's row padded to 16 bytes.
  DeviceBuffer staging_buffer;
  RETURN_IF_ERROR(staging_buffer.allocate(pool, bl.staging_bytes, stream));
  BackwardStaging st;
  carve_backward_staging(p, grad_bytes, staging_buffer.get(), &st);
  const OperandLayout ops = operand_layout(p);
  RETURN_IF_ERROR(stage_qkv(p, ops, st.qkv, stream));
  // dout is dense [B, Nq, H, D] in the dtype of q (check_backward_support).
  RETURN_IF_ERROR(stage_rows(st.dout, ops.q_hs, g.dout, p.batch * p.q_len * p.heads, D, esz, stream));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(st.row_d, row_terms.data(), static_cast<size_t>(rows) * 4, cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.row_lse, row_terms.data() + rows, static_cast<size_t>(rows) * 4,
                                       cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dk_acc, 0, static_cast<size_t>(st.kv_elems) * 4, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dv_acc, 0, static_cast<size_t>(st.kv_elems) * 4, stream));

  const BackwardProblem pr{.q = st.qkv.q,
                           .k = st.qkv.k,
                           .v = st.qkv.v,
                           .dout = st.dout,
                           .operands = ops,
                           .row_d = st.row_d,
                           .row_lse = st.row_lse,
                           .dk_acc = st.dk_acc,
                           .dv_acc = st.dv_acc,
                           .heads = p.heads,
                           .kv_heads = p.kv_heads,
                           .head_dim = D,
                           .q_pos0 = p.q_pos0,
                           .k_pos0 = p.k_pos0,
                           .shape = span_shape(p)};

  const WorkspaceSlots& work = bl.work;
  const int64_t T = work.tile_rows;
  CallBuffers<BackwardRoundBuffers> dev;
  RETURN_IF_ERROR(carve_call_buffers(pool, layout, bl, p, handle, stream, carve_backward_work, &dev));
  const BackwardRoundBuffers& rb = dev.rb;
  const TableBuffers& tables = dev.tables;

  const BatchedGemm gemm{handle, p.dtype};
  const float scale = static_cast<float>(p.scale);
  // One round: pointer arrays, S = K^T Q, P, dP = dO V^T, dS, dQ += dS K
  // (merged into the chunk's accumulators), dV = P^T dO, dK = dS^T Q
  // (scattered into dk_acc, dv_acc).
  auto round = [&](const Chunk&, const Round& r, bool) -> StatusOr<double> {
    const BackwardGemms gemms = backward_gemms(ops, T, r.key_cols);
    RETURN_IF_ERROR(launch_backward_build_round(pr, r, tables.lanes, rb, stream));
    RETURN_IF_ERROR(gemm(gemms.scores, scale, rb.k_ptr, rb.q_ptr, rb.score_ptr, r.slots));
    RETURN_IF_ERROR(launch_backward_probs(p.dtype, pr, r, tables.lanes, rb, stream));
    RETURN_IF_ERROR(gemm(gemms.dprob, 1.0f, rb.v_ptr, rb.dout_ptr, rb.score_ptr, r.slots));
    RETURN_IF_ERROR(launch_backward_ds(p.dtype, pr, r, tables.lanes, rb, stream));
    RETURN_IF_ERROR(gemm(gemms.dq, scale, rb.k_ptr, rb.ds_ptr, rb.dq_ptr, r.slots));
    RETURN_IF_ERROR(launch_dq_merge(pr, r, tables.lanes, rb, dev.acc, stream));
    RETURN_IF_ERROR(gemm(gemms.dv, 1.0f, rb.dout_ptr, rb.prob_ptr, rb.dv_ptr, r.slots));
    RETURN_IF_ERROR(gemm(gemms.dk, scale, rb.q_ptr, rb.ds_ptr, rb.dk_ptr, r.slots));
    RETURN_IF_ERROR(launch_kv_scatter(pr, r, tables.lanes, rb, stream));
    return 10.0 * static_cast<double>(r.slots) * static_cast<double>(T) * static_cast<double>(r.key_cols) *
           static_cast<double>(D);
  };
  // After a chunk's rounds: its dq rows from the accumulators.
  auto finalize_dq = [&](const Chunk& c, size_t) {
    return launch_dq_finalize(g.grad_dtype, st.dq, p.q_len, p.heads, D, c.lane0, c.lane1 - c.lane0, dev.acc, stream);
  };
  DeviceRounds rounds(ctx, stream);
  RETURN_IF_ERROR(rounds.run(work, layout.heads, p, pr.shape, tables, &dev.acc, round, finalize_dq));
  RETURN_IF_ERROR(launch_to_dtype(g.grad_dtype, st.dk_acc, st.dk, st.kv_elems, stream));
  RETURN_IF_ERROR(launch_to_dtype(g.grad_dtype, st.dv_acc, st.dv, st.kv_elems, stream));
  // dq, dk, dv are dense (make_backward_params): one copy each.
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dq, st.dq, static_cast<size_t>(st.dq_bytes), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dk, st.dk, static_cast<size_t>(st.dkv_bytes), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dv, st.dv, static_cast<size_t>(st.dkv_bytes), cudaMemcpyDeviceToHost, stream));
  RETURN_IF_ERROR(rounds.finish());
  if (stats != nullptr) {
    stats->flops = rounds.flops();
    stats->workspace = plan.backward_workspace;
  }
  return Status::Ok();
}

}  // namespace plsh::cuda
