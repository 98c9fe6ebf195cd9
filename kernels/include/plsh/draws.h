// Reproducible hash draws (SPEC section 5), made on the host in IEEE double.
// Every backend, server and client draws the same (pitch, shift) for the same
// (seed, head, sample).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace plsh {

struct Draw {
  double pitch = 0;  // delta ~ Gamma(2, sigma): block length in positions
  double shift = 0;  // u ~ Uniform[0, delta)
};

uint64_t mix64(uint64_t z);
// U_j in (0, 1) for j = 0, 1, 2.
double draw_uniform(uint64_t seed, int64_t head, int64_t sample, int j);
Draw draw_hash(uint64_t seed, int64_t head, int64_t sample, double sigma);
std::vector<Draw> draw_hashes(uint64_t seed, int64_t head, double sigma, int64_t samples);

// Below this pitch every block is one position: neighbouring quotients
// (p - u) / delta differ by more than 2, so their floors differ. Such pitches
// (rare, from steep slopes) are labelled by the position itself, which gives
// the same blocks as the formula and keeps the label inside int64 where the
// quotient would not fit (|p| up to 2^52 over a pitch near 1e-19).
inline constexpr double kSingletonPitch = 0.5;

// bin(p) = floor((p - u) / delta), evaluated in IEEE double. A head with
// slope 0 (sigma = +inf) puts every position in bin 0. With pitch >= 0.5 and
// |p| <= 2^52 (what make_params allows) the quotient fits in int64.
inline int64_t bin_of(int64_t pos, const Draw& d) {
  if (!std::isfinite(d.pitch)) return 0;
  if (d.pitch < kSingletonPitch) return pos;
  return static_cast<int64_t>(std::floor((static_cast<double>(pos) - d.shift) / d.pitch));
}

// First position p >= pos with bin_of(p) > bin_of(pos): the end (exclusive)
// of the block holding pos, exact with respect to bin_of. INT64_MAX for an
// infinite pitch.
int64_t block_end(int64_t pos, const Draw& d);
// First position of the block holding pos.
int64_t block_begin(int64_t pos, const Draw& d);

}  // namespace plsh
