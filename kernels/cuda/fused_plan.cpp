#include "cuda/fused_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "cuda/fused_backward.h"
#include "cuda/fused_dispatch.h"
#include "cuda/fused_forward.h"

namespace plsh::cuda {

namespace {

std::string str(int64_t x) { return std::to_string(x); }

}  // namespace

int64_t fused_forward_smem(const AttentionParams& p, int max_samples) {
  return dispatch_fused(p.dtype, p.head_dim, int64_t{-1},
                        [&](auto cfg) { return fused_forward_smem_bytes<decltype(cfg)>(max_samples); });
}

int64_t fused_backward_smem(const AttentionParams& p, int max_samples) {
  return dispatch_fused(p.dtype, p.head_dim, int64_t{-1},
                        [&](auto cfg) { return fused_backward_smem_bytes<decltype(cfg)>(max_samples); });
}

Status fused_supported(const AttentionParams& p) {
  // fixed_blocks' one deterministic draw per head runs per sample: the
  // fused kernels know lsh's hashes and window's widths, not fixed blocks.
  if (p.mode == Mode::kFixedBlocks) return unimplemented("the fused kernels do not run mode fixed_blocks");
  if (!fused_head_dim(p.head_dim))
    return unimplemented("the fused kernels are built for head_dim 64 and 128, got " + str(p.head_dim));
  if (p.mode == Mode::kLsh && p.samples > kFusedMaxHashes)
    return unimplemented("the fused lsh kernel holds at most " + str(kFusedMaxHashes) +
                         " hashes per head on chip, got samples = " + str(p.samples));
  if (p.kv_len > INT32_MAX - 2 * kFusedKeys || p.q_len > INT32_MAX - 2 * kFusedRows)
    return unimplemented("the fused kernels index rows in 32 bits, got q_len = " + str(p.q_len) +
                         ", kv_len = " + str(p.kv_len));
  if (p.heads > 65535 || p.batch > 65535)
    return unimplemented("the fused kernels' grid holds at most 65535 heads and batch items, got heads = " +
                         str(p.heads) + ", batch = " + str(p.batch));
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  if (p.memory == MemorySpace::kDevice) {
    // Rows are read 16 bytes at a time (cp.async): every row start aligned.
    const struct {
      const char* name;
      const void* data;
      int64_t strides[3];
    } tensors[] = {{"q", p.q, {p.q_batch_stride, p.q_row_stride, p.q_head_stride}},
                   {"k", p.k, {p.k_batch_stride, p.k_row_stride, p.k_head_stride}},
                   {"v", p.v, {p.v_batch_stride, p.v_row_stride, p.v_head_stride}}};
    for (const auto& t : tensors) {
      for (int64_t s : t.strides)
        if (s * esz % 16 != 0)
          return unimplemented(std::string("the fused kernels read 16-byte rows: ") + t.name + " has a stride of " +
                               str(s * esz) + " bytes");
      if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
        return unimplemented(std::string("the fused kernels read 16-byte rows: ") + t.name + " is not 16-byte aligned");
    }
  }
  const int max_samples = p.mode == Mode::kLsh ? static_cast<int>(p.samples) : 0;
  const int64_t smem = std::max({fused_forward_smem(p, max_samples), fused_backward_smem(p, max_samples),
                                 dispatch_fused(p.dtype, p.head_dim, int64_t{-1}, [&](auto cfg) {
                                   return fused_probe_smem_bytes<decltype(cfg)>(max_samples);
                                 })});
  if (smem > kMaxCtaSharedBytes)
    return unimplemented("the fused kernels need " + str(smem) + " bytes of shared memory per CTA here, at most " +
                         str(kMaxCtaSharedBytes));
  return Status::Ok();
}

FusedTables fused_tables(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  FusedTables t;
  t.heads.resize(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) {
    FusedHead& fh = t.heads[static_cast<size_t>(h)];
    const double slope = p.slopes[static_cast<size_t>(h)];
    const double sigma = p.sigma(h);
    if (p.mode == Mode::kLsh && std::isfinite(sigma)) {
      const std::vector<Draw>& d = draws[static_cast<size_t>(h)];
      fh.rule = FusedRule::kHashes;
      fh.slope = slope;  // nearest is 0 under lsh (queries among the keys); the probe's L* reads it
      fh.slope2 = static_cast<float>(slope * 1.4426950408889634);
      fh.samples = static_cast<int32_t>(d.size());
      fh.hash0 = static_cast<int64_t>(t.hashes.size() / 2);
      fh.lse_offset = -std::log(static_cast<double>(d.size()));
      for (const Draw& x : d) {
        t.hashes.push_back(x.pitch);
        t.hashes.push_back(x.shift);
      }
      t.max_samples = std::max(t.max_samples, fh.samples);
    } else {
      // exact; window; lsh with slope 0 (M~ = 1: every key, unbiased).
      fh.rule = FusedRule::kAlibi;
      fh.slope = slope;
      fh.slope2 = static_cast<float>(slope * 1.4426950408889634);
      fh.window = p.mode == Mode::kWindow ? p.window[static_cast<size_t>(h)] : kNoWindow;
    }
  }
  return t;
}

FusedArgs fused_args(const AttentionParams& p, const FusedTables& t, const FusedHead* head_table,
                     const double* hashes) {
  FusedArgs a;
  a.q = p.q, a.k = p.k, a.v = p.v, a.out = p.out, a.lse = p.lse;
  a.q_bs = p.q_batch_stride, a.q_rs = p.q_row_stride, a.q_hs = p.q_head_stride;
  a.k_bs = p.k_batch_stride, a.k_rs = p.k_row_stride, a.k_hs = p.k_head_stride;
  a.v_bs = p.v_batch_stride, a.v_rs = p.v_row_stride, a.v_hs = p.v_head_stride;
  a.o_bs = p.o_batch_stride, a.o_rs = p.o_row_stride, a.o_hs = p.o_head_stride;
  a.lse_bs = p.lse_batch_stride, a.lse_rs = p.lse_row_stride;
  a.batch = p.batch, a.q_len = p.q_len, a.kv_len = p.kv_len, a.heads = p.heads, a.head_group = p.head_group;
  a.qk_offset = p.q_pos0 - p.k_pos0;
  a.q_pos0 = p.q_pos0;
  a.k_pos0 = p.k_pos0;
  a.causal = p.causal ? 1 : 0;
  a.out_dtype = static_cast<int32_t>(p.out_dtype);
  a.scale2 = static_cast<float>(p.scale * 1.4426950408889634);
  a.max_samples = t.max_samples;
  a.head_table = head_table;
  a.hashes = hashes;
  return a;
}

int64_t carve_fused_forward(const AttentionParams& p, const FusedTables& t, char* base, FusedForwardBuffers* out) {
  FusedForwardBuffers b;
  Carver c(base);
  b.heads = c.take<FusedHead>(static_cast<int64_t>(t.heads.size()));
  b.hashes = c.take<double>(std::max<int64_t>(1, static_cast<int64_t>(t.hashes.size())));
  b.tiles_done = c.take<unsigned long long>(1);
  if (p.memory == MemorySpace::kHost) {
    const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
    b.q_bytes = p.batch * p.q_len * p.heads * p.head_dim * esz;
    b.kv_bytes = p.batch * p.kv_len * p.kv_heads * p.head_dim * esz;
    b.out_bytes = p.batch * p.q_len * p.heads * p.head_dim * static_cast<int64_t>(dtype_bytes(p.out_dtype));
    b.lse_bytes = p.batch * p.q_len * p.heads * 4;
    b.q = c.take<char>(b.q_bytes);
    b.k = c.take<char>(b.kv_bytes);
    b.v = c.take<char>(b.kv_bytes);
    b.out = c.take<char>(b.out_bytes);
    b.lse = c.take<float>(b.lse_bytes / 4);
  }
  if (out != nullptr) *out = b;
  return c.bytes();
}

int64_t fused_forward_bytes_for(const AttentionParams& p) {
  FusedTables t;
  t.heads.resize(static_cast<size_t>(p.heads));
  t.hashes.resize(p.mode == Mode::kLsh ? static_cast<size_t>(2 * p.heads * p.samples) : 0);
  return carve_fused_forward(p, t, nullptr, nullptr);
}

int64_t carve_fused_backward(const AttentionParams& p, const FusedTables& t, int64_t grad_bytes, char* base,
                             FusedBackwardBuffers* out) {
  FusedBackwardBuffers b;
  const int64_t fwd = carve_fused_forward(p, t, base, &b.fwd);
  Carver c(base == nullptr ? nullptr : base + fwd);
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  b.rows = p.batch * p.heads * p.q_len;
  b.dq_elems = p.batch * p.q_len * p.heads * p.head_dim;
  b.dkv_elems = p.batch * p.kv_len * p.kv_heads * p.head_dim;
  b.dout = c.take<char>(p.memory == MemorySpace::kHost ? b.dq_elems * esz : 0);
  b.row_d = c.take<float>(b.rows);
  b.row_lse2 = c.take<float>(b.rows);
  b.dq_acc = c.take<float>(b.dq_elems);
  b.spans = c.take<int32_t>(2 * p.heads * fused_tiles(p.q_len, kFusedRows));
  b.dq = c.take<char>(b.dq_elems * grad_bytes);
  b.dk = c.take<char>(b.dkv_elems * grad_bytes);
  b.dv = c.take<char>(b.dkv_elems * grad_bytes);
  if (out != nullptr) *out = b;
  return fwd + c.bytes();
}

FusedLayout plan_fused_layout(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws, bool backward,
                              int sm_count) {
  FusedLayout f;
  f.tables = fused_tables(p, draws);
  f.forward_bytes = carve_fused_forward(p, f.tables, nullptr, nullptr);
  // The probe rows come with the forward (issue 19) where the estimates
  // will want them: lsh and window, with a probe, on host tensors.
  f.probe = p.mode != Mode::kExact && p.estimates && p.probe_rows > 0 && p.memory == MemorySpace::kHost;
  if (f.probe) {
    f.probe_layout = plan_fused_probe(p, sm_count);
    f.forward_bytes += f.probe_layout.bytes;
  }
  if (backward) f.backward_bytes = carve_fused_backward(p, f.tables, 4, nullptr, nullptr);
  return f;
}

FusedProbeLayout plan_fused_probe(const AttentionParams& p, int sm_count) {
  FusedProbeLayout l;
  const int64_t per_head = std::min(p.probe_rows, p.batch * p.q_len);
  l.max_rows = p.heads * per_head;
  // Each batch item a sample touches may start a group, then every 64 rows.
  l.max_groups = p.heads * std::min(per_head, fused_tiles(per_head, kFusedRows) + p.batch);
  const int64_t key_tiles = fused_tiles(p.kv_len, kFusedKeys);
  const int64_t want = fused_tiles(4 * std::max(sm_count, 1), std::max<int64_t>(1, l.max_groups));
  l.splits = static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(64, key_tiles)));
  l.bytes = carve_fused_probe(p, l, nullptr, nullptr);
  return l;
}

int64_t carve_fused_probe(const AttentionParams& p, const FusedProbeLayout& l, char* base, FusedProbeBuffers* out) {
  FusedProbeBuffers b;
  Carver c(base);
  b.groups = c.take<ProbeGroup>(l.max_groups);
  b.row_index = c.take<int32_t>(l.max_rows);
  b.partial = c.take<float>(l.max_groups * l.splits * kFusedRows * probe_floats(p.head_dim));
  b.result = c.take<float>(l.max_rows * (p.head_dim + 3));
  if (out != nullptr) *out = b;
  return c.bytes();
}

void fused_probe_groups(const AttentionParams& p, const std::vector<std::vector<int64_t>>& samples,
                        std::vector<ProbeGroup>* groups, std::vector<int32_t>* row_index) {
  groups->clear();
  row_index->clear();
  for (size_t h = 0; h < samples.size(); ++h)
    for (size_t n = 0; n < samples[h].size();) {
      ProbeGroup g;
      g.head = static_cast<int32_t>(h);
      g.batch = static_cast<int32_t>(samples[h][n] / p.q_len);
      g.first = static_cast<int32_t>(row_index->size());
      while (n < samples[h].size() && samples[h][n] / p.q_len == g.batch && g.rows < kFusedRows) {
        row_index->push_back(static_cast<int32_t>(samples[h][n] % p.q_len));
        ++g.rows;
        ++n;
      }
      groups->push_back(g);
    }
}

Status check_fused_fits(const FusedLayout& f, const AttentionParams& p) {
  if (static_cast<int64_t>(f.tables.heads.size()) != p.heads)
    return internal_error("cuda backend: the plan has fused tables for " +
                          str(static_cast<int64_t>(f.tables.heads.size())) + " heads, the params " + str(p.heads));
  const int64_t need = carve_fused_forward(p, f.tables, nullptr, nullptr) + (f.probe ? f.probe_layout.bytes : 0);
  if (need > f.forward_bytes)
    return internal_error("cuda backend: the fused forward would carve " + str(need) + " bytes from the plan's " +
                          str(f.forward_bytes) + ": the plan was made for other params");
  return Status::Ok();
}

Status check_fused_backward_fits(const FusedLayout& f, const AttentionParams& p, int64_t grad_bytes) {
  RETURN_IF_ERROR(check_fused_fits(f, p));
  const int64_t need = carve_fused_backward(p, f.tables, grad_bytes, nullptr, nullptr);
  if (f.backward_bytes == 0 || need > f.backward_bytes)
    return internal_error("cuda backend: the fused backward would carve " + str(need) + " bytes from the plan's " +
                          str(f.backward_bytes) + ": the plan was made without the backward or for other params");
  return Status::Ok();
}

std::vector<ForwardStep> fused_forward_steps(const AttentionParams& p, const FusedTables& t, int64_t step_rows) {
  const FusedArgs a = fused_args(p, t, t.heads.data(), t.hashes.data());
  const int64_t tiles = fused_tiles(p.q_len, kFusedRows), per_step = std::max<int64_t>(1, step_rows / kFusedRows);
  std::vector<ForwardStep> steps;
  int64_t keys = 0;
  for (int64_t t0 = 0; t0 < tiles; t0 += per_step) {
    const int64_t t1 = std::min(tiles, t0 + per_step);
    for (const FusedHead& h : t.heads) keys = std::max(keys, fused_key_range(a, h, t1 - 1).end);
    steps.push_back({t0, t1, keys});
  }
  return steps;
}

namespace {

// Rates the model assumes on an H200 until bench/gpu/run.sh measures them
// (SPEC section 3, "CUDA: choosing the lsh algorithm").
constexpr double kFusedFlopsPerS = 3.0e14;     // mma.sync bf16 at ~40% of the dense peak
constexpr double kAluOpsPerS = 1.6e13;         // 32-bit integer/compare ops (64 per SM per clock)
constexpr double kBytesPerS = 4.0e12;          // device memory
constexpr double kLaunchS = 5e-6;              // one kernel or cuBLAS call
constexpr double kPerSampleBytesPerPair = 12;  // fp32 score written and read, P written and read

}  // namespace

LshCosts cuda_lsh_costs(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  LshCosts c;
  const double D = static_cast<double>(p.head_dim);
  const double lanes = static_cast<double>(p.batch);
  const double tiles_fused = std::ceil(static_cast<double>(p.q_len) / kFusedRows);
  const double tiles_ps = std::ceil(static_cast<double>(p.q_len) / static_cast<double>(kTileRows));
  const double keys = static_cast<double>(p.kv_len);
  const double side = p.causal ? 1.0 : 2.0;  // a tile reaches behind it, and ahead without causality
  double fused_pairs = 0, fused_weight_ops = 0, ps_pairs = 0, ps_rounds = 0;
  for (int64_t h = 0; h < p.heads; ++h) {
    const std::vector<Draw>& d = draws[static_cast<size_t>(h)];
    if (d.empty() || !std::isfinite(p.sigma(h))) {  // slope 0: one pass over every key in both
      const double pairs = tiles_fused * kFusedRows * keys * (p.causal ? 0.5 : 1.0);
      fused_pairs += pairs;
      ps_pairs += pairs;
      ps_rounds += std::ceil(keys / static_cast<double>(kMaxKeyCols));
      continue;
    }
    double widest = 0, mean = 0;
    for (const Draw& x : d) {
      const double reach = std::min(keys, std::ceil(x.pitch) + 1);
      widest = std::max(widest, reach);
      mean += std::min(1.0, 80.0 / std::max(x.pitch, 1.0));  // chance a hash splits a 16 x 64 rectangle
      // Per sample: every tile's span, rounded up to whole key chunks.
      const double span = std::min(keys, static_cast<double>(kTileRows) + side * reach);
      const double cols = static_cast<double>(key_cols_for(static_cast<int64_t>(span), p.kv_len));
      ps_pairs += tiles_ps * static_cast<double>(kTileRows) * std::ceil(span / cols) * cols;
      ps_rounds += std::ceil(span / cols);
    }
    // Fused: the union of the blocks, rounded up to whole key tiles (one more for the alignment).
    const double band = std::min(keys, kFusedRows + side * widest);
    const double pairs = tiles_fused * kFusedRows * (std::ceil(band / kFusedKeys) + 1) * kFusedKeys;
    fused_pairs += pairs;
    fused_weight_ops += pairs * (2 + 3 * mean);  // the count per element: the mixed hashes' interval tests
  }
  fused_pairs *= lanes, fused_weight_ops *= lanes, ps_pairs *= lanes;
  c.per_sample_s =
      ps_pairs * (4 * D / kFusedFlopsPerS + kPerSampleBytesPerPair / kBytesPerS) + 5 * ps_rounds * kLaunchS;
  c.banded_s = fused_supported(p).ok()
                   ? fused_pairs * 4 * D / kFusedFlopsPerS + fused_weight_ops / kAluOpsPerS + kLaunchS
                   : std::numeric_limits<double>::infinity();
  return c;
}

LshAlgorithm cuda_lsh_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  const LshCosts c = cuda_lsh_costs(p, draws);
  return c.banded_s <= c.per_sample_s ? LshAlgorithm::kBanded : LshAlgorithm::kPerSample;
}

}  // namespace plsh::cuda
