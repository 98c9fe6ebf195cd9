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

#include "cpu/tiles.h"

namespace plsh::cpu {

namespace {

// Adds nothing; masks keys after the query when causal. pos_row0 is the
// position of the first of `rows` query rows.
struct CausalMask {
  const AttentionParams& p;
  int64_t pos_row0;
  int64_t rows;

  void operator()(float* s, int64_t jt, int64_t len) const {
    if (!p.causal) return;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first_masked = std::clamp<int64_t>(pos_row0 + r - (p.k_pos0 + jt) + 1, 0, len);
      std::fill(s + r * len + first_masked, s + (r + 1) * len, kNegInf);
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
  std::fill_n(scratch.lse_shift.data(), job.rows, -std::log(static_cast<double>(p.samples)));
  int64_t ldq = 0;
  const float* q = rows_as_f32(qv, job.i0, job.rows, scratch.q.data(), &ldq);
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
  write_rows(p, job.b, job.h, job.i0, job.rows, state, scratch.lse_shift.data(), scratch.out_row.data());
  return flops;
}

double lsh_banded_tile(const AttentionParams& p, const TileJob& job, const std::vector<Draw>& draws,
                       Scratch& scratch) {
  const int64_t dim = p.head_dim;
  const int64_t samples = static_cast<int64_t>(draws.size());
  const SliceView qv = q_slice(p, job.b, job.h), kv = k_slice(p, job.b, job.h), vv = v_slice(p, job.b, job.h);
  const int64_t pos_first = p.q_pos0 + job.i0;
  const int64_t key_pos_first = p.k_pos0, key_pos_end = p.k_pos0 + p.kv_len;

  // Each row's block under each hash, clipped to the key positions (a block
  // clipped to nothing adds +1 and -1 at one edge: no weight anywhere).
  int64_t* begins = scratch.begins.data();
  int64_t* ends = scratch.ends.data();
  for (int64_t k = 0; k < samples; ++k) {
    const Draw& d = draws[static_cast<size_t>(k)];
    int64_t first = block_begin(pos_first, d), last = block_end(pos_first, d);
    for (int64_t r = 0; r < job.rows; ++r) {
      while (pos_first + r >= last) {
        first = last;
        last = block_end(first, d);
      }
      begins[r * samples + k] = std::clamp(first, key_pos_first, key_pos_end);
      ends[r * samples + k] = std::clamp(last, key_pos_first, key_pos_end);
    }
  }

  float* log_count = scratch.log_count.data();
  log_count[0] = kNegInf;
  for (int64_t c = 1; c <= samples; ++c)
    log_count[c] = static_cast<float>(std::log(static_cast<double>(c) / static_cast<double>(samples)));

  // Merge the sorted begins and ends into edges: after edge t (up to the
  // next) the count is #(begins <= edge) - #(ends <= edge).
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t r = 0; r < job.rows; ++r) {
    int64_t* rb = begins + r * samples;
    int64_t* re = ends + r * samples;
    std::sort(rb, rb + samples);
    std::sort(re, re + samples);
    int64_t* edges = scratch.edges.data() + r * 2 * samples;
    float* log_w = scratch.edge_log_w.data() + r * 2 * samples;
    int64_t ib = 0, ie = 0, count = 0, n = 0;
    while (ib < samples || ie < samples) {
      const int64_t at = std::min(ib < samples ? rb[ib] : std::numeric_limits<int64_t>::max(),
                                  ie < samples ? re[ie] : std::numeric_limits<int64_t>::max());
      while (ib < samples && rb[ib] == at) ++count, ++ib;
      while (ie < samples && re[ie] == at) --count, ++ie;
      edges[n] = at;
      log_w[n] = log_count[count];
      ++n;
    }
    scratch.edge_count[static_cast<size_t>(r)] = static_cast<int32_t>(n);
    lo = std::min(lo, edges[0]);
    hi = std::max(hi, edges[n - 1]);
  }
  if (p.causal) hi = std::min(hi, pos_first + job.rows);

  RowState state = fresh_state(scratch, job.rows, dim);
  int64_t j0 = 0, j1 = 0;
  key_rows_of(p, lo, hi, &j0, &j1);
  double flops = 0;
  if (j0 < j1) {
    int64_t ldq = 0;
    const float* q = rows_as_f32(qv, job.i0, job.rows, scratch.q.data(), &ldq);
    auto add_log_weight = [&](float* s, int64_t jt, int64_t len) {
      const int64_t tile_pos = p.k_pos0 + jt;
      for (int64_t r = 0; r < job.rows; ++r) {
        float* sr = s + r * len;
        const int64_t* edges = scratch.edges.data() + r * 2 * samples;
        const float* log_w = scratch.edge_log_w.data() + r * 2 * samples;
        const int64_t n = scratch.edge_count[static_cast<size_t>(r)];
        int64_t col = 0;
        auto run_until = [&](int64_t end_pos, float w) {
          const int64_t stop = std::clamp<int64_t>(end_pos - tile_pos, col, len);
          if (w == kNegInf) {
            std::fill(sr + col, sr + stop, kNegInf);
          } else {
#pragma omp simd
            for (int64_t c = col; c < stop; ++c) sr[c] += w;
          }
          col = stop;
        };
        run_until(edges[0], kNegInf);
        for (int64_t t = 0; t + 1 < n; ++t) run_until(edges[t + 1], log_w[t]);
        std::fill(sr + col, sr + len, kNegInf);
        if (p.causal) {
          const int64_t first_masked = std::clamp<int64_t>(pos_first + r - tile_pos + 1, 0, len);
          std::fill(sr + first_masked, sr + len, kNegInf);
        }
      }
    };
    flops = attend(q, ldq, job.rows, kv, vv, j0, j1, static_cast<float>(p.scale), add_log_weight, scratch, state);
  }
  write_rows(p, job.b, job.h, job.i0, job.rows, state, scratch.lse_shift.data(), scratch.out_row.data());
  return flops;
}

LshAlgorithm choose_lsh_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  // Banded keeps 48 bytes per (row, sample) of block edges per thread; past
  // this it is the per-sample reduction whatever the cost.
  constexpr int64_t kBandedScratchLimit = int64_t{256} << 20;
  if (scratch_bytes(p, /*banded=*/true) > kBandedScratchLimit) return LshAlgorithm::kPerSample;

  // Cost in FLOPs per (batch item, head): the GEMM work of each algorithm
  // plus, for the per-sample reduction, a fixed cost per block visit (two
  // small GEMM calls and the row bookkeeping, ~1 us or 1e5 FLOPs at
  // OpenBLAS's small-matrix rate).
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
