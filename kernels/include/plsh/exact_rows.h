// Float64 exact attention for a few query rows of one (batch item, head):
// the one float64 engine behind the probe (SPEC section 6) and the tests'
// reference, so that "computed exactly" means the same arithmetic in both.
//
// for_each_key_tile hands the caller the dot products q_i . k_j of every
// query row against a tile of key rows, with the value rows, all in double;
// SoftmaxRow64 folds a row's weighted logits into its output with an online
// maximum (FlashAttention's rescaling), so nothing overflows or vanishes
// whatever the logits.
#pragma once

#include <cstdint>
#include <functional>
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

// Scores query rows `rows` of batch item b, head h against the key rows of
// `ranges` (sorted, disjoint; of the kv head h reads), one tile of at most
// kExactRowsKeyTile keys at a time, in order. The sums over d run in index
// order. Returns false when ctx (may be null) asked to stop (polled every 64
// tiles, ~8k keys).
// With row_windows (one per row, the keys that row needs; rows in order of
// their windows' starts), a tile scores only the rows between the first whose
// window ends after it and the last whose window starts before its end.
bool for_each_key_tile(const AttentionParams& p, int64_t h, int64_t b, std::span<const int64_t> rows,
                       std::span<const KeyRange> ranges, const std::function<void(const KeyTile&)>& visit,
                       const ExecContext* ctx = nullptr, std::span<const KeyRange> row_windows = {});

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
