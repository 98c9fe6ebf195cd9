// Sharding without servers: the cuts plan_shards makes (heads on GQA
// groups, sequence on the CPU backend's row tiles), the keys each sequence
// shard carries against a brute-force list of what its rows may attend, the
// seed translation of head shards, the choice between the cuts, and how
// merge_results combines estimates.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "plsh/draws.h"
#include "plsh/sharding.h"
#include "shaped.h"

namespace plsh::client {
namespace {

using plsh::testing::shaped;

AttentionOptions base_options(Mode mode, bool causal) {
  return shaped({2, 1000, 2600, 6, 3, 40}, {.causal = causal,
                                            .slopes = {1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125},
                                            .q_pos0 = 5000 + 1200,
                                            .k_pos0 = 5000,
                                            .mode = mode,
                                            .samples = 8,
                                            .seed = 11});
}

bool same_draw(const Draw& a, const Draw& b) {
  return std::memcmp(&a.pitch, &b.pitch, sizeof(double)) == 0 && std::memcmp(&a.shift, &b.shift, sizeof(double)) == 0;
}

TEST(ShardPlan, HeadShardSeedDrawsWhatTheGlobalHeadDraws) {
  for (uint64_t seed : {uint64_t{0}, uint64_t{42}, ~uint64_t{0} - 5})
    for (int64_t h0 : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{1000}})
      for (int64_t h : {int64_t{0}, int64_t{1}, int64_t{3}})
        for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{15}, (int64_t{1} << 24) - 1}) {
          const Draw global = draw_hash(seed, h0 + h, k, 7.5);
          const Draw local = draw_hash(head_shard_seed(seed, h0), h, k, 7.5);
          EXPECT_TRUE(same_draw(global, local)) << "seed " << seed << " h0 " << h0 << " h " << h << " k " << k;
        }
}

TEST(ShardPlan, HeadShardsTakeWholeGqaGroups) {
  AttentionOptions o = base_options(Mode::kLsh, false);
  o.heads = 8;
  o.kv_heads = 4;
  o.slopes.clear();
  StatusOr<ShardPlan> plan = plan_kind(o, true, ShardKind::kHeads, 3);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->kind, ShardKind::kHeads);
  ASSERT_EQ(plan->shards.size(), 3u);
  int64_t next_kv = 0, sent = 0;
  for (const ShardSpec& s : plan->shards) {
    EXPECT_EQ(s.kv_head_begin, next_kv);
    EXPECT_EQ(s.head_begin, s.kv_head_begin * 2);
    EXPECT_EQ(s.head_end, s.kv_head_end * 2);
    EXPECT_EQ(s.row_begin, 0);
    EXPECT_EQ(s.row_end, o.q_len);
    EXPECT_EQ(s.key_end - s.key_begin, o.kv_len);
    next_kv = s.kv_head_end;
    sent += s.sent_bytes;
  }
  EXPECT_EQ(next_kv, 4);
  // Head shards send every byte once: the whole request's bytes.
  StatusOr<ShardPlan> whole = plan_kind(o, true, ShardKind::kSingle, 1);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(sent, whole->sent_bytes);
  EXPECT_EQ(plan->received_bytes, whole->received_bytes);

  // Shard 1 (heads 2..3 of 8): the standard slopes of H = 8, explicitly; its
  // draws those of global heads 2 and 3.
  const AttentionOptions s1 = shard_options(o, *plan, plan->shards[1]);
  const std::vector<double> standard = standard_slopes(8);
  ASSERT_EQ(s1.slopes.size(), 2u);
  EXPECT_EQ(s1.slopes[0], standard[2]);
  EXPECT_EQ(s1.slopes[1], standard[3]);
  EXPECT_EQ(s1.heads, 2);
  EXPECT_EQ(s1.kv_heads, 1);
  EXPECT_EQ(s1.q_pos0, o.q_pos0);
  EXPECT_TRUE(same_draw(draw_hash(s1.seed, 1, 3, 1 / standard[3]), draw_hash(o.seed, 3, 3, 1 / standard[3])));

  // No more shards than kv heads.
  StatusOr<ShardPlan> many = plan_kind(o, false, ShardKind::kHeads, 9);
  ASSERT_TRUE(many.ok());
  EXPECT_EQ(many->shards.size(), 4u);
}

// Whether query position i may attend key position j under the request
// (any head), by the definitions: SPEC sections 2-4.
bool allowed(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws, int64_t h, int64_t i, int64_t j) {
  if (p.causal && j > i) return false;
  switch (p.mode) {
    case Mode::kExact:
      return true;
    case Mode::kWindow:
      return p.window[static_cast<size_t>(h)] == kNoWindow || std::llabs(i - j) < p.window[static_cast<size_t>(h)];
    case Mode::kLsh:
    case Mode::kFixedBlocks:
      for (const Draw& d : draws[static_cast<size_t>(h)])
        if (bin_of(i, d) == bin_of(j, d)) return true;
      return false;
  }
  return false;
}

void check_sequence_keys(const AttentionOptions& o) {
  SCOPED_TRACE(std::string(mode_name(o.mode)) + (o.causal ? " causal" : ""));
  StatusOr<AttentionParams> p = resolve_params(o);
  ASSERT_TRUE(p.ok());
  std::vector<std::vector<Draw>> draws;
  // fixed_blocks by SPEC section 4's definition: pitch 2 sigma_h, shift 0.
  for (int64_t h = 0; h < p->heads; ++h)
    draws.push_back(p->mode == Mode::kFixedBlocks ? std::vector<Draw>{{2 * p->sigma(h), 0}}
                                                  : draw_hashes(p->seed, h, p->sigma(h), p->samples));
  StatusOr<ShardPlan> plan = plan_kind(o, false, ShardKind::kSequence, 3);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->kind, ShardKind::kSequence);
  ASSERT_EQ(plan->shards.size(), 3u);
  int64_t next_row = 0;
  for (const ShardSpec& s : plan->shards) {
    EXPECT_EQ(s.row_begin, next_row);
    EXPECT_EQ(s.row_begin % kShardRowAlign, 0);
    next_row = s.row_end;
    // Every allowed pair's key is in the shard; the shard reaches at most
    // one key past the allowed ones (and exactly one where it exists, for
    // the estimates), none past that.
    int64_t lo = INT64_MAX, hi = INT64_MIN;  // key rows allowed to some row of the shard
    for (int64_t r = s.row_begin; r < s.row_end; ++r) {
      const int64_t i = p->q_pos0 + r;
      for (int64_t h = 0; h < p->heads; ++h)
        for (int64_t jr = 0; jr < p->kv_len; ++jr)
          if (allowed(*p, draws, h, i, p->k_pos0 + jr)) {
            lo = std::min(lo, jr);
            hi = std::max(hi, jr);
          }
    }
    ASSERT_LE(lo, hi);
    EXPECT_LE(s.key_begin, lo);
    EXPECT_GT(s.key_end, hi);
    if (o.mode == Mode::kExact) {
      EXPECT_EQ(s.key_begin, 0);
      EXPECT_EQ(s.key_end, hi + 1);
    } else {
      EXPECT_EQ(s.key_begin, std::max<int64_t>(0, lo - 1));
      EXPECT_EQ(s.key_end, o.causal ? hi + 1 : std::min(p->kv_len, hi + 2));
    }
    const AttentionOptions so = shard_options(o, *plan, s);
    EXPECT_EQ(*so.q_pos0, p->q_pos0 + s.row_begin);
    EXPECT_EQ(so.k_pos0, p->k_pos0 + s.key_begin);
    EXPECT_TRUE(validate_options(so).ok()) << validate_options(so).to_string();
  }
  EXPECT_EQ(next_row, o.q_len);
}

TEST(ShardPlan, SequenceShardsCarryExactlyTheKeysTheirRowsMayAttend) {
  for (Mode mode : {Mode::kExact, Mode::kWindow, Mode::kLsh, Mode::kFixedBlocks})
    for (bool causal : {false, true}) check_sequence_keys(base_options(mode, causal));
  // A head with slope 0 (one block, no window) reaches every key.
  AttentionOptions flat = base_options(Mode::kLsh, false);
  flat.slopes[5] = 0;
  StatusOr<ShardPlan> plan = plan_kind(flat, false, ShardKind::kSequence, 3);
  ASSERT_TRUE(plan.ok());
  for (const ShardSpec& s : plan->shards) {
    EXPECT_EQ(s.key_begin, 0);
    EXPECT_EQ(s.key_end, flat.kv_len);
  }
}

TEST(ShardPlan, SequenceShardsAreNeverFewerThanATile) {
  AttentionOptions o = base_options(Mode::kExact, true);
  o.q_len = 200;  // two tiles of 128
  StatusOr<ShardPlan> plan = plan_kind(o, false, ShardKind::kSequence, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shards.size(), 2u);
  o.q_len = 100;
  plan = plan_kind(o, false, ShardKind::kSequence, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kSingle);
}

// The tile is the servers' (GetInfoResponse.shard_row_align; ShardedClient
// passes it through ShardingOptions::row_align), not only 128.
TEST(ShardPlan, SequenceShardsFollowTheRowAlignGiven) {
  AttentionOptions o = base_options(Mode::kExact, true);
  o.q_len = 200;
  StatusOr<ShardPlan> plan = plan_kind(o, false, ShardKind::kSequence, 3, 64);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->shards.size(), 3u);  // 128 would give two
  for (const ShardSpec& s : plan->shards) EXPECT_EQ(s.row_begin % 64, 0);
  EXPECT_NE(plan->shards[1].row_begin % kShardRowAlign, 0);
  ShardingOptions sharding;
  sharding.shards = 3;
  sharding.by = ShardBy::kSequence;
  sharding.row_align = 64;
  plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shards.size(), 3u) << plan->reason;
  EXPECT_FALSE(plan_kind(o, false, ShardKind::kSequence, 3, 0).ok());
}

TEST(ShardPlan, PicksTheCutWithFewerBytesPerShard) {
  ShardingOptions sharding;
  sharding.shards = 3;
  // Six heads in three groups: head shards send a third each, sequence
  // shards of exact attention all the keys.
  AttentionOptions o = base_options(Mode::kExact, false);
  StatusOr<ShardPlan> plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kHeads) << plan->reason;
  // One kv head: no head cut; sequence it is.
  o.kv_heads = 1;
  plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kSequence) << plan->reason;
  EXPECT_NE(plan->reason.find("heads would give 1"), std::string::npos) << plan->reason;
  // Local attention over a long sequence with few, unevenly split kv heads:
  // sequence shards carry less than a 2-of-4 kv-head shard.
  AttentionOptions w = base_options(Mode::kWindow, true);
  w.heads = w.kv_heads = 4;
  w.slopes = {1, 1, 1, 1};
  w.q_len = w.kv_len = 6000;
  w.q_pos0.reset();
  w.k_pos0 = 0;
  plan = plan_shards(w, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kSequence) << plan->reason;
  sharding.by = ShardBy::kHeads;
  plan = plan_shards(w, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kHeads);
}

TEST(ShardPlan, AutomaticCountKeepsShardsLargeEnough) {
  ShardingOptions sharding;  // shards = 0: automatic
  AttentionOptions o = base_options(Mode::kLsh, false);
  o.batch = 1;
  o.q_len = o.kv_len = 64;
  o.q_pos0.reset();
  o.k_pos0 = 0;
  StatusOr<ShardPlan> plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kSingle) << plan->reason;  // ~100 KiB: one shard
  o.q_len = o.kv_len = 65536;                                 // 6 heads x 40 x 4 bytes x 64k x 5 tensors: 300 MiB
  plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->shards.size(), 3u) << plan->reason;
  sharding.min_shard_bytes = int64_t{200} << 20;  // only one shard of 200 MiB fits
  plan = plan_shards(o, false, sharding, 3);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->kind, ShardKind::kSingle) << plan->reason;
  // Invalid options are refused as plsh_core refuses them.
  o.kv_heads = 4;
  plan = plan_shards(o, false, sharding, 3);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("kv_heads"), std::string::npos);
}

TEST(ShardPlan, MergeKeepsExactFiguresAndPoolsTheProbe) {
  AttentionOptions o = base_options(Mode::kLsh, false);
  StatusOr<ShardPlan> plan = plan_kind(o, false, ShardKind::kHeads, 3);
  ASSERT_TRUE(plan.ok());
  std::vector<ShardResult> shards(3);
  for (int s = 0; s < 3; ++s) {
    AttentionResult& r = shards[static_cast<size_t>(s)].result;
    r.backend = "cpu";
    r.flops = 100;
    r.dense_flops = 1000;
    for (int h = 0; h < 2; ++h) {
      HeadEstimate he;
      he.head = h;
      he.mask_max_err = 0.1 * (s + 1) + 0.01 * h;
      he.probe.rows = 64;
      he.probe.rel_err = s == 2 ? 0.3 : 0.1;
      he.probe.rel_err_stderr = 0.01;
      he.probe.max_abs_err = 0.5 + s;
      he.probe.bound_max = 2.0 + h;
      r.heads.push_back(he);
    }
    // Shard 2's outputs are twice as large: its squared error weighs 4x.
    shards[static_cast<size_t>(s)].out_mean_square = {s == 2 ? 4.0 : 1.0, s == 2 ? 4.0 : 1.0};
  }
  const AttentionResult m = merge_results(o, *plan, shards);
  ASSERT_EQ(m.heads.size(), 6u);
  for (int h = 0; h < 6; ++h) EXPECT_EQ(m.heads[static_cast<size_t>(h)].head, h);
  EXPECT_EQ(m.flops, 300);
  EXPECT_EQ(m.dense_flops, 3000);
  EXPECT_DOUBLE_EQ(m.mask_max_err, 0.31);
  EXPECT_EQ(m.probe.rows, 6 * 64);
  EXPECT_EQ(m.probe.max_abs_err, 2.5);
  EXPECT_EQ(m.probe.bound_max, 3.0);
  // Weights 1, 1, 4 per head pair: Q = (1 * 0.01 * 4 + 4 * 0.09 * 2) / (12).
  EXPECT_NEAR(m.probe.rel_err, std::sqrt((0.01 * 4 + 4 * 0.09 * 2) / 12.0), 1e-12);
  EXPECT_GT(m.probe.rel_err_stderr, 0);
  EXPECT_EQ(m.seed, o.seed);
}

TEST(ShardPlan, ReplicaTargets) {
  std::vector<std::string> replicas;
  std::string tls_name;
  ASSERT_TRUE(resolve_replicas("a:1, b:2,a:1", &replicas, &tls_name).ok());
  EXPECT_EQ(replicas, (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(tls_name, "");
  EXPECT_FALSE(resolve_replicas("a:1,,b:2", &replicas, &tls_name).ok());
  EXPECT_FALSE(resolve_replicas("dns:///nameonly", &replicas, &tls_name).ok());
  // The system resolver, as in a headless Service (localhost is in /etc/hosts).
  ASSERT_TRUE(resolve_replicas("dns:///localhost:50999", &replicas, &tls_name).ok());
  EXPECT_NE(std::find(replicas.begin(), replicas.end(), "ipv4:127.0.0.1:50999"), replicas.end());
  EXPECT_EQ(tls_name, "localhost");
  EXPECT_TRUE(is_replica_list("a:1,b:2"));
  EXPECT_TRUE(is_replica_list("dns:///x:1"));
  EXPECT_FALSE(is_replica_list("127.0.0.1:50051"));
}

}  // namespace
}  // namespace plsh::client
