// Reproducible hash draws (SPEC section 5), made on the host in IEEE double.
// Every backend, server and client draws the same (pitch, shift) for the same
// (seed, head, sample).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "plsh/text.h"

namespace plsh {

struct Draw {
  double pitch = 0;  // delta ~ Gamma(2, sigma): block length in positions
  double shift = 0;  // u ~ Uniform[0, delta)
};

// How the s hashes of a head depend on each other (SPEC section 5). Every
// sampler keeps each hash a valid draw on its own (pitch marginally
// Gamma(2, sigma), shift uniform on [0, pitch) given the pitch), so
// E[M~] = L* exactly whichever is used; they differ in the variance of M~.
//   kIid:        SPEC section 5's rule, hashes independent.
//   kStratified: the s pitches take one Gamma(2) quantile from each of s
//                equal strata (in a seeded random order); shifts as iid.
//   kAsh:        "averaged shifted histograms": m = ceil(s / r) stratified
//                pitches, each used by r hashes (ash_shifts_per_pitch) whose
//                shifts are a random offset plus l / r of the pitch,
//                l = 0..r-1, i.e. systematic shifts.
// The exact rules are draw_hashes' comment in draws.cpp, the proto's
// `sampling` field and the README.
enum class Sampling : int { kIid = 0, kStratified = 1, kAsh = 2 };
// What sampling_name prints and parse_sampling (plsh/params.h) reads.
inline constexpr EnumName<Sampling> kSamplingNames[] = {
    {Sampling::kIid, "iid"}, {Sampling::kStratified, "stratified"}, {Sampling::kAsh, "ash"}};
const char* sampling_name(Sampling s);  // "iid", "stratified", "ash"

uint64_t mix64(uint64_t z);
// U_j in (0, 1) for j = 0, 1, 2, 3 (iid reads j = 0, 1, 2; the other
// samplers read j = 3 for their permutations).
double draw_uniform(uint64_t seed, int64_t head, int64_t sample, int j);
Draw draw_hash(uint64_t seed, int64_t head, int64_t sample, double sigma);
// The iid draws (SPEC section 5).
std::vector<Draw> draw_hashes(uint64_t seed, int64_t head, double sigma, int64_t samples);
// The draws of `sampling`: a pure function of (seed, head, sample, samples)
// and sigma; kIid gives draw_hashes' draws bit for bit.
std::vector<Draw> draw_hashes(uint64_t seed, int64_t head, double sigma, int64_t samples, Sampling sampling);

// The fixed-blocks baseline's one hash (SPEC section 4, the paper's
// --fixed_block_size): pitch 2 sigma (the Gamma(2, sigma) mean) and shift
// 0, so that bin(p) = floor(p / (2 sigma)). Biased: its mask is not L*.
// sigma = +inf (slope 0) gives an infinite pitch: one block, as lsh's.
Draw fixed_block_draw(double sigma);

// kAsh: hashes per pitch for s samples, r = max(1, floor(sqrt(s) / 2 + 1/2))
// (s = 16: 2, 64: 4, 256: 8, 1024: 16). Fewer pitches trade pitch variance
// for shift variance; measured best of r in {1, 2, 4, 8, 16, 32} at s = 64
// and 256 on Gaussian and peaked inputs (bench/RESULTS.md).
int64_t ash_shifts_per_pitch(int64_t samples);

// The Gamma(2, 1) quantile: t >= 0 with P[T <= t] = 1 - (1 + t) e^-t = u,
// given u in (0, 1) and its complement 1 - u (passed separately so that
// neither tail loses precision). Newton's method in IEEE double, to within
// a few ulps.
double gamma2_quantile(double u, double one_minus_u);

// A seeded permutation of [0, n) (Fisher-Yates from the last position
// down, position i swapped with floor(U_3(i) (i + 1))); what the
// stratified samplers use to give each hash a uniformly random stratum.
std::vector<int64_t> draw_permutation(uint64_t seed, int64_t head, int64_t n);

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

// block_end(pos, d) where b = bin_of(pos, d) is known, and bin_of of the
// answer in *end_bin: a walk over a hash's blocks in order passes each
// block's end_bin on, so no step waits on a division for its bin. Most
// steps take no division at all: the estimate e = ceil((b + 1) pitch +
// shift) is the answer, in bin b + 1, when the exact quotients of e and
// e - 1 lie farther from b + 1 than the roundings of bin_of and of the
// estimate can move them (`margin`, in quotient units, with room to
// spare). Otherwise bin_of checks the estimate and steps, as block_end
// always did. block_end is this with b found first.
inline int64_t block_end_in_bin(int64_t pos, int64_t b, const Draw& d, int64_t* end_bin) {
  if (!std::isfinite(d.pitch)) {
    *end_bin = 0;
    return std::numeric_limits<int64_t>::max();
  }
  if (d.pitch < kSingletonPitch) {
    *end_bin = pos + 1;
    return pos + 1;
  }
  const double x = static_cast<double>(b + 1) * d.pitch + d.shift;  // where bin b + 1 begins
  int64_t e = static_cast<int64_t>(std::ceil(x));
  if (e > pos) {
    // |bin_of's quotient - (p - u) / pitch| <= 2.3e-16 |p - u| / pitch, and
    // x is within 4.5e-16 (|x| + |u|) of its exact value.
    const double inv = 1 / d.pitch;
    const double ed = static_cast<double>(e);
    const double margin = 1e-12 + 2e-15 * (std::fabs(x) + std::fabs(d.shift) + std::fabs(ed) + 1) * inv;
    const double after = (ed - x) * inv;         // e's quotient less b + 1
    const double before = (x - (ed - 1)) * inv;  // b + 1 less e - 1's quotient
    if (after > margin && after < 1 - margin && (e - 1 == pos || before > margin)) {
      *end_bin = b + 1;
      return e;
    }
  } else {
    e = pos + 1;
  }
  while (e - 1 > pos && bin_of(e - 1, d) > b) --e;
  int64_t bin_e;
  while ((bin_e = bin_of(e, d)) <= b) ++e;
  *end_bin = bin_e;
  return e;
}

// First position of the block holding pos.
int64_t block_begin(int64_t pos, const Draw& d);

}  // namespace plsh
