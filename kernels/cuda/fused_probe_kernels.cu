// The probe rows on the device: fused_probe.h's CTAs (one per group of rows
// and key split) and the merge of the splits (a thread per row).
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/fused_dispatch.h"
#include "cuda/fused_kernels.h"
#include "cuda/fused_probe.h"

namespace plsh::cuda {

namespace {

template <typename Cfg>
__global__ void __launch_bounds__(kFusedThreads) fused_probe_kernel(FusedArgs a, ProbeArgs pa) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceExec x;
  fused_probe_cta<Cfg>(a, pa, blockIdx.x, blockIdx.y, smem, x);
}

__global__ void fused_probe_merge_kernel(ProbeArgs pa, int64_t groups) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // group * 64 + row
  if (e >= groups * kFusedRows) return;
  const int64_t g = e / kFusedRows, r = e % kFusedRows;
  if (r < pa.groups[g].rows) fused_probe_merge(pa, g, r);
}

}  // namespace

Status launch_fused_probe(DType dtype, int64_t head_dim, const FusedArgs& a, const ProbeArgs& pa, int64_t groups,
                          cudaStream_t stream) {
  if (groups == 0) return Status::Ok();
  const Status none = internal_error("cuda backend: no fused probe for dtype " + std::string(dtype_name(dtype)) +
                                     ", head_dim " + std::to_string(head_dim));
  RETURN_IF_ERROR(dispatch_fused(dtype, head_dim, none, [&](auto cfg) -> Status {
    using Cfg = decltype(cfg);
    const int64_t smem = fused_probe_smem_bytes<Cfg>(a.max_samples);
    RETURN_IF_ERROR(fused_launch_check("fused_probe_kernel", groups, pa.splits, 1, smem));
    CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(fused_probe_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
    fused_probe_kernel<Cfg><<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(pa.splits)), kFusedThreads,
                              static_cast<size_t>(smem), stream>>>(a, pa);
    return cuda_status(cudaGetLastError(), "launch of fused_probe_kernel", __FILE__, __LINE__);
  }));
  const int64_t threads = groups * kFusedRows;
  fused_probe_merge_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(pa, groups);
  return cuda_status(cudaGetLastError(), "launch of fused_probe_merge_kernel", __FILE__, __LINE__);
}

}  // namespace plsh::cuda
