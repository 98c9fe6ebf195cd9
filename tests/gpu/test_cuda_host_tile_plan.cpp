// The CUDA backend's planning, checked on the host: the GPU derives every
// GEMM operand, mask range and accumulator row from these same functions,
// so a pair missed or counted twice here would be a wrong output there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "cuda/backward_plan.h"
#include "cuda/workspace_slots.h"
#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "shaped.h"
#include "status_assert.h"

namespace plsh::cuda {
namespace {

using plsh::testing::shaped;

struct PlanCase {
  std::string name;
  int64_t q_len, kv_len, q_pos0, k_pos0;
  bool causal;
  // Passes of the single head: pitches for lsh hashes (inf: slope 0),
  // window widths, or exact.
  std::vector<double> pitches;
  std::vector<int64_t> windows;
  bool exact;
  int64_t tiles_per_chunk;  // 0: all
};

std::vector<LanePass> passes_of(const PlanCase& c, int64_t head) {
  std::vector<LanePass> passes;
  for (size_t k = 0; k < c.pitches.size(); ++k) {
    LanePass l;
    l.head = static_cast<int32_t>(head);
    l.rule = SpanRule::kSameBin;
    l.pitch = c.pitches[k];
    l.shift = c.pitches[k] * (0.13 + 0.29 * static_cast<double>((k + static_cast<size_t>(head)) % 3));
    l.reach = lsh_reach(l.pitch);
    passes.push_back(l);
  }
  for (int64_t w : c.windows) {
    LanePass l;
    l.head = static_cast<int32_t>(head);
    l.rule = SpanRule::kWindow;
    l.window = w;
    l.reach = window_reach(w);
    passes.push_back(l);
  }
  if (c.exact) {
    LanePass l;
    l.head = static_cast<int32_t>(head);
    l.rule = SpanRule::kAll;
    l.reach = -1;
    passes.push_back(l);
  }
  return passes;
}

// Ground truth from plsh::bin_of, independent of span_bin.
bool truth_allowed(const LanePass& l, bool causal, int64_t pq, int64_t pk) {
  if (causal && pk > pq) return false;
  const int64_t d = std::llabs(pq - pk);
  switch (l.rule) {
    case SpanRule::kAll:
      return true;
    case SpanRule::kWindow:
      return d < l.window;
    case SpanRule::kSameBin: {
      Draw draw;
      draw.pitch = l.pitch;
      draw.shift = l.shift;
      return bin_of(pq, draw) == bin_of(pk, draw);
    }
  }
  return false;
}

class TilePlanCoverage : public ::testing::TestWithParam<PlanCase> {};

// Every (query, key) pair a pass allows is seen by exactly one slot of one
// round, inside that slot's GEMM operands; no other pair is let through; each
// row is owned by one tile per round; and the operands never leave the
// tensors.
TEST_P(TilePlanCoverage, EveryAllowedPairExactlyOnceAndOperandsInBounds) {
  const PlanCase& c = GetParam();
  const SpanShape shape{.q_len = c.q_len,
                        .kv_len = c.kv_len,
                        .qk_offset = c.q_pos0 - c.k_pos0,
                        .causal = c.causal,
                        .tile_rows = std::min(kTileRows, c.q_len)};
  const int64_t lanes = 3;  // three heads with shifted draws
  std::vector<LaneSetup> setups(lanes);
  for (int64_t g = 0; g < lanes; ++g) {
    setups[g].passes = passes_of(c, g);
    for (LanePass& l : setups[g].passes) l.acc_lane = static_cast<int32_t>(g);
  }
  const size_t passes = setups[0].passes.size();
  const int64_t tiles = tile_count(shape);
  const int64_t per_chunk = c.tiles_per_chunk > 0 ? c.tiles_per_chunk : tiles;

  // seen[lane][pass][i * kv_len + j]
  std::vector<std::vector<std::vector<uint8_t>>> seen(
      lanes, std::vector<std::vector<uint8_t>>(passes, std::vector<uint8_t>(c.q_len * c.kv_len, 0)));
  int64_t rounds_total = 0;
  for (int64_t t0 = 0; t0 < tiles; t0 += per_chunk) {
    const int64_t t1 = std::min(tiles, t0 + per_chunk);
    std::vector<LanePass> table;
    const std::vector<Round> rounds = plan_rounds(shape, setups, t0, t1, &table);
    rounds_total += static_cast<int64_t>(rounds.size());
    for (const Round& r : rounds) {
      ASSERT_GE(r.key_cols, 1);
      ASSERT_LE(r.key_cols, std::min(kMaxKeyCols, c.kv_len));
      std::map<std::pair<int32_t, int64_t>, int> owners;  // (lane, row) -> tiles owning it in this round
      for (int64_t slot = 0; slot < r.slots; ++slot) {
        const TileDesc d = describe_slot(shape, r, table.data(), slot);
        ASSERT_GE(d.lane, r.lane_begin);
        ASSERT_LT(d.lane, r.lane_end);
        const LanePass& l = table[d.lane];
        ASSERT_EQ(static_cast<size_t>(r.pass) < setups[l.acc_lane].passes.size(), true);
        // GEMM operands inside the tensors.
        ASSERT_GE(d.row0, 0);
        ASSERT_LE(d.row0 + shape.tile_rows, c.q_len);
        ASSERT_GE(d.col0, 0);
        ASSERT_LE(d.col0 + r.key_cols, c.kv_len);
        // Owned rows and valid keys inside the operands, and inside the chunk's accumulator rows.
        ASSERT_GE(d.own_begin, d.row0);
        ASSERT_LE(d.own_end, d.row0 + shape.tile_rows);
        ASSERT_GE(d.own_begin, t0 * shape.tile_rows);
        ASSERT_LE(d.own_end, t1 * shape.tile_rows);
        ASSERT_LE(d.valid_begin, d.valid_end);
        if (d.valid_begin < d.valid_end) {
          ASSERT_GE(d.valid_begin, d.col0);
          ASSERT_LE(d.valid_end, d.col0 + r.key_cols);
        }
        for (int64_t i = d.own_begin; i < d.own_end; ++i) {
          ASSERT_EQ(++owners[std::make_pair(d.lane, i)], 1) << "row " << i << " owned twice in round pass " << r.pass;
          for (int64_t j = d.valid_begin; j < d.valid_end; ++j) {
            if (!pair_allowed(l, c.causal, c.q_pos0 + i, c.k_pos0 + j)) continue;
            ++seen[l.acc_lane][r.pass][i * c.kv_len + j];
          }
        }
      }
    }
  }
  EXPECT_GT(rounds_total, 0);
  for (int64_t g = 0; g < lanes; ++g) {
    for (size_t k = 0; k < passes; ++k) {
      const LanePass& l = setups[g].passes[k];
      int64_t allowed = 0;
      for (int64_t i = 0; i < c.q_len; ++i) {
        for (int64_t j = 0; j < c.kv_len; ++j) {
          const bool want = truth_allowed(l, c.causal, c.q_pos0 + i, c.k_pos0 + j);
          allowed += want ? 1 : 0;
          ASSERT_EQ(seen[g][k][i * c.kv_len + j], want ? 1 : 0)
              << "lane " << g << " pass " << k << " query row " << i << " key row " << j;
        }
      }
      // Cannot pass vacuously: every pass allows something here.
      EXPECT_GT(allowed, 0) << "lane " << g << " pass " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TilePlanCoverage,
    ::testing::Values(
        // Pitches near 1 (blocks of 1-3 rows share tiles), a pitch wider than
        // a tile, and one whose span needs two key chunks.
        PlanCase{"lsh_self_causal", 197, 197, 0, 0, true, {0.7, 1.3, 2.6, 17.5, 90.0}, {}, false, 0},
        PlanCase{"lsh_self_noncausal", 131, 131, 0, 0, false, {1.1, 3.9, 300.0}, {}, false, 0},
        PlanCase{"lsh_decode_tail_offsets", 37, 700, 663 + 1000, 1000, true, {1.6, 45.0, 320.0}, {}, false, 0},
        PlanCase{"lsh_negative_positions_chunked", 150, 260, -40, -150, false, {2.2, 33.3}, {}, false, 2},
        PlanCase{
            "lsh_large_positions", 90, 120, (int64_t{1} << 40) + 30, int64_t{1} << 40, true, {1.9, 12.7}, {}, false, 0},
        PlanCase{"window", 211, 211, 0, 0, true, {}, {1, 7, 64, 65, 600}, false, 0},
        PlanCase{"window_noncausal_chunked", 170, 300, 60, 0, false, {}, {3, 129}, false, 1},
        PlanCase{"exact_causal_two_chunks", 150, 1100, 950, 0, true, {}, {}, true, 0},
        PlanCase{"exact_noncausal", 70, 600, 0, 0, false, {}, {}, true, 1},
        PlanCase{"single_row", 1, 1, 0, 0, true, {0.9, 5.0}, {1}, true, 0},
        PlanCase{"short_keys", 100, 9, 0, 0, false, {1.5, 50.0}, {2}, true, 0}),
    [](const ::testing::TestParamInfo<PlanCase>& info) { return info.param.name; });

SpanShape self_shape(int64_t n, bool causal) {
  SpanShape s;
  s.q_len = s.kv_len = n;
  s.causal = causal;
  s.tile_rows = std::min(kTileRows, n);
  return s;
}

// Blocks of 1-3 rows must not become one GEMM each: a pass costs one slot
// per 64-row tile, whatever the number of blocks.
TEST(TilePlan, SmallPitchesPackManyBlocksPerTile) {
  const SpanShape shape = self_shape(8192, true);
  LaneSetup s;
  LanePass l;
  l.rule = SpanRule::kSameBin;
  l.pitch = 1.37;
  l.shift = 0.5;
  l.reach = lsh_reach(l.pitch);
  s.passes.push_back(l);
  std::vector<LanePass> table;
  const std::vector<Round> rounds = plan_rounds(shape, {s}, 0, tile_count(shape), &table);
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].slots, 8192 / kTileRows);
  EXPECT_EQ(rounds[0].key_cols, kMinKeyCols * 4);  // 64 rows + reach 3: 67 columns -> 128
  Draw d{l.pitch, l.shift};
  int64_t blocks = 0;
  for (int64_t pos = 0; pos < 8192; pos = block_end(pos, d)) ++blocks;
  EXPECT_GT(blocks, 20 * rounds[0].slots);
}

// Causal exact: the chunks past a tile's diagonal are not computed.
TEST(TilePlan, CausalExactSkipsChunksAboveTheDiagonal) {
  auto slots_for = [](bool causal) {
    const SpanShape shape = self_shape(4096, causal);
    LaneSetup s;
    LanePass l;
    l.rule = SpanRule::kAll;
    l.reach = -1;
    s.passes.push_back(l);
    std::vector<LanePass> table;
    int64_t slots = 0;
    for (const Round& r : plan_rounds(shape, {s}, 0, tile_count(shape), &table)) slots += r.slots;
    return slots;
  };
  const int64_t full = slots_for(false);
  const int64_t causal = slots_for(true);
  EXPECT_EQ(full, 64 * 8);  // 64 tiles x 4096 / 512 chunks
  // Tile t needs ceil(64 (t + 1) / 512) chunks: 288 over the 64 tiles.
  EXPECT_EQ(causal, 288);
}

// Lanes with narrow and wide spans go to different batches, so a wide head
// does not widen every GEMM.
TEST(TilePlan, LanesGroupByKeyColumns) {
  const SpanShape shape = self_shape(1024, true);
  std::vector<LaneSetup> setups(2);
  for (int g = 0; g < 2; ++g) {
    LanePass l;
    l.acc_lane = g;
    l.rule = SpanRule::kWindow;
    l.window = g == 0 ? 4 : 1000;
    l.reach = window_reach(l.window);
    setups[g].passes.push_back(l);
  }
  std::vector<LanePass> table;
  const std::vector<Round> rounds = plan_rounds(shape, setups, 0, tile_count(shape), &table);
  // 67 columns (-> 128) for the narrow lane; 1024 (all keys) in two chunks of 512 for the wide one.
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_EQ(rounds[0].key_cols, 128);
  EXPECT_EQ(rounds[0].lane_end - rounds[0].lane_begin, 1);
  for (size_t i = 1; i < rounds.size(); ++i) EXPECT_EQ(rounds[i].key_cols, kMaxKeyCols);
}

TEST(TilePlan, LshReachBoundsEveryBlock) {
  for (int64_t k = 0; k < 400; ++k) {
    const double sigma = k % 4 == 0 ? 0.8 : k % 4 == 1 ? 1.19 : k % 4 == 2 ? 6.0 : 70.0;
    const Draw d = draw_hash(99, k % 7, k, sigma);
    const int64_t reach = lsh_reach(d.pitch);
    for (int64_t pos = -500; pos < 3000;) {
      const int64_t end = block_end(pos, d);
      ASSERT_LE(end - block_begin(pos, d) - 1, reach) << "pitch " << d.pitch;
      pos = end;
    }
  }
  EXPECT_EQ(lsh_reach(std::numeric_limits<double>::infinity()), -1);
  EXPECT_EQ(lsh_reach(1e300), -1);
  EXPECT_EQ(window_reach(kNoWindow), -1);
}

TEST(TilePlan, HostBinsMatchBinOf) {
  for (int64_t k = 0; k < 64; ++k) {
    const Draw d = draw_hash(5, 3, k, k % 2 ? 1.3 : 211.0);
    for (int64_t pos :
         {int64_t{0}, int64_t{1}, int64_t{-7}, int64_t{12345}, (int64_t{1} << 45) + k, -(int64_t{1} << 50)})
      ASSERT_EQ(span_bin(pos, d.pitch, d.shift), bin_of(pos, d));
  }
}

TEST(TilePlan, KeyColumnsArePowersOfTwoWithinLimits) {
  EXPECT_EQ(key_cols_for(1, 1000), kMinKeyCols);
  EXPECT_EQ(key_cols_for(33, 1000), 64);
  EXPECT_EQ(key_cols_for(512, 1000), 512);
  EXPECT_EQ(key_cols_for(5000, 100000), kMaxKeyCols);
  EXPECT_EQ(key_cols_for(5000, 300), 300);  // never wider than the keys
}

WorkspaceShape shape_for(int64_t n) { return {.lanes = 32, .q_len = n, .kv_len = n, .head_dim = 128, .elem_bytes = 2}; }

TEST(Workspace, FitsTheBudgetAndDoesNotGrowWithN) {
  const int64_t budget = int64_t{1} << 30;
  int64_t per_slot = 0;
  for (int64_t n : {int64_t{1} << 13, int64_t{1} << 17, int64_t{1} << 19, int64_t{1} << 24}) {
    ASSERT_OK_AND_ASSIGN(WorkspaceSlots p, size_workspace(shape_for(n), budget));
    const WorkspaceShape s = shape_for(n);
    auto carved = [&](int64_t slots) {
      return carve_work(slots, p.tile_rows, p.key_cols, s.head_dim, s.elem_bytes, nullptr, nullptr, nullptr);
    };
    EXPECT_LE(carved(p.slots), budget);
    EXPECT_EQ(p.slots, p.lanes_per_chunk * p.tiles_per_chunk);
    EXPECT_EQ(p.bytes, p.slots * p.bytes_per_slot);
    if (per_slot == 0) per_slot = p.bytes_per_slot;
    EXPECT_EQ(p.bytes_per_slot, per_slot);
    // Fills the budget to within one lane's row of tiles, alignment included.
    EXPECT_GT(carved(p.slots + p.lanes_per_chunk), budget) << "n " << n;
  }
  // 64 rows x 512 columns of fp32 scores and bf16 probabilities, 64 x 128 fp32
  // partial and accumulator rows, stats and pointers.
  EXPECT_EQ(per_slot,
            64 * 512 * 6 + 64 * 128 * 4 + 64 * 8 + 64 * 130 * 4 + 48 + static_cast<int64_t>(sizeof(TileDesc)));
}

TEST(Workspace, SmallProblemTakesOneChunk) {
  WorkspaceShape s = shape_for(1000);
  s.lanes = 4;
  StatusOr<WorkspaceSlots> p = size_workspace(s, int64_t{1} << 32);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->lanes_per_chunk, 4);
  EXPECT_EQ(p->tiles_per_chunk, ceil_div(1000, 64));
}

TEST(Workspace, TightBudgetChunksOverLanes) {
  const WorkspaceShape s = shape_for(1 << 16);
  StatusOr<WorkspaceSlots> one = size_workspace(s, 1 << 20);
  ASSERT_TRUE(one.ok());
  EXPECT_LE(one->bytes, 1 << 20);
  EXPECT_EQ(one->tiles_per_chunk, 1);
  EXPECT_GE(one->lanes_per_chunk, 1);
  EXPECT_LT(one->lanes_per_chunk, 32);
}

TEST(Workspace, RefusesABudgetBelowOneTile) {
  StatusOr<WorkspaceSlots> p = size_workspace(shape_for(4096), 1000);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("device memory"), std::string::npos) << p.status().message();
}

// A slice of a carved buffer: where it starts and the bytes it must hold.
struct Slice {
  const void* at;
  int64_t bytes;
};

// The slices, listed in carving order, are aligned, disjoint, in that order,
// and inside the buffer.
void expect_carved_in_order(const std::vector<char>& buffer, std::initializer_list<Slice> slices) {
  int64_t end = 0;
  for (const Slice& s : slices) {
    const int64_t at = static_cast<const char*>(s.at) - buffer.data();
    EXPECT_EQ(at % kSliceAlign, 0);
    EXPECT_GE(at, end) << "slices overlap";
    end = at + s.bytes;
  }
  EXPECT_LE(end, static_cast<int64_t>(buffer.size()));
}

// A buffer of the bytes carve measures for `slots` slots (T = 64 rows, 512
// key columns, D = 40, 2-byte elements), carved into r and a.
template <typename Buffers>
std::vector<char> carved(int64_t (*carve)(int64_t, int64_t, int64_t, int64_t, int64_t, char*, Buffers*, Accumulators*),
                         int64_t slots, Buffers* r, Accumulators* a) {
  const int64_t bytes = carve(slots, 64, 512, 40, 2, nullptr, nullptr, nullptr);
  std::vector<char> buffer(static_cast<size_t>(bytes));
  EXPECT_EQ(carve(slots, 64, 512, 40, 2, buffer.data(), r, a), bytes);
  return buffer;
}

// The work buffers' slices, as the forward (carve_work) and the backward
// (carve_backward_work) carve them from one allocation.
TEST(Layout, WorkSlicesAreAlignedDisjointAndInside) {
  const int64_t T = 64, Kc = 512, Kp = key_pitch(Kc), D = 40, Dp = partial_pitch(D);
  const int64_t ptrs = 8, desc = static_cast<int64_t>(sizeof(TileDesc));
  for (int64_t S : {int64_t{1}, int64_t{3}, int64_t{1000}}) {
    SCOPED_TRACE(::testing::Message() << S << " slots");
    RoundBuffers r;
    Accumulators a;
    BackwardRoundBuffers b;
    Accumulators ba;
    const std::vector<char> forward = carved(carve_work, S, &r, &a);
    const std::vector<char> backward = carved(carve_backward_work, S, &b, &ba);
    // Two tables, their slices in carving order.
    // clang-format off
    expect_carved_in_order(forward,
        {{r.scores, S * T * Kp * 4}, {r.probs, S * T * Kp * 2}, {r.q_ptr, S * ptrs}, {r.k_ptr, S * ptrs},
         {r.v_ptr, S * ptrs}, {r.score_ptr, S * ptrs}, {r.prob_ptr, S * ptrs}, {r.desc, S * desc},
         {r.partial, S * T * Dp * 4}, {r.partial_ptr, S * ptrs}, {r.row_max, S * T * 4}, {r.row_sum, S * T * 4},
         {a.acc, S * T * D * 4}, {a.acc_max, S * T * 4}, {a.acc_sum, S * T * 4}});
    expect_carved_in_order(backward,
        {{b.scores, S * T * Kp * 4}, {b.probs, S * T * Kp * 2}, {b.q_ptr, S * ptrs}, {b.k_ptr, S * ptrs},
         {b.v_ptr, S * ptrs}, {b.score_ptr, S * ptrs}, {b.prob_ptr, S * ptrs}, {b.desc, S * desc},
         {b.ds, S * T * Kp * 2}, {b.ds_ptr, S * ptrs}, {b.dout_ptr, S * ptrs}, {b.dq_part, S * T * Dp * 4},
         {b.dq_ptr, S * ptrs}, {b.dk_part, S * Kc * Dp * 4}, {b.dk_ptr, S * ptrs}, {b.dv_part, S * Kc * Dp * 4},
         {b.dv_ptr, S * ptrs}, {ba.acc, S * T * D * 4}});
    // clang-format on
  }
}

AttentionParams layout_params(Mode mode, int64_t n, int64_t heads, int64_t samples) {
  StatusOr<AttentionParams> p = resolve_params(
      shaped({1, n, n, heads, 0, 64}, {.dtype = DType::kBF16, .causal = true, .mode = mode, .samples = samples}));
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return *p;
}

// What the plan charges is exactly what forward allocates (staging, tables,
// work), it stays under the cap, and a smaller cap makes smaller chunks.
TEST(Layout, PlanChargesWhatForwardAllocatesWithinTheCap) {
  const AttentionParams p = layout_params(Mode::kLsh, 8192, 8, 16);
  const std::vector<std::vector<Draw>> draws = plan_draws(p);
  for (int64_t cap : {int64_t{1} << 26, int64_t{1} << 30}) {
    ASSERT_OK_AND_ASSIGN(CudaLayout l, plan_layout(p, draws, cap));
    EXPECT_LE(l.device_bytes(), cap);
    EXPECT_EQ(l.staging_bytes, carve_staging(p, nullptr, nullptr));
    EXPECT_EQ(l.table_bytes, carve_tables(p.heads, l.table_entries, l.cublas_workspace_bytes, nullptr, nullptr));
    EXPECT_EQ(l.work_bytes,
              carve_work(l.work.slots, l.work.tile_rows, l.work.key_cols, p.head_dim, 2, nullptr, nullptr, nullptr));
    EXPECT_EQ(l.device_bytes(), l.staging_bytes + l.table_bytes + l.work_bytes);
  }
  StatusOr<CudaLayout> small = plan_layout(p, draws, int64_t{1} << 26);
  StatusOr<CudaLayout> large = plan_layout(p, draws, int64_t{1} << 30);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_LT(small->work.slots, large->work.slots);
  EXPECT_EQ(plan_layout(p, draws, carve_staging(p, nullptr, nullptr)).status().code(), StatusCode::kResourceExhausted);
}

// The passes are the plan's draws, not draws made again: changing the
// plan's draws changes the passes.
TEST(Layout, PassesReadThePlanDraws) {
  const AttentionParams p = layout_params(Mode::kLsh, 1000, 2, 5);
  std::vector<std::vector<Draw>> draws = plan_draws(p);
  draws[1][3].pitch = 123.25;
  draws[1][3].shift = 7.5;
  const std::vector<LaneSetup> heads = head_passes(p, draws);
  ASSERT_EQ(heads.size(), 2u);
  ASSERT_EQ(heads[1].passes.size(), 5u);
  for (size_t h = 0; h < 2; ++h)
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_EQ(heads[h].passes[k].pitch, draws[h][k].pitch);
      EXPECT_EQ(heads[h].passes[k].shift, draws[h][k].shift);
    }
}

// Every lane table a chunk builds fits the entries the plan sized.
TEST(Layout, LaneTablesFitThePlannedEntries) {
  for (const Mode mode : {Mode::kExact, Mode::kWindow, Mode::kLsh}) {
    const AttentionParams p = layout_params(mode, 3000, 3, 7);
    ASSERT_OK_AND_ASSIGN(CudaLayout l, plan_layout(p, plan_draws(p), int64_t{1} << 28));
    const SpanShape shape = span_shape(p);
    const int64_t lanes = p.batch * p.heads, tiles = tile_count(shape);
    for (int64_t lane0 = 0; lane0 < lanes; lane0 += l.work.lanes_per_chunk) {
      const int64_t lane1 = std::min(lanes, lane0 + l.work.lanes_per_chunk);
      const std::vector<LaneSetup> setups = chunk_lanes(l.heads, p.heads, lane0, lane1);
      for (int64_t t0 = 0; t0 < tiles; t0 += l.work.tiles_per_chunk) {
        std::vector<LanePass> table;
        plan_rounds(shape, setups, t0, std::min(tiles, t0 + l.work.tiles_per_chunk), &table);
        EXPECT_LE(static_cast<int64_t>(table.size()), l.table_entries) << mode_name(mode);
      }
    }
  }
}

// What a request may plan for (issue 15): the caller's share capped at the
// pool, or half the pool when the caller gives none.
TEST(Layout, RequestCapIsTheCallersShareOrHalfThePool) {
  EXPECT_EQ(request_device_cap(1000, 0), 500);
  EXPECT_EQ(request_device_cap(1000, 300), 300);
  EXPECT_EQ(request_device_cap(1000, 5000), 1000);
  EXPECT_EQ(cublas_workspace_for(int64_t{1} << 30), kCublasWorkspaceBytes);
  EXPECT_EQ(cublas_workspace_for(int64_t{1} << 20), kCublasMinWorkspaceBytes);
  const AttentionParams p = layout_params(Mode::kExact, 4096, 8, 0);
  ASSERT_OK_AND_ASSIGN(CudaLayout l, plan_layout(p, plan_draws(p), int64_t{1} << 30));
  EXPECT_EQ(l.cublas_workspace_bytes, kCublasWorkspaceBytes);
  EXPECT_GE(l.table_bytes, kCublasWorkspaceBytes) << "cuBLAS's workspace is charged with the tables";
}

// Forward carves for the params it is given; a plan sized for other params
// (device tensors bound as host ones, longer keys, more heads) is refused
// with INTERNAL before any buffer is carved past its end.
TEST(Layout, ForwardRefusesParamsThePlanDidNotSize) {
  AttentionParams p = layout_params(Mode::kExact, 1000, 4, 0);
  ASSERT_OK_AND_ASSIGN(CudaLayout l, plan_layout(p, plan_draws(p), int64_t{1} << 28));
  EXPECT_TRUE(check_layout_fits(l, p).ok());
  AttentionParams dev = p;
  dev.memory = MemorySpace::kDevice;
  StatusOr<CudaLayout> dl = plan_layout(dev, plan_draws(dev), int64_t{1} << 28);
  ASSERT_TRUE(dl.ok());
  EXPECT_EQ(dl->staging_bytes, 0);
  EXPECT_TRUE(check_layout_fits(*dl, dev).ok());
  const Status host_on_device_plan = check_layout_fits(*dl, p);
  EXPECT_EQ(host_on_device_plan.code(), StatusCode::kInternal);
  EXPECT_NE(host_on_device_plan.message().find("staging"), std::string::npos) << host_on_device_plan.message();
  AttentionParams wider = p;
  wider.head_dim = 128;
  wider.q_head_stride = wider.k_head_stride = wider.v_head_stride = wider.o_head_stride = 128;
  EXPECT_EQ(check_layout_fits(l, wider).code(), StatusCode::kInternal);
  const AttentionParams more_heads = layout_params(Mode::kExact, 1000, 8, 0);
  EXPECT_EQ(check_layout_fits(l, more_heads).code(), StatusCode::kInternal);
}

AttentionParams operand_params(DType dtype, int64_t n, int64_t kv, int64_t heads, int64_t kv_heads, int64_t dim,
                               MemorySpace memory) {
  StatusOr<AttentionParams> p =
      resolve_params(shaped({2, n, kv, heads, kv_heads, dim}, {.dtype = dtype, .causal = false, .mode = Mode::kExact}));
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  p->memory = memory;
  return *p;
}

// Every pointer the batched GEMMs get, and every leading dimension in
// bytes, is a multiple of 16 (issue 15: bf16 with D = 20 has a 40-byte head
// stride; cuBLAS cannot check pointers that live on the device, and a
// misaligned vector load loses the context). Host tensors are staged with
// padded rows; internal buffers have padded pitches.
TEST(CudaOperands, EveryGemmOperandIs16ByteAligned) {
  int64_t checked = 0;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t dim : {20, 40, 59, 64, 128})
      for (const auto& [n, kv] : {std::pair<int64_t, int64_t>{1, 9}, {97, 1025}, {70, 33}}) {
        const AttentionParams p = operand_params(dtype, n, kv, 4, 2, dim, MemorySpace::kHost);
        ASSERT_TRUE(check_operands(p).ok()) << check_operands(p).to_string();
        const OperandLayout o = operand_layout(p);
        const int64_t esz = o.elem_bytes;
        for (int64_t ld : {o.q_rs, o.k_rs, o.v_rs, o.q_hs, o.k_hs, o.q_bs, o.v_bs})
          ASSERT_EQ(ld * esz % 16, 0) << dtype_name(dtype) << " D " << dim;
        ASSERT_GE(o.q_hs, dim);
        const SpanShape shape = span_shape(p);
        const std::vector<LaneSetup> heads = head_passes(p, plan_draws(p));
        const std::vector<LaneSetup> lanes = chunk_lanes(heads, p.heads, 0, p.batch * p.heads);
        std::vector<LanePass> table;
        for (const Round& r : plan_rounds(shape, lanes, 0, tile_count(shape), &table)) {
          ASSERT_EQ(key_pitch(r.key_cols) * 4 % 16, 0);
          ASSERT_EQ(key_pitch(r.key_cols) * esz % 16, 0);
          ASSERT_EQ(partial_pitch(dim) * 4 % 16, 0);
          for (int64_t slot = 0; slot < r.slots; ++slot) {
            const TileDesc d = describe_slot(shape, r, table.data(), slot);
            const SlotOperands so =
                slot_operands(o, table[static_cast<size_t>(d.lane)], d, slot, shape.tile_rows, r.key_cols);
            for (int64_t off : {so.q, so.k, so.v, so.scores, so.probs, so.partial})
              ASSERT_EQ(off % 16, 0) << dtype_name(dtype) << " D " << dim << " n " << n << " slot " << slot;
            ++checked;
          }
        }
        // The staged copy holds B * N * H rows of D elements at the padded pitch.
        StagingBuffers sb;
        carve_staging(p, nullptr, &sb);
        EXPECT_EQ(sb.q_bytes, ((p.batch * n * p.heads - 1) * o.q_hs + dim) * esz);
        EXPECT_EQ(sb.k_bytes, ((p.batch * kv * p.kv_heads - 1) * o.k_hs + dim) * esz);
      }
  EXPECT_GT(checked, 1000);
  // The caller's own layout, which the kernels used before: bf16 D = 20 puts
  // odd heads 40 bytes in, which is what this test exists to catch.
  AttentionParams raw = operand_params(DType::kBF16, 97, 97, 4, 2, 20, MemorySpace::kDevice);
  const OperandLayout unpadded = operand_layout(raw);
  LanePass odd_head;
  odd_head.head = 1;
  TileDesc d{};
  EXPECT_NE(slot_operands(unpadded, odd_head, d, 0, 64, 64).q % 16, 0);
}

// Device tensors are read where they are: refused unless their strides and
// base pointers are 16-byte multiples, with a message that says what to do.
TEST(CudaOperands, UnalignedDeviceTensorsAreRefused) {
  const AttentionParams bad = operand_params(DType::kBF16, 64, 64, 4, 2, 20, MemorySpace::kDevice);
  const Status s = check_operands(bad);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("q head stride = 40 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("multiple of 8"), std::string::npos) << s.message();
  EXPECT_TRUE(check_operands(operand_params(DType::kBF16, 64, 64, 4, 2, 64, MemorySpace::kDevice)).ok());
  EXPECT_TRUE(check_operands(operand_params(DType::kF32, 64, 64, 4, 2, 20, MemorySpace::kDevice)).ok());
  EXPECT_EQ(check_operands(operand_params(DType::kF32, 64, 64, 4, 2, 59, MemorySpace::kDevice)).code(),
            StatusCode::kUnimplemented);
  AttentionParams shifted = operand_params(DType::kBF16, 64, 64, 4, 2, 64, MemorySpace::kDevice);
  alignas(16) static char buffer[64];
  shifted.q = buffer + 2;
  const Status at = check_operands(shifted);
  EXPECT_EQ(at.code(), StatusCode::kUnimplemented);
  EXPECT_NE(at.message().find("q device pointer"), std::string::npos) << at.message();
  // The same bf16 D = 20 from the host is fine: it is staged with padded rows.
  EXPECT_TRUE(check_operands(operand_params(DType::kBF16, 64, 64, 4, 2, 20, MemorySpace::kHost)).ok());
}

// No cublasGemmBatchedEx call gets more than 65535 matrices: the 128k exact
// benchmark (32 heads x 2048 tiles) makes 65536 per round.
TEST(CudaGemm, BatchesNeverExceed65535Matrices) {
  EXPECT_TRUE(gemm_batches(0).empty());
  const std::vector<GemmBatch> one = gemm_batches(1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].count, 1);
  const std::vector<GemmBatch> b = gemm_batches(65536);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].first, 0);
  EXPECT_EQ(b[0].count, 65535);
  EXPECT_EQ(b[1].first, 65535);
  EXPECT_EQ(b[1].count, 1);
  for (int64_t slots : {int64_t{65535}, int64_t{131070}, 3 * int64_t{65535} + 7, kMaxSlots}) {
    int64_t next = 0;
    for (const GemmBatch& g : gemm_batches(slots)) {
      EXPECT_EQ(g.first, next);
      EXPECT_GE(g.count, 1);
      EXPECT_LE(g.count, kMaxGemmBatch);
      next += g.count;
    }
    EXPECT_EQ(next, slots);
  }
}

// However large the budget, a chunk's slots stay a valid grid.x and its
// lanes a valid grid.y; and the 128k exact shape does make rounds above
// 65535 slots, which gemm_batches splits.
TEST(Workspace, LaunchLimitsHoldForHugeBudgets) {
  WorkspaceShape s = shape_for(int64_t{1} << 20);
  s.lanes = 100000;
  StatusOr<WorkspaceSlots> p = size_workspace(s, int64_t{1} << 50);
  ASSERT_TRUE(p.ok());
  EXPECT_LE(p->lanes_per_chunk, kMaxLanesPerChunk);
  EXPECT_LE(p->slots, kMaxSlots);
  WorkspaceShape bench = shape_for(int64_t{1} << 17);
  StatusOr<WorkspaceSlots> big = size_workspace(bench, int64_t{50} << 30);  // half an H200's pool
  ASSERT_TRUE(big.ok());
  EXPECT_GT(big->slots, kMaxGemmBatch);
  EXPECT_GT(gemm_batches(big->slots).size(), 1u);
}

}  // namespace
}  // namespace plsh::cuda
