// The fused backward's steps, in the one order both executors run them
// (fused_kernels.cu on the device, fused_host.h on the host):
//   1. spans: every (head, query tile)'s key tiles, for the CTAs' search of
//      the query tiles that reach their key tile;
//   2. row terms: D_i = dO_i . O_i and lse2 (base 2, before the offset and
//      the nearest key's bias) from the forward's lse, one thread per row:
//      on the GPU, not a host loop over out and dout;
//   3. the statistics pass over the query tiles with rows far from the keys:
//      there a float32 lse (-slope * 1e6 = -5e5 at slope 0.5 and distance
//      1e6) has lost ~0.03 in its last bit, which every P of the row would
//      carry, so lse2 is recomputed exactly by the forward's own kernel
//      (stats_only: m + log2 l, no P V);
//   4. dq's accumulator zeroed, the backward's CTAs, dq in its dtype.
#pragma once

#include <cstdint>

#include "cuda/fused_exec.h"
#include "cuda/fused_tile.h"

namespace plsh::cuda {

// What step 2 reads besides FusedArgs (dout and its strides are there).
struct FusedRowTermsArgs {
  const void* out = nullptr;  // [B, Nq, H, D] out_dtype
  int32_t out_dtype = 0;
  int32_t pad = 0;
  int64_t o_bs = 0, o_rs = 0, o_hs = 0;
  const float* lse = nullptr;  // [B, Nq, H]
  int64_t lse_bs = 0, lse_rs = 0;
  int64_t head_dim = 0;
  float* row_d = nullptr;     // [B * H][Nq]
  float* row_lse2 = nullptr;  // [B * H][Nq]
};

// Row i of lane g = b * H + h: its part of D_i = dO_i . O_i over columns
// c0, c0 + step, ... (float32 sums, in the out dtype given; the device
// splits a row over a warp, the host takes it whole), and its lse2 from the
// forward's lse (fused_lse2_from_lse).
PLSH_HD inline float fused_row_dot(const FusedArgs& a, const FusedRowTermsArgs& t, int64_t g, int64_t i, int c0,
                                   int step) {
  const int64_t b = g / a.heads, h = g % a.heads;
  const int64_t o_at = b * t.o_bs + i * t.o_rs + h * t.o_hs, d_at = b * a.do_bs + i * a.do_rs + h * a.do_hs;
  auto load = [&](const void* x, int64_t at) -> float {
    if (t.out_dtype == 0) return static_cast<const float*>(x)[at];
    const uint16_t bits = static_cast<const uint16_t*>(x)[at];
    return t.out_dtype == 1 ? bits_to_float(F16{}, bits) : bits_to_float(Bf16{}, bits);
  };
  float dot = 0;
  for (int64_t c = c0; c < t.head_dim; c += step) dot += load(t.out, o_at + c) * load(a.dout, d_at + c);
  return dot;
}
PLSH_HD inline float fused_row_lse2(const FusedArgs& a, const FusedRowTermsArgs& t, int64_t g, int64_t i) {
  const int64_t b = g / a.heads, h = g % a.heads;
  const FusedHead& head = a.head_table[h];
  return fused_lse2_from_lse(t.lse[b * t.lse_bs + i * t.lse_rs + h], head, fused_row(a, head, i).nearest);
}

// The query tiles holding rows outside the keys (nearest > 0): before them
// (R = i + qk_offset < 0) and after them (R >= Nk).
struct FarTiles {
  TileSpan before, after;
};
PLSH_HD inline FarTiles fused_far_tiles(const FusedArgs& a) {
  FarTiles f{{0, 0}, {0, 0}};
  const int64_t tiles = fused_tiles(a.q_len, kFusedRows);
  const int64_t before = min64(a.q_len, max64(0, -a.qk_offset));           // rows [0, before)
  const int64_t after = max64(0, min64(a.q_len, a.kv_len - a.qk_offset));  // rows [after, Nq)
  if (before > 0) f.before = {0, fused_tiles(before, kFusedRows)};
  if (after < a.q_len) f.after = {after / kFusedRows, tiles};
  return f;
}

// Steps 1-4 through `s`: spans(spans), row_terms(), stats(args, tiles),
// zero_dq(), then the backward's key tiles in `chunks` launches,
// main(kt0, kt1) each followed by between(chunk, chunks) (where the device
// paces itself and a stop takes effect), and dq_out(); false at the first
// that fails.
template <typename Steps>
bool fused_backward_steps(const Steps& s, const FusedArgs& a, int32_t* spans, int64_t chunks = 1) {
  if (!s.spans(spans) || !s.row_terms()) return false;
  FusedArgs st = a;
  st.stats_only = 1;
  st.row_lse2 = const_cast<float*>(a.row_lse2_in);
  st.out = nullptr;
  st.lse = nullptr;
  st.tiles_done = nullptr;
  const FarTiles far = fused_far_tiles(a);
  for (const TileSpan& t : {far.before, far.after})
    if (t.begin < t.end && !s.stats(st, t)) return false;
  if (!s.zero_dq()) return false;
  const int64_t key_tiles = fused_tiles(a.kv_len, kFusedKeys);
  const int64_t per = fused_tiles(key_tiles, chunks < 1 ? 1 : chunks);
  const int64_t n = fused_tiles(key_tiles, per);
  for (int64_t c = 0; c < n; ++c)
    if (!s.main(c * per, min64(key_tiles, (c + 1) * per)) || !s.between(c, n)) return false;
  return s.dq_out();
}

}  // namespace plsh::cuda
