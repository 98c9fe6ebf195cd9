#include "cuda/cuda_forward.h"

#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "cuda/device_round.h"
#include "cuda/step_events.h"

namespace plsh::cuda {

Status run_cuda_forward(const Plan& plan, const CudaLayout& layout, const ExecContext& ctx, DevicePool& pool,
                        cublasHandle_t handle, cudaStream_t stream, ForwardStats* stats) {
  const AttentionParams& p = plan.params;
  // Host tensors travel through the pool, in the slices the plan sized:
  // q, k and v with each head's row padded to 16 bytes (operand_layout).
  DeviceBuffer staging_buffer;
  StagingBuffers staged;
  DeviceProblem pr;
  DeviceOutput out;
  pr.q = static_cast<const char*>(p.q);
  pr.k = static_cast<const char*>(p.k);
  pr.v = static_cast<const char*>(p.v);
  pr.operands = operand_layout(p);
  out.out = p.out;
  out.lse = p.lse;
  if (p.memory == MemorySpace::kHost) {
    RETURN_IF_ERROR(staging_buffer.allocate(pool, layout.staging_bytes, stream));
    carve_staging(p, staging_buffer.get(), &staged);
    RETURN_IF_ERROR(stage_qkv(p, pr.operands, staged.qkv, stream));
    pr.q = staged.qkv.q;
    pr.k = staged.qkv.k;
    pr.v = staged.qkv.v;
    out.out = staged.out;
    out.lse = p.lse != nullptr ? staged.lse : nullptr;
  }
  pr.head_dim = p.head_dim;
  pr.q_pos0 = p.q_pos0;
  pr.k_pos0 = p.k_pos0;
  pr.shape = span_shape(p);
  out.o_bs = p.o_batch_stride, out.o_rs = p.o_row_stride, out.o_hs = p.o_head_stride;
  out.lse_bs = p.lse_batch_stride, out.lse_rs = p.lse_row_stride;
  out.heads = p.heads;
  out.shape = pr.shape;

  const WorkspaceSlots& work = layout.work;
  const int64_t T = work.tile_rows;
  const int64_t D = p.head_dim;
  CallBuffers<RoundBuffers> dev;
  RETURN_IF_ERROR(carve_call_buffers(pool, layout, layout, p, handle, stream, carve_work, &dev));
  const RoundBuffers& rb = dev.rb;
  const TableBuffers& tables = dev.tables;

  const std::vector<LaneSetup>& heads = layout.heads;
  std::vector<HeadLse> lse_terms(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) lse_terms[static_cast<size_t>(h)] = head_lse(p, heads[static_cast<size_t>(h)]);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tables.head_lse, lse_terms.data(), lse_terms.size() * sizeof(HeadLse),
                                       cudaMemcpyHostToDevice, stream));

  // A chunk's out and lse from its accumulators: queued with its last round
  // (so that the round's step covers it), or alone for a chunk of none.
  auto finalize = [&](const Chunk& c) {
    return launch_finalize(p.out_dtype, out, p.q_len, D, c.lane0, c.lane1 - c.lane0, tables.head_lse, dev.acc, stream);
  };
  const BatchedGemm gemm{handle, p.dtype};
  auto round = [&](const Chunk& c, const Round& r, bool last) -> StatusOr<double> {
    const ForwardGemms gemms = forward_gemms(pr.operands, T, r.key_cols);
    RETURN_IF_ERROR(launch_build_round(pr, r, tables.lanes, rb, stream));
    RETURN_IF_ERROR(gemm(gemms.scores, static_cast<float>(p.scale), rb.k_ptr, rb.q_ptr, rb.score_ptr, r.slots));
    RETURN_IF_ERROR(launch_masked_softmax(p.dtype, pr, r, tables.lanes, rb, stream));
    RETURN_IF_ERROR(gemm(gemms.partial, 1.0f, rb.v_ptr, rb.prob_ptr, rb.partial_ptr, r.slots));
    RETURN_IF_ERROR(launch_merge(pr, r, tables.lanes, rb, dev.acc, stream));
    if (last) RETURN_IF_ERROR(finalize(c));
    return 4.0 * static_cast<double>(r.slots) * static_cast<double>(T) * static_cast<double>(r.key_cols) *
           static_cast<double>(D);
  };
  DeviceRounds rounds(ctx, stream);
  RETURN_IF_ERROR(rounds.run(work, heads, p, pr.shape, tables, &dev.acc, round,
                             [&](const Chunk& c, size_t n) { return n == 0 ? finalize(c) : Status::Ok(); }));

  if (p.memory == MemorySpace::kHost) {
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(p.out, staged.out, static_cast<size_t>(staged.out_bytes), cudaMemcpyDeviceToHost, stream));
    if (p.lse != nullptr)
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(p.lse, staged.lse, static_cast<size_t>(staged.lse_bytes), cudaMemcpyDeviceToHost, stream));
  }
  RETURN_IF_ERROR(rounds.finish());
  if (stats != nullptr) {
    stats->flops = rounds.flops();
    stats->lsh_algorithm = plan.lsh_algorithm;
    stats->workspace = plan.forward_workspace;
  }
  return Status::Ok();
}

}  // namespace plsh::cuda
