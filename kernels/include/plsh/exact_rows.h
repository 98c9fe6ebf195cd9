// Float64 exact attention for a few query rows of one (batch item, head):
// the one float64 engine behind the probe (SPEC section 6) and the tests'
// reference, so that "computed exactly" means the same arithmetic in both.
//
// KeyTileBuffer holds a tile of key rows in double and gives the dot
// products q_i . k_j of query rows against it; SoftmaxRow64 folds a row's weighted logits into its output with an
// online maximum (FlashAttention's rescaling), so nothing overflows or vanishes whatever the logits.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "plsh/backend.h"
#include "plsh/params.h"

namespace plsh {

// Keys per tile: 128 rows of k and v in double stay in L2 at D <= 256.
inline constexpr int64_t kExactRowsKeyTile = 128;

struct KeyTile {
  int64_t j0 = 0, count = 0;           // key rows [j0, j0 + count)
  int64_t rows = 0;                    // query rows (the row stride of scores)
  int64_t row_begin = 0, row_end = 0;  // the rows scored in this tile (all, without row windows)
  const double* scores = nullptr;      // [count][rows]: q_r . k_j, unscaled (query row innermost);
                                       // rows outside [row_begin, row_end) are not written
  const double* values = nullptr;      // [count][D]
};

// Key rows [begin, end).
struct KeyRange {
  int64_t begin = 0, end = 0;
};

// One tile of key rows of one (batch item, kv head) in double: k in panels
// that score() reads, v row-major. The probe's sweep (probe_sweep.cpp) fills it
// once for every task that needs the tile.
class KeyTileBuffer {
 public:
  explicit KeyTileBuffer(int64_t head_dim);
  // Converts key rows [j0, j0 + count), count <= kExactRowsKeyTile, of batch
  // item b, kv head hk. Meanwhile asks for the rows [next_j0, next_j0 +
  // count) of kv head next_hk (what the caller loads next; next_hk < 0:
  // nothing) to be brought into cache.
  void load(const AttentionParams& p, int64_t b, int64_t hk, int64_t j0, int64_t count, int64_t next_hk,
            int64_t next_j0);
  // scores[jj * R + r] = q_r . k_(first + jj) for rows [r0, r1) of q ([R][D]
  // in double) and the loaded keys [first, first + n) (key rows, absolute;
  // first - j0() a multiple of kExactRowsKeyScoreAlign), each sum over d in
  // index order from 0.
  void score(const double* q, int64_t R, int64_t r0, int64_t r1, int64_t first, int64_t n, double* scores) const;
  int64_t j0() const { return j0_; }
  int64_t count() const { return count_; }
  const double* values(int64_t j) const { return vt_.data() + (j - j0_) * dim_; }  // key row j's v

 private:
  // Key rows [j, j + rows) of the tile, rows = 1 or 4 (four: from a multiple of four).
  void convert_rows(const AttentionParams& p, int64_t b, int64_t hk, int64_t j, int64_t rows);

  int64_t dim_, j0_ = 0, count_ = 0;
  std::vector<float> buf_;
  std::vector<double> kt_, vt_;
};

// Where a score() may start within a tile: its panels' width.
inline constexpr int64_t kExactRowsKeyScoreAlign = 32;

// One row's online softmax: acc = sum_j exp(l_j - max) v_j, sum likewise.
struct SoftmaxRow64 {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;
  std::vector<double> acc;  // [D]

  explicit SoftmaxRow64(int64_t dim) : acc(static_cast<size_t>(dim), 0.0) {}
  // Folds n keys with logits l[0, n) (-inf: not allowed) and values v
  // ([n][dim]): one rescale for the tile, then the sums in key order.
  // `weights`: room for n doubles, the caller's scratch (the tile's
  // exp(l_j - max)), so that the rows of a task share one.
  void fold(const double* logits, int64_t n, const double* values, double* weights);
  double lse() const { return max + std::log(sum); }
};

// out[j] = exp(x[j] - shift) for j < n, every x[j] <= shift (-inf gives 0),
// in vector lanes (exp_nonpositive64, within a few ulp of std::exp).
void exp_shifted(const double* x, int64_t n, double shift, double* out);

}  // namespace plsh
