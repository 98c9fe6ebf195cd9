#include "cuda/tile_plan.h"

#include <algorithm>
#include <map>
#include <string>

#include "plsh/draws.h"

namespace plsh::cuda {

namespace {
// Beyond 2^52 positions stop being exact in double, and a reach that large
// only widens spans that are clamped to the key range anyway.
constexpr double kMaxBoundedReach = 4.0e15;
// cuBLAS takes the batch count as an int, and one slot is one thread block.
constexpr int64_t kMaxSlots = int64_t{1} << 22;
}  // namespace

int64_t lsh_reach(double pitch) {
  if (!(pitch < kMaxBoundedReach)) return -1;  // also +inf (slope 0) and NaN
  return static_cast<int64_t>(std::ceil(pitch)) + 1;
}

int64_t window_reach(int64_t window) {
  if (window <= 0) return 0;
  if (static_cast<double>(window) > kMaxBoundedReach) return -1;
  return window - 1;
}

int64_t key_cols_for(int64_t width, int64_t kv_len) {
  int64_t cols = kMinKeyCols;
  while (cols < width && cols < kMaxKeyCols) cols *= 2;
  return std::min(cols, kv_len);
}

StatusOr<WorkspacePlan> plan_workspace(const WorkspaceShape& s, int64_t budget_bytes) {
  if (s.lanes < 1 || s.q_len < 1 || s.kv_len < 1 || s.head_dim < 1 || s.elem_bytes < 1)
    return invalid_argument("workspace shape: lanes, q_len, kv_len, head_dim and elem_bytes must be >= 1");
  WorkspacePlan p;
  p.tile_rows = std::min(kTileRows, s.q_len);
  p.key_cols = std::min(kMaxKeyCols, s.kv_len);
  const int64_t T = p.tile_rows;
  p.bytes_per_slot = T * p.key_cols * (4 + s.elem_bytes)  // fp32 scores, probabilities in the input dtype
                     + T * s.head_dim * 4                  // fp32 partial output of the second GEMM
                     + T * 2 * 4                           // its row max and row sum
                     + T * (s.head_dim + 2) * 4            // running accumulators, max and sum
                     + 6 * 8                               // cuBLAS pointer arrays
                     + static_cast<int64_t>(sizeof(TileDesc));
  const int64_t max_slots = std::min(kMaxSlots, budget_bytes / p.bytes_per_slot);
  if (max_slots < 1)
    return resource_exhausted("cuda workspace: one " + std::to_string(T) + "-row tile needs " +
                              std::to_string(p.bytes_per_slot) + " bytes, memory budget left is " +
                              std::to_string(budget_bytes) + " bytes");
  const int64_t tiles = ceil_div(s.q_len, T);
  // Lanes are the finalize kernel's grid.y, at most 65535.
  p.lanes_per_chunk = std::min({s.lanes, max_slots, int64_t{65535}});
  p.tiles_per_chunk = std::min(tiles, max_slots / p.lanes_per_chunk);
  p.slots = p.lanes_per_chunk * p.tiles_per_chunk;
  p.bytes = p.slots * p.bytes_per_slot;
  return p;
}

SpanShape span_shape(const AttentionParams& p) {
  SpanShape s;
  s.q_len = p.q_len;
  s.kv_len = p.kv_len;
  s.qk_offset = p.q_pos0 - p.k_pos0;
  s.causal = p.causal;
  s.tile_rows = std::min(kTileRows, p.q_len);
  return s;
}

std::vector<LaneSetup> head_passes(const AttentionParams& p) {
  std::vector<LaneSetup> heads(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) {
    LaneSetup& setup = heads[static_cast<size_t>(h)];
    LanePass base;
    base.head = static_cast<int32_t>(h);
    base.slope = static_cast<float>(p.slopes[static_cast<size_t>(h)]);
    const double sigma = p.sigma(h);
    if (p.mode == Mode::kLsh && std::isfinite(sigma)) {
      for (const Draw& d : draw_hashes(p.seed, h, sigma, p.samples)) {
        LanePass l = base;
        l.rule = SpanRule::kSameBin;
        l.slope = 0;
        l.pitch = d.pitch;
        l.shift = d.shift;
        l.reach = lsh_reach(d.pitch);
        setup.passes.push_back(l);
      }
    } else if (p.mode == Mode::kWindow && p.window[static_cast<size_t>(h)] != kNoWindow) {
      LanePass l = base;
      l.rule = SpanRule::kWindow;
      l.window = p.window[static_cast<size_t>(h)];
      l.reach = window_reach(l.window);
      setup.passes.push_back(l);
    } else {
      LanePass l = base;
      l.rule = SpanRule::kAll;
      l.reach = -1;
      setup.passes.push_back(l);
    }
  }
  return heads;
}

float lse_offset(const LaneSetup& head, int64_t samples) {
  return !head.passes.empty() && head.passes.front().rule == SpanRule::kSameBin ? std::log(static_cast<float>(samples))
                                                                                : 0.0f;
}

std::vector<Round> plan_rounds(const SpanShape& shape, const std::vector<LaneSetup>& lanes, int64_t tile_begin,
                               int64_t tile_end, std::vector<LanePass>* table) {
  std::vector<Round> rounds;
  size_t max_passes = 0;
  for (const LaneSetup& l : lanes) max_passes = std::max(max_passes, l.passes.size());

  struct Item {
    size_t lane;
    int64_t chunks;
  };
  for (size_t k = 0; k < max_passes; ++k) {
    // Lanes whose spans need the same chunk width share a batch; a wider
    // span takes more rounds, not a wider GEMM for everyone.
    std::map<int64_t, std::vector<Item>> by_cols;
    for (size_t li = 0; li < lanes.size(); ++li) {
      if (k >= lanes[li].passes.size()) continue;
      const int64_t width = max_span_width(shape, lanes[li].passes[k].reach);
      const int64_t cols = key_cols_for(width, shape.kv_len);
      by_cols[cols].push_back({li, ceil_div(width, cols)});
    }
    for (const auto& [cols, items] : by_cols) {
      int64_t max_chunks = 0;
      for (const Item& it : items) max_chunks = std::max(max_chunks, it.chunks);
      for (int64_t c = 0; c < max_chunks; ++c) {
        Round r;
        r.pass = static_cast<int64_t>(k);
        r.key_cols = cols;
        r.chunk = c;
        r.lane_begin = static_cast<int64_t>(table->size());
        for (const Item& it : items) {
          if (it.chunks <= c) continue;
          LanePass l = lanes[it.lane].passes[k];
          int64_t first = tile_begin;
          if (l.reach < 0 && shape.causal) {
            // Unbounded causal spans grow with the tile: skip the tiles whose
            // span ends before this chunk starts (half the square).
            int64_t lo = tile_begin, hi = tile_end;
            while (lo < hi) {
              const int64_t mid = lo + (hi - lo) / 2;
              const KeySpan sp = tile_key_span(shape, l.reach, mid);
              if (sp.end - sp.begin > c * cols) hi = mid;
              else lo = mid + 1;
            }
            first = lo;
          }
          if (first >= tile_end) continue;
          l.tile_begin = first;
          l.tile_end = tile_end;
          l.slot_begin = r.slots;
          r.slots += tile_end - first;
          table->push_back(l);
        }
        r.lane_end = static_cast<int64_t>(table->size());
        if (r.slots > 0) rounds.push_back(r);
      }
    }
  }
  return rounds;
}

std::vector<LaneSetup> chunk_lanes(const std::vector<LaneSetup>& heads, int64_t num_heads, int64_t lane0, int64_t lane1) {
  std::vector<LaneSetup> setups(static_cast<size_t>(lane1 - lane0));
  for (int64_t g = lane0; g < lane1; ++g) {
    LaneSetup& s = setups[static_cast<size_t>(g - lane0)];
    s = heads[static_cast<size_t>(g % num_heads)];
    for (LanePass& l : s.passes) {
      l.acc_lane = static_cast<int32_t>(g - lane0);
      l.batch = static_cast<int32_t>(g / num_heads);
    }
  }
  return setups;
}

}  // namespace plsh::cuda
