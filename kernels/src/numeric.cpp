#include "plsh/numeric.h"

#include <algorithm>
#include <cmath>

namespace plsh {

void load_row(const void* data, DType t, int64_t offset, int64_t n, float* dst) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, static_cast<const float*>(data) + offset, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
  }
}

void store_row(void* data, DType t, int64_t offset, int64_t n, const float* src) {
  switch (t) {
    case DType::kF32:
      std::memcpy(static_cast<float*>(data) + offset, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      return;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
  }
}

int64_t first_non_finite(const void* data, DType t, int64_t n) {
  if (t == DType::kF32) {
    const float* f = static_cast<const float*>(data);
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(f[i])) return i;
    return -1;
  }
  // Half and bfloat16: all-ones exponent field means Inf or NaN.
  const uint16_t* h = static_cast<const uint16_t*>(data);
  const uint16_t exp_mask = t == DType::kF16 ? 0x7C00u : 0x7F80u;
  for (int64_t i = 0; i < n; ++i)
    if ((h[i] & exp_mask) == exp_mask) return i;
  return -1;
}

double max_abs(const void* data, DType t, int64_t n) {
  // Non-negative IEEE numbers order as their bit patterns: compare the
  // magnitudes' bits, convert the largest once.
  if (t == DType::kF32) {
    const uint32_t* f = static_cast<const uint32_t*>(data);
    uint32_t most = 0;
    for (int64_t i = 0; i < n; ++i) most = std::max(most, f[i] & 0x7FFFFFFFu);
    float x;
    std::memcpy(&x, &most, 4);
    return x;
  }
  const uint16_t* h = static_cast<const uint16_t*>(data);
  uint16_t most = 0;
  for (int64_t i = 0; i < n; ++i) most = std::max<uint16_t>(most, h[i] & 0x7FFFu);
  return t == DType::kF16 ? half_to_float(most) : bf16_to_float(most);
}

}  // namespace plsh
