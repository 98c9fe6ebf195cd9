// What the CUDA backend asks of the machine before it exists (is there a
// device), the device-side bins the tests compare with bin_of, and the
// registry's entry point: the versioned plugin struct (plsh/backend.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"

namespace plsh::cuda {

Status no_device_reason(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why =
        std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    return failed_precondition(*why);
  }
  if (count == 0) {
    *why = "no CUDA device: cudaGetDeviceCount found 0 devices";
    return failed_precondition(*why);
  }
  return Status::Ok();
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

const plsh::PlshBackendPlugin kCudaPlugin = {plsh::kBackendApiVersion, plsh::backend_abi_fingerprint(), "cuda",
                                             &create_cuda_backend};

}  // namespace

extern "C" __attribute__((visibility("default"))) const plsh::PlshBackendPlugin* plsh_backend_plugin() {
  return &kCudaPlugin;
}
