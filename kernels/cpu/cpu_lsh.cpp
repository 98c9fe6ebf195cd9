// Positional LSH (SPEC section 3): the two algorithms that compute the same
// o~ = sum_j a_ij M~_ij v_j / sum_j a_ij M~_ij.
//
// Per-sample reduction: for each hash k the tile's rows split into blocks,
// and each block runs plain (unbiased) attention over the key rows of its
// own block. Every block folds into the tile's online-softmax state, which
// *is* the log-sum-exp merge of the per-sample (o_k, lse_k): the state holds
// sum_k exp(lse_k - M) o_k and sum_k exp(lse_k - M), so at the end
// o = that ratio and lse = M + log(sum) - log s. A sample whose block holds
// no allowed key adds nothing (lse_k = -inf).
//
// Banded weighted: one pass over the union of the query's blocks with the
// log weight log(c_ij / s) added to the logits, c_ij being how many hashes
// put i and j in one bin. c_ij is piecewise constant in j with at most 2s
// steps, so each row keeps its sorted block edges instead of a dense count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

#include "cpu/tiles.h"

namespace plsh::cpu {

namespace {

// Adds nothing; masks keys after the query when causal. pos_row0 is the
// position of the first of `rows` query rows.
struct CausalMask {
  const AttentionParams& p;
  int64_t pos_row0;
  int64_t rows;

  void operator()(float* st, int64_t ld, int64_t jt, int64_t len) const {
    if (!p.causal) return;
    for (int64_t c = 0; c < len; ++c) {
      const int64_t first_allowed = std::clamp<int64_t>(p.k_pos0 + jt + c - pos_row0, 0, rows);
      std::fill_n(st + c * ld, first_allowed, kNegInf);
    }
  }
};

}  // namespace

double lsh_per_sample_tile(const AttentionParams& p, const TileJob& job, const std::vector<Draw>& draws,
                           const ExecContext& ctx, Scratch& scratch) {
  const int64_t dim = p.head_dim;
  const SliceView qv = q_slice(p, job.b, job.h), kv = k_slice(p, job.b, job.h), vv = v_slice(p, job.b, job.h);
  const int64_t pos_first = p.q_pos0 + job.i0;
  const int64_t pos_end = pos_first + job.rows;  // exclusive
  const float scale = static_cast<float>(p.scale);

  RowState state = fresh_state(scratch, job.rows, dim);
  std::fill_n(scratch.lse_shift, job.rows, -std::log(static_cast<double>(p.samples)));
  int64_t ldq = 0;
  const float* q = rows_as_f32(qv, job.i0, job.rows, scratch.q, &ldq);
  double flops = 0;
  for (const Draw& d : draws) {
    if (!ctx.check_stop().ok()) return flops;
    for (int64_t pos = pos_first; pos < pos_end;) {
      const int64_t block_first = block_begin(pos, d);
      const int64_t block_last = block_end(pos, d);  // exclusive
      const int64_t r0 = pos - pos_first;
      const int64_t r1 = std::min(block_last, pos_end) - pos_first;
      // Causal: no row of this block sees past its last row's position.
      const int64_t key_end = p.causal ? std::min(block_last, pos_first + r1) : block_last;
      int64_t j0 = 0, j1 = 0;
      key_rows_of(p, block_first, key_end, &j0, &j1);
      if (j0 < j1) {
        const CausalMask mask{p, pos, r1 - r0};
        flops += attend(q + r0 * ldq, ldq, r1 - r0, kv, vv, j0, j1, scale, mask, scratch, state.offset(r0, dim));
      }
      pos = pos_first + r1;
    }
  }
  write_rows(p, job.b, job.h, job.i0, job.rows, state, scratch.lse_shift, scratch.out_row);
  return flops;
}

double lsh_banded_tile(const AttentionParams& p, const TileJob& job, const std::vector<Draw>& draws, Scratch& scratch) {
  const int64_t dim = p.head_dim;
  const int64_t samples = static_cast<int64_t>(draws.size());
  const SliceView qv = q_slice(p, job.b, job.h), kv = k_slice(p, job.b, job.h), vv = v_slice(p, job.b, job.h);
  const int64_t pos_first = p.q_pos0 + job.i0;
  const int64_t pos_end = pos_first + job.rows;
  const int64_t key_pos_first = p.k_pos0, key_pos_end = p.k_pos0 + p.kv_len;

  // The blocks of every hash that meet the tile's rows: each makes a
  // rectangle of (rows, keys) pairs in one bin. c_ij counts the rectangles
  // that hold (i, j). Few per hash (1 + rows / pitch), where per-row block
  // edges sorted afresh on every row cost O(s log s) a row: at s = 256 the
  // sorting was most of banded lsh's time.
  BlockRect* rects = scratch.rects;
  int64_t rect_count = 0;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (const Draw& d : draws) {
    int64_t bin = bin_of(pos_first, d);  // the bin of `last`, once the loop has begun
    for (int64_t first = block_begin(pos_first, d), last = block_end_in_bin(pos_first, bin, d, &bin); first < pos_end;
         first = last, last = block_end_in_bin(first, bin, d, &bin)) {
      // Clipped to the key positions as a whole (an empty block still sets
      // the range of keys the tile visits, as the row edges did).
      const int64_t kb = std::clamp(first, key_pos_first, key_pos_end);
      const int64_t ke = std::clamp(last, key_pos_first, key_pos_end);
      lo = std::min(lo, kb);
      hi = std::max(hi, ke);
      if (kb < ke)
        rects[rect_count++] = {std::max(first, pos_first) - pos_first, std::min(last, pos_end) - pos_first, kb, ke};
    }
  }
  if (p.causal) hi = std::min(hi, pos_end);

  float* log_count = scratch.log_count;
  log_count[0] = kNegInf;
  for (int64_t c = 1; c <= samples; ++c)
    log_count[c] = static_cast<float>(std::log(static_cast<double>(c) / static_cast<double>(samples)));

  RowState state = fresh_state(scratch, job.rows, dim);
  int64_t j0 = 0, j1 = 0;
  key_rows_of(p, lo, hi, &j0, &j1);
  double flops = 0;
  if (j0 < j1) {
    int64_t ldq = 0;
    const float* q = rows_as_f32(qv, job.i0, job.rows, scratch.q, &ldq);
    const int64_t width = job.rows;
    int32_t* counts = scratch.counts;  // [len + 1][width]
    auto add_log_weight = [&](float* st, int64_t ld, int64_t jt, int64_t len) {
      const int64_t tile_pos = p.k_pos0 + jt;
      // A rectangle adds 1 along its rows at its first key and takes it
      // away at its end; a prefix sum down the keys then leaves c_ij.
      std::fill_n(counts, (len + 1) * width, 0);
      for (const BlockRect& r : std::span<const BlockRect>(rects, static_cast<size_t>(rect_count))) {
        const int64_t c0 = std::max(r.key_begin, tile_pos) - tile_pos;
        const int64_t c1 = std::min(r.key_end, tile_pos + len) - tile_pos;
        if (c0 >= c1) continue;
        int32_t* open = counts + c0 * width;
        int32_t* close = counts + c1 * width;
        for (int64_t i = r.row_begin; i < r.row_end; ++i) {
          open[i] += 1;
          close[i] -= 1;
        }
      }
      add_counted_log_weight(st, ld, counts, width, job.rows, 0, len, tile_pos, pos_first, p.causal, log_count);
    };
    flops = attend(q, ldq, job.rows, kv, vv, j0, j1, static_cast<float>(p.scale), add_log_weight, scratch, state);
  }
  write_rows(p, job.b, job.h, job.i0, job.rows, state, scratch.lse_shift, scratch.out_row);
  return flops;
}

LshAlgorithm choose_lsh_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  // Banded keeps 48 bytes per (row, sample) of block edges per thread; past
  // this it is the per-sample reduction whatever the cost.
  constexpr int64_t kBandedScratchLimit = int64_t{256} << 20;
  if (scratch_bytes(p, /*banded=*/true) > kBandedScratchLimit) return LshAlgorithm::kPerSample;

  // Cost in FLOPs per (batch item, head): the GEMM work of each algorithm
  // plus, for the per-sample reduction, a fixed cost per block visit (two
  // small tile products and the row bookkeeping, ~1 us or 1e5 FLOPs, a
  // figure measured on OpenBLAS's small-matrix calls and kept since).
  constexpr double kBlockVisitFlops = 1e5;
  const double rows = static_cast<double>(p.q_len);
  const double keys = static_cast<double>(p.kv_len);
  const double per_key = 4.0 * static_cast<double>(p.head_dim);
  const double causal_share = p.causal ? 0.5 : 1.0;  // keys before the query, on average
  double per_sample = 0, banded = 0;
  for (const std::vector<Draw>& head : draws) {
    double max_pitch = 0;
    for (const Draw& d : head) {
      const double pitch = std::min(d.pitch, keys);  // +inf (slope 0) -> one block
      max_pitch = std::max(max_pitch, pitch);
      per_sample += rows * pitch * causal_share * per_key;
      per_sample += (std::ceil(rows / pitch) + rows / static_cast<double>(row_tile(Mode::kLsh))) * kBlockVisitFlops;
    }
    const double band = std::min(keys, static_cast<double>(row_tile(Mode::kLsh)) + 2.0 * max_pitch);
    banded += rows * band * causal_share * per_key;
  }
  return per_sample < banded ? LshAlgorithm::kPerSample : LshAlgorithm::kBanded;
}

}  // namespace plsh::cpu
