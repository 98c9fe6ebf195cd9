// The CUDA backend's glue: device selection, the plan (tile layout and
// device workspace, tile_plan.h), and forward() and backward(), which check
// their plan, reserve its device bytes and lend a cuBLAS handle to
// cuda_forward.cpp and cuda_backward.cpp, which run the rounds. The memory
// pool is in device_memory.h.
#include "cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
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
#include "cuda/cuda_forward.h"
#include "cuda/cuda_kernels.h"
#include "cuda/device_memory.h"
#include "cuda/fused_plan.h"
#include "cuda/fused_run.h"
#include "cuda/transfer.h"
#include "cuda/workspace_slots.h"
#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh::cuda {

namespace {

// The caller holds `bytes` of the pool for this run already: its workspace
// carries the admission's hold (CudaBackend::allocate_device) of that many.
bool held_by_caller(const WorkspaceRef& workspace, int64_t bytes) {
  return workspace.device != nullptr && workspace.device_bytes >= bytes;
}

// Calls the backend runs at once: $PLSH_CUDA_MAX_CALLS (a server sets it to
// its --workers), else 8. A call past them waits for one to end.
int max_calls() {
  if (const char* env = std::getenv("PLSH_CUDA_MAX_CALLS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) return static_cast<int>(n);
  }
  return 8;
}

// A counting semaphore whose wait polls the call's stop condition.
class CallSlots {
 public:
  explicit CallSlots(int slots) : free_(slots) {}
  class Slot {
   public:
    explicit Slot(CallSlots& s) : slots_(s) {}
    ~Slot() {
      if (held_) slots_.give_back();
    }
    Status take(const ExecContext& ctx) {
      std::unique_lock<std::mutex> lock(slots_.mutex_);
      while (slots_.free_ == 0) {
        RETURN_IF_ERROR(ctx.check_stop());
        slots_.freed_.wait_for(lock, std::chrono::milliseconds(5));
      }
      --slots_.free_;
      held_ = true;
      return Status::Ok();
    }

   private:
    CallSlots& slots_;
    bool held_ = false;
  };

 private:
  void give_back() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++free_;
    }
    freed_.notify_one();
  }
  std::mutex mutex_;
  std::condition_variable freed_;
  int free_;
};

class CudaBackend final : public Backend {
 public:
  Status init(const CudaBackendOptions& options) {
    device_ = options.device;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    sm_count_ = prop.multiProcessorCount;
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
      pinned_.abandon();
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
    // cudaMemGetInfo reads the current device: make it ours for the call
    // and give the calling thread its own back (a server thread serving
    // another device must not find its device changed by a gauge).
    int previous = -1;
    cudaError_t e = cudaGetDevice(&previous);
    if (e == cudaSuccess && previous != device_) e = cudaSetDevice(device_);
    if (e == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (previous >= 0 && previous != device_) {
      const cudaError_t back = cudaSetDevice(previous);
      if (e == cudaSuccess) e = back;
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // a recoverable error must not fail this thread's next launch check
      health_.record(e, "in cudaMemGetInfo");
      return std::nullopt;
    }
    return DeviceMemory{static_cast<int64_t>(total_bytes - free_bytes), static_cast<int64_t>(total_bytes),
                        pool_.budget()};
  }

  Status supports(const AttentionParams& p) const override {
    // After a sticky error: UNAVAILABLE, so that "auto" falls back to the CPU.
    RETURN_IF_ERROR(health_.usable());
    const Status fused = fused_supported(p);
    if (uses_draws(p.mode) && p.lsh_algorithm == LshAlgorithm::kBanded && !fused.ok())
      return unimplemented(
          "lsh_algorithm = banded runs on the cuda backend's fused kernel, which cannot take this "
          "request (" +
          fused.message() + "), expected auto or per_sample");
    // 16-byte aligned GEMM operands (device tensors as given; host ones are
    // staged with padded rows), leading dimensions within cuBLAS's int.
    RETURN_IF_ERROR(check_operands(p));
    // The least a request needs: on the cuBLAS pipeline its staging copies,
    // one tile's work and cuBLAS's smallest workspace; on the fused path its
    // staging and tables (whichever path it can take that needs less).
    const int64_t staging = p.memory == MemorySpace::kHost ? carve_staging(p, nullptr, nullptr) : 0;
    const int64_t one_tile = carve_work(1, std::min(kTileRows, p.q_len), std::min(kMaxKeyCols, p.kv_len), p.head_dim,
                                        static_cast<int64_t>(dtype_bytes(p.dtype)), nullptr, nullptr, nullptr);
    int64_t least = staging + one_tile + kCublasMinWorkspaceBytes;
    if (fused.ok()) least = std::min(least, fused_forward_bytes_for(p));
    if (least > pool_.budget())
      return resource_exhausted("cuda backend: the request needs at least " + std::to_string(least) +
                                " bytes of device memory, the backend's budget is " + std::to_string(pool_.budget()));
    return Status::Ok();
  }

  // The backward (SPEC section 8, backward_plan.h): on host tensors with
  // out_dtype = dtype; the CPU backend takes the rest.
  Status supports_backward(const AttentionParams& p) const override {
    RETURN_IF_ERROR(supports(p));
    // The fused backward reads dout in the dtype of q, k, v, from host or
    // device tensors; the cuBLAS pipeline's also needs host tensors.
    if (fused_supported(p).ok() && !(p.mode == Mode::kLsh && p.lsh_algorithm == LshAlgorithm::kPerSample)) {
      if (p.out_dtype != p.dtype)
        return unimplemented(
            std::string("the cuda backend's backward needs out_dtype = dtype (its kernels read dout in "
                        "the dtype of q, k, v), got out_dtype = ") +
            dtype_name(p.out_dtype) + ", dtype = " + dtype_name(p.dtype) + "; expected backend = cpu");
      return Status::Ok();
    }
    return check_backward_support(p);
  }

  StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
    RETURN_IF_ERROR(supports(p));
    if (limits.backward) RETURN_IF_ERROR(supports_backward(p));
    ASSIGN_OR_RETURN(Plan plan, start_plan(p, name(), limits));
    try {
      // The caller's share, or half the pool (request_device_cap); a request
      // too large for half the pool may have all of it: it can only run alone.
      const int64_t cap = request_device_cap(pool_.budget(), limits.device_bytes);
      // lsh: the algorithm (SPEC section 3's cost model for auto); exact,
      // window and banded lsh run on the fused kernels where they can.
      if (p.mode == Mode::kLsh)
        plan.lsh_algorithm =
            p.lsh_algorithm != LshAlgorithm::kAuto ? p.lsh_algorithm : cuda_lsh_algorithm(p, plan.draws);
      if (p.mode == Mode::kFixedBlocks) plan.lsh_algorithm = LshAlgorithm::kPerSample;  // fused_supported: not fused
      const bool fused = p.mode == Mode::kLsh ? plan.lsh_algorithm == LshAlgorithm::kBanded : fused_supported(p).ok();
      if (fused) {
        RETURN_IF_ERROR(plan_fused(p, limits, cap, &plan));
        return plan;
      }
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
      // The host side: the passes and one chunk's lane table (the draws are
      // the plan's own, Plan::own_host_bytes).
      int64_t passes = 0;
      for (const LaneSetup& h : layout.heads) passes += static_cast<int64_t>(h.passes.size());
      plan.forward_workspace.host_bytes = (layout.table_entries + passes) * static_cast<int64_t>(sizeof(LanePass));
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

  // Besides the draws, plan() builds one LanePass per head and pass
  // (head_passes), twice over while its vectors grow.
  int64_t planning_host_bytes(const AttentionParams& p) const override {
    const int64_t passes = p.heads * (p.mode == Mode::kLsh ? p.samples : 1);
    return Backend::planning_host_bytes(p) + 2 * passes * static_cast<int64_t>(sizeof(LanePass)) +
           p.heads * static_cast<int64_t>(sizeof(LaneSetup));
  }

  // The admission's device bytes: held against this backend's pool budget
  // from the header on (RESOURCE_EXHAUSTED when the other requests hold
  // too much), so that nothing is refused for device memory after the ack.
  // What it returns is that hold, not memory: a forward or backward given it
  // in WorkspaceRef::device takes its buffers from the pool within it, on
  // the request's stream (stream-ordered, freed in order); one given none
  // (tests, benchmarks) reserves for itself as it starts.
  StatusOr<std::shared_ptr<void>> allocate_device(int64_t bytes) const override {
    if (bytes <= 0) return std::shared_ptr<void>();
    RETURN_IF_ERROR(health_.usable());
    RETURN_IF_ERROR(pool_.reserve(bytes));
    struct Hold {
      DevicePool* pool;
      int64_t bytes;
    };
    return std::shared_ptr<void>(new Hold{&pool_, bytes}, [](void* h) {
      const Hold* hold = static_cast<const Hold*>(h);
      hold->pool->unreserve(hold->bytes);
      delete hold;
    });
  }

  // The caller's host workspace is not read yet: forward and backward
  // allocate their host tables as the plan sized them; their device bytes
  // are the caller's hold (allocate_device) or a reservation of their own.
  Status forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats) override;
  // The estimates' probe rows with the forward (issue 19): fused plans of
  // lsh and window on host tensors, planned with their probe.
  bool probes_with_forward(const Plan& plan) const override {
    const auto* layout = dynamic_cast<const CudaLayout*>(plan.layout.get());
    return plan.backend == name() && layout != nullptr && layout->fused != nullptr && layout->fused->probe;
  }
  Status forward_with_probe(const Plan& plan, const std::vector<std::vector<int64_t>>& rows,
                            const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats,
                            ProbeRowsOut* out) override;
  Status backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace, const ExecContext& ctx,
                  BackwardStats* stats) override;

 private:
  Status run_forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats,
                     const std::vector<std::vector<int64_t>>* probe_rows = nullptr, ProbeRowsOut* probe_out = nullptr);
  // The fused path's plan: its layout (fused_plan.h) against the cap.
  Status plan_fused(const AttentionParams& p, const PlanLimits& limits, int64_t cap, Plan* plan) const;
  // run(stream) holding `device_bytes` of the pool, as with_handle without
  // a cuBLAS handle (the fused path has no GEMM call).
  template <typename Run>
  Status with_stream(const ExecContext& ctx, const WorkspaceRef& workspace, int64_t device_bytes, Run&& run);
  Status run_backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace, const ExecContext& ctx,
                      BackwardStats* stats);
  // forward and backward around their run_*: the device's health before
  // and after, stale errors cleared, sticky ones recorded.
  template <typename Run>
  Status guarded(Run&& run, const ExecContext& ctx);
  // run(handle, stream) on the request's stream (ctx.stream, or the
  // thread's default stream) holding `device_bytes` of the pool (the
  // caller's hold when `workspace` has one that large: allocate_device), so
  // that concurrent requests together never exceed its budget, and a cuBLAS
  // handle set to that stream. Whatever path leaves, the work run queued
  // drains before the handle goes back to another request (the buffers run
  // allocated free in stream order before that; after a stop that is at
  // most the steps in flight, StepPacer), and the bytes go back last.
  template <typename Run>
  Status with_handle(const ExecContext& ctx, const WorkspaceRef& workspace, int64_t device_bytes, Run&& run);

  // The plan's cuda layout; INVALID_ARGUMENT for another backend's plan.
  StatusOr<const CudaLayout*> layout_of(const Plan& plan) const {
    if (plan.backend != name())
      return invalid_argument("plan made by backend '" + plan.backend + "', expected a plan of the cuda backend");
    const auto* layout = dynamic_cast<const CudaLayout*>(plan.layout.get());
    if (layout == nullptr)
      return invalid_argument("cuda backend: the plan has no cuda layout, expected CudaBackend::plan's");
    return layout;
  }

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
    const Status math =
        cublas_status(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode", __FILE__, __LINE__);
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

  // The fused backward's inputs: the plan's tensors bound, supports_backward,
  // and g's tensors present in the plan's memory space.
  Status check_fused_backward_inputs(const Plan& plan, const BackwardParams& g) const {
    const AttentionParams& p = plan.params;
    if (p.q == nullptr || p.k == nullptr || p.v == nullptr)
      return failed_precondition("cuda backend: the plan's tensors are not bound, expected bind_tensors first");
    RETURN_IF_ERROR(supports_backward(p));
    if (g.memory != p.memory || g.out == nullptr || g.lse == nullptr || g.dout == nullptr || g.dq == nullptr ||
        g.dk == nullptr || g.dv == nullptr)
      return invalid_argument(
          "cuda backend: backward tensors missing or not in the plan's memory space, expected "
          "make_backward_params' for this plan");
    return Status::Ok();
  }

  int device_ = 0;
  int sm_count_ = 1;
  std::string device_name_;
  mutable DeviceHealth health_;
  mutable DevicePool pool_;
  CallSlots calls_{max_calls()};
  PinnedPool pinned_{max_calls()};
  std::mutex handle_mutex_;
  std::vector<cublasHandle_t> free_handles_;
};

template <typename Run>
Status CudaBackend::guarded(Run&& run, const ExecContext& ctx) {
  RETURN_IF_ERROR(health_.usable());
  // At most max_calls() calls at once, each with one cuBLAS handle and one
  // set of pinned buffers: both are held outside the pool's budget.
  CallSlots::Slot slot(calls_);
  RETURN_IF_ERROR(slot.take(ctx));
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

template <typename Run>
Status CudaBackend::with_handle(const ExecContext& ctx, const WorkspaceRef& workspace, int64_t device_bytes,
                                Run&& run) {
  return with_stream(ctx, workspace, device_bytes, [&](cudaStream_t stream) -> Status {
    ASSIGN_OR_RETURN(cublasHandle_t handle, acquire_handle());
    struct HandleGuard {
      CudaBackend* self;
      cublasHandle_t h;
      cudaStream_t stream;
      ~HandleGuard() {
        (void)cudaStreamSynchronize(stream);  // drained before another request may have the handle
        self->release_handle(h);
      }
    } handle_guard{this, handle, stream};
    CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
    return run(handle, stream);
  });
}

template <typename Run>
Status CudaBackend::with_stream(const ExecContext& ctx, const WorkspaceRef& workspace, int64_t device_bytes,
                                Run&& run) {
  cudaStream_t stream = ctx.stream != nullptr ? static_cast<cudaStream_t>(ctx.stream) : cudaStreamPerThread;
  Reservation reservation(pool_);
  if (!held_by_caller(workspace, device_bytes)) RETURN_IF_ERROR(reservation.take(device_bytes));
  struct Drain {
    cudaStream_t stream;
    ~Drain() { (void)cudaStreamSynchronize(stream); }  // its error, if sticky, is read by guarded()
  } drain{stream};
  return run(stream);
}

Status CudaBackend::plan_fused(const AttentionParams& p, const PlanLimits& limits, int64_t cap, Plan* plan) const {
  auto fused = std::make_shared<FusedLayout>(plan_fused_layout(p, plan->draws, limits.backward, sm_count_));
  CudaLayout layout;
  layout.fused = fused;
  layout.fused_bytes = fused->forward_bytes;
  layout.has_backward = limits.backward;
  layout.backward.fused_bytes = fused->backward_bytes;
  // The fused path holds the request's tensors whole: it fits the caller's
  // share, or (no share given) the pool, or it does not run here.
  const int64_t need = std::max(fused->forward_bytes, fused->backward_bytes);
  const int64_t room = limits.device_bytes > 0 ? cap : pool_.budget();
  if (need > room)
    return resource_exhausted("cuda backend: the request needs " + std::to_string(need) +
                              " bytes of device memory (its tensors and tables), the request may have " +
                              std::to_string(room));
  const int64_t tables = static_cast<int64_t>(fused->tables.heads.size() * sizeof(FusedHead) +
                                              fused->tables.hashes.size() * sizeof(double));
  plan->forward_workspace.device_bytes = fused->forward_bytes;
  plan->forward_workspace.host_bytes = tables;
  if (limits.backward) {
    plan->backward = true;
    plan->backward_workspace.device_bytes = fused->backward_bytes;
    plan->backward_workspace.host_bytes = tables;
  }
  plan->layout = std::make_shared<const CudaLayout>(std::move(layout));
  return Status::Ok();
}

Status CudaBackend::forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                            ForwardStats* stats) {
  return guarded([&] { return run_forward(plan, workspace, ctx, stats); }, ctx);
}

Status CudaBackend::forward_with_probe(const Plan& plan, const std::vector<std::vector<int64_t>>& rows,
                                       const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats,
                                       ProbeRowsOut* out) {
  if (!probes_with_forward(plan))
    return failed_precondition(
        "cuda backend: the plan has no probe (lsh or window, estimates and probe rows, host "
        "tensors, the fused path), expected forward()");
  if (static_cast<int64_t>(rows.size()) != plan.params.heads)
    return invalid_argument("cuda backend: probe rows for " + std::to_string(rows.size()) + " heads, expected " +
                            std::to_string(plan.params.heads));
  return guarded([&] { return run_forward(plan, workspace, ctx, stats, &rows, out); }, ctx);
}

Status CudaBackend::backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace,
                             const ExecContext& ctx, BackwardStats* stats) {
  return guarded([&] { return run_backward(plan, g, workspace, ctx, stats); }, ctx);
}

Status CudaBackend::run_forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                                ForwardStats* stats, const std::vector<std::vector<int64_t>>* probe_rows,
                                ProbeRowsOut* probe_out) {
  ASSIGN_OR_RETURN(const CudaLayout* layout, layout_of(plan));
  const AttentionParams& p = plan.params;
  if (p.q == nullptr || p.out == nullptr)
    return failed_precondition("cuda backend: the plan's tensors are not bound, expected bind_tensors first");
  RETURN_IF_ERROR(supports(p));
  if (layout->fused != nullptr) {
    RETURN_IF_ERROR(check_fused_fits(*layout->fused, p));
    if (p.memory == MemorySpace::kDevice) RETURN_IF_ERROR(check_device_tensors(p));
    return with_stream(ctx, workspace, layout->fused_bytes, [&](cudaStream_t stream) {
      return run_fused_forward(plan, *layout->fused, ctx, pool_, pinned_, stream, stats, probe_rows, probe_out);
    });
  }
  // Every buffer carved below stays inside what the plan charged.
  RETURN_IF_ERROR(check_layout_fits(*layout, p));
  if (plan.forward_workspace.device_bytes != layout->device_bytes())
    return internal_error("cuda backend: the plan charges " + std::to_string(plan.forward_workspace.device_bytes) +
                          " device bytes, its layout sized " + std::to_string(layout->device_bytes()));
  if (p.memory == MemorySpace::kDevice) RETURN_IF_ERROR(check_device_tensors(p));
  return with_handle(ctx, workspace, layout->device_bytes(), [&](cublasHandle_t handle, cudaStream_t stream) {
    return run_cuda_forward(plan, *layout, ctx, pool_, handle, stream, stats);
  });
}

Status CudaBackend::run_backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace,
                                 const ExecContext& ctx, BackwardStats* stats) {
  ASSIGN_OR_RETURN(const CudaLayout* layout, layout_of(plan));
  const AttentionParams& p = plan.params;
  if (layout->fused != nullptr) {
    RETURN_IF_ERROR(check_fused_backward_inputs(plan, g));
    RETURN_IF_ERROR(check_fused_backward_fits(*layout->fused, p, static_cast<int64_t>(dtype_bytes(g.grad_dtype))));
    if (p.memory == MemorySpace::kDevice) RETURN_IF_ERROR(check_device_tensors(p));
    return with_stream(ctx, workspace, layout->fused->backward_bytes, [&](cudaStream_t stream) {
      return run_fused_backward(plan, *layout->fused, g, ctx, pool_, pinned_, stream, stats);
    });
  }
  RETURN_IF_ERROR(check_backward_inputs(plan, g));
  RETURN_IF_ERROR(check_backward_layout_fits(*layout, p, static_cast<int64_t>(dtype_bytes(g.grad_dtype))));
  if (plan.backward_workspace.device_bytes != layout->backward.device_bytes())
    return internal_error("cuda backend: the plan charges " + std::to_string(plan.backward_workspace.device_bytes) +
                          " device bytes for the backward, its layout sized " +
                          std::to_string(layout->backward.device_bytes()));
  return with_handle(ctx, workspace, layout->backward.device_bytes(), [&](cublasHandle_t handle, cudaStream_t stream) {
    return run_cuda_backward(plan, *layout, g, ctx, pool_, handle, stream, stats);
  });
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

}  // namespace plsh::cuda
