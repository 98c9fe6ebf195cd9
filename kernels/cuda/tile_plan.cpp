#include "cuda/workspace_slots.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "plsh/draws.h"

namespace plsh::cuda {

namespace {
// Beyond 2^52 positions stop being exact in double, and a reach that large
// only widens spans that are clamped to the key range anyway.
constexpr double kMaxBoundedReach = 4.0e15;
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

int64_t carve_work(int64_t slots, int64_t tile_rows, int64_t key_cols, int64_t head_dim, int64_t elem_bytes, char* base,
                   RoundBuffers* round, Accumulators* acc) {
  const int64_t S = slots, T = tile_rows, Kc = key_cols, D = head_dim;
  RoundBuffers r;
  Accumulators a;
  Carver c(base);
  const int64_t Kp = key_pitch(Kc), Dp = partial_pitch(D);
  carve_round_slices(c, S, T, Kp, elem_bytes, &r);
  r.partial = c.take<float>(S * T * Dp);
  r.partial_ptr = c.take<float*>(S);
  r.row_max = c.take<float>(S * T);
  r.row_sum = c.take<float>(S * T);
  a.acc = c.take<float>(S * T * D);
  a.acc_max = c.take<float>(S * T);
  a.acc_sum = c.take<float>(S * T);
  if (round != nullptr) *round = r;
  if (acc != nullptr) *acc = a;
  return c.bytes();
}

namespace {
// Elements a tensor spans: the last element's offset + 1.
int64_t extent(int64_t batch, int64_t rows, int64_t heads, int64_t dim, int64_t bs, int64_t rs, int64_t hs) {
  return (batch - 1) * bs + (rows - 1) * rs + (heads - 1) * hs + dim;
}
}  // namespace

OperandLayout operand_layout(const AttentionParams& p) {
  OperandLayout o;
  o.elem_bytes = static_cast<int64_t>(dtype_bytes(p.dtype));
  o.head_group = p.head_group;
  o.head_dim = p.head_dim;
  if (p.memory == MemorySpace::kHost) {
    const int64_t dp = aligned_count(p.head_dim, o.elem_bytes);
    o.q_hs = dp, o.q_rs = p.heads * dp, o.q_bs = p.q_len * o.q_rs;
    o.k_hs = o.v_hs = dp;
    o.k_rs = o.v_rs = p.kv_heads * dp;
    o.k_bs = o.v_bs = p.kv_len * o.k_rs;
  } else {
    o.q_bs = p.q_batch_stride, o.q_rs = p.q_row_stride, o.q_hs = p.q_head_stride;
    o.k_bs = p.k_batch_stride, o.k_rs = p.k_row_stride, o.k_hs = p.k_head_stride;
    o.v_bs = p.v_batch_stride, o.v_rs = p.v_row_stride, o.v_hs = p.v_head_stride;
  }
  return o;
}

Status check_operands(const AttentionParams& p) {
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  struct Tensor {
    const char* name;
    const void* data;
    int64_t rows, heads, bs, rs, hs;
  };
  const Tensor tensors[] = {
      {"q", p.q, p.q_len, p.heads, p.q_batch_stride, p.q_row_stride, p.q_head_stride},
      {"k", p.k, p.kv_len, p.kv_heads, p.k_batch_stride, p.k_row_stride, p.k_head_stride},
      {"v", p.v, p.kv_len, p.kv_heads, p.v_batch_stride, p.v_row_stride, p.v_head_stride},
  };
  const OperandLayout o = operand_layout(p);
  const int64_t lds[] = {o.q_rs, o.k_rs, o.v_rs};
  for (int t = 0; t < 3; ++t) {
    const Tensor& x = tensors[t];
    if (lds[t] > INT32_MAX)
      return unimplemented(std::string(x.name) + " row stride " + std::to_string(lds[t]) +
                           " elements exceeds cuBLAS's int leading dimension");
    if (p.memory == MemorySpace::kHost) {
      // The staging copy pads rows of a dense tensor (one 2D copy).
      if (x.hs != p.head_dim || x.rs != x.heads * p.head_dim || x.bs != x.rows * x.rs)
        return unimplemented(std::string(x.name) + " is not dense [B, N, H, D] (strides " + std::to_string(x.bs) +
                             ", " + std::to_string(x.rs) + ", " + std::to_string(x.hs) +
                             "): the cuda backend stages dense host tensors only");
      continue;
    }
    const struct {
      const char* what;
      int64_t elems;
    } strides[] = {{"head", x.hs}, {"row", x.rs}, {"batch", x.bs}};
    for (const auto& st : strides)
      if (st.elems * esz % kOperandAlign != 0)
        return unimplemented(std::string(x.name) + " " + st.what + " stride = " + std::to_string(st.elems * esz) +
                             " bytes (" + std::to_string(st.elems) + " x " + std::to_string(esz) + "-byte " +
                             dtype_name(p.dtype) + "), expected a multiple of 16: the cuda backend's batched GEMMs " +
                             "need 16-byte aligned device rows; pass host tensors (staged with padded rows) or a " +
                             "head_dim that is a multiple of " + std::to_string(kOperandAlign / esz));
    if (reinterpret_cast<uintptr_t>(x.data) % static_cast<uintptr_t>(kOperandAlign) != 0)
      return unimplemented(std::string(x.name) +
                           " device pointer is not 16-byte aligned, expected the start of an "
                           "allocation or an offset that is a multiple of 16 bytes");
  }
  return Status::Ok();
}

int64_t carve_staging(const AttentionParams& p, char* base, StagingBuffers* out) {
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  StagingBuffers b;
  AttentionParams host = p;
  host.memory = MemorySpace::kHost;  // the staging layout whatever p is bound to
  const OperandLayout o = operand_layout(host);
  b.q_bytes = extent(p.batch, p.q_len, p.heads, p.head_dim, o.q_bs, o.q_rs, o.q_hs) * esz;
  b.k_bytes = extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, o.k_bs, o.k_rs, o.k_hs) * esz;
  b.v_bytes = extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, o.v_bs, o.v_rs, o.v_hs) * esz;
  b.out_bytes = extent(p.batch, p.q_len, p.heads, p.head_dim, p.o_batch_stride, p.o_row_stride, p.o_head_stride) *
                static_cast<int64_t>(dtype_bytes(p.out_dtype));
  // A plan made before the tensors are bound cannot see p.lse: lse is
  // sized whenever the params could carry it, i.e. always.
  b.lse_bytes = ((p.batch - 1) * p.lse_batch_stride + (p.q_len - 1) * p.lse_row_stride + p.heads) * 4;
  Carver c(base);
  b.qkv.q = c.take<char>(b.q_bytes);
  b.qkv.k = c.take<char>(b.k_bytes);
  b.qkv.v = c.take<char>(b.v_bytes);
  b.out = c.take<char>(b.out_bytes);
  b.lse = c.take<float>(b.lse_bytes / 4);
  if (out != nullptr) *out = b;
  return c.bytes();
}

int64_t carve_tables(int64_t heads, int64_t entries, int64_t cublas_workspace_bytes, char* base, TableBuffers* out) {
  TableBuffers t;
  Carver c(base);
  t.head_lse = c.take<HeadLse>(heads);
  t.lanes = c.take<LanePass>(entries);
  t.entries = entries;
  t.cublas_workspace = c.take<char>(cublas_workspace_bytes);  // 256-byte aligned, as cuBLAS asks
  t.cublas_workspace_bytes = cublas_workspace_bytes;
  if (out != nullptr) *out = t;
  return c.bytes();
}

int64_t cublas_workspace_for(int64_t device_cap_bytes) {
  return device_cap_bytes / 8 >= kCublasWorkspaceBytes ? kCublasWorkspaceBytes : kCublasMinWorkspaceBytes;
}

int64_t request_device_cap(int64_t pool_budget, int64_t limit_bytes) {
  return limit_bytes > 0 ? std::min(limit_bytes, pool_budget) : pool_budget / 2;
}

std::vector<GemmBatch> gemm_batches(int64_t slots) {
  std::vector<GemmBatch> batches;
  for (int64_t first = 0; first < slots; first += kMaxGemmBatch)
    batches.push_back({first, std::min(kMaxGemmBatch, slots - first)});
  return batches;
}

ForwardGemms forward_gemms(const OperandLayout& o, int64_t tile_rows, int64_t key_cols) {
  const int64_t T = tile_rows, Kc = key_cols, D = o.head_dim;
  const int64_t Kp = key_pitch(Kc), Dp = partial_pitch(D);
  ForwardGemms g;
  // Column-major S^T (Kc x T, ld Kp) = op_T(K: D x Kc, ld k_rs) . Q (D x T, ld q_rs): row-major S [T][Kp].
  g.scores = {true, false, Kc, T, D, o.k_rs, o.q_rs, Kp};
  // O^T (D x T, ld Dp) = V^T (D x Kc, ld v_rs) . P^T (Kc x T, ld Kp): row-major O [T][Dp].
  g.partial = {false, false, D, T, Kc, o.v_rs, Kp, Dp};
  return g;
}

StatusOr<WorkspaceSlots> size_workspace(const WorkspaceShape& s, int64_t budget_bytes) {
  const int64_t T = std::min(kTileRows, s.q_len), Kc = std::min(kMaxKeyCols, s.kv_len);
  return size_workspace_for(s, budget_bytes, [&](int64_t slots) {
    return carve_work(slots, T, Kc, s.head_dim, s.elem_bytes, nullptr, nullptr, nullptr);
  });
}

StatusOr<int64_t> work_budget(const char* what, int64_t device_cap_bytes, int64_t staging_bytes, int64_t table_bytes) {
  const int64_t left = device_cap_bytes - staging_bytes - table_bytes;
  if (left <= 0)
    return resource_exhausted(std::string(what) + ": staging (" + std::to_string(staging_bytes) +
                              " bytes) and lane tables (" + std::to_string(table_bytes) +
                              " bytes) alone exceed the request's device memory of " +
                              std::to_string(device_cap_bytes) + " bytes");
  return left;
}

StatusOr<WorkspaceSlots> size_workspace_for(const WorkspaceShape& s, int64_t budget_bytes,
                                            const std::function<int64_t(int64_t slots)>& work_bytes) {
  if (s.lanes < 1 || s.q_len < 1 || s.kv_len < 1 || s.head_dim < 1 || s.elem_bytes < 1)
    return invalid_argument("workspace shape: lanes, q_len, kv_len, head_dim and elem_bytes must be >= 1");
  WorkspaceSlots p;
  p.tile_rows = std::min(kTileRows, s.q_len);
  p.key_cols = std::min(kMaxKeyCols, s.kv_len);
  const int64_t T = p.tile_rows;
  // kSliceAlign slots make every slice a multiple of the alignment: no
  // padding, so this is the exact per-slot sum of the carved slices.
  p.bytes_per_slot = work_bytes(kSliceAlign) / kSliceAlign;
  int64_t max_slots = std::min(kMaxSlots, std::max<int64_t>(budget_bytes, 0) / p.bytes_per_slot);
  while (max_slots > 0 && work_bytes(max_slots) > budget_bytes) --max_slots;  // the slices' padding
  if (max_slots < 1)
    return resource_exhausted("cuda workspace: one " + std::to_string(T) + "-row tile needs " +
                              std::to_string(work_bytes(1)) + " bytes, the request's device memory left is " +
                              std::to_string(budget_bytes) + " bytes");
  const int64_t tiles = ceil_div(s.q_len, T);
  // Lanes are the finalize kernel's grid.y, at most 65535.
  p.lanes_per_chunk = std::min({s.lanes, max_slots, kMaxLanesPerChunk});
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

WorkspaceShape workspace_shape(const AttentionParams& p) {
  WorkspaceShape ws;
  ws.lanes = p.batch * p.heads;
  ws.q_len = p.q_len;
  ws.kv_len = p.kv_len;
  ws.head_dim = p.head_dim;
  ws.elem_bytes = static_cast<int64_t>(dtype_bytes(p.dtype));
  return ws;
}

std::vector<LaneSetup> head_passes(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  std::vector<LaneSetup> heads(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) {
    LaneSetup& setup = heads[static_cast<size_t>(h)];
    LanePass base;
    base.head = static_cast<int32_t>(h);
    base.slope = static_cast<float>(p.slopes[static_cast<size_t>(h)]);
    const double sigma = p.sigma(h);
    // lsh and fixed_blocks: one pass per hash of the plan's draws.
    if (uses_draws(p.mode) && std::isfinite(sigma)) {
      for (const Draw& d : draws[static_cast<size_t>(h)]) {
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

HeadLse head_lse(const AttentionParams& p, const LaneSetup& head) {
  HeadLse h;
  if (head.passes.empty()) return h;
  const LanePass& first = head.passes.front();
  if (first.rule == SpanRule::kSameBin) {
    h.offset = -std::log(static_cast<double>(p.samples));
  } else {
    h.slope = p.slopes[static_cast<size_t>(first.head)];  // the double the float logits' slope came from
  }
  return h;
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
              if (sp.end - sp.begin > c * cols)
                hi = mid;
              else
                lo = mid + 1;
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

std::vector<LaneSetup> chunk_lanes(const std::vector<LaneSetup>& heads, int64_t num_heads, int64_t lane0,
                                   int64_t lane1) {
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

int64_t lane_table_entries(const SpanShape& shape, const std::vector<LaneSetup>& heads, int64_t lanes_per_chunk) {
  // A chunk of lanes holds at most lanes_per_chunk lanes, each some head's
  // copy: bound each by the head with the most entries.
  int64_t most = 0;
  for (const LaneSetup& h : heads) {
    int64_t entries = 0;
    for (const LanePass& l : h.passes) {
      const int64_t width = max_span_width(shape, l.reach);
      entries += ceil_div(width, key_cols_for(width, shape.kv_len));
    }
    most = std::max(most, entries);
  }
  return most * lanes_per_chunk;
}

StatusOr<CudaLayout> plan_layout(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws,
                                 int64_t device_cap_bytes) {
  CudaLayout layout;
  layout.heads = head_passes(p, draws);
  layout.staging_bytes = p.memory == MemorySpace::kHost ? carve_staging(p, nullptr, nullptr) : 0;
  const SpanShape shape = span_shape(p);
  const int64_t lanes = p.batch * p.heads;
  layout.table_entries = lane_table_entries(shape, layout.heads, std::min(lanes, kMaxLanesPerChunk));
  layout.cublas_workspace_bytes = cublas_workspace_for(device_cap_bytes);
  layout.table_bytes = carve_tables(p.heads, layout.table_entries, layout.cublas_workspace_bytes, nullptr, nullptr);
  const WorkspaceShape ws = workspace_shape(p);
  ASSIGN_OR_RETURN(const int64_t left,
                   work_budget("cuda workspace", device_cap_bytes, layout.staging_bytes, layout.table_bytes));
  ASSIGN_OR_RETURN(layout.work, size_workspace(ws, left));
  layout.work_bytes = carve_work(layout.work.slots, layout.work.tile_rows, layout.work.key_cols, p.head_dim,
                                 ws.elem_bytes, nullptr, nullptr, nullptr);
  return layout;
}

Status check_layout_fits(const CudaLayout& layout, const AttentionParams& p) {
  auto over = [](const char* what, int64_t need, int64_t planned) {
    return internal_error(std::string("cuda backend: forward would carve ") + std::to_string(need) + " bytes of " +
                          what + " from the plan's " + std::to_string(planned) +
                          ": the plan was made for other params");
  };
  if (static_cast<int64_t>(layout.heads.size()) != p.heads)
    return internal_error("cuda backend: the plan has passes for " + std::to_string(layout.heads.size()) +
                          " heads, the params " + std::to_string(p.heads));
  if (p.memory == MemorySpace::kHost) {
    const int64_t staging = carve_staging(p, nullptr, nullptr);
    if (staging > layout.staging_bytes) return over("staging", staging, layout.staging_bytes);
  }
  const int64_t tables = carve_tables(p.heads, layout.table_entries, layout.cublas_workspace_bytes, nullptr, nullptr);
  if (tables > layout.table_bytes) return over("tables", tables, layout.table_bytes);
  const WorkspaceSlots& w = layout.work;
  if (w.tile_rows != std::min(kTileRows, p.q_len) || w.key_cols < std::min(kMaxKeyCols, p.kv_len))
    return internal_error("cuda backend: the plan's tiles (" + std::to_string(w.tile_rows) + " x " +
                          std::to_string(w.key_cols) + ") do not fit the params' q_len and kv_len");
  const int64_t work = carve_work(w.slots, w.tile_rows, w.key_cols, p.head_dim,
                                  static_cast<int64_t>(dtype_bytes(p.dtype)), nullptr, nullptr, nullptr);
  if (work > layout.work_bytes) return over("work", work, layout.work_bytes);
  return Status::Ok();
}

}  // namespace plsh::cuda
