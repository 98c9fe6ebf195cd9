// The CUDA backend's backward run on the host, slot by slot, as
// test_cuda_host_pipeline.cpp runs its forward: the same plan
// (plan_layout, plan_backward_layout), staging and work buffers carved by
// the same functions into host memory, the same chunks, rounds and slot
// descriptions, the same pointer offsets (checked for cuBLAS's 16-byte
// alignment), and the cuBLAS calls executed from the very GemmArgs the
// backend passes (backward_gemms) by a column-major loop, so that a wrong
// transpose or leading dimension fails here. The kernels' bodies are
// restated with the shared functions of tile_plan.h and backward_plan.h
// (slot_logit, backward_prob, row_lse_for). Against the float64 reference
// and the CPU backend this checks the whole composition on a machine
// without a GPU; the kernels' CUDA code itself is for the GPU tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cuda/backward_plan.h"
#include "cuda/workspace_slots.h"
#include "pipeline_cases.h"
#include "plsh/attention.h"
#include "plsh/backward.h"
#include "plsh/numeric.h"
#include "plsh/plan.h"
#include "problem.h"
#include "reference.h"

namespace plsh::cuda {
namespace {

using plsh::testing::head_slopes;

// cublasGemmBatchedEx for one matrix, column-major: C = alpha op(A) op(B),
// A and B of dtype t (byte pointers), C float32, float32 accumulation.
void host_gemm(const GemmArgs& g, float alpha, const char* A, const char* B, DType t, float* C) {
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t i = 0; i < g.m; ++i) {
      float acc = 0;
      for (int64_t l = 0; l < g.k; ++l) {
        const int64_t a = g.trans_a ? l + i * g.lda : i + l * g.lda;
        const int64_t b = g.trans_b ? j + l * g.ldb : l + j * g.ldb;
        acc += static_cast<float>(load_element(A, t, a)) * static_cast<float>(load_element(B, t, b));
      }
      C[i + j * g.ldc] = alpha * acc;
    }
}

bool aligned(int64_t bytes) { return bytes % kOperandAlign == 0; }

struct EmulatedBackward {
  std::vector<uint8_t> dq, dk, dv;  // in grad_dtype, dense
  int64_t chunks = 0, rounds = 0;
};

// The backend's run_cuda_backward, on the host.
EmulatedBackward emulate_backward(const AttentionParams& p, const BackwardParams& g, int64_t budget) {
  EmulatedBackward e;
  const std::vector<std::vector<Draw>> draws = plan_draws(p);
  StatusOr<CudaLayout> layout_or = plan_layout(p, draws, budget);
  EXPECT_TRUE(layout_or.ok()) << layout_or.status().to_string();
  if (!layout_or.ok()) return e;
  CudaLayout layout = std::move(*layout_or);
  StatusOr<CudaBackwardLayout> bl_or = plan_backward_layout(p, layout, budget);
  EXPECT_TRUE(bl_or.ok()) << bl_or.status().to_string();
  if (!bl_or.ok()) return e;
  layout.backward = *bl_or;
  layout.has_backward = true;
  const CudaBackwardLayout& bl = layout.backward;
  EXPECT_LE(bl.device_bytes(), budget);
  const int64_t grad_bytes = static_cast<int64_t>(dtype_bytes(g.grad_dtype));
  EXPECT_TRUE(check_backward_layout_fits(layout, p, grad_bytes).ok());

  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t D = p.head_dim;
  std::vector<char> staging(static_cast<size_t>(bl.staging_bytes), 0);
  BackwardStaging st;
  EXPECT_LE(carve_backward_staging(p, grad_bytes, staging.data(), &st), bl.staging_bytes);
  const OperandLayout ops = operand_layout(p);
  // The 2D copies: every [D] row to its padded place.
  for (int64_t r = 0; r < p.batch * p.q_len * p.heads; ++r) {
    std::memcpy(st.qkv.q + r * ops.q_hs * esz, static_cast<const char*>(p.q) + r * D * esz,
                static_cast<size_t>(D * esz));
    std::memcpy(st.dout + r * ops.q_hs * esz, static_cast<const char*>(g.dout) + r * D * esz,
                static_cast<size_t>(D * esz));
  }
  for (int64_t r = 0; r < p.batch * p.kv_len * p.kv_heads; ++r) {
    std::memcpy(st.qkv.k + r * ops.k_hs * esz, static_cast<const char*>(p.k) + r * D * esz,
                static_cast<size_t>(D * esz));
    std::memcpy(st.qkv.v + r * ops.v_hs * esz, static_cast<const char*>(p.v) + r * D * esz,
                static_cast<size_t>(D * esz));
  }
  backward_row_stats(p, g, layout.heads, st.row_d, st.row_lse);

  std::vector<char> work_buffer(static_cast<size_t>(bl.work_bytes), 0);
  BackwardRoundBuffers rb;
  Accumulators acc;
  EXPECT_LE(
      carve_backward_work(bl.work.slots, bl.work.tile_rows, bl.work.key_cols, D, esz, work_buffer.data(), &rb, &acc),
      bl.work_bytes);
  const SpanShape shape = span_shape(p);
  const WorkspaceSlots& work = bl.work;
  const int64_t T = work.tile_rows;
  const int64_t Dp = partial_pitch(D);
  const float scale = static_cast<float>(p.scale);
  const int64_t lanes_total = p.batch * p.heads, tiles_total = tile_count(shape);
  const Status ran = for_each_chunk(work, layout.heads, p.heads, lanes_total, tiles_total, [&](const Chunk& chunk) {
    const int64_t lane0 = chunk.lane0, lane1 = chunk.lane1, t0 = chunk.tile0, t1 = chunk.tile1;
    ++e.chunks;
    std::vector<LanePass> table;
    const std::vector<Round> rounds = plan_rounds(shape, chunk.setups, t0, t1, &table);
    EXPECT_LE(static_cast<int64_t>(table.size()), layout.table_entries);
    e.rounds += static_cast<int64_t>(rounds.size());
    acc.row0 = t0 * T;
    acc.rows_per_lane = (t1 - t0) * T;
    std::fill_n(acc.acc, (lane1 - lane0) * acc.rows_per_lane * D, 0.0f);
    for (const Round& r : rounds) {
      EXPECT_LE(r.slots, work.slots);
      const int64_t Kc = r.key_cols, Kp = key_pitch(Kc);
      const BackwardGemms gemms = backward_gemms(ops, T, Kc);
      const ForwardGemms forward = forward_gemms(ops, T, Kc);  // on the same staged operands
      for (int64_t slot = 0; slot < r.slots; ++slot) {
        const TileDesc d = describe_slot(shape, r, table.data(), slot);
        const LanePass& l = table[static_cast<size_t>(d.lane)];
        const BackwardSlotOperands o = backward_slot_operands(ops, l, d, slot, T, Kc);
        for (int64_t off : {o.q, o.k, o.v, o.dout, o.scores, o.probs, o.ds, o.dq, o.dk, o.dv})
          EXPECT_TRUE(aligned(off)) << "slot operand at byte " << off << " is not 16-byte aligned";
        for (const GemmArgs* ga :
             {&gemms.scores, &gemms.dprob, &gemms.dq, &gemms.dv, &gemms.dk, &forward.scores, &forward.partial})
          EXPECT_TRUE(aligned(ga->lda * esz) && aligned(ga->ldb * esz) && aligned(ga->ldc * 4))
              << "a leading dimension is not a multiple of 16 bytes";
        float* scores = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.scores) + o.scores);
        char* probs = rb.probs + o.probs;
        char* ds = rb.ds + o.ds;
        float* dq_part = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dq_part) + o.dq);
        float* dk_part = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dk_part) + o.dk);
        float* dv_part = reinterpret_cast<float*>(reinterpret_cast<char*>(rb.dv_part) + o.dv);
        const int64_t g_lane = static_cast<int64_t>(l.batch) * p.heads + l.head;

        host_gemm(gemms.scores, scale, st.qkv.k + o.k, st.qkv.q + o.q, p.dtype, scores);
        // backward_probs_kernel
        const bool same_bin = l.rule == SpanRule::kSameBin;
        for (int64_t rr = 0; rr < T; ++rr) {
          const int64_t i = d.row0 + rr;
          const bool owned = i >= d.own_begin && i < d.own_end;
          const SlotRow row = slot_row(l, shape, p.q_pos0, i);
          const float lse = st.row_lse[g_lane * p.q_len + i];
          for (int64_t x = 0; x < Kc; ++x) {
            const int64_t j = d.col0 + x;
            float logit = 0;
            const int64_t k_bin = same_bin ? span_bin(p.k_pos0 + j, l.pitch, l.shift) : 0;
            const bool ok = owned && slot_logit(l, d, p.causal, row.pos, j, p.k_pos0 + j, row.nearest, row.bin, k_bin,
                                                scores[rr * Kp + x], &logit);
            store_element(probs, p.dtype, rr * Kp + x, ok ? backward_prob(logit, lse) : 0.0f);
          }
        }
        host_gemm(gemms.dprob, 1.0f, st.qkv.v + o.v, st.dout + o.dout, p.dtype, scores);
        // backward_ds_kernel
        for (int64_t rr = 0; rr < T; ++rr) {
          const int64_t i = d.row0 + rr;
          const bool owned = i >= d.own_begin && i < d.own_end;
          const float di = owned ? st.row_d[g_lane * p.q_len + i] : 0.0f;
          for (int64_t x = 0; x < Kc; ++x) {
            const float pv = owned ? static_cast<float>(load_element(probs, p.dtype, rr * Kp + x)) : 0.0f;
            store_element(ds, p.dtype, rr * Kp + x, pv * (scores[rr * Kp + x] - di));
          }
        }
        host_gemm(gemms.dq, scale, st.qkv.k + o.k, ds, p.dtype, dq_part);
        // dq_merge_kernel
        for (int64_t rr = 0; rr < T; ++rr) {
          const int64_t i = d.row0 + rr;
          if (i < d.own_begin || i >= d.own_end) continue;
          float* a = acc.acc + (l.acc_lane * acc.rows_per_lane + (i - acc.row0)) * D;
          for (int64_t x = 0; x < D; ++x) a[x] += dq_part[rr * Dp + x];
        }
        host_gemm(gemms.dv, 1.0f, st.dout + o.dout, probs, p.dtype, dv_part);
        host_gemm(gemms.dk, scale, st.qkv.q + o.q, ds, p.dtype, dk_part);
        // kv_scatter_kernel
        const int64_t hk = l.head / p.head_group;
        for (int64_t x = d.valid_begin - d.col0; x < d.valid_end - d.col0; ++x) {
          const int64_t j = d.col0 + x;
          for (int64_t c = 0; c < D; ++c) {
            const int64_t at = ((static_cast<int64_t>(l.batch) * p.kv_len + j) * p.kv_heads + hk) * D + c;
            st.dk_acc[at] += dk_part[x * Dp + c];
            st.dv_acc[at] += dv_part[x * Dp + c];
          }
        }
      }
    }
    // dq_finalize_kernel
    for (int64_t gl = lane0; gl < lane1; ++gl) {
      const int64_t b = gl / p.heads, h = gl % p.heads;
      for (int64_t local = 0; local < acc.rows_per_lane; ++local) {
        const int64_t i = acc.row0 + local;
        if (i >= p.q_len) continue;
        const float* a = acc.acc + ((gl - lane0) * acc.rows_per_lane + local) * D;
        for (int64_t x = 0; x < D; ++x)
          store_element(st.dq, g.grad_dtype, ((b * p.q_len + i) * p.heads + h) * D + x, a[x]);
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(ran.ok()) << ran.to_string();
  for (int64_t i = 0; i < st.kv_elems; ++i) {  // to_dtype_kernel
    store_element(st.dk, g.grad_dtype, i, st.dk_acc[i]);
    store_element(st.dv, g.grad_dtype, i, st.dv_acc[i]);
  }
  e.dq.assign(st.dq, st.dq + st.dq_bytes);
  e.dk.assign(st.dk, st.dk + st.dkv_bytes);
  e.dv.assign(st.dv, st.dv + st.dkv_bytes);
  return e;
}

// A case and the work slots its budget holds.
struct BackwardPipelineCase : testing::AttentionCase {
  int64_t max_slots;   // > 0: a budget of this many work slots (chunks over lanes and tiles)
  int64_t min_chunks;  // the budget must force at least this many chunks
};
void PrintTo(const BackwardPipelineCase& c, std::ostream* os) { testing::PrintTo(c, os); }

class CudaBackwardOnHost : public ::testing::TestWithParam<BackwardPipelineCase> {};

TEST_P(CudaBackwardOnHost, MatchesFloat64ReferenceAndCpuBackend) {
  const BackwardPipelineCase& c = GetParam();
  AttentionOptions o = testing::options_of(c, 99);
  o.lsh_algorithm = uses_draws(c.mode) ? LshAlgorithm::kPerSample : LshAlgorithm::kAuto;
  testing::Problem pr = testing::make_problem(o, 5);
  ASSERT_TRUE(pr.status.ok()) << pr.status.to_string();
  const AttentionParams& p = pr.params;
  ASSERT_TRUE(check_backward_support(p).ok());

  // The forward's out and lse, and the CPU backend's gradients, on one plan.
  const DType grad_dtype = c.grad_dtype.value_or(o.dtype);
  testing::GradTensors cpu_grads = testing::grad_tensors(o, grad_dtype, 6);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const GradientRefs refs = cpu_grads.refs();
  PlanLimits limits;
  limits.threads = 1;
  StatusOr<ForwardBackwardResult> cpu_run = run_forward_backward(*cpu, p, limits, refs, ExecContext{});
  ASSERT_TRUE(cpu_run.ok()) << cpu_run.status().to_string();
  StatusOr<BackwardParams> g = make_backward_params(p, refs);
  ASSERT_TRUE(g.ok()) << g.status().to_string();

  int64_t budget = int64_t{1} << 30;
  if (c.max_slots > 0) {
    // Staging, the tables with cuBLAS's smallest workspace (what a budget
    // this small gets, cublas_workspace_for) and max_slots slots of work.
    StatusOr<CudaLayout> roomy = plan_layout(p, plan_draws(p), budget);
    ASSERT_TRUE(roomy.ok());
    const int64_t tables = carve_tables(o.heads, roomy->table_entries, kCublasMinWorkspaceBytes, nullptr, nullptr);
    budget = carve_backward_staging(p, 4, nullptr, nullptr) + tables +
             carve_backward_work(c.max_slots, std::min(kTileRows, o.q_len), std::min(kMaxKeyCols, o.kv_len), o.head_dim,
                                 static_cast<int64_t>(dtype_bytes(o.dtype)), nullptr, nullptr, nullptr);
  }
  const EmulatedBackward e = emulate_backward(p, *g, budget);
  ASSERT_FALSE(e.dq.empty());
  EXPECT_GE(e.chunks, c.min_chunks);

  const testing::ReferenceGradients ref =
      testing::reference_backward(p, testing::dense_inputs(p), testing::reference_weights(p), cpu_grads.dout_values());
  const testing::ErrorStats eq = testing::compare(e.dq.data(), grad_dtype, ref.dq);
  const testing::ErrorStats ek = testing::compare(e.dk.data(), grad_dtype, ref.dk);
  const testing::ErrorStats ev = testing::compare(e.dv.data(), grad_dtype, ref.dv);
  const testing::ErrorStats cq = testing::compare(e.dq.data(), grad_dtype, cpu_grads.values(cpu_grads.dq));
  const testing::ErrorStats ck = testing::compare(e.dk.data(), grad_dtype, cpu_grads.values(cpu_grads.dk));
  const testing::ErrorStats cv = testing::compare(e.dv.data(), grad_dtype, cpu_grads.values(cpu_grads.dv));
  // float32: 1e-5 (SPEC, STYLE). 16-bit inputs: P and dS are rounded for
  // the GEMMs (one unit each, as the forward rounds P), O through D_i and
  // the gradients themselves: four units (2^-11 f16, 2^-8 bf16), except
  // for float32 gradients, three.
  const double unit = o.dtype == DType::kF16 ? 0x1.0p-11 : o.dtype == DType::kBF16 ? 0x1.0p-8 : 0.0;
  const double tol = std::max(1e-5, (grad_dtype == DType::kF32 ? 3 : 4) * unit);
  std::printf(
      "%s: %lld chunks, %lld rounds; vs float64 max_rel dq %.2e dk %.2e dv %.2e; vs cpu backend %.2e %.2e %.2e;"
      " tolerance %.1e\n",
      c.name.c_str(), static_cast<long long>(e.chunks), static_cast<long long>(e.rounds), eq.max_rel, ek.max_rel,
      ev.max_rel, cq.max_rel, ck.max_rel, cv.max_rel, tol);
  EXPECT_LE(eq.max_rel, tol) << "dq";
  EXPECT_LE(ek.max_rel, tol) << "dk";
  EXPECT_LE(ev.max_rel, tol) << "dv";
  EXPECT_LE(cq.max_rel, 2 * tol) << "dq vs cpu";
  EXPECT_LE(ck.max_rel, 2 * tol) << "dk vs cpu";
  EXPECT_LE(cv.max_rel, 2 * tol) << "dv vs cpu";
}

using testing::kAuto;

std::vector<BackwardPipelineCase> pipeline_backward_cases() {
  const testing::PipelineShapes s = testing::pipeline_shapes();
  std::vector<BackwardPipelineCase> v;
  auto add = [&v](testing::AttentionCase c, int64_t max_slots, int64_t min_chunks) {
    v.push_back({std::move(c), max_slots, min_chunks});
  };
  add(s.lsh_chunked, 3, 4);
  add(s.fixed_blocks_chunked, 3, 4);
  add(s.lsh_noncausal_bf16, 0, 1);
  add(s.lsh_tail_offsets, 0, 1);
  add(s.exact_two_key_chunks, 2, 2);
  add({"exact_noncausal_offsets_f16", 1, 33, 300, 3, 3, 59, DType::kF16, Mode::kExact, false, int64_t{1000}, 900}, 0,
      1);
  // One query row (T = 1) against 37 keys.
  add({"exact_one_query_f32", 1, 1, 37, 2, 1, 40, DType::kF32, Mode::kExact, false}, 0, 1);
  add(s.window, 0, 1);
  add({"window_width_bf16_f32_grads", 1, 130, 130, 2, 2, 59, DType::kBF16, Mode::kWindow, false, std::nullopt, 0, 0,
       kAuto, head_slopes(), 9, std::nullopt, DType::kF32},
      0, 1);
  // Queries past the keys: the nearest-key shift goes through row_lse_for.
  const std::vector<double> past = {0.5, 1.0 / 64};
  add({"exact_queries_past_keys_f32", 1, 40, 300, 2, 1, 40, DType::kF32, Mode::kExact, false, int64_t{380}, 0, 0, kAuto,
       past},
      0, 1);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardOnHost, ::testing::ValuesIn(pipeline_backward_cases()),
                         testing::CaseName());

// What the backward takes and refuses, and that its workspace is planned.
TEST(CudaBackwardPlan, SupportAndSizing) {
  AttentionOptions o;
  o.q_len = o.kv_len = 1000;
  o.heads = 4;
  o.head_dim = 64;
  o.mode = Mode::kExact;
  StatusOr<AttentionParams> p = resolve_params(o);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(check_backward_support(*p).ok());
  AttentionParams device = *p;
  device.memory = MemorySpace::kDevice;
  EXPECT_EQ(check_backward_support(device).code(), StatusCode::kUnimplemented);
  AttentionParams mixed = *p;
  mixed.dtype = DType::kBF16;
  const Status s = check_backward_support(mixed);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("out_dtype"), std::string::npos) << s.message();

  StatusOr<CudaLayout> fwd = plan_layout(*p, {}, int64_t{1} << 30);
  ASSERT_TRUE(fwd.ok());
  StatusOr<CudaBackwardLayout> b = plan_backward_layout(*p, *fwd, int64_t{1} << 30);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_LE(b->device_bytes(), int64_t{1} << 30);
  // The staging holds at least q, k, v, dout, the float32 dK/dV
  // accumulators and float32 gradients.
  EXPECT_GE(b->staging_bytes, (4 * 1000 * 4 * 64 + 2 * 1000 * 4 * 64 + 3 * 1000 * 4 * 64) * 4);
  // One slot's work is more than the forward's: three [T][Kp] slices and the dK, dV shares.
  EXPECT_GT(b->work.bytes_per_slot, fwd->work.bytes_per_slot);
  // Too little memory: RESOURCE_EXHAUSTED naming what does not fit.
  EXPECT_EQ(plan_backward_layout(*p, *fwd, b->staging_bytes).status().code(), StatusCode::kResourceExhausted);
  CudaLayout without = *fwd;
  EXPECT_EQ(check_backward_layout_fits(without, *p, 4).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace plsh::cuda
