// The CUDA backend's algorithm run on the host, slot by slot: the same head
// passes, workspace chunks, rounds, slot descriptions, masked logits,
// rounding of the probabilities and log-sum-exp merge as the kernels (the
// shared functions of tile_plan.h), with cuBLAS's two GEMMs written as loops.
// Against the float64 reference this checks the whole composition (chunking
// over lanes and tiles, key chunks, lsh samples, lse offsets) on a machine
// without a GPU; what it cannot check is the kernels' CUDA code itself, which
// the GPU tests do.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/workspace_slots.h"
#include "log_reference.h"
#include "pipeline_cases.h"
#include "plsh/numeric.h"
#include "plsh/params.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"

namespace plsh::cuda {
namespace {

float round_to(DType t, float x) {
  switch (t) {
    case DType::kF32:
      return x;
    case DType::kF16:
      return half_to_float(float_to_half(x));
    case DType::kBF16:
      return bf16_to_float(float_to_bf16(x));
  }
  return x;
}

struct EmulatedPipeline {
  std::vector<double> out;  // [B, Nq, H, D]
  std::vector<double> lse;  // [B, Nq, H]
  int64_t chunks = 0;
  int64_t rounds = 0;
};

EmulatedPipeline emulate(const AttentionParams& p, int64_t budget) {
  const SpanShape shape = span_shape(p);
  const std::vector<LaneSetup> heads = head_passes(p, plan_draws(p));
  StatusOr<WorkspaceSlots> plan_or = size_workspace(workspace_shape(p), budget);
  EXPECT_TRUE(plan_or.ok()) << plan_or.status().to_string();
  const WorkspaceSlots plan = *plan_or;
  const int64_t T = plan.tile_rows, D = p.head_dim;
  EmulatedPipeline e;
  e.out.assign(static_cast<size_t>(p.batch * p.q_len * p.heads * D), std::numeric_limits<double>::quiet_NaN());
  e.lse.assign(static_cast<size_t>(p.batch * p.q_len * p.heads), std::numeric_limits<double>::quiet_NaN());
  auto q_at = [&](int64_t b, int64_t i, int64_t h, int64_t x) {
    return static_cast<float>(
        load_element(p.q, p.dtype, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride + x));
  };
  auto k_at = [&](int64_t b, int64_t j, int64_t h, int64_t x) {
    return static_cast<float>(
        load_element(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + h * p.k_head_stride + x));
  };
  auto v_at = [&](int64_t b, int64_t j, int64_t h, int64_t x) {
    return static_cast<float>(
        load_element(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + h * p.v_head_stride + x));
  };
  const int64_t lanes_total = p.batch * p.heads;
  const int64_t tiles_total = tile_count(shape);
  const Status ran = for_each_chunk(plan, heads, p.heads, lanes_total, tiles_total, [&](const Chunk& chunk) {
    const int64_t lane0 = chunk.lane0, lane1 = chunk.lane1, t0 = chunk.tile0, t1 = chunk.tile1;
    ++e.chunks;
    std::vector<LanePass> table;
    const std::vector<Round> rounds = plan_rounds(shape, chunk.setups, t0, t1, &table);
    e.rounds += static_cast<int64_t>(rounds.size());
    const int64_t row0 = t0 * T, rows = (t1 - t0) * T;
    std::vector<float> acc(static_cast<size_t>((lane1 - lane0) * rows * D), 0.0f);
    std::vector<float> acc_max(static_cast<size_t>((lane1 - lane0) * rows), 0.0f);
    std::vector<float> acc_sum(acc_max.size(), 0.0f);
    for (const Round& r : rounds) {
      EXPECT_LE(r.slots, plan.slots);
      const int64_t Kc = r.key_cols;
      std::vector<float> logits(static_cast<size_t>(Kc));
      std::vector<uint8_t> ok(static_cast<size_t>(Kc));
      std::vector<float> prob(static_cast<size_t>(Kc));
      std::vector<float> part(static_cast<size_t>(D));
      for (int64_t slot = 0; slot < r.slots; ++slot) {
        const TileDesc d = describe_slot(shape, r, table.data(), slot);
        const LanePass& l = table[static_cast<size_t>(d.lane)];
        const int64_t hk = l.head / p.head_group;
        for (int64_t rr = 0; rr < T; ++rr) {
          const int64_t i = d.row0 + rr;
          if (i < d.own_begin || i >= d.own_end) continue;
          const SlotRow row = slot_row(l, shape, p.q_pos0, i);
          const bool same_bin = l.rule == SpanRule::kSameBin;
          float m = -INFINITY;
          for (int64_t x = 0; x < Kc; ++x) {
            const int64_t j = d.col0 + x;
            float dot = 0;  // the first GEMM: fp32 accumulation, alpha = scale
            for (int64_t c = 0; c < D; ++c) dot += q_at(l.batch, i, l.head, c) * k_at(l.batch, j, hk, c);
            const int64_t k_bin = same_bin ? span_bin(p.k_pos0 + j, l.pitch, l.shift) : 0;
            ok[x] = slot_logit(l, d, p.causal, row.pos, j, p.k_pos0 + j, row.nearest, row.bin, k_bin,
                               static_cast<float>(p.scale) * dot, &logits[x]);
            if (ok[x]) m = std::max(m, logits[x]);
          }
          float l_part = 0;
          for (int64_t x = 0; x < Kc; ++x) {
            prob[x] = ok[x] ? round_to(p.dtype, std::exp(logits[x] - m)) : 0.0f;
            l_part += prob[x];
          }
          std::fill(part.begin(), part.end(), 0.0f);  // the second GEMM
          for (int64_t x = 0; x < Kc; ++x)
            if (prob[x] != 0)
              for (int64_t c = 0; c < D; ++c) part[c] += prob[x] * v_at(l.batch, d.col0 + x, hk, c);
          if (l_part == 0) continue;
          const int64_t idx = l.acc_lane * rows + (i - row0);
          const MergeCoefficients mc = merge_coefficients(acc_max[idx], acc_sum[idx], m);
          for (int64_t c = 0; c < D; ++c) acc[idx * D + c] = acc[idx * D + c] * mc.c_acc + part[c] * mc.c_part;
          acc_sum[idx] = acc_sum[idx] * mc.c_acc + l_part * mc.c_part;
          acc_max[idx] = mc.m_new;
        }
      }
    }
    for (int64_t g = lane0; g < lane1; ++g) {
      const int64_t b = g / p.heads, h = g % p.heads;
      for (int64_t i = row0; i < std::min(row0 + rows, p.q_len); ++i) {
        const int64_t idx = (g - lane0) * rows + (i - row0);
        const float l = acc_sum[idx];
        for (int64_t c = 0; c < D; ++c)
          e.out[static_cast<size_t>(((b * p.q_len + i) * p.heads + h) * D + c)] =
              round_to(p.out_dtype, l > 0 ? acc[idx * D + c] / l : 0.0f);
        // As the device stores it: row_lse in double, rounded to float.
        e.lse[static_cast<size_t>((b * p.q_len + i) * p.heads + h)] = static_cast<float>(
            row_lse(acc_max[idx], l, head_lse(p, heads[static_cast<size_t>(h)]), nearest_key_distance(shape, i)));
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(ran.ok()) << ran.to_string();
  return e;
}

// A case and the workspace budget to plan it for.
struct PipelineCase : testing::AttentionCase {
  int64_t budget;      // bytes for the workspace plan
  int64_t min_chunks;  // the budget must force at least this many chunks
};
void PrintTo(const PipelineCase& c, std::ostream* os) { testing::PrintTo(c, os); }

class CudaPipelineOnHost : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(CudaPipelineOnHost, MatchesFloat64Reference) {
  const PipelineCase& c = GetParam();
  const AttentionOptions o = testing::options_of(c, 99);
  testing::Problem pr = testing::make_problem(o, 5, false);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  const EmulatedPipeline e = emulate(pr.params, c.budget);
  EXPECT_GE(e.chunks, c.min_chunks);
  const testing::ReferenceOutput ref = testing::log_domain_reference(pr.params);
  double max_err = 0, max_ref = 0, lse_err = 0;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(e.out[i])) << "output element " << i << " not written";
    max_err = std::max(max_err, std::fabs(e.out[i] - ref.out[i]));
    max_ref = std::max(max_ref, std::fabs(ref.out[i]));
  }
  for (size_t i = 0; i < ref.lse.size(); ++i)
    lse_err = std::max(lse_err, std::fabs(e.lse[i] - ref.lse[i]) / std::max(1.0, std::fabs(ref.lse[i])));
  // The GPU tests' tolerances (test_cuda_backend.cpp): f32 1e-4; bf16 two
  // roundings of 2^-9 relative, 1e-2; lse one rounding of the sum.
  const bool f32 = c.dtype == DType::kF32;
  EXPECT_LE(max_err / max_ref, f32 ? 1e-4 : 1e-2) << e.chunks << " chunks, " << e.rounds << " rounds";
  EXPECT_LE(lse_err, f32 ? 1e-5 : 4e-3);

  // And against the CPU backend, as the GPU tests compare the device.
  testing::Problem on_cpu = testing::make_problem(o, 5);
  ASSERT_TRUE(on_cpu.status.ok()) << on_cpu.status.to_string();
  const std::vector<float>& lse_cpu = on_cpu.lse;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const Status s = testing::plan_and_forward(*cpu, on_cpu.params, ExecContext{}, nullptr, 1);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const std::vector<double> out_cpu = testing::to_doubles(on_cpu.out, on_cpu.params.out_dtype);
  double cpu_err = 0, cpu_lse_err = 0;
  for (size_t i = 0; i < e.out.size(); ++i) cpu_err = std::max(cpu_err, std::fabs(e.out[i] - out_cpu[i]));
  for (size_t i = 0; i < e.lse.size(); ++i)
    cpu_lse_err = std::max(
        cpu_lse_err, std::fabs(e.lse[i] - lse_cpu[i]) / std::max(1.0, std::fabs(static_cast<double>(lse_cpu[i]))));
  std::printf("%s: vs float64 max_rel %.3g lse %.3g; vs cpu backend max_rel %.3g lse %.3g\n", c.name.c_str(),
              max_err / max_ref, lse_err, cpu_err / max_ref, cpu_lse_err);
  EXPECT_LE(cpu_err / max_ref, f32 ? 1e-4 : 2e-2) << "emulated cuda vs cpu backend";
  EXPECT_LE(cpu_lse_err, f32 ? 2e-5 : 8e-3) << "emulated cuda vs cpu backend";
}

using testing::kAuto;

std::vector<PipelineCase> pipeline_cases() {
  constexpr int64_t kRoomy = int64_t{1} << 30, kChunked = 3 * 150000;
  const testing::PipelineShapes s = testing::pipeline_shapes();
  std::vector<PipelineCase> v;
  auto add = [&v](testing::AttentionCase c, int64_t budget, int64_t min_chunks) {
    v.push_back({std::move(c), budget, min_chunks});
  };
  add(s.lsh_chunked, kChunked, 4);
  add(s.fixed_blocks_chunked, kChunked, 4);
  add(s.lsh_noncausal_bf16, kRoomy, 1);
  // The CUDA backend reads plan.draws only: other samplers' draws need no
  // change there (stratified pitches, ash's shared pitches with evenly
  // spaced shifts).
  testing::AttentionCase ash = s.lsh_chunked, stratified = s.lsh_noncausal_bf16;
  ash.name = "lsh_ash_causal_gqa_f32_chunked", ash.samples = 64, ash.sampling = Sampling::kAsh;
  stratified.name = "lsh_stratified_noncausal_bf16", stratified.samples = 16,
  stratified.sampling = Sampling::kStratified;
  add(ash, kChunked, 4);
  add(stratified, kRoomy, 1);
  add(s.lsh_tail_offsets, kRoomy, 1);
  add(s.exact_two_key_chunks, 2 * 150000, 2);
  add({"exact_noncausal_offsets_bf16", 1, 33, 300, 3, 3, 59, DType::kBF16, Mode::kExact, false, int64_t{1000}, 900},
      kRoomy, 1);
  add(s.window, kRoomy, 1);
  // Queries far from every key (shards of a long sequence): a bias of
  // -slope * 1e6 in float would swamp the scores; the logits must be taken
  // relative to the nearest key and the offset added to lse.
  const std::vector<double> far = {0.5, 1.0 / 64}, before = {0.5, 0.125}, shard = {0.5, 1.0 / 16};
  const DType f32 = DType::kF32;
  add({"exact_far_queries_noncausal_f32", 1, 40, 300, 2, 1, 40, f32, Mode::kExact, false, int64_t{1000000}, 0, 0, kAuto,
       far},
      kRoomy, 1);
  add({"exact_far_queries_causal_f32", 1, 40, 300, 2, 1, 40, f32, Mode::kExact, true, int64_t{1000000}, 0, 0, kAuto,
       far},
      kRoomy, 1);
  add({"exact_queries_before_keys_f32", 1, 40, 300, 2, 2, 64, f32, Mode::kExact, false, int64_t{-200000}, 0, 0, kAuto,
       before},
      kRoomy, 1);
  add({"exact_shard_at_65536_f32", 1, 64, 4096, 2, 1, 64, f32, Mode::kExact, true, int64_t{65536}, 0, 0, kAuto, shard},
      kRoomy, 1);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaPipelineOnHost, ::testing::ValuesIn(pipeline_cases()), testing::CaseName());

}  // namespace
}  // namespace plsh::cuda
