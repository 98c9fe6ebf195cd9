// What the forward (cuda_forward.cpp) and the backward (cuda_backward.cpp)
// do alike on the host side: stage host rows into the padded device layout,
// carve the lane tables and hand cuBLAS its workspace, run a round's GEMMs
// as batched cuBLAS calls, and run the chunks and their rounds, paced on the
// GPU (DeviceRounds).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/step_events.h"
#include "cuda/workspace_slots.h"
#include "plsh/backend.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// A call's GEMMs: its cuBLAS handle and its tensors' dtype.
struct BatchedGemm {
  cublasHandle_t handle;
  DType dtype;
  // One GEMM of a round (forward_gemms, backward_gemms) over its `slots`
  // matrices, at most kMaxGemmBatch per cuBLAS call (the pointer arrays of
  // a sub-batch start at its first slot): A and B of the dtype, C float32,
  // float32 accumulation.
  Status operator()(const GemmArgs& a, float alpha, const void* const* A, const void* const* B, float* const* C,
                    int64_t slots) const;
};

// `rows` dense host rows of `row_elems` elements (esz bytes each) to device
// rows `pitch_elems` apart: one 2D copy.
Status stage_rows(char* dst, int64_t pitch_elems, const void* src, int64_t rows, int64_t row_elems, int64_t esz,
                  cudaStream_t stream);
// Host q, k and v (dense, check_operands) to their staging copies in the
// operand layout `ops`.
Status stage_qkv(const AttentionParams& p, const OperandLayout& ops, const StagedQkv& dst, cudaStream_t stream);

// The lane tables' buffer of `table_bytes` from the pool, carved as the
// plan sized it (carve_tables), with cuBLAS's workspace set to its slice: no
// allocation outside what the plan charged (cublasSetStream has just reset
// the handle to its default pool).
Status carve_table_buffer(DevicePool& pool, const CudaLayout& layout, int64_t table_bytes, int64_t heads,
                          cublasHandle_t handle, cudaStream_t stream, DeviceBuffer* buffer, TableBuffers* tables);

// A call's device buffers beside its staging, freed with it on its stream:
// the work buffer, carved into the round's slices (rb) and the chunk
// accumulators, and the lane tables' buffer with cuBLAS's workspace.
template <typename RoundBuffersT>
struct CallBuffers {
  DeviceBuffer work_buffer, table_buffer;
  RoundBuffersT rb;
  Accumulators acc;
  TableBuffers tables;
};

// Both buffers of a call from the pool, as `sizes` (the forward's
// CudaLayout, the backward's CudaBackwardLayout) planned them: work_bytes
// carved by `carve` (carve_work, carve_backward_work) for sizes.work's
// slots, and table_bytes by carve_table_buffer.
template <typename Sizes, typename RoundBuffersT>
Status carve_call_buffers(DevicePool& pool, const CudaLayout& layout, const Sizes& sizes, const AttentionParams& p,
                          cublasHandle_t handle, cudaStream_t stream,
                          int64_t (*carve)(int64_t, int64_t, int64_t, int64_t, int64_t, char*, RoundBuffersT*,
                                           Accumulators*),
                          CallBuffers<RoundBuffersT>* b) {
  const WorkspaceSlots& work = sizes.work;
  RETURN_IF_ERROR(b->work_buffer.allocate(pool, sizes.work_bytes, stream));
  carve(work.slots, work.tile_rows, work.key_cols, p.head_dim, static_cast<int64_t>(dtype_bytes(p.dtype)),
        b->work_buffer.get(), &b->rb, &b->acc);
  return carve_table_buffer(pool, layout, sizes.table_bytes, p.heads, handle, stream, &b->table_buffer, &b->tables);
}

// The start of a chunk: the stop check, its rounds (plan_rounds) with their
// lane table (`table`, reused from chunk to chunk) copied to the device,
// INTERNAL if that outgrows the plan's, and the chunk's rows of the
// accumulators zeroed (acc_max and acc_sum too where the work buffer has
// them: the forward's).
StatusOr<std::vector<Round>> begin_chunk(const ExecContext& ctx, const SpanShape& shape, const Chunk& c,
                                         const TableBuffers& tables, int64_t head_dim, std::vector<LanePass>* table,
                                         Accumulators* acc, cudaStream_t stream);

// A call's chunks (for_each_chunk) and their rounds on `stream`, paced on
// the GPU (PacedRounds) so that cancel, deadline and progress follow the
// device: each chunk starts with begin_chunk; each round, after the stop
// check, is on_round(chunk, round, last), which queues the round's launches
// and GEMMs and returns its FLOPs (last: the chunk's last round); after a
// chunk's rounds on_chunk_end(chunk, rounds) queues what follows them. The
// caller then queues what follows the rounds (the copies back), and
// finish() waits for it the same way, so that a stop still acts while the
// GPU finishes, and then for the stream.
class DeviceRounds {
 public:
  DeviceRounds(const ExecContext& ctx, cudaStream_t stream) : ctx_(ctx), stream_(stream) {}

  template <typename OnRound, typename OnChunkEnd>
  Status run(const WorkspaceSlots& work, const std::vector<LaneSetup>& heads, const AttentionParams& p,
             const SpanShape& shape, const TableBuffers& tables, Accumulators* acc, OnRound&& on_round,
             OnChunkEnd&& on_chunk_end) {
    const int64_t lanes = p.batch * p.heads, tiles = tile_count(shape);
    paced_.emplace(chunk_count(work, lanes, tiles));
    RETURN_IF_ERROR(paced_->start(stream_, ctx_));
    std::vector<LanePass> table;
    return for_each_chunk(work, heads, p.heads, lanes, tiles, [&](const Chunk& c) -> Status {
      ASSIGN_OR_RETURN(const std::vector<Round> rounds,
                       begin_chunk(ctx_, shape, c, tables, p.head_dim, &table, acc, stream_));
      for (size_t ri = 0; ri < rounds.size(); ++ri) {
        RETURN_IF_ERROR(ctx_.check_stop());
        ASSIGN_OR_RETURN(const double flops, on_round(c, rounds[ri], ri + 1 == rounds.size()));
        RETURN_IF_ERROR(paced_->add_round(c.index, ri, rounds.size(), flops));
      }
      return on_chunk_end(c, rounds.size());
    });
  }

  Status finish() { return paced_->finish(stream_); }
  double flops() const { return paced_->flops(); }

 private:
  const ExecContext& ctx_;
  cudaStream_t stream_;
  std::optional<PacedRounds> paced_;
};

}  // namespace plsh::cuda
