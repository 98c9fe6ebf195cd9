// The fused forward on the device: fused_forward.h's body under DeviceExec,
// one CTA per (query tile, head, batch item), heaviest tiles first (a
// causal tile's work grows with its index).
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/fused_dispatch.h"
#include "cuda/fused_forward.h"
#include "cuda/fused_kernels.h"

namespace plsh::cuda {

namespace {

template <typename Cfg>
__global__ void __launch_bounds__(kFusedThreads)
    fused_forward_kernel(FusedArgs a, int64_t tile_begin, int64_t tile_end, int64_t batch_begin) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceExec x;
  const int64_t t = tile_end - 1 - static_cast<int64_t>(blockIdx.x);
  (void)tile_begin;
  fused_forward_cta<Cfg>(a, t, blockIdx.y, batch_begin + blockIdx.z, smem, x);
}

}  // namespace

Status fused_launch_check(const char* kernel, int64_t x, int64_t y, int64_t z, int64_t smem) {
  if (x < 1 || x > 2147483647 || y < 1 || y > 65535 || z < 1 || z > 65535)
    return internal_error(std::string("cuda backend: ") + kernel + " grid (" + std::to_string(x) + ", " +
                          std::to_string(y) + ", " + std::to_string(z) + ") is beyond CUDA's limits");
  if (smem > 227 * 1024)
    return internal_error(std::string("cuda backend: ") + kernel + " needs " + std::to_string(smem) +
                          " bytes of shared memory per CTA, beyond sm_90's 227 KiB");
  return Status::Ok();
}

Status launch_fused_forward(DType dtype, int64_t head_dim, const FusedArgs& a, int64_t tile_begin, int64_t tile_end,
                            int64_t batch_begin, int64_t batch_end, cudaStream_t stream) {
  if (tile_end <= tile_begin || batch_end <= batch_begin) return Status::Ok();
  const Status none = internal_error("cuda backend: no fused forward for dtype " + std::string(dtype_name(dtype)) +
                                     ", head_dim " + std::to_string(head_dim));
  return dispatch_fused(dtype, head_dim, none, [&](auto cfg) -> Status {
    using Cfg = decltype(cfg);
    const int64_t smem = fused_forward_smem_bytes<Cfg>(a.max_samples);
    RETURN_IF_ERROR(
        fused_launch_check("fused_forward_kernel", tile_end - tile_begin, a.heads, batch_end - batch_begin, smem));
    CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(fused_forward_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
    const dim3 grid(static_cast<unsigned>(tile_end - tile_begin), static_cast<unsigned>(a.heads),
                    static_cast<unsigned>(batch_end - batch_begin));
    fused_forward_kernel<Cfg>
        <<<grid, kFusedThreads, static_cast<size_t>(smem), stream>>>(a, tile_begin, tile_end, batch_begin);
    return cuda_status(cudaGetLastError(), "launch of fused_forward_kernel", __FILE__, __LINE__);
  });
}

}  // namespace plsh::cuda
