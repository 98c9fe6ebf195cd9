// exp(x) for x <= 0 (and -inf), written so that it vectorises: Cephes'
// expf polynomial (relative error ~2e-7), round-to-nearest by the
// 1.5 * 2^23 trick. Below -88 the exponent field reaches 0 and the result
// is 0, as exp(-inf) must be. The forward's softmax (microkernels.cpp, which
// also has it on eight AVX2 lanes) and the backward's probabilities share it.
// Always inlined: GCC does not inline a plain inline function into
// target_clones callers (probs_from_lse), and a call per element stops the
// loop from vectorising (the backward ran 27% slower so).
//
// Internal to kernels/cpu; not a public header.
#pragma once

#include <cstdint>
#include <cstring>

namespace plsh::cpu {

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float xc = x > -88.0f ? x : -88.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

}  // namespace plsh::cpu
