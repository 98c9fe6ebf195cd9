// The one switch that turns the runtime (dtype, head_dim) of a request into
// the fused kernels' template configuration (STYLE: dispatch in one place).
// The device launchers (fused_kernels.cu) and the host emulation
// (fused_host.h) both go through it, so that they instantiate the same
// configurations; fused_supported (fused_plan.h) refuses every other shape
// before anything is planned, and those run on the cuBLAS pipeline.
#pragma once

#include <cstdint>

#include "cuda/fused_exec.h"
#include "cuda/fused_math.h"
#include "plsh/params.h"

namespace plsh::cuda {

// Head dims the fused kernels are built for.
inline constexpr int64_t kFusedHeadDims[] = {64, 128};

inline bool fused_head_dim(int64_t d) {
  for (int64_t x : kFusedHeadDims)
    if (x == d) return true;
  return false;
}

// f(FusedCfg<T, D>{}) for the request's dtype and head_dim, or `otherwise`
// (f not called) for a shape with no configuration.
template <typename R, typename F>
R dispatch_fused(DType dtype, int64_t head_dim, R otherwise, F&& f) {
  switch (dtype) {
    case DType::kBF16:
      if (head_dim == 64) return f(FusedCfg<Bf16, 64>{});
      if (head_dim == 128) return f(FusedCfg<Bf16, 128>{});
      break;
    case DType::kF16:
      if (head_dim == 64) return f(FusedCfg<F16, 64>{});
      if (head_dim == 128) return f(FusedCfg<F16, 128>{});
      break;
    case DType::kF32:
      if (head_dim == 64) return f(FusedCfg<F32, 64>{});
      if (head_dim == 128) return f(FusedCfg<F32, 128>{});
      break;
  }
  return otherwise;
}

}  // namespace plsh::cuda
