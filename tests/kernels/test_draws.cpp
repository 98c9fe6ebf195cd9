// SPEC section 5: the draws must be reproduced bit for bit across backends,
// servers and clients. The vectors below are from the foundation issue.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh {
namespace {

struct DrawVector {
  uint64_t seed;
  double sigma;
  int64_t head;
  Draw expected[3];
};

TEST(Draws, ReproduceSpecVectorsTo1e12) {
  const DrawVector vectors[] = {
      {0,
       1,
       0,
       {{0.96450103661526387, 0.025495400102711691},
        {3.3578502298647637, 0.58382225367881713},
        {1.4528469846108807, 0.576007302887102}}},
      {42,
       8,
       3,
       {{13.684641122336192, 3.6569602163871684},
        {8.9363361362786495, 0.91949601520605606},
        {9.4359456880874131, 0.80842349351866305}}},
      {9223372036854775813ULL,
       256,
       31,
       {{55.33994055838842, 18.393322614180224},
        {250.23836955274976, 10.707729937915882},
        {795.26960331862722, 254.71675227615404}}},
  };
  for (const DrawVector& v : vectors) {
    const std::vector<Draw> draws = draw_hashes(v.seed, v.head, v.sigma, 3);
    for (int k = 0; k < 3; ++k) {
      EXPECT_NEAR(draws[k].pitch, v.expected[k].pitch, 1e-12 * v.expected[k].pitch)
          << "seed " << v.seed << " sample " << k;
      EXPECT_NEAR(draws[k].shift, v.expected[k].shift, 1e-12 * v.expected[k].shift)
          << "seed " << v.seed << " sample " << k;
    }
  }
}

TEST(Draws, ShiftInsidePitch) {
  for (int64_t k = 0; k < 10000; ++k) {
    const Draw d = draw_hash(7, 5, k, 3.0);
    ASSERT_GT(d.pitch, 0);
    ASSERT_GE(d.shift, 0);
    ASSERT_LT(d.shift, d.pitch);
  }
}

TEST(Draws, BlockEdgesAgreeWithBinOf) {
  for (int64_t k = 0; k < 200; ++k) {
    const Draw d = draw_hash(11, 2, k, k % 2 ? 0.7 : 37.0);
    for (int64_t pos = -300; pos < 300; pos += 7) {
      const int64_t b = bin_of(pos, d);
      const int64_t begin = block_begin(pos, d), end = block_end(pos, d);
      ASSERT_LE(begin, pos);
      ASSERT_GT(end, pos);
      EXPECT_EQ(bin_of(begin, d), b);
      EXPECT_EQ(bin_of(end - 1, d), b);
      EXPECT_NE(bin_of(begin - 1, d), b);
      EXPECT_NE(bin_of(end, d), b);
      // Within one hash every block has floor(delta) or ceil(delta) positions
      // (or 1 when delta < 1 leaves bins empty).
      const int64_t len = end - begin;
      EXPECT_GE(len, std::max<int64_t>(1, static_cast<int64_t>(std::floor(d.pitch))));
      EXPECT_LE(len, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(d.pitch))));
    }
  }
}

// A walk over a hash's blocks with block_end_in_bin (each step's bin the
// last step's end_bin, most steps without a division) finds every block
// end that bin_of does, and the end's bin: pitches drawn, pitches at and
// next to whole numbers (estimates next to a bin's edge), pitches in
// [0.5, 1) (empty bins), positions near 0, 2^45 and 2^52 (where the margin
// leaves every step to bin_of).
TEST(Draws, BlockWalkAgreesWithBinOf) {
  std::vector<Draw> draws;
  for (int64_t k = 0; k < 60; ++k) draws.push_back(draw_hash(13, 1, k, k % 3 == 0 ? 0.7 : k % 3 == 1 ? 2.0 : 37.0));
  for (const double pitch : {0.5, 0.75, 1.0, 3.0, 7.0, 1000.0})
    for (const double eps : {0.0, 1e-13, -1e-13, 1e-9, -1e-9, 1e-6})
      for (const double shift : {0.0, 0.25, 0.5, 0.999}) draws.push_back(Draw{pitch + eps, shift * (pitch + eps)});
  for (const Draw& d : draws) {
    for (const int64_t start : {int64_t{-300}, int64_t{1} << 45, (int64_t{1} << 52) - 400}) {
      int64_t pos = start, bin = bin_of(start, d);
      while (pos < start + 600) {
        int64_t end_bin = 0;
        const int64_t end = block_end_in_bin(pos, bin, d, &end_bin);
        int64_t want = pos + 1;
        while (bin_of(want, d) == bin) ++want;
        ASSERT_EQ(end, want) << "pitch " << d.pitch << " shift " << d.shift << " at " << pos;
        ASSERT_EQ(end_bin, bin_of(end, d)) << "pitch " << d.pitch << " shift " << d.shift << " at " << pos;
        ASSERT_EQ(end, block_end(pos, d));
        pos = end;
        bin = end_bin;
      }
    }
  }
}

TEST(Slopes, PowerOfTwoHeadsAreGeometric) {
  const std::vector<double> s = standard_slopes(8);
  ASSERT_EQ(s.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(s[i], std::pow(2.0, -(i + 1)));
}

TEST(Slopes, NonPowerOfTwoFollowsBloom) {
  // H = 12: the 8 slopes of P = 8, then slopes 0, 2, 4, 6 of 2P = 16.
  const std::vector<double> s = standard_slopes(12);
  ASSERT_EQ(s.size(), 12u);
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(s[i], std::pow(2.0, -(i + 1)));
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(s[8 + i], std::pow(2.0, -0.5 * (2 * i + 1)));
  EXPECT_EQ(standard_slopes(1).size(), 1u);
  EXPECT_DOUBLE_EQ(standard_slopes(1)[0], std::pow(2.0, -8.0));
  EXPECT_EQ(standard_slopes(6).size(), 6u);
}

TEST(Draws, InfinitePitchPutsEverythingInOneBin) {
  const Draw d = draw_hash(1, 0, 0, INFINITY);
  EXPECT_EQ(bin_of(0, d), bin_of(1 << 30, d));
}

}  // namespace
}  // namespace plsh

namespace plsh {
namespace {

// Steep slopes draw pitches far below one position; near |p| = 2^52 the
// quotient (p - u) / delta no longer fits in int64. Blocks are single
// positions there, found without stepping through bins (which once hung).
TEST(Draws, TinyPitchesGiveSinglePositionBlocksFarFromZero) {
  const int64_t far = int64_t{1} << 52;
  int64_t tiny = 0;
  for (int64_t k = 0; k < 256; ++k) {
    const Draw d = draw_hash(3, 0, k, 1.0 / 1024);
    if (d.pitch >= kSingletonPitch) continue;
    ++tiny;
    for (const int64_t pos : {far - 3, far, -far, int64_t{0}, int64_t{17}}) {
      EXPECT_EQ(block_begin(pos, d), pos);
      EXPECT_EQ(block_end(pos, d), pos + 1);
      EXPECT_NE(bin_of(pos, d), bin_of(pos + 1, d));
      EXPECT_NE(bin_of(pos, d), bin_of(pos - 1, d));
    }
  }
  EXPECT_GT(tiny, 200) << "sigma = 1/1024 should give pitches below 0.5 almost always";
  // Just above the threshold the formula holds and the blocks agree with it.
  const Draw d{0.75, 0.3};
  for (int64_t pos = far - 40; pos < far; ++pos) {
    const int64_t b = bin_of(pos, d);
    EXPECT_EQ(b, static_cast<int64_t>(std::floor((static_cast<double>(pos) - 0.3) / 0.75)));
    EXPECT_EQ(bin_of(block_begin(pos, d), d), b);
    EXPECT_EQ(bin_of(block_end(pos, d) - 1, d), b);
  }
}

}  // namespace
}  // namespace plsh
