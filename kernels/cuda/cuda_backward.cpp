#include "cuda/cuda_backward.h"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "cuda/backward_plan.h"
#include "cuda/cuda_backward_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/step_events.h"
#include "cuda/step_pacer.h"

namespace plsh::cuda {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF32: break;
  }
  return CUDA_R_32F;
}

// One GEMM of a round (backward_gemms) over its slots, at most kMaxGemmBatch
// matrices per cuBLAS call; A and B of the input type, C float32.
Status batched_gemm(cublasHandle_t handle, const GemmArgs& a, float alpha, const void* const* A, const void* const* B,
                    float* const* C, cudaDataType_t in_type, int64_t slots) {
  const float zero = 0.0f;
  for (const GemmBatch& g : gemm_batches(slots)) {
    CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
        handle, a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(a.m),
        static_cast<int>(a.n), static_cast<int>(a.k), &alpha, A + g.first, in_type, static_cast<int>(a.lda),
        B + g.first, in_type, static_cast<int>(a.ldb), &zero, reinterpret_cast<void* const*>(C + g.first), CUDA_R_32F,
        static_cast<int>(a.ldc), static_cast<int>(g.count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return Status::Ok();
}

}  // namespace

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
  const size_t row = static_cast<size_t>(D * esz);
  const size_t q_rows = static_cast<size_t>(p.batch * p.q_len * p.heads);
  const size_t kv_rows = static_cast<size_t>(p.batch * p.kv_len * p.kv_heads);
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(st.q, static_cast<size_t>(ops.q_hs * esz), p.q, row, row, q_rows,
                                         cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(st.k, static_cast<size_t>(ops.k_hs * esz), p.k, row, row, kv_rows,
                                         cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(st.v, static_cast<size_t>(ops.v_hs * esz), p.v, row, row, kv_rows,
                                         cudaMemcpyHostToDevice, stream));
  // dout is dense [B, Nq, H, D] in the dtype of q (check_backward_support).
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(st.dout, static_cast<size_t>(ops.q_hs * esz), g.dout, row, row, q_rows,
                                         cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.row_d, row_terms.data(), static_cast<size_t>(rows) * 4,
                                       cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.row_lse, row_terms.data() + rows, static_cast<size_t>(rows) * 4,
                                       cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dk_acc, 0, static_cast<size_t>(st.kv_elems) * 4, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.dv_acc, 0, static_cast<size_t>(st.kv_elems) * 4, stream));

  BackwardProblem pr;
  pr.q = st.q;
  pr.k = st.k;
  pr.v = st.v;
  pr.dout = st.dout;
  pr.operands = ops;
  pr.row_d = st.row_d;
  pr.row_lse = st.row_lse;
  pr.dk_acc = st.dk_acc;
  pr.dv_acc = st.dv_acc;
  pr.heads = p.heads;
  pr.kv_heads = p.kv_heads;
  pr.head_dim = D;
  pr.q_pos0 = p.q_pos0;
  pr.k_pos0 = p.k_pos0;
  pr.shape = span_shape(p);

  const WorkspacePlan& work = bl.work;
  const int64_t T = work.tile_rows;
  DeviceBuffer work_buffer;
  RETURN_IF_ERROR(work_buffer.allocate(pool, bl.work_bytes, stream));
  BackwardRoundBuffers rb;
  Accumulators acc;
  carve_backward_work(work.slots, T, work.key_cols, D, esz, work_buffer.get(), &rb, &acc);

  DeviceBuffer table_buffer;
  RETURN_IF_ERROR(table_buffer.allocate(pool, bl.table_bytes, stream));
  TableBuffers tables;
  carve_tables(p.heads, layout.table_entries, layout.cublas_workspace_bytes, table_buffer.get(), &tables);
  CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(handle, tables.cublas_workspace, static_cast<size_t>(tables.cublas_workspace_bytes)));

  StepEvents events;
  RETURN_IF_ERROR(events.create(kStepsInFlight));
  StepPacer pacer(kStepsInFlight, kStepFlops, event_hooks(events, stream, ctx));

  const cudaDataType_t in_type = cuda_type(p.dtype);
  const float scale = static_cast<float>(p.scale);
  const int64_t lanes_total = p.batch * p.heads;
  const int64_t tiles_total = tile_count(pr.shape);
  const double chunks_total =
      static_cast<double>(ceil_div(lanes_total, work.lanes_per_chunk) * ceil_div(tiles_total, work.tiles_per_chunk));
  double chunks_done = 0;
  double flops = 0;
  std::vector<LanePass> table;

  for (int64_t lane0 = 0; lane0 < lanes_total; lane0 += work.lanes_per_chunk) {
    const int64_t lane1 = std::min(lanes_total, lane0 + work.lanes_per_chunk);
    const std::vector<LaneSetup> setups = chunk_lanes(layout.heads, p.heads, lane0, lane1);
    for (int64_t t0 = 0; t0 < tiles_total; t0 += work.tiles_per_chunk) {
      const int64_t t1 = std::min(tiles_total, t0 + work.tiles_per_chunk);
      RETURN_IF_ERROR(ctx.check_stop());
      table.clear();
      const std::vector<Round> rounds = plan_rounds(pr.shape, setups, t0, t1, &table);
      if (static_cast<int64_t>(table.size()) > tables.entries)
        return internal_error("cuda backend: lane table of " + std::to_string(table.size()) +
                              " entries exceeds the plan's " + std::to_string(tables.entries));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tables.lanes, table.data(), table.size() * sizeof(LanePass),
                                           cudaMemcpyHostToDevice, stream));
      acc.row0 = t0 * T;
      acc.rows_per_lane = (t1 - t0) * T;
      CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(acc.acc, 0, static_cast<size_t>((lane1 - lane0) * acc.rows_per_lane * D * 4), stream));

      for (size_t ri = 0; ri < rounds.size(); ++ri) {
        const Round& r = rounds[ri];
        RETURN_IF_ERROR(ctx.check_stop());
        const BackwardGemms gemms = backward_gemms(ops, T, r.key_cols);
        RETURN_IF_ERROR(launch_backward_build_round(pr, r, tables.lanes, rb, stream));
        RETURN_IF_ERROR(batched_gemm(handle, gemms.scores, scale, rb.k_ptr, rb.q_ptr, rb.score_ptr, in_type, r.slots));
        RETURN_IF_ERROR(launch_backward_probs(p.dtype, pr, r, tables.lanes, rb, stream));
        RETURN_IF_ERROR(batched_gemm(handle, gemms.dprob, 1.0f, rb.v_ptr, rb.dout_ptr, rb.score_ptr, in_type, r.slots));
        RETURN_IF_ERROR(launch_backward_ds(p.dtype, pr, r, tables.lanes, rb, stream));
        RETURN_IF_ERROR(batched_gemm(handle, gemms.dq, scale, rb.k_ptr, const_cast<const void* const*>(rb.ds_ptr),
                                     rb.dq_ptr, in_type, r.slots));
        RETURN_IF_ERROR(launch_dq_merge(pr, r, tables.lanes, rb, acc, stream));
        RETURN_IF_ERROR(batched_gemm(handle, gemms.dv, 1.0f, rb.dout_ptr, const_cast<const void* const*>(rb.prob_ptr),
                                     rb.dv_ptr, in_type, r.slots));
        RETURN_IF_ERROR(batched_gemm(handle, gemms.dk, scale, rb.q_ptr, const_cast<const void* const*>(rb.ds_ptr),
                                     rb.dk_ptr, in_type, r.slots));
        RETURN_IF_ERROR(launch_kv_scatter(pr, r, tables.lanes, rb, stream));
        const double round_flops = 10.0 * static_cast<double>(r.slots) * static_cast<double>(T) *
                                   static_cast<double>(r.key_cols) * static_cast<double>(D);
        flops += round_flops;
        RETURN_IF_ERROR(pacer.add(
            round_flops,
            (chunks_done + static_cast<double>(ri + 1) / static_cast<double>(rounds.size())) / chunks_total));
      }
      RETURN_IF_ERROR(launch_dq_finalize(g.grad_dtype, st.dq, p.q_len, p.heads, D, lane0, lane1 - lane0, acc, stream));
      chunks_done += 1;
    }
  }
  RETURN_IF_ERROR(launch_to_dtype(g.grad_dtype, st.dk_acc, st.dk, st.kv_elems, stream));
  RETURN_IF_ERROR(launch_to_dtype(g.grad_dtype, st.dv_acc, st.dv, st.kv_elems, stream));
  // dq, dk, dv are dense (make_backward_params): one copy each.
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dq, st.dq, static_cast<size_t>(st.dq_bytes), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dk, st.dk, static_cast<size_t>(st.dkv_bytes), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.dv, st.dv, static_cast<size_t>(st.dkv_bytes), cudaMemcpyDeviceToHost, stream));
  RETURN_IF_ERROR(pacer.add(0, 1.0));
  RETURN_IF_ERROR(pacer.finish());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (stats != nullptr) {
    stats->flops = flops;
    stats->workspace = plan.backward_workspace;
  }
  return Status::Ok();
}

}  // namespace plsh::cuda
