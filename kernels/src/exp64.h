// exp(x) in float64 for x <= 0, written so that a loop of it vectorises
// (the probe's exact softmax weights and its bound's a_ij, two per row and
// key, were a scalar libm call each). Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2 / 2, then the Taylor series of e^r to r^13 (truncation below
// 4e-18 relative) by Horner's rule, and 2^n by the exponent bits. Measured
// against std::exp over [-745, 0] (tests/kernels/test_exp64.cpp): at most
// a few ulp. Below -708 the result is 0 (the true value is subnormal,
// under 3e-308: a weight relative to the row's largest, which is 1);
// -inf gives 0 and NaN gives NaN.
//
// Internal to kernels/src; not a public header.
#pragma once

#include <cstdint>
#include <cstring>

namespace plsh {

__attribute__((always_inline)) inline double exp_nonpositive64(double x) {
  const double xc = x > -708.0 ? x : -708.0;
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const double t = xc * 1.4426950408889634 + shifter;
  const double n = t - shifter;
  const double r = (xc - n * 0.693145751953125) - n * 1.4286068203094173e-6;
  double y = 1.0 / 6227020800.0;  // 1/13!
  y = y * r + 1.0 / 479001600.0;
  y = y * r + 1.0 / 39916800.0;
  y = y * r + 1.0 / 3628800.0;
  y = y * r + 1.0 / 362880.0;
  y = y * r + 1.0 / 40320.0;
  y = y * r + 1.0 / 5040.0;
  y = y * r + 1.0 / 720.0;
  y = y * r + 1.0 / 120.0;
  y = y * r + 1.0 / 24.0;
  y = y * r + 1.0 / 6.0;
  y = y * r + 0.5;
  y = y * r + 1.0;
  y = y * r + 1.0;
  // 2^n from t's low bits (t's bits minus the shifter's are n), not by a
  // double-to-integer conversion, which AVX2 has no vector form of.
  uint64_t t_bits;
  std::memcpy(&t_bits, &t, 8);
  const uint64_t bits = (t_bits - 0x4338000000000000ULL + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, 8);
  const double e = x < -708.0 ? 0.0 : y * scale;
  return x == x ? e : x;
}

}  // namespace plsh
