// The fused backward on the device: fused_steps.h's steps, each a launch on
// the request's stream: spans (a thread per (head, query tile)), row terms
// (a warp per row), the statistics pass (the forward's kernel), the
// backward's CTAs (fused_backward.h under DeviceExec, one per (key tile, kv
// head, batch item)) and dq in its dtype.
#include <algorithm>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/fused_backward.h"
#include "cuda/fused_dispatch.h"
#include "cuda/fused_kernels.h"

namespace plsh::cuda {

namespace {

__global__ void fused_spans_kernel(FusedArgs a, int32_t* spans) {
  const int64_t tiles = fused_tiles(a.q_len, kFusedRows);
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < a.heads * tiles) fused_span(a, e / tiles, e % tiles, spans);
}

__global__ void fused_row_terms_kernel(FusedArgs a, FusedRowTermsArgs t) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // g * Nq + i
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= a.batch * a.heads * a.q_len) return;  // whole warps: row is warp-uniform
  const int64_t g = row / a.q_len, i = row % a.q_len;
  float dot = fused_row_dot(a, t, g, i, lane, 32);
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) {
    t.row_d[row] = dot;
    t.row_lse2[row] = fused_row_lse2(a, t, g, i);
  }
}

template <typename Cfg>
__global__ void __launch_bounds__(kFusedThreads) fused_backward_kernel(FusedArgs a, int64_t kt0) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceExec x;
  fused_backward_cta<Cfg>(a, kt0 + blockIdx.x, blockIdx.y, blockIdx.z, smem, x);
}

__global__ void fused_dq_out_kernel(const float* acc, void* dq, int32_t dtype, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_out(dq, dtype, e, acc[e]);
}

constexpr int kBlock = 256;

int64_t blocks_for(int64_t threads) { return std::max<int64_t>(1, (threads + kBlock - 1) / kBlock); }

// FusedBackwardSteps' hooks on the device; each returns whether its launch
// went in, the first failure kept in `status`.
struct DeviceBackwardSteps {
  DType dtype;
  int64_t head_dim;
  const FusedArgs& a;
  const FusedRowTermsArgs& terms;
  void* dq;
  const std::function<Status(int64_t, int64_t)>& pace;
  cudaStream_t stream;
  Status* status;

  bool ok(Status s) const {
    if (!s.ok() && status->ok()) (void)(*status = std::move(s));
    return status->ok();
  }
  bool launched(const char* what) const {
    return ok(cuda_status(cudaGetLastError(), (std::string("launch of ") + what).c_str(), __FILE__, __LINE__));
  }
  bool spans(int32_t* spans) const {
    const int64_t n = a.heads * fused_tiles(a.q_len, kFusedRows);
    if (!ok(fused_launch_check("fused_spans_kernel", blocks_for(n), 1, 1, 0))) return false;
    fused_spans_kernel<<<static_cast<unsigned>(blocks_for(n)), kBlock, 0, stream>>>(a, spans);
    return launched("fused_spans_kernel");
  }
  bool row_terms() const {
    const int64_t n = a.batch * a.heads * a.q_len * 32;
    if (!ok(fused_launch_check("fused_row_terms_kernel", blocks_for(n), 1, 1, 0))) return false;
    fused_row_terms_kernel<<<static_cast<unsigned>(blocks_for(n)), kBlock, 0, stream>>>(a, terms);
    return launched("fused_row_terms_kernel");
  }
  bool stats(const FusedArgs& s, const TileSpan& tiles) const {
    return ok(launch_fused_forward(dtype, head_dim, s, tiles.begin, tiles.end, 0, a.batch, stream));
  }
  bool zero_dq() const {
    const size_t bytes = static_cast<size_t>(a.batch * a.q_len * a.heads * head_dim) * sizeof(float);
    return ok(cuda_status(cudaMemsetAsync(a.dq_acc, 0, bytes, stream), "cudaMemsetAsync(dq_acc)", __FILE__, __LINE__));
  }
  bool between(int64_t chunk, int64_t chunks) const { return ok(pace(chunk, chunks)); }
  bool main(int64_t kt0, int64_t kt1) const {
    return dispatch_fused(dtype, head_dim, false, [&](auto cfg) {
      using Cfg = decltype(cfg);
      const int64_t smem = fused_backward_smem_bytes<Cfg>(a.max_samples);
      const int64_t key_tiles = kt1 - kt0;
      if (!ok(fused_launch_check("fused_backward_kernel", key_tiles, a.kv_heads, a.batch, smem))) return false;
      if (!ok(cuda_status(cudaFuncSetAttribute(fused_backward_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)),
                          "cudaFuncSetAttribute(fused_backward_kernel)", __FILE__, __LINE__)))
        return false;
      const dim3 grid(static_cast<unsigned>(key_tiles), static_cast<unsigned>(a.kv_heads),
                      static_cast<unsigned>(a.batch));
      fused_backward_kernel<Cfg><<<grid, kFusedThreads, static_cast<size_t>(smem), stream>>>(a, kt0);
      return launched("fused_backward_kernel");
    });
  }
  bool dq_out() const {
    const int64_t n = a.batch * a.q_len * a.heads * head_dim;
    const int64_t blocks = std::min<int64_t>(blocks_for(n), 65535);
    fused_dq_out_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(a.dq_acc, dq, a.grad_dtype, n);
    return launched("fused_dq_out_kernel");
  }
};

}  // namespace

Status launch_fused_backward(DType dtype, int64_t head_dim, const FusedArgs& a, const FusedRowTermsArgs& terms,
                             int32_t* spans, void* dq, int64_t chunks,
                             const std::function<Status(int64_t, int64_t)>& between, cudaStream_t stream) {
  Status status;
  const DeviceBackwardSteps steps{dtype, head_dim, a, terms, dq, between, stream, &status};
  if (!fused_backward_steps(steps, a, spans, chunks) && status.ok())
    return internal_error("cuda backend: no fused backward for dtype " + std::string(dtype_name(dtype)) +
                          ", head_dim " + std::to_string(head_dim));
  return status;
}

}  // namespace plsh::cuda
