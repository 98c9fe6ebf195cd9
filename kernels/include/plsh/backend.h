// One backend interface, many backends (ggml's habit). kernels/cpu and
// kernels/cuda implement it; the registry lists CUDA first when it is built
// and a device is present, the CPU last as the fallback. The server asks the
// registry and never includes a CUDA header.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh {

// How one forward call runs: where, and when to give up.
struct ExecContext {
  void* stream = nullptr;                        // cudaStream_t on CUDA backends; unused on the CPU
  const std::atomic<bool>* cancel = nullptr;     // set by the caller to stop the work early
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  int threads = 0;                               // CPU worker threads; 0: all cores
  std::function<void(double)> progress;          // fraction done in [0, 1], from any thread

  // CANCELLED or DEADLINE_EXCEEDED when the work should stop, else OK.
  // Backends call it between tiles.
  Status check_stop() const;
};

// Memory of a backend's device, for the server's gauges.
struct DeviceMemory {
  int64_t used_bytes = 0;   // in use on the device, by any process
  int64_t total_bytes = 0;  // the device's capacity
};

// What a forward pass did, for the result's metadata.
struct ForwardStats {
  double flops = 0;                               // multiply-adds x2 actually done (QK^T and PV)
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;  // the algorithm used for lsh
  int64_t workspace_bytes = 0;                    // peak extra memory used
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;     // "cpu", "cuda"
  virtual std::string device() const = 0;   // "x86_64, 2 threads" / "NVIDIA H200 (sm_90, 139 GiB)"
  // OK, or why these params cannot run here (FAILED_PRECONDITION / UNIMPLEMENTED).
  virtual Status supports(const AttentionParams& p) const = 0;
  // Extra memory forward() will need beyond the tensors, so callers can
  // refuse a request before touching any memory (CUTLASS's can_run ->
  // workspace -> run).
  virtual int64_t workspace_bytes(const AttentionParams& p) const = 0;
  // Writes p.out (and p.lse when set).
  virtual Status forward(const AttentionParams& p, const ExecContext& ctx, ForwardStats* stats) = 0;
  // The device's memory now; nullopt for backends without a device (CPU).
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }
};

// The backends this process can use, best first: CUDA (when the CUDA backend
// library is found and a device is present), then the CPU. `notes` collects
// one line per backend that was looked for and not used, and why.
class BackendRegistry {
 public:
  static BackendRegistry& global();

  // Looks for backends once; later calls return the same list (a copy, so
  // that add() on another thread cannot invalidate a caller's iteration).
  std::vector<Backend*> backends();
  const std::vector<std::string>& notes();

  // "auto": the first backend that supports p; "cpu" / "cuda": that one or a
  // FAILED_PRECONDITION saying why it is not available.
  StatusOr<Backend*> select(const std::string& name, const AttentionParams& p);
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

// Entry point exported by the CUDA backend shared library
// (libplsh_cuda.so), which the registry loads with dlopen so that processes
// that never use CUDA never map cuBLAS (see README, "Why dlopen").
extern "C" {
typedef Backend* (*CreateBackendFn)(std::string* why_not);
}
inline constexpr const char* kCudaBackendSymbol = "plsh_create_cuda_backend";

}  // namespace plsh
