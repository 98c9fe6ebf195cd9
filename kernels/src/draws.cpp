#include "plsh/draws.h"

#include <cmath>
#include <limits>

namespace plsh {

uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

double draw_uniform(uint64_t seed, int64_t head, int64_t sample, int j) {
  const uint64_t index = 1 + 4 * ((static_cast<uint64_t>(head) << 24) + static_cast<uint64_t>(sample)) +
                         static_cast<uint64_t>(j);
  const uint64_t word = mix64(seed + 0x9E3779B97F4A7C15ULL * index);
  return (static_cast<double>(word >> 11) + 0.5) * 0x1.0p-53;
}

Draw draw_hash(uint64_t seed, int64_t head, int64_t sample, double sigma) {
  const double u0 = draw_uniform(seed, head, sample, 0);
  const double u1 = draw_uniform(seed, head, sample, 1);
  const double u2 = draw_uniform(seed, head, sample, 2);
  Draw d;
  d.pitch = -sigma * (std::log(u0) + std::log(u1));
  d.shift = u2 * d.pitch;
  return d;
}

std::vector<Draw> draw_hashes(uint64_t seed, int64_t head, double sigma, int64_t samples) {
  std::vector<Draw> draws(static_cast<size_t>(samples));
  for (int64_t k = 0; k < samples; ++k) draws[static_cast<size_t>(k)] = draw_hash(seed, head, k, sigma);
  return draws;
}

int64_t block_end(int64_t pos, const Draw& d) {
  if (!std::isfinite(d.pitch)) return std::numeric_limits<int64_t>::max();
  if (d.pitch < kSingletonPitch) return pos + 1;
  const int64_t b = bin_of(pos, d);
  // Estimate from the formula, then step so the answer agrees with bin_of
  // exactly whatever the rounding of (p - u) / delta.
  int64_t e = static_cast<int64_t>(std::ceil(static_cast<double>(b + 1) * d.pitch + d.shift));
  if (e <= pos) e = pos + 1;
  while (e - 1 > pos && bin_of(e - 1, d) > b) --e;
  while (bin_of(e, d) <= b) ++e;
  return e;
}

int64_t block_begin(int64_t pos, const Draw& d) {
  if (!std::isfinite(d.pitch)) return std::numeric_limits<int64_t>::min();
  if (d.pitch < kSingletonPitch) return pos;
  const int64_t b = bin_of(pos, d);
  int64_t s = static_cast<int64_t>(std::floor(static_cast<double>(b) * d.pitch + d.shift));
  if (s > pos) s = pos;
  while (bin_of(s, d) < b) ++s;
  while (s - 1 >= INT64_MIN / 2 && bin_of(s - 1, d) == b) --s;
  return s;
}

}  // namespace plsh
