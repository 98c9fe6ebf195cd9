// Every CUDA and cuBLAS call becomes a plsh::Status naming the call and its
// file:line; the server never aborts on a device error. Two kinds of CUDA
// error, told apart here:
//   recoverable  an allocation that did not fit, a bad argument: the call
//                failed, the context is fine. The runtime also keeps it as
//                the thread's "last error", which the next launch check
//                (cudaGetLastError) would report as its own: so turning it
//                into a Status clears it.
//   sticky       a fault on the device (illegal address, misaligned access,
//                a kernel that failed): the context is lost for the whole
//                process, and every later call returns the same error.
//                Nothing clears it; DeviceHealth remembers it so that the
//                backend refuses work (UNAVAILABLE) and "auto" picks the CPU.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <string>

#include "plsh/status.h"

namespace plsh::cuda {

// The errors that driver_types.h (CUDA 13.0) documents as "To continue using
// CUDA, the process must be terminated and relaunched", the uncorrectable
// ECC and NVLink errors, after which the device needs a reset, and
// cudaErrorUnknown: the runtime's answer once a device has fallen off the
// bus or its driver has reset it (Xid 79), which no later call recovers
// from either; treating it as recoverable left "auto" sending requests to a
// dead device (issue 19's review).
constexpr bool is_sticky_error(cudaError_t e) {
  switch (e) {
    case cudaErrorECCUncorrectable:     // 214
    case cudaErrorNvlinkUncorrectable:  // 220
    case cudaErrorContained:            // 226
    case cudaErrorIllegalAddress:       // 700
    case cudaErrorLaunchTimeout:        // 702
    case cudaErrorAssert:               // 710
    case cudaErrorHardwareStackError:   // 714
    case cudaErrorIllegalInstruction:   // 715
    case cudaErrorMisalignedAddress:    // 716
    case cudaErrorInvalidAddressSpace:  // 717
    case cudaErrorInvalidPc:            // 718
    case cudaErrorLaunchFailure:        // 719
    case cudaErrorTensorMemoryLeak:     // 721
    case cudaErrorMpsClientTerminated:  // 810
    case cudaErrorExternalDevice:       // 911
    case cudaErrorUnknown:              // 999
      return true;
    default:
      return false;
  }
}

// RESOURCE_EXHAUSTED for an allocation that did not fit; UNAVAILABLE for a
// sticky error (the device is lost to this process: a retry, elsewhere or
// here on the CPU, can succeed); INTERNAL otherwise.
constexpr StatusCode cuda_error_code(cudaError_t e) {
  if (e == cudaErrorMemoryAllocation) return StatusCode::kResourceExhausted;
  if (is_sticky_error(e)) return StatusCode::kUnavailable;
  return StatusCode::kInternal;
}

inline std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

inline Status cuda_status(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return Status::Ok();
  // This error is now reported: clear it from the thread's last-error slot
  // (a no-op for a sticky one, which stays whatever we do).
  (void)cudaGetLastError();
  return Status(cuda_error_code(e), std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                        cuda_error_text(e) +
                                        (is_sticky_error(e) ? "; the CUDA context of this process is lost" : ""));
}

inline Status cublas_status(cublasStatus_t e, const char* call, const char* file, int line) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  // cuBLAS's own failures leave nothing in the runtime's last-error slot
  // worth keeping: a recoverable one there would fail the next launch check.
  const cudaError_t last = cudaGetLastError();
  const StatusCode code = e == CUBLAS_STATUS_ALLOC_FAILED ? StatusCode::kResourceExhausted
                          : is_sticky_error(last)         ? StatusCode::kUnavailable
                                                          : StatusCode::kInternal;
  return Status(code, std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                          cublasGetStatusName(e) + " (" + cublasGetStatusString(e) + ")" +
                          (last != cudaSuccess ? "; CUDA: " + cuda_error_text(last) : std::string()));
}

// Whether the device can still take work in this process: the first sticky
// error seen, kept for good. Thread-safe.
class DeviceHealth {
 public:
  // Remembers e when it is sticky (the first one wins); true when it was.
  bool record(cudaError_t e, const std::string& where) {
    if (!is_sticky_error(e)) return false;
    record_lost(cuda_error_text(e) + " " + where);
    return true;
  }
  // The same for an error already turned into a Status (UNAVAILABLE).
  void record_lost(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!lost_.load()) {
      reason_ = reason;
      lost_.store(true);
    }
  }
  bool lost() const { return lost_.load(); }
  // OK, or UNAVAILABLE naming the sticky error.
  Status usable() const {
    if (!lost_.load()) return Status::Ok();
    std::lock_guard<std::mutex> lock(mutex_);
    return unavailable("cuda backend unusable since " + reason_ +
                       ": the CUDA context of this process is lost; restart the process to use the GPU again");
  }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> lost_{false};
  std::string reason_;
};

// Whether the CUDA runtime still answers: false during process exit once it
// has shut down (cudaErrorCudartUnloading), when destructors must not call
// into it or into cuBLAS.
inline bool cuda_runtime_alive() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess;
}

}  // namespace plsh::cuda

#define CUDA_RETURN_IF_ERROR(expr) RETURN_IF_ERROR(::plsh::cuda::cuda_status((expr), #expr, __FILE__, __LINE__))
#define CUBLAS_RETURN_IF_ERROR(expr) RETURN_IF_ERROR(::plsh::cuda::cublas_status((expr), #expr, __FILE__, __LINE__))
// After every launch: a bad configuration shows here, a fault at the next sync.
#define LAUNCH_RETURN_IF_ERROR(kernel) \
  RETURN_IF_ERROR(::plsh::cuda::cuda_status(cudaGetLastError(), "launch of " kernel, __FILE__, __LINE__))
