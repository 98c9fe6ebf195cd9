// The forward's and the backward's tile products, softmax, probabilities
// and dS (kernels/cpu/microkernels.h), the
// AVX2+FMA kernels and the generic ones, each against float64 sums on odd
// sizes: rows and keys that leave partial register blocks and query panels,
// head dims that leave a partial 16-column strip, strides that are not the
// packed width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "cpu/exp.h"
#include "cpu/microkernels.h"

namespace plsh::cpu {
namespace {

namespace k = kernels_for_testing;

struct Sizes {
  int64_t rows, keys, dim;
};
// Whole blocks, partial blocks on every side, a single row / key / column.
constexpr Sizes kSizes[] = {{96, 96, 64}, {128, 128, 64}, {7, 13, 5},   {1, 1, 1},
                            {17, 31, 40}, {33, 6, 17},    {50, 77, 130}};

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(gen);
  return x;
}

// The generic kernels, and the AVX2 ones where this CPU has them (the log
// says when it has not).
std::vector<bool> implementations() {
  std::vector<bool> which{false};
  if (k::have_avx2())
    which.push_back(true);
  else
    std::printf("no AVX2+FMA on this CPU: the generic kernels alone are tested\n");
  return which;
}

// f(z, avx2) for every size and every implementation, traced.
template <typename F>
void for_each_case(F&& f) {
  for (const Sizes& z : kSizes) {
    for (bool avx2 : implementations()) {
      SCOPED_TRACE(::testing::Message() << "rows " << z.rows << " keys " << z.keys << " dim " << z.dim << " avx2 "
                                        << avx2);
      f(z, avx2);
    }
  }
}

// A float64 sum of terms and of their magnitudes: a float32 sum of the
// same terms is within 1e-6 of their magnitude (plus 1) of it.
struct Sum64 {
  double sum = 0, mag = 0;
  void add(double t) {
    sum += t;
    mag += std::abs(t);
  }
  double tolerance() const { return 1e-6 * (mag + 1); }
};

// product(c, ldc) on a random c (m rows, seed) adds sum_{k < depth} a(r, k)
// b[k][x] to c[r][x] for x < dim, as a float64 sum would within float32
// accumulation over the terms' magnitudes, and leaves columns past dim
// untouched: pv_tile's and ab_tile's contract.
template <typename Product, typename A>
void expect_accumulates(Product&& product, int64_t m, int64_t ldc, int64_t dim, int64_t depth, uint32_t seed, A&& a,
                        const float* b, int64_t ldb) {
  std::vector<float> c = random_floats(m * ldc, seed);
  const std::vector<float> before = c;
  product(c.data(), ldc);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t x = 0; x < ldc; ++x) {
      if (x >= dim) {
        ASSERT_EQ(c[r * ldc + x], before[r * ldc + x]) << "row " << r << " column " << x << " past dim";
        continue;
      }
      Sum64 want;
      want.add(before[r * ldc + x]);
      for (int64_t k = 0; k < depth; ++k) want.add(static_cast<double>(a(r, k)) * b[k * ldb + x]);
      ASSERT_NEAR(c[r * ldc + x], want.sum, want.tolerance()) << "row " << r << " column " << x;
    }
  }
}

TEST(Microkernels, QueryKeyProductMatchesFloat64) {
  for_each_case([&](const Sizes& z, bool avx2) {
    const int64_t ldq = z.dim + 3, ldk = z.dim + 7, ldst = padded_rows(z.rows) + 5;
    const std::vector<float> q = random_floats(z.rows * ldq, 1), kk = random_floats(z.keys * ldk, 2);
    const float scale = 0.37f;
    std::vector<float> qt(static_cast<size_t>(padded_rows(z.rows) * z.dim), std::nanf(""));
    k::pack_queries(avx2, q.data(), ldq, z.rows, z.dim, scale, qt.data());
    std::vector<float> st(static_cast<size_t>(z.keys * ldst), std::nanf(""));
    k::qk_tile(avx2, kk.data(), ldk, z.keys, z.dim, qt.data(), z.rows, st.data(), ldst);
    for (int64_t j = 0; j < z.keys; ++j) {
      for (int64_t i = 0; i < padded_rows(z.rows); ++i) {
        Sum64 want;
        for (int64_t d = 0; i < z.rows && d < z.dim; ++d)
          want.add(static_cast<double>(scale) * q[i * ldq + d] * kk[j * ldk + d]);
        // Padding rows are zero queries: their logits are 0, not garbage.
        ASSERT_NEAR(st[j * ldst + i], want.sum, want.tolerance()) << "key " << j << " row " << i;
      }
    }
  });
}

// The product with the exact/window bias as its epilogue: each allowed
// logit is the float64 product plus neg_slope * max(left[i] - j, j -
// right[i]), everything else -inf (padding rows too), and col_max the max of
// what came in and of the column's logits.
TEST(Microkernels, QueryKeyBiasProductMatchesFloat64) {
  const float inf = std::numeric_limits<float>::infinity();
  for_each_case([&](const Sizes& z, bool avx2) {
    const int64_t ldq = z.dim + 3, ldk = z.dim + 7, ldst = padded_rows(z.rows) + 5, padded = padded_rows(z.rows);
    const std::vector<float> q = random_floats(z.rows * ldq, 11), kk = random_floats(z.keys * ldk, 12);
    const float scale = 0.41f;
    std::vector<float> qt(static_cast<size_t>(padded * z.dim), std::nanf(""));
    k::pack_queries(avx2, q.data(), ldq, z.rows, z.dim, scale, qt.data());
    // Query row i 10 keys after key i (diagonal 10: whole blocks of allowed
    // keys cross it, at query panel 16 and keys 24..29), reference distances
    // 0..3. By six-key block (a register block's keys): every row allowed
    // (whole blocks before or after the diagonal take the fast path), random
    // ranges, none, the causal rows.
    std::mt19937 gen(13);
    std::vector<float> left(static_cast<size_t>(padded)), right(left.size()), lo(static_cast<size_t>(z.keys)),
        hi(lo.size());
    for (int64_t i = 0; i < padded; ++i) {
      const int64_t nearest = static_cast<int64_t>(gen() % 4);
      left[i] = static_cast<float>(10 + i - nearest);
      right[i] = static_cast<float>(10 + i + nearest);
    }
    for (int64_t j = 0; j < z.keys; ++j) {
      int64_t a = static_cast<int64_t>(gen() % static_cast<uint32_t>(z.rows + 1));
      int64_t b = static_cast<int64_t>(gen() % static_cast<uint32_t>(z.rows + 1));
      if (a > b) std::swap(a, b);
      switch (j / 6 % 4) {
        case 0:
          a = 0, b = z.rows;
          break;
        case 2:
          b = a;
          break;
        case 3:
          a = std::clamp<int64_t>(j - 10, 0, z.rows), b = z.rows;
          break;
        default:
          break;
      }
      lo[j] = static_cast<float>(a);
      hi[j] = static_cast<float>(b);
    }
    const BiasEpilogue bias{-0.125f, 10, left.data(), right.data(), lo.data(), hi.data()};
    std::vector<float> col_max(static_cast<size_t>(padded), -inf);
    for (int64_t i = 0; i < padded; i += 3) col_max[i] = 1.5f;  // a running max from an earlier tile
    const std::vector<float> before = col_max;
    std::vector<float> st(static_cast<size_t>(z.keys * ldst), std::nanf(""));
    k::qk_bias_tile(avx2, kk.data(), ldk, z.keys, z.dim, qt.data(), z.rows, st.data(), ldst, bias, col_max.data());
    for (int64_t i = 0; i < padded; ++i) {
      float want_max = before[i];
      for (int64_t j = 0; j < z.keys; ++j) {
        const float got = st[j * ldst + i];
        want_max = std::max(want_max, got);
        if (i >= z.rows || static_cast<float>(i) < lo[j] || static_cast<float>(i) >= hi[j]) {
          ASSERT_EQ(got, -inf) << "key " << j << " row " << i;
          continue;
        }
        Sum64 want;
        for (int64_t d = 0; d < z.dim; ++d) want.add(static_cast<double>(scale) * q[i * ldq + d] * kk[j * ldk + d]);
        const double jd = static_cast<double>(j);
        const double distance = std::max(static_cast<double>(left[i]) - jd, jd - static_cast<double>(right[i]));
        want.add(-0.125 * distance);
        ASSERT_NEAR(got, want.sum, want.tolerance()) << "key " << j << " row " << i;
      }
      ASSERT_EQ(col_max[i], want_max) << "row " << i;
    }
  });
}

TEST(Microkernels, ProbabilityValueProductAccumulatesInFloat64Agreement) {
  for_each_case([&](const Sizes& z, bool avx2) {
    const int64_t ldpt = z.rows + 9, ldv = z.dim + 11;
    const std::vector<float> pt = random_floats(z.keys * ldpt, 3), v = random_floats(z.keys * ldv, 4);
    expect_accumulates(
        [&](float* acc, int64_t ldacc) {
          k::pv_tile(avx2, pt.data(), ldpt, z.keys, v.data(), ldv, z.rows, z.dim, acc, ldacc);
        },
        z.rows, z.dim + 2, z.dim, z.keys, 5, [&](int64_t i, int64_t j) { return pt[j * ldpt + i]; }, v.data(), ldv);
  });
}

// The online softmax over two tiles equals the one-shot softmax of both,
// with masked (-inf) logits, a column masked in the first tile only, and a
// column masked in both (its state stays empty: max -inf, sum 0); the same
// whether the fold finds each tile's max or is given it (qk_bias_tile's).
TEST(Microkernels, FoldIsTheOnlineSoftmax) {
  const float inf = std::numeric_limits<float>::infinity();
  for (bool given_max : {false, true})
    for_each_case([&](const Sizes& z, bool avx2) {
      SCOPED_TRACE(given_max ? "max given" : "max found");
      const int64_t ld = z.rows + 3, dim = 3;
      std::vector<float> t1 = random_floats(z.keys * ld, 6), t2 = random_floats(z.keys * ld, 7);
      for (float& x : t2) x = 4 * x + 3;  // the second tile's max is larger: acc is rescaled
      for (int64_t j = 0; j < z.keys; ++j) {
        t1[j * ld + 0] = -inf;  // column 0: nothing in the first tile
        if (z.rows > 1) t1[j * ld + z.rows - 1] = t2[j * ld + z.rows - 1] = -inf;  // last: nothing at all
        if (j % 3 == 1) t1[j * ld + z.rows / 2] = -inf;
      }
      const std::vector<float> l1 = t1, l2 = t2;
      std::vector<float> acc(static_cast<size_t>(z.rows * dim), 0.0f);
      std::vector<float> row_max(static_cast<size_t>(z.rows), -inf), row_sum(static_cast<size_t>(z.rows), 0.0f);
      std::vector<double> want_acc(acc.size(), 0.0);
      for (std::vector<float>* tile : {&t1, &t2}) {
        std::vector<float> tile_max(static_cast<size_t>(z.rows), -inf);
        for (int64_t j = 0; j < z.keys; ++j)
          for (int64_t i = 0; i < z.rows; ++i) tile_max[i] = std::max(tile_max[i], (*tile)[j * ld + i]);
        k::fold_tile(avx2, tile->data(), ld, z.keys, z.rows, acc.data(), dim, row_max.data(), row_sum.data(),
                     given_max ? tile_max.data() : nullptr);
        // acc += P V with V[j] = (1, j, j^2 mod 7) from the probabilities left in the tile.
        for (int64_t i = 0; i < z.rows; ++i)
          for (int64_t j = 0; j < z.keys; ++j) {
            const float p = (*tile)[j * ld + i];
            acc[i * dim + 0] += p;
            acc[i * dim + 1] += p * static_cast<float>(j % 5);
            acc[i * dim + 2] += p * static_cast<float>(j * j % 7);
          }
      }
      for (int64_t i = 0; i < z.rows; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (const std::vector<float>* l : {&l1, &l2})
          for (int64_t j = 0; j < z.keys; ++j) m = std::max(m, static_cast<double>((*l)[j * ld + i]));
        if (m == -std::numeric_limits<double>::infinity()) {
          EXPECT_EQ(row_max[i], -inf) << "row " << i;
          EXPECT_EQ(row_sum[i], 0.0f) << "row " << i;
          EXPECT_EQ(acc[i * dim], 0.0f) << "row " << i;
          continue;
        }
        double sum = 0, o1 = 0, o2 = 0;
        for (const std::vector<float>* l : {&l1, &l2})
          for (int64_t j = 0; j < z.keys; ++j) {
            const double e = std::exp(static_cast<double>((*l)[j * ld + i]) - m);
            sum += e;
            o1 += e * static_cast<double>(j % 5);
            o2 += e * static_cast<double>(j * j % 7);
          }
        EXPECT_EQ(row_max[i], static_cast<float>(m)) << "row " << i;
        EXPECT_NEAR(row_sum[i] / sum, 1.0, 2e-6) << "row " << i;
        EXPECT_NEAR(acc[i * dim + 0] / sum, 1.0, 2e-6) << "row " << i;
        EXPECT_NEAR(acc[i * dim + 1] / row_sum[i], o1 / sum, 2e-5) << "row " << i;
        EXPECT_NEAR(acc[i * dim + 2] / row_sum[i], o2 / sum, 2e-5) << "row " << i;
      }
    });
}

// The backward's dV += P^T dO and dK += dS^T Q: c[j][x] += sum_i a[j][i]
// b[i][x], columns past dim untouched.
TEST(Microkernels, RowBroadcastProductAccumulatesInFloat64Agreement) {
  for_each_case([&](const Sizes& z, bool avx2) {
    // keys x rows times rows x dim: m = keys, depth = rows.
    const int64_t lda = z.rows + 5, ldb = z.dim + 13;
    const std::vector<float> a = random_floats(z.keys * lda, 6), b = random_floats(z.rows * ldb, 7);
    expect_accumulates(
        [&](float* c, int64_t ldc) { k::ab_tile(avx2, a.data(), lda, z.keys, z.rows, b.data(), ldb, z.dim, c, ldc); },
        z.keys, z.dim + 3, z.dim, z.rows, 8, [&](int64_t j, int64_t i) { return a[j * lda + i]; }, b.data(), ldb);
  });
}

// P^T = exp(S^T - lse) within exp's error, -inf logits and an lse of +inf
// (a row that saw no key) to 0, a logit a hair above lse to about 1, and
// columns past `rows` untouched; then dS^T = P^T (dP^T - D) exactly.
TEST(Microkernels, ProbabilitiesAndScoreGradientsMatchFloat64) {
  const float inf = std::numeric_limits<float>::infinity();
  for_each_case([&](const Sizes& z, bool avx2) {
    const int64_t ld = z.rows + 7;
    std::vector<float> st = random_floats(z.keys * ld, 9), lse = random_floats(z.rows, 10);
    for (float& x : lse) x = std::abs(x) + 4.0f;  // above every logit but the planted ones
    for (int64_t j = 0; j < z.keys; ++j) {
      if (j % 5 == 1) st[j * ld + (j % z.rows)] = -inf;
      if (j % 7 == 2) st[j * ld + (j % z.rows)] = lse[j % z.rows] + 1e-6f;
    }
    if (z.rows > 2) lse[2] = inf;
    const std::vector<float> logits = st;
    k::probs_tile(avx2, st.data(), ld, z.keys, z.rows, lse.data());
    for (int64_t j = 0; j < z.keys; ++j) {
      for (int64_t i = 0; i < ld; ++i) {
        const float got = st[j * ld + i], s = logits[j * ld + i];
        if (i >= z.rows) {
          ASSERT_EQ(got, s);
          continue;
        }
        if (s == -inf || lse[i] == inf) {
          ASSERT_EQ(got, 0.0f) << "key " << j << " row " << i;
          continue;
        }
        const double want = std::exp(static_cast<double>(s) - lse[i]);
        ASSERT_NEAR(got, want, 1e-6 * want) << "key " << j << " row " << i;
      }
    }
    std::vector<float> dpt = random_floats(z.keys * ld, 11);
    const std::vector<float> dots = random_floats(z.rows, 12), dp = dpt;
    k::dscores_tile(avx2, dpt.data(), st.data(), ld, z.keys, z.rows, dots.data());
    for (int64_t j = 0; j < z.keys; ++j)
      for (int64_t i = 0; i < ld; ++i)
        ASSERT_EQ(dpt[j * ld + i], i >= z.rows ? dp[j * ld + i] : st[j * ld + i] * (dp[j * ld + i] - dots[i]));
  });
}

TEST(Microkernels, ExpHasItsStatedRelativeErrorAndUnderflowsToZero) {
  double worst = 0;
  for (double x = -87.0; x <= 0.0; x += 0.001) {
    const double got = exp_nonpositive(static_cast<float>(x));
    const double want = std::exp(static_cast<double>(static_cast<float>(x)));
    worst = std::max(worst, std::abs(got - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(exp_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_nonpositive(-1000.0f), 0.0f);
  EXPECT_EQ(exp_nonpositive(0.0f), 1.0f);
}

}  // namespace
}  // namespace plsh::cpu
