// One backend interface, many backends (ggml's habit). kernels/cpu and
// kernels/cuda implement it; the registry lists CUDA first when it is built
// and a device is present, the CPU last as the fallback. The server asks the
// registry and never includes a CUDA header.
//
// A request goes through a backend in three steps (CUTLASS's can_implement
// -> get_workspace_size -> initialize(args, workspace) -> run):
//   supports(params)        can this backend run it at all?
//   plan(params, limits)    once per request, before the data: draws, the
//                           algorithm, the workspace of each step by memory
//                           space, the backend's layout (plsh/plan.h)
//   forward(plan, workspace, ctx)
//                           the computation, reading only the plan, working
//                           only in the caller's workspace (plsh/workspace.h)
//   backward(plan, grads, workspace, ctx)
//                           SPEC section 8: dq, dk, dv of the forward this
//                           plan computes (same draws, same window), for a
//                           plan made with PlanLimits::backward
// run_attention (plsh/attention.h) adds the estimates, which read the same
// plan and work in the same workspace after the forward. A server plans at
// the header, reserves plan.own_host_bytes and plan.workspace() against its
// host and device budgets, then binds the received tensors and runs in the
// workspace it reserved. run_backward is the backward's front door.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plsh/backward.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "plsh/status.h"
#include "plsh/workspace.h"

namespace plsh {

// How one forward or backward call runs: where, and when to give up. How many threads
// is the plan's (PlanLimits::threads), since the workspace was sized for it.
struct ExecContext {
  void* stream = nullptr;                     // cudaStream_t on CUDA backends; unused on the CPU
  const std::atomic<bool>* cancel = nullptr;  // set by the caller to stop the work early
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<void(double)> progress;  // fraction done in [0, 1], from any thread

  // CANCELLED or DEADLINE_EXCEEDED when the work should stop, else OK.
  // Backends call it between tiles.
  Status check_stop() const;
  // The same as a flag, for loops that only need to know whether to go on.
  bool should_stop() const { return !check_stop().ok(); }
};

// Memory of a backend's device, for the server's gauges.
struct DeviceMemory {
  int64_t used_bytes = 0;    // in use on the device, by any process
  int64_t total_bytes = 0;   // the device's capacity
  int64_t budget_bytes = 0;  // the most the backend itself will hold at once
};

// What a forward pass did, for the result's metadata.
struct ForwardStats {
  double flops = 0;                                  // multiply-adds x2 actually done (QK^T and PV)
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;  // the algorithm used for lsh
  Workspace workspace;                               // of the caller's workspace, the bytes actually carved
};

// What a backward pass did.
struct BackwardStats {
  double flops = 0;     // multiply-adds x2 actually done (the five GEMMs: QK^T, dO V^T, P^T dO, dS^T Q, dS K)
  Workspace workspace;  // of the caller's workspace, the bytes actually carved
};

// The probe rows a backend computed with its forward (forward_with_probe),
// per head, in the order asked: o* (float32 accumulation, D per row), the
// per-row bound's sum_j a_ij |L*_ij - M~_ij| / sum_j a_ij M~_ij, and
// max_j ||v_j||^2 over the row's allowed keys.
struct ProbeRowsOut {
  std::vector<std::vector<float>> o_star;       // [H][rows * D]
  std::vector<std::vector<float>> bound_ratio;  // [H][rows]
  std::vector<std::vector<float>> max_v2;       // [H][rows]
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;    // one of kBackendNames: "cpu", "cuda"
  virtual std::string device() const = 0;  // "x86_64, 2 threads" / "NVIDIA H200 (sm_90, 139 GiB)"
  // OK, or why these params cannot run here (FAILED_PRECONDITION / UNIMPLEMENTED).
  virtual Status supports(const AttentionParams& p) const = 0;
  // The request's plan (plsh/plan.h): supports() first, then the draws, the
  // algorithm and the workspace by memory space. Needs no tensor: p may be
  // resolve_params()'s, with the tensors bound later.
  virtual StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const = 0;
  // Host bytes plan(p) allocates at most on the way (its draws and what the
  // backend derives from them), before the plan's own figures exist: what a
  // server holds against its budget while it plans. At least the plan's
  // own_host_bytes. This default: the draws, and the permutation of pitch
  // strata a sampler holds while it draws one head (plsh/draws.h).
  virtual int64_t planning_host_bytes(const AttentionParams& p) const {
    return draw_bytes(p) + (p.mode == Mode::kLsh ? p.samples * static_cast<int64_t>(sizeof(int64_t)) : 0);
  }
  // Writes plan.params.out (and .lse when set). The plan must be this
  // backend's and its tensors bound; `workspace` must hold at least
  // plan.forward_workspace (else INVALID_ARGUMENT, nothing written).
  virtual Status forward(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                         ForwardStats* stats) = 0;
  // OK, or why this backend has no backward pass for these params
  // (UNIMPLEMENTED / FAILED_PRECONDITION). plan() with PlanLimits::backward
  // asks it first. Not pure, so that backends without a backward (and
  // test doubles) need not say so twice.
  virtual Status supports_backward(const AttentionParams& p) const {
    (void)p;
    return unimplemented("the " + name() + " backend has no backward pass");
  }
  // Writes g.dq, g.dk, g.dv: the gradient of the forward this plan computes
  // (its draws, its window), from the forward's out and lse and the upstream
  // dout. The plan must be this backend's, made with PlanLimits::backward,
  // its q, k, v bound; g from make_backward_params for the plan's params;
  // `workspace` at least plan.backward_workspace (else INVALID_ARGUMENT).
  // A stopped backward (cancel, deadline) leaves dq, dk, dv partly written.
  virtual Status backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace,
                          const ExecContext& ctx, BackwardStats* stats) {
    (void)g, (void)workspace, (void)ctx, (void)stats;
    return supports_backward(plan.params);
  }
  // Device memory for a plan's device workspace (Plan::workspace()
  // .device_bytes), owned by the caller: a server's admission allocates it
  // with the request, before the ack, and hands it to forward and backward
  // as WorkspaceRef::device. Freed when the last copy goes. Null for 0
  // bytes; backends without a device refuse more (FAILED_PRECONDITION).
  // The CUDA backend's is a hold on its stream-ordered pool, not memory to
  // write: its steps take their buffers from the pool within the hold.
  virtual StatusOr<std::shared_ptr<void>> allocate_device(int64_t bytes) const {
    if (bytes <= 0) return std::shared_ptr<void>();
    return failed_precondition("the " + name() + " backend has no device memory to allocate " + std::to_string(bytes) +
                               " bytes in");
  }
  // The device's memory now; nullopt for backends without a device (CPU).
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }

  // ---- Estimates where the work is (issue 19; plsh/device_estimates.h) ----
  // A backend that can compute the section-6 probe's exact rows in the same
  // call as its forward (while its copies of k and v are on its device)
  // says so per plan; run_attention then computes the mask errors on the
  // host while the forward runs, and the probe from what this returns.
  // rows[h]: head h's sample, sorted, as b * Nq + i.
  virtual bool probes_with_forward(const Plan& plan) const {
    (void)plan;
    return false;
  }
  // `workspace` as forward's.
  virtual Status forward_with_probe(const Plan& plan, const std::vector<std::vector<int64_t>>& rows,
                                    const WorkspaceRef& workspace, const ExecContext& ctx, ForwardStats* stats,
                                    ProbeRowsOut* out) {
    (void)plan, (void)rows, (void)workspace, (void)ctx, (void)stats, (void)out;
    return unimplemented("the " + name() + " backend computes no probe rows with its forward");
  }

 protected:
  // A backward's inputs as every backend needs them: the plan's tensors
  // bound (FAILED_PRECONDITION), supports_backward, and g's tensors all
  // present in host memory (INVALID_ARGUMENT).
  Status check_backward_inputs(const Plan& plan, const BackwardParams& g) const;
};

// The names a request may give ("auto": the registry's choice), the one list
// that the server, the CLI and the clients check against.
inline constexpr const char* kBackendNames[] = {"auto", "cpu", "cuda"};
// OK for a name in kBackendNames, else INVALID_ARGUMENT naming `field`.
Status check_backend_name(const std::string& name, const char* field = "backend");

// The backends this process can use, best first: CUDA (when the CUDA backend
// library is found, speaks this API version and a device is present), then
// the CPU. `notes` collects one line per backend that was looked for and not
// used, and why.
class BackendRegistry {
 public:
  static BackendRegistry& global();

  // Looks for backends once; later calls return the same list (a copy, so
  // that add() on another thread cannot invalidate a caller's iteration).
  std::vector<Backend*> backends();
  std::vector<std::string> notes();

  // "auto": the first backend that supports p (and, with `backward`, its
  // backward pass); "cpu" / "cuda": that one or a FAILED_PRECONDITION saying
  // why it is not available.
  StatusOr<Backend*> select(const std::string& name, const AttentionParams& p, bool backward = false);
  // The same, without params: the backend a name refers to.
  StatusOr<Backend*> find(const std::string& name);

  // For tests and embedders: add a backend ahead of the discovered ones.
  void add(std::unique_ptr<Backend> backend);

 private:
  void discover();
  bool discovered_ = false;
  std::vector<std::unique_ptr<Backend>> owned_;
  std::vector<Backend*> list_;
  std::vector<std::string> notes_;
};

// The dlopen boundary of a backend library (libplsh_cuda.so). It is a C++
// boundary, not a C ABI, and says so: the library hands back a Backend (a
// vtable), and Plan, AttentionParams, BackwardParams and ExecContext cross it
// by reference with std::vector, std::string and std::function inside, so the
// library and the process must come from one tree, one compiler and one C++
// standard library. The entry point is extern "C" only so that dlsym finds it
// by a plain name. Two checks, read before anything else of the library is
// called (a mismatch is a note, and the CPU serves), versioned like ggml's
// GGML_BACKEND_API_VERSION:
//   api_version      kBackendApiVersion, bumped by hand whenever Backend or
//                    the types above change meaning or layout;
//   abi_fingerprint  backend_abi_fingerprint(), computed from the sizes of
//                    the types that cross, the compiler's C++ ABI version and
//                    libstdc++'s string ABI: a layout change nobody bumped
//                    for, or a library from another toolchain, is caught too.
// 3: Backend::supports_backward and ::backward, the
// plan's backward workspace; 4: AttentionParams' sampling and target; 5:
// the caller's workspace (WorkspaceRef) in forward and backward,
// Backend::planning_host_bytes, Plan::own_host_bytes; 6: Backend::
// allocate_device (the caller owns the device workspace too); 7: the
// plugin struct's abi_fingerprint; 8: Backend::probes_with_forward and
// ::forward_with_probe (issue 19).
inline constexpr uint32_t kBackendApiVersion = 8;

// What the library and the process must agree on beyond the version (above).
constexpr uint64_t backend_abi_fingerprint() {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the values
  const uint64_t values[] = {sizeof(Plan),
                             sizeof(AttentionParams),
                             sizeof(BackwardParams),
                             sizeof(ExecContext),
                             sizeof(WorkspaceRef),
                             sizeof(ForwardStats),
                             sizeof(BackwardStats),
                             sizeof(DeviceMemory),
                             sizeof(std::string),
                             sizeof(std::function<void(double)>),
#ifdef __GXX_ABI_VERSION
                             __GXX_ABI_VERSION,
#endif
#ifdef _GLIBCXX_USE_CXX11_ABI
                             _GLIBCXX_USE_CXX11_ABI + 1,
#endif
                             0};
  for (uint64_t v : values) h = (h ^ v) * 1099511628211ull;
  return h;
}

extern "C" {
struct PlshBackendPlugin {
  uint32_t api_version;      // kBackendApiVersion of the library's build; read first, always here
  uint64_t abi_fingerprint;  // backend_abi_fingerprint() of the library's build
  const char* name;          // "cuda"
  // A new backend (owned by the caller), or null with the reason written to
  // why_not (NUL-terminated, at most why_not_size bytes).
  plsh::Backend* (*create)(char* why_not, size_t why_not_size);
};
typedef const PlshBackendPlugin* (*BackendPluginFn)();
}
inline constexpr const char* kBackendPluginSymbol = "plsh_backend_plugin";

}  // namespace plsh
