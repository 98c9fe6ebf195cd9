// Host-side conversions between the wire dtypes and float/double.
// IEEE binary16 and bfloat16 bit patterns, round-to-nearest-even on the way
// down, as the GPU does.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>  // memcpy, which includers (numeric.cpp) use

#include "plsh/params.h"

namespace plsh {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FFu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    // |f| * 2^24 is exact in float; nearbyint rounds to nearest even. 1024
    // lands on the smallest normal's bit pattern, as it should.
    const float a = std::bit_cast<float>(abs);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rest = abs & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7FFFu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

// Element i of a tensor of dtype t, as double.
inline double load_element(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  }
  return 0;
}

inline void store_element(void* data, DType t, int64_t i, float value) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(data)[i] = value;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(data)[i] = float_to_half(value);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
      break;
  }
}

// Converts n elements starting at element `offset` to float.
void load_row(const void* data, DType t, int64_t offset, int64_t n, float* dst);
// The same n elements as float: read in place for float32, else converted
// into buf (n floats) and buf returned.
inline const float* row_as_f32(const void* data, DType t, int64_t offset, int64_t n, float* buf) {
  if (t == DType::kF32) return static_cast<const float*>(data) + offset;
  load_row(data, t, offset, n, buf);
  return buf;
}
void store_row(void* data, DType t, int64_t offset, int64_t n, const float* src);

// Index of the first NaN or Inf among n elements, or -1.
int64_t first_non_finite(const void* data, DType t, int64_t n);
// max |x| over n finite elements (0 for n = 0).
double max_abs(const void* data, DType t, int64_t n);

}  // namespace plsh
