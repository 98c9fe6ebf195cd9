// mask_max_err (SPEC section 6): max |L*_ij - M~_ij| over the request's
// positions, exact at the step ends of M~; and the positions, blocks and
// row samples the other estimates share.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "estimates_internal.h"

namespace plsh {

using namespace estimates_detail;

namespace {

MaskMaxError lsh_mask_max_error(const HeadMask& m, const PositionRange& r, int64_t row_budget, uint64_t seed,
                                const ExecContext* ctx) {
  MaskMaxError out;
  const std::vector<int64_t> rows = sample_indices(r.q_len, row_budget, seed);
  out.rows_checked = static_cast<int64_t>(rows.size());
  out.rows_sampled = out.rows_checked < r.q_len;
  if (mask_is_exact(m, r) || m.draws.empty()) return out;

  const size_t s = m.draws.size();
  const double inv_s = 1.0 / static_cast<double>(s);
  const DecayTable lstar(m.sigma, max_distance(r));
  std::vector<int64_t> begins(s), ends(s), end_bins(s), sorted_begins(s), sorted_ends(s);
  struct Move {
    int64_t old_begin, old_end, new_begin, new_end;
  };
  std::vector<Move> moves(s);  // [0, moved): this row's
  size_t moved = 0;
  auto replace_sorted = [](std::vector<int64_t>& v, int64_t old_value, int64_t new_value) {
    v.erase(std::lower_bound(v.begin(), v.end(), old_value));
    v.insert(std::upper_bound(v.begin(), v.end(), new_value), new_value);
  };
  // Where the row's blocks span few positions (short pitches, many hashes)
  // the step function is counted over those positions instead of sorting
  // its 2s edges: O(s + span) instead of O(s log s) a row. s = 256, sigma = 2:
  // the sort was a third of the estimates' time.
  const double sort_cost = 2.0 * static_cast<double>(s) * std::log2(static_cast<double>(s) + 1);
  std::vector<int32_t> left_count, right_count;
  bool sorted_stale = true;  // the sorted edges do not follow begins / ends
  bool first = true;
  // Rows whose blocks are the same in every hash (a cell) share M~'s step
  // function. For a key left or right of the cell, L* is monotone in the
  // row, so |L* - M~| is largest at the cell's first or last row; inside it
  // M~ = 1 and the farthest pair is (last row, first key) or (first row,
  // last key). So when every row is checked, a cell's first and last rows
  // give its maximum exactly and the rows between are skipped: sigma = 256,
  // s = 16, n = 32768: about 2000 rows instead of 32768.
  const bool consecutive = !out.rows_sampled;
  // The running maximum in a register: as out.value, every key's max waited
  // on the last one's store (a sixth of this function's samples, perf).
  double worst = 0;
  size_t visited = 0;
  for (size_t n = 0, next = 1; n < rows.size(); n = next, next = n + 1) {
    if (visited++ % 1024 == 0 && stop_requested(ctx)) {
      out.stopped = true;
      out.value = worst;
      return out;
    }
    const int64_t pos = r.q_pos0 + rows[n];
    const int64_t k_lo = r.k_pos0;
    const int64_t k_hi = r.causal ? std::min(r.k_pos0 + r.kv_len - 1, pos) : r.k_pos0 + r.kv_len - 1;
    if (k_hi < k_lo) continue;
    // Rows ascend, so each hash's block only moves forward. The sorted
    // edges are kept up to date move by move while few blocks move (long
    // blocks, consecutive rows), else sorted afresh.
    moved = 0;
    for (size_t k = 0; k < s; ++k) {
      if (first || pos >= ends[k]) {
        // Blocks tile the line: the next block begins where this one ends,
        // which spares a block_begin (floor divisions) per block, and its
        // bin is the last end's (block_end_in_bin).
        const Draw& d = m.draws[k];
        int64_t b = ends[k], e = pos, bin = 0;
        if (!first) e = block_end_in_bin(b, end_bins[k], d, &bin);
        if (first || pos >= e) {
          b = block_begin(pos, d);
          e = block_end_in_bin(pos, bin_of(pos, d), d, &bin);
        }
        end_bins[k] = bin;
        moves[moved++] = {begins[k], ends[k], b, e};
        begins[k] = b;
        ends[k] = e;
      }
    }
    first = false;
    // The blocks' hull [lo, hi) and their nearest end, in one pass.
    int64_t lo = INT64_MAX, hi = INT64_MIN, nearest_end = INT64_MAX;
    for (size_t k = 0; k < s; ++k) {
      lo = std::min(lo, begins[k]);
      hi = std::max(hi, ends[k]);
      nearest_end = std::min(nearest_end, ends[k]);
    }
    if (consecutive) {
      // The cell of pos ends at the nearest block end: go on at its last row.
      const int64_t cell_last = nearest_end - 1;
      const int64_t last_row = std::min<int64_t>(r.q_len - 1, cell_last - r.q_pos0);
      next = static_cast<size_t>(std::max<int64_t>(last_row, rows[n] + 1));  // rows[n] == n
    }
    if (hi - lo <= (int64_t{1} << 16) && static_cast<double>(hi - lo) < sort_cost) {
      // M~(x) = #{begin_k <= x} / s left of pos, #{end_k > x} / s right of
      // it: counted over [lo, hi); 0 outside, where |L* - M~| = L* peaks at
      // the allowed key nearest pos.
      sorted_stale = true;
      const size_t span = static_cast<size_t>(hi - lo);
      // Zero beyond what earlier rows touched; they reset their own entries.
      if (left_count.size() <= span) {
        left_count.resize(span + 1, 0);
        right_count.resize(span + 1, 0);
      }
      for (size_t k = 0; k < s; ++k) {
        ++left_count[static_cast<size_t>(begins[k] - lo)];
        ++right_count[static_cast<size_t>(ends[k] - 1 - lo)];
      }
      auto check = [&](int64_t x, int64_t count) {
        if (x < k_lo || x > k_hi) return;
        worst = std::max(worst, std::fabs(lstar(std::llabs(pos - x)) - static_cast<double>(count) * inv_s));
      };
      check(lo - 1, 0);
      check(hi, 0);
      // Left of pos (lo <= pos < hi), then right of it, each running count
      // begun at the hull's edge and checked only over the allowed keys.
      int64_t count = 0, x = lo;
      for (; x < std::min(k_lo, pos + 1); ++x) count += left_count[static_cast<size_t>(x - lo)];
      for (const int64_t last = std::min(pos, k_hi); x <= last; ++x) {
        count += left_count[static_cast<size_t>(x - lo)];
        worst = std::max(worst, std::fabs(lstar(pos - x) - static_cast<double>(count) * inv_s));
      }
      count = 0;
      x = hi - 1;
      for (; x > k_hi && x >= pos; --x) count += right_count[static_cast<size_t>(x - lo)];
      for (const int64_t last = std::max(pos, k_lo); x >= last; --x) {
        count += right_count[static_cast<size_t>(x - lo)];
        worst = std::max(worst, std::fabs(lstar(x - pos) - static_cast<double>(count) * inv_s));
      }
      for (size_t k = 0; k < s; ++k) {
        left_count[static_cast<size_t>(begins[k] - lo)] = 0;
        right_count[static_cast<size_t>(ends[k] - 1 - lo)] = 0;
      }
      continue;
    }
    if (sorted_stale || moved * 8 > s) {
      sorted_begins = begins;
      sorted_ends = ends;
      std::sort(sorted_begins.begin(), sorted_begins.end());
      std::sort(sorted_ends.begin(), sorted_ends.end());
      sorted_stale = false;
    } else {
      for (size_t k = 0; k < moved; ++k) {
        const Move& mv = moves[k];
        replace_sorted(sorted_begins, mv.old_begin, mv.new_begin);
        replace_sorted(sorted_ends, mv.old_end, mv.new_end);
      }
    }
    // M~ is a step function of the key position x: left of pos it is k/s on
    // [begin_(k), begin_(k+1) - 1] (the sorted block starts), right of pos
    // (s - k)/s on [end_(k), end_(k+1) - 1]. L* is monotone on each side, so
    // |L* - M~| peaks at a piece's first or last allowed key.
    auto piece = [&](int64_t lo, int64_t hi, double mask) {
      lo = std::max(lo, k_lo);
      hi = std::min(hi, k_hi);
      if (lo > hi) return;
      worst = std::max(
          {worst, std::fabs(lstar(std::llabs(pos - lo)) - mask), std::fabs(lstar(std::llabs(pos - hi)) - mask)});
    };
    for (size_t k = 0; k <= s; ++k) {
      const int64_t lo = k == 0 ? INT64_MIN : sorted_begins[k - 1];
      const int64_t hi = k == s ? pos : sorted_begins[k] - 1;
      piece(lo, hi, static_cast<double>(k) * inv_s);
    }
    for (size_t k = 0; k <= s; ++k) {
      const int64_t lo = k == 0 ? pos : sorted_ends[k - 1];
      const int64_t hi = k == s ? INT64_MAX : sorted_ends[k] - 1;
      piece(lo, hi, static_cast<double>(s - k) * inv_s);
    }
  }
  out.value = worst;
  return out;
}

// Window: the error sits on the excluded pairs, where it equals L*, so the
// maximum is L* at the smallest excluded distance present in the request.
MaskMaxError window_mask_max_error(const HeadMask& m, const PositionRange& r) {
  MaskMaxError out;
  out.rows_checked = r.q_len;
  if (mask_is_exact(m, r)) return out;
  const int64_t w = m.window;  // <= max_distance(r), so pos +- w cannot overflow
  int64_t nearest = INT64_MAX;
  for (int64_t i = 0; i < r.q_len; ++i) {
    const int64_t pos = r.q_pos0 + i;
    const int64_t k_lo = r.k_pos0;
    const int64_t k_hi = r.causal ? std::min(r.k_pos0 + r.kv_len - 1, pos) : r.k_pos0 + r.kv_len - 1;
    if (k_hi < k_lo) continue;
    const int64_t left = std::min(k_hi, pos - w);  // nearest key at or beyond distance w on the left
    if (left >= k_lo) nearest = std::min(nearest, pos - left);
    const int64_t right = std::max(k_lo, pos + w);
    if (right <= k_hi) nearest = std::min(nearest, right - pos);
  }
  if (nearest != INT64_MAX) out.value = decay(nearest, m.sigma);
  return out;
}

}  // namespace

PositionRange position_range(const AttentionParams& p) {
  return PositionRange{p.q_pos0, p.q_len, p.k_pos0, p.kv_len, p.causal};
}

int64_t max_block_size(std::span<const Draw> draws, const PositionRange& r) {
  // The query and key ranges, merged when they touch: walking the hull of
  // two far-apart ranges (offsets reach 2^52) would never end.
  struct Span {
    int64_t lo, hi;  // [lo, hi)
  };
  Span spans[2] = {{r.q_pos0, r.q_pos0 + r.q_len}, {r.k_pos0, r.k_pos0 + r.kv_len}};
  if (spans[1].lo < spans[0].lo) std::swap(spans[0], spans[1]);
  int span_count = 2;
  if (spans[1].lo <= spans[0].hi) {
    spans[0].hi = std::max(spans[0].hi, spans[1].hi);
    span_count = 1;
  }
  for (const Draw& d : draws) {
    if (!std::isfinite(d.pitch)) {  // one block holds every position
      int64_t all = 0;
      for (int i = 0; i < span_count; ++i) all += spans[i].hi - spans[i].lo;
      return all;
    }
  }
  // No block holds more than most(d) positions: integers p1 < p2 of one bin
  // have (p2 - p1) / pitch < 1 but for the rounding of (p - u) / pitch, a
  // few ulps of |p - u| / pitch at each end (`slack` positions). So the
  // hashes go by decreasing pitch, a hash whose most cannot beat the
  // largest block found is not walked, and a walk stops at a block of its
  // most: s = 16 at sigma = 2 over 32768 positions walked all 130k blocks,
  // four divisions each, for the one figure.
  double reach = 1;  // largest |p| over the spans (at least 1)
  for (int i = 0; i < span_count; ++i) reach = std::max(reach, std::fabs(static_cast<double>(spans[i].hi)));
  for (int i = 0; i < span_count; ++i) reach = std::max(reach, std::fabs(static_cast<double>(spans[i].lo)));
  auto most = [&](const Draw& d) {
    const double slack = 1e-15 * (reach + std::fabs(d.shift));
    const double bound = std::floor(d.pitch * (1 + 1e-15) + slack) + 1;
    return bound < 4e18 ? static_cast<int64_t>(bound) : std::numeric_limits<int64_t>::max();
  };
  std::vector<const Draw*> order;
  for (const Draw& d : draws) order.push_back(&d);
  std::sort(order.begin(), order.end(), [](const Draw* a, const Draw* b) { return a->pitch > b->pitch; });
  int64_t best = 0;
  for (const Draw* hash : order) {
    const Draw& d = *hash;
    const int64_t cap = most(d);
    if (cap <= best) continue;
    // A block reaching across the gap counts its positions in both spans.
    int64_t last_bin = 0, last_size = 0;
    bool any = false;
    for (int i = 0; i < span_count && best < cap; ++i) {
      int64_t bin = bin_of(spans[i].lo, d);
      for (int64_t pos = spans[i].lo; pos < spans[i].hi && best < cap;) {
        int64_t next_bin;
        const int64_t end = std::min(block_end_in_bin(pos, bin, d, &next_bin), spans[i].hi);
        int64_t size = end - pos;
        if (any && bin == last_bin) size += last_size;
        best = std::max(best, size);
        last_bin = bin;
        last_size = size;
        any = true;
        pos = end;
        bin = next_bin;
      }
    }
  }
  return best;
}

HeadMask head_mask(const Plan& plan, int64_t h) {
  const AttentionParams& p = plan.params;
  HeadMask m;
  m.mode = p.mode;
  m.sigma = p.sigma(h);
  if (uses_draws(p.mode) && static_cast<size_t>(h) < plan.draws.size()) m.draws = plan.draws[static_cast<size_t>(h)];
  if (p.mode == Mode::kWindow && !p.window.empty()) m.window = p.window[static_cast<size_t>(h)];
  return m;
}

std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> out;
  if (n <= 0 || count <= 0) return out;
  if (count >= n) {
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  out.reserve(static_cast<size_t>(count));
  using u128 = unsigned __int128;
  for (int64_t t = 0; t < count; ++t) {
    // Stratum t is [floor(t n / count), floor((t + 1) n / count)): never
    // empty since n > count, and disjoint from the others.
    const int64_t lo = static_cast<int64_t>(static_cast<u128>(t) * static_cast<u128>(n) / static_cast<u128>(count));
    const int64_t hi = static_cast<int64_t>(static_cast<u128>(t + 1) * static_cast<u128>(n) / static_cast<u128>(count));
    const double u =
        static_cast<double>(mix64(seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(t + 1)) >> 11) * 0x1.0p-53;
    const int64_t pick = lo + static_cast<int64_t>(u * static_cast<double>(hi - lo));
    out.push_back(std::min(pick, hi - 1));
  }
  return out;
}

MaskMaxError mask_max_error(const HeadMask& m, const PositionRange& r, int64_t row_budget, uint64_t sample_seed,
                            const ExecContext* ctx) {
  if (m.mode == Mode::kWindow) return window_mask_max_error(m, r);
  return lsh_mask_max_error(m, r, row_budget, sample_seed, ctx);
}

}  // namespace plsh
