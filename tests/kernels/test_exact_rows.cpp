// The float64 exact rows' arithmetic (kernels/src/exact_rows.cpp): the
// vectorised exp behind the probe's weights, against libm, and the online
// softmax built on it, against a direct sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "plsh/exact_rows.h"
#include "plsh/numeric.h"
#include "src/exp64.h"

namespace plsh {
namespace {

// Distance from want in units of want's last place.
double ulps(double got, double want) {
  return std::abs(got - want) / (std::nextafter(want, std::numeric_limits<double>::infinity()) - want);
}

TEST(Exp64, WithinTwoUlpOfLibmDownTo708) {
  std::mt19937_64 rng(20261206);
  std::uniform_real_distribution<double> wide(-708.0, 0.0), near(-40.0, 0.0);
  double worst = 0, worst_x = 0;
  for (int i = 0; i < 400000; ++i) {
    const double x = i % 2 ? wide(rng) : near(rng);
    const double u = ulps(exp_nonpositive64(x), std::exp(x));
    if (u > worst) worst = u, worst_x = x;
  }
  // The reduction's rounding and Horner's give at most 1 ulp (measured on
  // 2e7 draws); 2 leaves room for another compiler's contraction choices.
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
}

TEST(Exp64, EdgesAreExactOrZeroOrNan) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(exp_nonpositive64(0.0), 1.0);
  EXPECT_EQ(exp_nonpositive64(-0.0), 1.0);
  EXPECT_EQ(exp_nonpositive64(-inf), 0.0);
  EXPECT_EQ(exp_nonpositive64(-708.5), 0.0);  // subnormal in truth: flushed
  EXPECT_EQ(exp_nonpositive64(-1e300), 0.0);
  EXPECT_TRUE(std::isnan(exp_nonpositive64(std::numeric_limits<double>::quiet_NaN())));
  EXPECT_LE(ulps(exp_nonpositive64(-708.0), std::exp(-708.0)), 2.0);
  EXPECT_LE(ulps(exp_nonpositive64(-1e-300), 1.0), 1.0);
}

// exp_shifted (the loop the probe calls, in whichever clone this CPU
// picks) is exp_nonpositive64 of each x - shift, odd lengths included.
TEST(Exp64, ShiftedArrayIsElementwise) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> x_of(-300.0, 5.0);
  for (int64_t n : {0, 1, 3, 4, 7, 128, 131}) {
    std::vector<double> x(static_cast<size_t>(n)), out(static_cast<size_t>(n), -1.0);
    for (double& v : x) v = x_of(rng);
    if (n > 2) x[1] = -std::numeric_limits<double>::infinity();
    const double shift = 5.0;
    exp_shifted(x.data(), n, shift, out.data());
    for (int64_t j = 0; j < n; ++j) {
      const size_t i = static_cast<size_t>(j);
      EXPECT_LE(ulps(out[i], std::exp(x[i] - shift)), 2.0) << "n " << n << " j " << j;
    }
  }
}

// Three tiles folded online give the direct softmax's output and lse:
// rising maxima (each tile rescales the last), -inf keys skipped.
TEST(SoftmaxRow64, FoldedTilesAreTheDirectSoftmax) {
  const int64_t dim = 5, keys = 3 * 7;
  std::mt19937_64 rng(11);
  std::normal_distribution<double> z(0.0, 1.0);
  std::vector<double> logits(static_cast<size_t>(keys)), values(static_cast<size_t>(keys * dim));
  for (int64_t j = 0; j < keys; ++j) logits[static_cast<size_t>(j)] = 3 * z(rng) + 20.0 * static_cast<double>(j / 7);
  for (double& v : values) v = z(rng);
  logits[4] = -std::numeric_limits<double>::infinity();
  SoftmaxRow64 row(dim);
  std::vector<double> scratch(7);
  for (int64_t t = 0; t < 3; ++t) row.fold(logits.data() + t * 7, 7, values.data() + t * 7 * dim, scratch.data());

  double top = -std::numeric_limits<double>::infinity();
  for (double l : logits) top = std::max(top, l);
  double sum = 0;
  std::vector<double> acc(static_cast<size_t>(dim), 0.0);
  for (int64_t j = 0; j < keys; ++j) {
    const double w = std::exp(logits[static_cast<size_t>(j)] - top);
    sum += w;
    for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += w * values[static_cast<size_t>(j * dim + d)];
  }
  EXPECT_NEAR(row.lse(), top + std::log(sum), 1e-12);
  for (int64_t d = 0; d < dim; ++d) {
    const size_t i = static_cast<size_t>(d);
    EXPECT_NEAR(row.acc[i] / row.sum, acc[i] / sum, 1e-13) << "d " << d;
  }
}

// A key tile of one kv head (odd D, a tile that starts off the grid, f32
// and bf16 keys): its scores from a panel boundary on, for a range of
// rows, are each row's dot product with each key summed over d in index
// order, to the bit; its values are the v rows widened; rows outside the
// range are left as they were.
TEST(KeyTileBuffer, ScoresAreIndexOrderDotProducts) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t N = 100, H = 2, D = 13, R = 3, hk = 1;
    std::mt19937_64 rng(23);
    std::normal_distribution<float> z(0.0f, 1.0f);
    std::vector<float> k32(static_cast<size_t>(N * H * D)), v32(k32.size());
    for (float& x : k32) x = z(rng);
    for (float& x : v32) x = z(rng);
    std::vector<uint16_t> k16(k32.size()), v16(v32.size());
    for (size_t i = 0; i < k32.size(); ++i) {
      k16[i] = float_to_bf16(k32[i]);
      v16[i] = float_to_bf16(v32[i]);
      if (dtype == DType::kBF16) {  // what the tile reads, widened
        k32[i] = bf16_to_float(k16[i]);
        v32[i] = bf16_to_float(v16[i]);
      }
    }
    AttentionParams p;
    p.dtype = dtype;
    p.k = dtype == DType::kBF16 ? static_cast<const void*>(k16.data()) : k32.data();
    p.v = dtype == DType::kBF16 ? static_cast<const void*>(v16.data()) : v32.data();
    p.kv_len = N;
    p.head_dim = D;
    p.k_row_stride = p.v_row_stride = H * D;
    p.k_head_stride = p.v_head_stride = D;
    p.k_batch_stride = p.v_batch_stride = N * H * D;
    std::vector<double> q(static_cast<size_t>(R * D));
    for (double& x : q) x = z(rng);

    KeyTileBuffer tile(D);
    const int64_t j0 = 37, count = 63, first = j0 + kExactRowsKeyScoreAlign, n = count - kExactRowsKeyScoreAlign;
    tile.load(p, 0, hk, j0, count, 0, j0 + count);
    std::vector<double> scores(static_cast<size_t>(n * R), -7.0);
    tile.score(q.data(), R, 1, R, first, n, scores.data());
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = first + jj;
      for (int64_t r = 0; r < R; ++r) {
        double want = -7.0;
        if (r >= 1) {
          want = 0;
          for (int64_t d = 0; d < D; ++d)
            want +=
                q[static_cast<size_t>(r * D + d)] * static_cast<double>(k32[static_cast<size_t>((j * H + hk) * D + d)]);
        }
        EXPECT_EQ(scores[static_cast<size_t>(jj * R + r)], want) << "key " << j << " row " << r;
      }
      for (int64_t d = 0; d < D; ++d)
        EXPECT_EQ(tile.values(j)[d], static_cast<double>(v32[static_cast<size_t>((j * H + hk) * D + d)]));
    }
  }
}

}  // namespace
}  // namespace plsh
