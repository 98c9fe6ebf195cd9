// Device-side helpers the CUDA backend's kernel files share: the one switch
// that turns a runtime DType into a template argument (STYLE: dispatch in one
// place), float conversions of the three dtypes, and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "plsh/params.h"

namespace plsh::cuda {

template <typename F>
auto dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF16: return f(__half{});
    case DType::kBF16: return f(__nv_bfloat16{});
    case DType::kF32: break;
  }
  return f(float{});
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace plsh::cuda
