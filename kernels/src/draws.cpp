#include "plsh/draws.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

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
  const uint64_t index =
      1 + 4 * ((static_cast<uint64_t>(head) << 24) + static_cast<uint64_t>(sample)) + static_cast<uint64_t>(j);
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

Draw fixed_block_draw(double sigma) { return Draw{2.0 * sigma, 0.0}; }

const char* sampling_name(Sampling s) { return name_of(kSamplingNames, s); }

int64_t ash_shifts_per_pitch(int64_t samples) {
  if (samples <= 1) return 1;
  const double r = std::floor(std::sqrt(static_cast<double>(samples)) / 2 + 0.5);
  return std::clamp<int64_t>(static_cast<int64_t>(r), 1, samples);
}

namespace {

// log1p(t) - t without the cancellation of the two near t = 0 (a series
// there: -t^2/2 + t^3/3 - ..., 30 terms, each under 0.1^k).
double log1p_minus(double t) {
  if (t >= 0.1) return std::log1p(t) - t;
  double term = t, sum = 0;
  for (int k = 2; k <= 30; ++k) {
    term *= -t;
    sum += term / k;
  }
  return sum;
}

}  // namespace

double gamma2_quantile(double u, double one_minus_u) {
  // Solve h(t) = ln(1 + t) - t - ln(1 - u) = 0: h is concave and decreasing
  // on t > 0, so Newton's iterates decrease monotonically to the root from
  // any point right of it, and its first step from the left lands right of
  // it; the iteration stops when an iterate no longer decreases.
  const double log_tail = u < 0.5 ? std::log1p(-u) : std::log(one_minus_u);
  // Starting points: t^2/2 ~ u near 0; t ~ -ln(1-u) + ln(1 - ln(1-u)) in the tail.
  double t = u < 0.5 ? std::sqrt(2 * u) : -log_tail + std::log1p(-log_tail);
  if (!(t > 0)) t = 0x1.0p-60;
  for (int i = 0; i < 200; ++i) {
    const double h = log1p_minus(t) - log_tail;
    double next = t + h * (1 + t) / t;  // t - h / h', h'(t) = -t / (1 + t)
    if (!(next > 0)) next = t / 2;      // not expected (Newton stays right of 0); safe anyway
    if (i > 0 && next >= t) break;
    t = next;
  }
  return t;
}

std::vector<int64_t> draw_permutation(uint64_t seed, int64_t head, int64_t n) {
  std::vector<int64_t> perm(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
  for (int64_t i = n - 1; i >= 1; --i) {
    const double u = draw_uniform(seed, head, i, 3);
    const int64_t j = std::min(i, static_cast<int64_t>(u * static_cast<double>(i + 1)));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

// Samplers other than iid (SPEC section 5 allows them when every hash stays
// a valid draw on its own). With U_j(k) = draw_uniform(seed, head, k, j):
//
// stratified (s strata):
//   pi      = draw_permutation(seed, head, s)
//   v_k     = (pi[k] + U_0(k)) / s, 1 - v_k = ((s - 1 - pi[k]) + (1 - U_0(k))) / s
//   pitch_k = sigma * gamma2_quantile(v_k, 1 - v_k)
//   shift_k = U_2(k) * pitch_k
// v_k is uniform on (0, 1) (a uniformly random stratum plus a uniform
// offset), so pitch_k ~ Gamma(2, sigma); the shift is the iid rule's.
//
// ash (r = ash_shifts_per_pitch(s) hashes per pitch, m = ceil(s / r) pitches):
//   hash k belongs to group g = floor(k / r), of size r_g = min(r, s - g r),
//   as its l = k - g r -th member;
//   pi      = draw_permutation(seed, head, m)
//   v_g     = (pi[g] + U_0(g r)) / m, pitch_k = sigma * gamma2_quantile(v_g, 1 - v_g)
//   f_k     = U_2(g r) + l / r_g, minus 1 when >= 1
//   shift_k = f_k * pitch_k
// f_k is uniform on [0, 1) whatever l, so each shift is uniform on [0,
// pitch) given the pitch; the r_g shifts of a group are evenly spaced.
// A pitch of +inf (slope 0) gets a shift of +inf, as under iid.
std::vector<Draw> draw_hashes(uint64_t seed, int64_t head, double sigma, int64_t samples, Sampling sampling) {
  if (sampling == Sampling::kIid || samples <= 0) return draw_hashes(seed, head, sigma, samples);
  const int64_t r = sampling == Sampling::kAsh ? ash_shifts_per_pitch(samples) : 1;
  const int64_t groups = (samples + r - 1) / r;
  const std::vector<int64_t> perm = draw_permutation(seed, head, groups);
  std::vector<Draw> draws(static_cast<size_t>(samples));
  const double m = static_cast<double>(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * r;
    const int64_t size = std::min(r, samples - first);
    const double u0 = draw_uniform(seed, head, first, 0);
    const double stratum = static_cast<double>(perm[static_cast<size_t>(g)]);
    const double v = (stratum + u0) / m;
    const double v_complement = ((m - 1 - stratum) + (1 - u0)) / m;
    const double pitch = sigma * gamma2_quantile(v, v_complement);
    const double u2 = draw_uniform(seed, head, first, 2);
    for (int64_t l = 0; l < size; ++l) {
      double f = u2 + static_cast<double>(l) / static_cast<double>(size);
      if (f >= 1) f -= 1;
      Draw& d = draws[static_cast<size_t>(first + l)];
      d.pitch = pitch;
      d.shift = std::isfinite(pitch) ? f * pitch : pitch;
    }
  }
  return draws;
}

int64_t block_end(int64_t pos, const Draw& d) {
  int64_t end_bin;
  return block_end_in_bin(pos, bin_of(pos, d), d, &end_bin);
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
