// How the CUDA backend's launchers start a kernel: the grid checked against
// CUDA's limits first, the launch's own error after.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/device_types.cuh"
#include "plsh/status.h"

namespace plsh::cuda {

// grid.x <= 2^31 - 1, grid.y and grid.z <= 65535 (CUDA's limits on every
// GPU this builds for): an INTERNAL error rather than a failed launch.
inline Status check_grid(const char* kernel, int64_t x, int64_t y = 1) {
  if (x >= 1 && x <= 2147483647 && y >= 1 && y <= 65535) return Status::Ok();
  return internal_error(std::string("cuda backend: ") + kernel + " grid (" + std::to_string(x) + ", " +
                        std::to_string(y) + ") is beyond CUDA's limits (2^31 - 1, 65535)");
}

// kernel<<<(grid_x, grid_y), kThreads, 0, stream>>>(args...) after
// check_grid; returns the launch's error (configuration errors: faults
// surface at the next synchronisation).
template <typename... Params, typename... Args>
Status launch(const char* name, int64_t grid_x, int64_t grid_y, cudaStream_t stream, void (*kernel)(Params...),
              const Args&... args) {
  RETURN_IF_ERROR(check_grid(name, grid_x, grid_y));
  kernel<<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kThreads, 0, stream>>>(args...);
  return cuda_status(cudaGetLastError(), ("launch of " + std::string(name)).c_str(), __FILE__, __LINE__);
}

}  // namespace plsh::cuda
