#include "cuda/device_round.h"

#include <string>

#include "cuda/cuda_check.h"

namespace plsh::cuda {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF32:
      break;
  }
  return CUDA_R_32F;
}

}  // namespace

Status BatchedGemm::operator()(const GemmArgs& a, float alpha, const void* const* A, const void* const* B,
                               float* const* C, int64_t slots) const {
  const cudaDataType_t in_type = cuda_type(dtype);
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

Status stage_rows(char* dst, int64_t pitch_elems, const void* src, int64_t rows, int64_t row_elems, int64_t esz,
                  cudaStream_t stream) {
  const size_t row = static_cast<size_t>(row_elems * esz);
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, static_cast<size_t>(pitch_elems * esz), src, row, row,
                                         static_cast<size_t>(rows), cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

Status stage_qkv(const AttentionParams& p, const OperandLayout& ops, const StagedQkv& dst, cudaStream_t stream) {
  // B * N * H rows of D elements each (dense: the source pitch is D).
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t q_rows = p.batch * p.q_len * p.heads, kv_rows = p.batch * p.kv_len * p.kv_heads;
  RETURN_IF_ERROR(stage_rows(dst.q, ops.q_hs, p.q, q_rows, p.head_dim, esz, stream));
  RETURN_IF_ERROR(stage_rows(dst.k, ops.k_hs, p.k, kv_rows, p.head_dim, esz, stream));
  return stage_rows(dst.v, ops.v_hs, p.v, kv_rows, p.head_dim, esz, stream);
}

Status carve_table_buffer(DevicePool& pool, const CudaLayout& layout, int64_t table_bytes, int64_t heads,
                          cublasHandle_t handle, cudaStream_t stream, DeviceBuffer* buffer, TableBuffers* tables) {
  RETURN_IF_ERROR(buffer->allocate(pool, table_bytes, stream));
  carve_tables(heads, layout.table_entries, layout.cublas_workspace_bytes, buffer->get(), tables);
  CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(handle, tables->cublas_workspace, static_cast<size_t>(tables->cublas_workspace_bytes)));
  return Status::Ok();
}

StatusOr<std::vector<Round>> begin_chunk(const ExecContext& ctx, const SpanShape& shape, const Chunk& c,
                                         const TableBuffers& tables, int64_t head_dim, std::vector<LanePass>* table,
                                         Accumulators* acc, cudaStream_t stream) {
  RETURN_IF_ERROR(ctx.check_stop());
  table->clear();
  std::vector<Round> rounds = plan_rounds(shape, c.setups, c.tile0, c.tile1, table);
  if (static_cast<int64_t>(table->size()) > tables.entries)
    return internal_error("cuda backend: lane table of " + std::to_string(table->size()) +
                          " entries exceeds the plan's " + std::to_string(tables.entries));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(tables.lanes, table->data(), table->size() * sizeof(LanePass), cudaMemcpyHostToDevice, stream));
  acc->row0 = c.tile0 * shape.tile_rows;
  acc->rows_per_lane = (c.tile1 - c.tile0) * shape.tile_rows;
  const int64_t acc_rows = (c.lane1 - c.lane0) * acc->rows_per_lane;
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc->acc, 0, static_cast<size_t>(acc_rows * head_dim * 4), stream));
  if (acc->acc_max != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc->acc_max, 0, static_cast<size_t>(acc_rows * 4), stream));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc->acc_sum, 0, static_cast<size_t>(acc_rows * 4), stream));
  }
  return rounds;
}

}  // namespace plsh::cuda
