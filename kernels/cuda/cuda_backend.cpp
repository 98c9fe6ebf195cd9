// The CUDA backend's glue: device selection, the plan (tile layout and
// device workspace, tile_plan.h), and forward(), which stages host tensors,
// carves the workspace exactly as the plan sized it, and runs the rounds:
// build_round -> cuBLAS S = Q K^T -> masked softmax -> cuBLAS O = P V ->
// merge, then finalize per chunk. The kernels are in cuda_kernels.cu, the
// memory pool in device_memory.h. backward() checks its plan and lends a
// handle to cuda_backward.cpp, which runs the backward's rounds.
#include "cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cuda/backward_plan.h"
#include "cuda/cuda_backward.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "cuda/device_memory.h"
#include "cuda/step_events.h"
#include "cuda/step_pacer.h"
#include "cuda/tile_plan.h"
#include "plsh/draws.h"
#include "plsh/params.h"

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

class CudaBackend final : public Backend {
 public:
  Status init(const CudaBackendOptions& options) {
    device_ = options.device;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    device_name_ = std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
                   std::to_string(static_cast<int64_t>(total_bytes >> 30)) + " GiB)";
    int64_t budget = options.memory_budget_bytes;
    if (budget <= 0) {
      if (const char* env = std::getenv("PLSH_CUDA_MEMORY_MB"); env != nullptr && *env != '\0') {
        char* end = nullptr;
        const long long mb = std::strtoll(env, &end, 10);
        if (end == env || *end != '\0' || mb <= 0)
          return invalid_argument(std::string("PLSH_CUDA_MEMORY_MB = '") + env + "', expected a positive integer");
        budget = static_cast<int64_t>(mb) << 20;
      } else {
        budget = static_cast<int64_t>(free_bytes / 4 * 3);
      }
    }
    return pool_.init(device_, budget);
  }

  ~CudaBackend() override {
    // The registry keeps its backends in a static, destroyed at process exit,
    // possibly after the CUDA runtime has shut down: then destroying cuBLAS
    // handles (and the pool, DevicePool) could crash inside libraries that
    // are half gone. The process is ending and the driver takes everything
    // back, so nothing is released then; nor in a lost context, where every
    // call fails anyway. A backend destroyed mid-process (tests, embedders)
    // releases its handles.
    if (health_.lost() || !cuda_runtime_alive()) {
      pool_.abandon();
      return;
    }
    for (cublasHandle_t h : free_handles_) (void)cublasDestroy(h);
  }

  std::string name() const override { return "cuda"; }
  // The device, and after a sticky error why it takes no more work: what
  // GetInfo and each result's metadata show, and the server can log.
  std::string device() const override {
    const Status health = health_.usable();
    return health.ok() ? device_name_ : device_name_ + " [" + health.message() + "]";
  }
  std::optional<DeviceMemory> device_memory() const override {
    if (health_.lost()) return std::nullopt;
    size_t free_bytes = 0, total_bytes = 0;
    const cudaError_t set = cudaSetDevice(device_);
    const cudaError_t e = set != cudaSuccess ? set : cudaMemGetInfo(&free_bytes, &total_bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // a recoverable error must not fail this thread's next launch check
      health_.record(e, "in cudaMemGetInfo");
      return std::nullopt;
    }
    return DeviceMemory{static_cast<int64_t>(total_bytes - free_bytes), static_cast<int64_t>(total_bytes), pool_.budget()};
  }

  Status supports(const AttentionParams& p) const override {
    // After a sticky error: UNAVAILABLE, so that "auto" falls back to the CPU.
    RETURN_IF_ERROR(health_.usable());
    if (p.mode == Mode::kLsh && p.lsh_algorithm == LshAlgorithm::kBanded)
      return unimplemented("lsh_algorithm = banded is not implemented on the cuda backend, expected auto or per_sample");
    // 16-byte aligned GEMM operands (device tensors as given; host ones are
    // staged with padded rows), leading dimensions within cuBLAS's int.
    RETURN_IF_ERROR(check_operands(p));
    // The least a request needs: its staging copies, one tile's work and
    // cuBLAS's smallest workspace.
    const int64_t staging = p.memory == MemorySpace::kHost ? carve_staging(p, nullptr, nullptr) : 0;
    const int64_t one_tile = carve_work(1, std::min(kTileRows, p.q_len), std::min(kMaxKeyCols, p.kv_len), p.head_dim,
                                        static_cast<int64_t>(dtype_bytes(p.dtype)), nullptr, nullptr, nullptr);
    const int64_t least = staging + one_tile + kCublasMinWorkspaceBytes;
    if (least > pool_.budget())
      return resource_exhausted("cuda backend: the request needs at least " + std::to_string(least) +
                                " bytes of device memory, the backend's budget is " + std::to_string(pool_.budget()));
    return Status::Ok();
  }

  // The backward (SPEC section 8, backward_plan.h): on host tensors with
  // out_dtype = dtype; the CPU backend takes the rest.
  Status supports_backward(const AttentionParams& p) const override {
    RETURN_IF_ERROR(supports(p));
    return check_backward_support(p);
  }

  StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
    RETURN_IF_ERROR(supports(p));
    if (limits.backward) RETURN_IF_ERROR(supports_backward(p));
    ASSIGN_OR_RETURN(Plan plan, start_plan(p, name(), limits));
    try {
      if (p.mode == Mode::kLsh) plan.lsh_algorithm = LshAlgorithm::kPerSample;
      // The caller's share, or half the pool (request_device_cap); a request
      // too large for half the pool may have all of it: it can only run alone.
      const int64_t cap = request_device_cap(pool_.budget(), limits.device_bytes);
      // The forward's layout and, when asked, the backward's, against one cap
      // (they run one after the other, each holding its own bytes).
      auto plan_for = [&](int64_t bytes) -> StatusOr<CudaLayout> {
        ASSIGN_OR_RETURN(CudaLayout l, plan_layout(p, plan.draws, bytes));
        if (limits.backward) {
          ASSIGN_OR_RETURN(l.backward, plan_backward_layout(p, l, bytes));
          l.has_backward = true;
        }
        return l;
      };
      StatusOr<CudaLayout> planned = plan_for(cap);
      if (!planned.ok() && limits.device_bytes <= 0 && cap < pool_.budget()) planned = plan_for(pool_.budget());
      if (!planned.ok()) return planned.status();
      CudaLayout layout = std::move(*planned);
      // Exactly what forward allocates from the pool (staging, tables with
      // cuBLAS's workspace, work): check_layout_fits holds forward to it.
      plan.forward_workspace.device_bytes = layout.device_bytes();
      // The host side: the draws, the passes and one chunk's lane table.
      int64_t passes = 0;
      for (const LaneSetup& h : layout.heads) passes += static_cast<int64_t>(h.passes.size());
      plan.forward_workspace.host_bytes =
          (layout.table_entries + passes) * static_cast<int64_t>(sizeof(LanePass)) +
          p.heads * p.samples * static_cast<int64_t>(sizeof(Draw));
      if (layout.has_backward) {
        plan.backward = true;
        plan.backward_workspace.device_bytes = layout.backward.device_bytes();
        // And on the host the per-row terms (D_i, lse') besides the same tables.
        plan.backward_workspace.host_bytes = plan.forward_workspace.host_bytes + 2 * p.batch * p.heads * p.q_len * 4;
      }
      plan.layout = std::make_shared<const CudaLayout>(std::move(layout));
    } catch (const std::bad_alloc&) {
      return resource_exhausted("cuda backend: the plan for heads = " + std::to_string(p.heads) +
                                ", samples = " + std::to_string(p.samples) + " could not be allocated on the host");
    }
    return plan;
  }

  Status forward(const Plan& plan, const ExecContext& ctx, ForwardStats* stats) override;
  Status backward(const Plan& plan, const BackwardParams& g, const ExecContext& ctx, BackwardStats* stats) override;

 private:
  Status run_forward(const Plan& plan, const ExecContext& ctx, ForwardStats* stats);
  Status run_backward(const Plan& plan, const BackwardParams& g, const ExecContext& ctx, BackwardStats* stats);
  // forward and backward around their run_*: the device's health before
  // and after, stale errors cleared, sticky ones recorded.
  template <typename Run>
  Status guarded(Run&& run);

  StatusOr<cublasHandle_t> acquire_handle() {
    {
      std::lock_guard<std::mutex> lock(handle_mutex_);
      if (!free_handles_.empty()) {
        cublasHandle_t h = free_handles_.back();
        free_handles_.pop_back();
        return h;
      }
    }
    cublasHandle_t h = nullptr;
    CUBLAS_RETURN_IF_ERROR(cublasCreate(&h));
    // fp32 inputs stay fp32 on the tensor cores' side too: no TF32. A handle
    // that cannot be set up is destroyed, not leaked.
    const Status math = cublas_status(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode", __FILE__, __LINE__);
    if (!math.ok()) {
      (void)cublasDestroy(h);
      return math;
    }
    return h;
  }
  void release_handle(cublasHandle_t h) {
    std::lock_guard<std::mutex> lock(handle_mutex_);
    free_handles_.push_back(h);
  }

  Status check_device_tensors(const AttentionParams& p) const {
    // lse too when asked for: the finalize kernel writes through it, and a
    // host pointer there would be a sticky illegal-address error.
    const void* ptrs[] = {p.q, p.k, p.v, p.out, p.lse};
    const char* names[] = {"q", "k", "v", "out", "lse"};
    for (int t = 0; t < 5; ++t) {
      if (ptrs[t] == nullptr) continue;  // only lse may be null (bind_tensors checked the rest)
      cudaPointerAttributes attr{};
      CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptrs[t]));
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return invalid_argument(std::string(names[t]) + " is not device memory, expected memory = device tensors");
      if (attr.type == cudaMemoryTypeDevice && attr.device != device_)
        return invalid_argument(std::string(names[t]) + " is on device " + std::to_string(attr.device) +
                                ", expected device " + std::to_string(device_) + " (this backend's)");
    }
    return Status::Ok();
  }

  int device_ = 0;
  std::string device_name_;
  mutable DeviceHealth health_;
  mutable DevicePool pool_;
  std::mutex handle_mutex_;
  std::vector<cublasHandle_t> free_handles_;
};

template <typename Run>
Status CudaBackend::guarded(Run&& run) {
  RETURN_IF_ERROR(health_.usable());
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // An error an earlier call left on this thread (a pool allocation that did
  // not fit, a failed pointer query, another library's) would otherwise be
  // read by this request's first launch check as its own.
  const cudaError_t stale = cudaGetLastError();
  if (health_.record(stale, "found at the start of a request")) return health_.usable();
  const Status s = run();
  // run_forward and run_backward drain the stream on every path; a sticky
  // error shows in the last-error slot whichever call met it (a cuBLAS
  // status, the drain).
  const cudaError_t last = cudaGetLastError();
  if (health_.record(last, "during a request")) return s.ok() ? health_.usable() : s;
  // UNAVAILABLE from a run comes only from a sticky error (cuda_check.h).
  if (s.code() == StatusCode::kUnavailable) health_.record_lost(s.message());
  return s;
}

Status CudaBackend::forward(const Plan& plan, const ExecContext& ctx, ForwardStats* stats) {
  return guarded([&] { return run_forward(plan, ctx, stats); });
}

Status CudaBackend::backward(const Plan& plan, const BackwardParams& g, const ExecContext& ctx, BackwardStats* stats) {
  return guarded([&] { return run_backward(plan, g, ctx, stats); });
}

Status CudaBackend::run_forward(const Plan& plan, const ExecContext& ctx, ForwardStats* stats) {
  if (plan.backend != name())
    return invalid_argument("plan made by backend '" + plan.backend + "', expected a plan of the cuda backend");
  const auto* layout = dynamic_cast<const CudaLayout*>(plan.layout.get());
  if (layout == nullptr) return invalid_argument("cuda backend: the plan has no cuda layout, expected CudaBackend::plan's");
  const AttentionParams& p = plan.params;
  if (p.q == nullptr || p.out == nullptr)
    return failed_precondition("cuda backend: the plan's tensors are not bound, expected bind_tensors first");
  RETURN_IF_ERROR(supports(p));
  // Every buffer carved below stays inside what the plan charged.
  RETURN_IF_ERROR(check_layout_fits(*layout, p));
  if (plan.forward_workspace.device_bytes != layout->device_bytes())
    return internal_error("cuda backend: the plan charges " + std::to_string(plan.forward_workspace.device_bytes) +
                          " device bytes, its layout sized " + std::to_string(layout->device_bytes()));
  cudaStream_t stream = ctx.stream != nullptr ? static_cast<cudaStream_t>(ctx.stream) : cudaStreamPerThread;
  if (p.memory == MemorySpace::kDevice) RETURN_IF_ERROR(check_device_tensors(p));

  // Hold the plan's device bytes for the whole call: concurrent requests
  // together never exceed the pool's budget.
  Reservation reservation(pool_);
  RETURN_IF_ERROR(reservation.take(layout->device_bytes()));

  ASSIGN_OR_RETURN(cublasHandle_t handle, acquire_handle());
  // Whatever path leaves this function, the work it queued drains before the
  // buffers go back to the pool for another stream and the handle to
  // another request (the DeviceBuffers below free in stream order; this
  // guard, declared first, runs last). After a stop that is at most the
  // steps in flight (StepPacer).
  struct HandleGuard {
    CudaBackend* self;
    cublasHandle_t h;
    cudaStream_t stream;
    ~HandleGuard() {
      (void)cudaStreamSynchronize(stream);  // its error, if sticky, is read by forward()
      self->release_handle(h);
    }
  } handle_guard{this, handle, stream};
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));

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
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  if (p.memory == MemorySpace::kHost) {
    RETURN_IF_ERROR(staging_buffer.allocate(pool_, layout->staging_bytes, stream));
    carve_staging(p, staging_buffer.get(), &staged);
    // One 2D copy per tensor: B * N * H rows of D elements (dense: the
    // source pitch is D, check_operands), each to a padded row.
    const size_t row = static_cast<size_t>(p.head_dim * esz);
    const size_t q_rows = static_cast<size_t>(p.batch * p.q_len * p.heads);
    const size_t kv_rows = static_cast<size_t>(p.batch * p.kv_len * p.kv_heads);
    const OperandLayout& o = pr.operands;
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(staged.q, static_cast<size_t>(o.q_hs * esz), p.q, row, row, q_rows,
                                           cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(staged.k, static_cast<size_t>(o.k_hs * esz), p.k, row, row, kv_rows,
                                           cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(staged.v, static_cast<size_t>(o.v_hs * esz), p.v, row, row, kv_rows,
                                           cudaMemcpyHostToDevice, stream));
    pr.q = staged.q;
    pr.k = staged.k;
    pr.v = staged.v;
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

  const WorkspacePlan& work = layout->work;
  const int64_t T = work.tile_rows;
  const int64_t D = p.head_dim;
  DeviceBuffer work_buffer;
  RETURN_IF_ERROR(work_buffer.allocate(pool_, layout->work_bytes, stream));
  RoundBuffers rb;
  Accumulators acc;
  carve_work(work.slots, T, work.key_cols, D, esz, work_buffer.get(), &rb, &acc);

  const std::vector<LaneSetup>& heads = layout->heads;
  DeviceBuffer table_buffer;
  RETURN_IF_ERROR(table_buffer.allocate(pool_, layout->table_bytes, stream));
  TableBuffers tables;
  carve_tables(p.heads, layout->table_entries, layout->cublas_workspace_bytes, table_buffer.get(), &tables);
  // cuBLAS's workspace is the plan's (cublasSetStream has just reset it to
  // the handle's default pool): no allocation outside what was charged.
  CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(handle, tables.cublas_workspace, static_cast<size_t>(tables.cublas_workspace_bytes)));
  std::vector<HeadLse> lse_terms(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) lse_terms[static_cast<size_t>(h)] = head_lse(p, heads[static_cast<size_t>(h)]);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tables.head_lse, lse_terms.data(), lse_terms.size() * sizeof(HeadLse),
                                       cudaMemcpyHostToDevice, stream));

  // Steps of about kStepFlops, at most kStepsInFlight queued: cancel,
  // deadline and progress follow the GPU, not the host (step_pacer.h).
  StepEvents events;
  RETURN_IF_ERROR(events.create(kStepsInFlight));
  StepPacer::Hooks hooks = event_hooks(events, stream, ctx);
  StepPacer pacer(kStepsInFlight, kStepFlops, std::move(hooks));

  const cudaDataType_t in_type = cuda_type(p.dtype);
  const float alpha_qk = static_cast<float>(p.scale);
  const float one = 1.0f, zero = 0.0f;
  const OperandLayout& ops = pr.operands;
  const int64_t lanes_total = p.batch * p.heads;
  const int64_t tiles_total = tile_count(pr.shape);
  const double chunks_total =
      static_cast<double>(ceil_div(lanes_total, work.lanes_per_chunk) * ceil_div(tiles_total, work.tiles_per_chunk));
  double chunks_done = 0;
  double flops = 0;
  std::vector<LanePass> table;

  for (int64_t lane0 = 0; lane0 < lanes_total; lane0 += work.lanes_per_chunk) {
    const int64_t lane1 = std::min(lanes_total, lane0 + work.lanes_per_chunk);
    const std::vector<LaneSetup> setups = chunk_lanes(heads, p.heads, lane0, lane1);
    for (int64_t t0 = 0; t0 < tiles_total; t0 += work.tiles_per_chunk) {
      const int64_t t1 = std::min(tiles_total, t0 + work.tiles_per_chunk);
      RETURN_IF_ERROR(ctx.check_stop());
      table.clear();
      const std::vector<Round> rounds = plan_rounds(pr.shape, setups, t0, t1, &table);
      if (static_cast<int64_t>(table.size()) > tables.entries)
        return internal_error("cuda backend: lane table of " + std::to_string(table.size()) + " entries exceeds the plan's " +
                              std::to_string(tables.entries));
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(tables.lanes, table.data(), table.size() * sizeof(LanePass), cudaMemcpyHostToDevice, stream));
      acc.row0 = t0 * T;
      acc.rows_per_lane = (t1 - t0) * T;
      const int64_t acc_rows = (lane1 - lane0) * acc.rows_per_lane;
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc, 0, static_cast<size_t>(acc_rows * D * 4), stream));
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc_max, 0, static_cast<size_t>(acc_rows * 4), stream));
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc_sum, 0, static_cast<size_t>(acc_rows * 4), stream));

      for (size_t ri = 0; ri < rounds.size(); ++ri) {
        const Round& r = rounds[ri];
        RETURN_IF_ERROR(ctx.check_stop());
        const int Kc = static_cast<int>(r.key_cols);
        const int Kp = static_cast<int>(key_pitch(r.key_cols));
        RETURN_IF_ERROR(launch_build_round(pr, r, tables.lanes, rb, stream));
        // At most kMaxGemmBatch matrices per cuBLAS call: the pointer arrays
        // of a sub-batch start at its first slot.
        for (const GemmBatch& g : gemm_batches(r.slots)) {
          const int count = static_cast<int>(g.count);
          // S^T (Kc x T, column-major, pitch Kp) = K_chunk (Kc x D) . Q_tile^T: row-major S [T][Kp].
          CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
              handle, CUBLAS_OP_T, CUBLAS_OP_N, Kc, static_cast<int>(T), static_cast<int>(D), &alpha_qk,
              rb.k_ptr + g.first, in_type, static_cast<int>(ops.k_rs), rb.q_ptr + g.first, in_type,
              static_cast<int>(ops.q_rs), &zero, reinterpret_cast<void* const*>(rb.score_ptr + g.first), CUDA_R_32F, Kp,
              count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
        RETURN_IF_ERROR(launch_masked_softmax(p.dtype, pr, r, tables.lanes, rb, stream));
        for (const GemmBatch& g : gemm_batches(r.slots)) {
          const int count = static_cast<int>(g.count);
          // O^T (D x T, pitch Dp) = V_chunk^T (D x Kc) . P^T (Kc x T, pitch Kp): row-major O [T][Dp].
          CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
              handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(D), static_cast<int>(T), Kc, &one, rb.v_ptr + g.first,
              in_type, static_cast<int>(ops.v_rs), rb.prob_ptr + g.first, in_type, Kp, &zero,
              reinterpret_cast<void* const*>(rb.partial_ptr + g.first), CUDA_R_32F, static_cast<int>(partial_pitch(D)),
              count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
        RETURN_IF_ERROR(launch_merge(pr, r, tables.lanes, rb, acc, stream));
        const double round_flops =
            4.0 * static_cast<double>(r.slots) * static_cast<double>(T) * static_cast<double>(Kc) * static_cast<double>(D);
        flops += round_flops;
        const bool last_round = ri + 1 == rounds.size();
        if (last_round)
          RETURN_IF_ERROR(launch_finalize(p.out_dtype, out, p.q_len, D, lane0, lane1 - lane0, tables.head_lse, acc, stream));
        // Done once it has run: this chunk's share of its rounds.
        RETURN_IF_ERROR(pacer.add(
            round_flops,
            (chunks_done + static_cast<double>(ri + 1) / static_cast<double>(rounds.size())) / chunks_total));
      }
      if (rounds.empty())
        RETURN_IF_ERROR(launch_finalize(p.out_dtype, out, p.q_len, D, lane0, lane1 - lane0, tables.head_lse, acc, stream));
      chunks_done += 1;
    }
  }

  if (p.memory == MemorySpace::kHost) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.out, staged.out, static_cast<size_t>(staged.out_bytes), cudaMemcpyDeviceToHost, stream));
    if (p.lse != nullptr)
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.lse, staged.lse, static_cast<size_t>(staged.lse_bytes), cudaMemcpyDeviceToHost, stream));
  }
  // The last step (with the copies back) is waited for the same way: a stop
  // still acts while the GPU finishes.
  RETURN_IF_ERROR(pacer.add(0, 1.0));
  RETURN_IF_ERROR(pacer.finish());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (stats != nullptr) {
    stats->flops = flops;
    stats->lsh_algorithm = plan.lsh_algorithm;
    stats->workspace = plan.forward_workspace;
  }
  return Status::Ok();
}

Status CudaBackend::run_backward(const Plan& plan, const BackwardParams& g, const ExecContext& ctx,
                                 BackwardStats* stats) {
  if (plan.backend != name())
    return invalid_argument("plan made by backend '" + plan.backend + "', expected a plan of the cuda backend");
  const auto* layout = dynamic_cast<const CudaLayout*>(plan.layout.get());
  if (layout == nullptr) return invalid_argument("cuda backend: the plan has no cuda layout, expected CudaBackend::plan's");
  const AttentionParams& p = plan.params;
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr)
    return failed_precondition("cuda backend: the plan's tensors are not bound, expected bind_tensors first");
  RETURN_IF_ERROR(supports_backward(p));
  if (g.memory != MemorySpace::kHost || g.out == nullptr || g.lse == nullptr || g.dout == nullptr ||
      g.dq == nullptr || g.dk == nullptr || g.dv == nullptr)
    return invalid_argument("cuda backend: backward tensors missing or not in host memory, expected "
                            "make_backward_params' for this plan");
  RETURN_IF_ERROR(check_backward_layout_fits(*layout, p, static_cast<int64_t>(dtype_bytes(g.grad_dtype))));
  if (plan.backward_workspace.device_bytes != layout->backward.device_bytes())
    return internal_error("cuda backend: the plan charges " + std::to_string(plan.backward_workspace.device_bytes) +
                          " device bytes for the backward, its layout sized " +
                          std::to_string(layout->backward.device_bytes()));
  cudaStream_t stream = ctx.stream != nullptr ? static_cast<cudaStream_t>(ctx.stream) : cudaStreamPerThread;
  Reservation reservation(pool_);
  RETURN_IF_ERROR(reservation.take(layout->backward.device_bytes()));
  ASSIGN_OR_RETURN(cublasHandle_t handle, acquire_handle());
  // As in run_forward: the queued work drains before the handle goes back.
  struct HandleGuard {
    CudaBackend* self;
    cublasHandle_t h;
    cudaStream_t stream;
    ~HandleGuard() {
      (void)cudaStreamSynchronize(stream);
      self->release_handle(h);
    }
  } handle_guard{this, handle, stream};
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  return run_cuda_backward(plan, *layout, g, ctx, pool_, handle, stream, stats);
}

Status no_device_reason(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    return failed_precondition(*why);
  }
  if (count == 0) {
    *why = "no CUDA device: cudaGetDeviceCount found 0 devices";
    return failed_precondition(*why);
  }
  return Status::Ok();
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(std::string* why_not, const CudaBackendOptions& options) {
  std::string why;
  if (!no_device_reason(&why).ok()) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  auto backend = std::make_unique<CudaBackend>();
  const Status s = backend->init(options);
  if (!s.ok()) {
    if (why_not != nullptr) *why_not = "cuda backend init: " + s.to_string();
    return nullptr;
  }
  return backend;
}

StatusOr<std::vector<int64_t>> device_bins(const Draw& draw, const std::vector<int64_t>& positions, int device) {
  std::string why;
  RETURN_IF_ERROR(no_device_reason(&why));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<int64_t> bins(positions.size());
  if (n == 0) return bins;
  long long* d_pos = nullptr;
  long long* d_out = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&d_pos, static_cast<size_t>(n) * 8));
  struct Free {
    long long** a;
    long long** b;
    ~Free() {
      (void)cudaFree(*a);
      (void)cudaFree(*b);
    }
  } guard{&d_pos, &d_out};
  CUDA_RETURN_IF_ERROR(cudaMalloc(&d_out, static_cast<size_t>(n) * 8));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(d_pos, positions.data(), static_cast<size_t>(n) * 8, cudaMemcpyHostToDevice));
  RETURN_IF_ERROR(launch_bins(d_pos, d_out, n, draw.pitch, draw.shift, nullptr));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(bins.data(), d_out, static_cast<size_t>(n) * 8, cudaMemcpyDeviceToHost));
  return bins;
}

}  // namespace plsh::cuda

// The registry's entry point (plsh/backend.h): the versioned plugin struct.
namespace {

plsh::Backend* create_cuda_backend(char* why_not, size_t why_not_size) {
  std::string why;
  std::unique_ptr<plsh::Backend> backend = plsh::cuda::make_cuda_backend(&why);
  if (backend == nullptr && why_not != nullptr && why_not_size > 0) {
    const size_t n = std::min(why.size(), why_not_size - 1);
    std::memcpy(why_not, why.data(), n);
    why_not[n] = '\0';
  }
  return backend.release();
}

const plsh::PlshBackendPlugin kCudaPlugin = {plsh::kBackendApiVersion, "cuda", &create_cuda_backend};

}  // namespace

extern "C" __attribute__((visibility("default"))) const plsh::PlshBackendPlugin* plsh_backend_plugin() {
  return &kCudaPlugin;
}
