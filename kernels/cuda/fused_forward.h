// The fused forward's body (FlashAttention-2's structure): one CTA per
// (query tile of 64 rows, head, batch item), 4 warps of 16 rows. Q stays on
// chip (in registers on the tensor-core path); the CTA walks only the key
// tiles its rows can reach (fused_key_tiles), K and V double-buffered in
// shared memory by cp.async; per key tile each warp computes S = Q K^T,
// weights it (ALiBi bias, or the hash count c_ij from the rows' blocks held
// in shared memory), folds it into its rows' online softmax (base 2) and
// adds P V; at the end out = O / l and lse. Scores and probabilities never
// leave the chip. Runs under DeviceExec (fused_kernels.cu) and HostExec
// (fused_host.h) alike.
//
// With args.stats_only it computes only each row's m + log2 l (base 2: the
// backward's lse far from the keys, fused_backward.h): no P V, no out.
#pragma once

#include <cstdint>

#include "cuda/fused_exec.h"
#include "cuda/fused_math.h"
#include "cuda/fused_tile.h"

namespace plsh::cuda {

// Shared memory of one forward CTA.
template <typename Cfg>
struct FwdSmem {
  using S = typename Cfg::Storage;
  S* q = nullptr;  // [kFusedRows][kPitch]
  // [kFusedKeys][kPitch] per stage. Two members and a select, not an array:
  // an array indexed by the runtime stage would live in local memory.
  S* k0 = nullptr;
  S* k1 = nullptr;
  S* v0 = nullptr;
  S* v1 = nullptr;
  float* p = nullptr;            // f32 path: [kFusedWarps][16][kPPitch]
  FusedBlock* blocks = nullptr;  // [max_samples][kFusedRows]
  int64_t* edges = nullptr;      // [max_samples][2]
  int64_t* bins = nullptr;       // [max_samples][kFusedRows], over k and v: setup only
  int64_t bytes = 0;

  PLSH_HD FwdSmem(unsigned char* base, int max_samples) {
    SmemCarver c{base};
    q = c.take<S>(kFusedRows * Cfg::kPitch);
    const int64_t kv_at = c.at;
    c.take_each(kFusedKeys * Cfg::kPitch, k0, v0, k1, v1);
    const int64_t kv_end = c.at;
    if (!Cfg::kTC) p = c.take<float>(kFusedWarps * 16 * Cfg::kPPitch);
    blocks = c.take<FusedBlock>(static_cast<int64_t>(max_samples) * kFusedRows);
    edges = c.take<int64_t>(2 * static_cast<int64_t>(max_samples));
    const int64_t bins_bytes = static_cast<int64_t>(max_samples) * kFusedRows * 8;
    if (bins_bytes <= kv_end - kv_at) {
      bins = base == nullptr ? nullptr : reinterpret_cast<int64_t*>(base + kv_at);
    } else {
      bins = c.take<int64_t>(static_cast<int64_t>(max_samples) * kFusedRows);
    }
    bytes = c.at;
  }
  PLSH_HD S* k(int stage) const { return stage == 0 ? k0 : k1; }
  PLSH_HD S* v(int stage) const { return stage == 0 ? v0 : v1; }
};

// One lane's registers across the key tiles.
template <typename Cfg>
struct FwdLane {
  float o[Cfg::kDT][4];      // O, C layout
  float s[Cfg::kNT][4];      // S, then the logits, then P
  float w[Cfg::kNT][4];      // kHashes: c_ij
  float m[2], l[2];          // rows g and g + 8: running max (base 2), this lane's share of the sum
  float tile_max[2];         // this key tile's max of each row, then the quad's
  uint32_t qf[Cfg::kKQ][4];  // Q's A fragments (tensor cores)
  uint32_t tmp[8];           // ldmatrix and P fragments in flight
  FusedRow row[2];
  unsigned long long tiles;  // (warp, key tile) products run
};

template <typename Cfg, typename X>
PLSH_HD void fused_forward_cta(const FusedArgs& a, int64_t t, int64_t h, int64_t b, unsigned char* smem_base, X& x) {
  using Lane = FwdLane<Cfg>;
  const FusedHead head = a.head_table[h];
  const int64_t hk = h / a.head_group;
  const int64_t row0 = t * kFusedRows;
  FwdSmem<Cfg> sm(smem_base, a.max_samples);
  const bool pv = !a.stats_only;

  fused_load_rows<Cfg>(x, sm.q, a.q, b * a.q_bs + h * a.q_hs, a.q_rs, row0, a.q_len, kFusedRows);
  x.commit();
  const KeyRange keys = head.rule == FusedRule::kHashes
                            ? fused_setup_blocks(x, a, head, t, sm.bins, sm.edges, sm.blocks)
                            : fused_alibi_keys(a, head, t);
  const TileSpan span = fused_key_tiles(keys);
  auto load_kv = [&](int64_t kt, int stage) { fused_load_kv<Cfg>(x, a, b, hk, kt, sm.k(stage), sm.v(stage), pv); };
  if (span.begin < span.end) load_kv(span.begin, 0);

  typename X::template PerThread<Lane> st;
  fused_each_lane(x, st, [&](Lane& L, int w, int lane) {
    L.tiles = 0;
    fused_zero(L.o);
    PLSH_UNROLL
    for (int half = 0; half < 2; ++half) {
      L.row[half] = fused_row(a, head, row0 + w * 16 + frag_row(lane, half));
      L.m[half] = -INFINITY;
      L.l[half] = 0;
    }
  });
  // Q has landed (the K/V group may still fly); its fragments to registers.
  if (span.begin < span.end)
    x.template wait<1>();
  else
    x.template wait<0>();
  x.sync();
  if constexpr (Cfg::kTC) {
    x.warps([&](int w) { fused_a_frags<Cfg>(x, sm.q, w * 16, [&](int lane, int kk) { return st(w, lane).qf[kk]; }); });
  }

  for (int64_t kt = span.begin; kt < span.end; ++kt) {
    const int stage = fused_key_step(x, span, kt, load_kv);
    x.warps([&](int w) {
      const int rf = w * 16;
      const int rl = static_cast<int>(min64(w * 16 + 15, a.q_len - 1 - row0));
      const FusedRow first = fused_row(a, head, row0 + rf), last = fused_row(a, head, row0 + (rl >= rf ? rl : rf));
      const WarpKeys wk = fused_warp_keys(x, a, head, sm.blocks, rf, rl, first, last, kt);
      if (wk.empty) return;
      // S = Q K^T
      x.lanes([&](int lane) {
        Lane& L = st(w, lane);
        ++L.tiles;
        fused_zero(L.s);
      });
      if constexpr (Cfg::kTC) {
        fused_abt_tc<Cfg>(
            x, [](int) {}, [&](int lane, int kk) -> const uint32_t* { return st(w, lane).qf[kk]; }, sm.k(stage),
            [&](int lane, int nt) { return st(w, lane).s[nt]; }, [&](int lane) { return st(w, lane).tmp; });
      } else {
        fused_abt_simt<Cfg>(x, sm.q, rf, sm.k(stage), [&](int lane, int nt) { return st(w, lane).s[nt]; });
      }
      // Weights, and each row's max over its allowed logits.
      x.lanes([&](int lane) {
        Lane& L = st(w, lane);
        const int rr[2] = {rf + frag_row(lane, 0), rf + frag_row(lane, 1)};
        fused_logits<Cfg::kNT>(a, head, wk, sm.blocks, lane, L.row, rr, L.s, L.w);
        PLSH_UNROLL
        for (int half = 0; half < 2; ++half) {
          float m = -INFINITY;
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int j = 0; j < 2; ++j) m = fmaxf(m, L.s[nt][2 * half + j]);
          L.tile_max[half] = m;
        }
      });
      fused_quad_max(x, st, w, &Lane::tile_max);
      // Rescale, P = 2^(x - m) (times c_ij), the row sums.
      fused_each_row(x, st, w, [&](Lane& L, int, int half) {
        const RowScale rs = fused_rescale(L.m[half], L.tile_max[half]);
        L.m[half] = rs.m_new;
        L.l[half] *= rs.alpha;
        if (pv) {
          PLSH_UNROLL
          for (int dt = 0; dt < Cfg::kDT; ++dt) PLSH_UNROLL
          for (int j = 0; j < 2; ++j) L.o[dt][2 * half + j] *= rs.alpha;
        }
        float sum = 0;
        PLSH_UNROLL
        for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
        for (int j = 0; j < 2; ++j) {
          float& e = L.s[nt][2 * half + j];
          float p = e == -INFINITY ? 0.0f : fused_prob(e, rs.m_new);
          if (head.rule == FusedRule::kHashes) p *= L.w[nt][2 * half + j];
          e = p;
          sum += p;
        }
        L.l[half] += sum;
      });
      if (!pv) return;
      // O += P V
      if constexpr (Cfg::kTC) {
        auto tmp = [&](int lane) { return st(w, lane).tmp; };
        fused_ab_tc<Cfg, Cfg::kDT>(
            x,
            [&](int kk) {
              fused_pack_a<Cfg>(
                  x, kk, [&](int lane, int nt) { return st(w, lane).s[nt]; }, tmp);
            },
            sm.v(stage), 0, [&](int lane, int dt) { return st(w, lane).o[dt]; }, tmp);
      } else {
        float* prow = sm.p + w * 16 * Cfg::kPPitch;
        x.lanes([&](int lane) {
          Lane& L = st(w, lane);
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int i = 0; i < 4; ++i)
            prow[frag_row(lane, i >> 1) * Cfg::kPPitch + nt * 8 + frag_col(lane, i & 1)] = L.s[nt][i];
        });
        x.syncwarp();
        fused_pb_simt<Cfg, Cfg::kDT>(x, prow, reinterpret_cast<const float*>(sm.v(stage)), 0,
                                     [&](int lane, int dt) { return st(w, lane).o[dt]; });
        x.syncwarp();
      }
    });
    x.sync();  // before the next iteration's loads overwrite this stage
  }

  // out = O / l, lse (or the statistics alone).
  x.warps([&](int w) {
    fused_quad_sum(x, st, w, &Lane::l);
    x.lanes([&](int lane) {
      Lane& L = st(w, lane);
      if (lane == 0 && a.tiles_done != nullptr) x.count(a.tiles_done, L.tiles);
      PLSH_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int64_t i = row0 + w * 16 + frag_row(lane, half);
        if (i >= a.q_len) continue;
        const float l = L.l[half];
        if (a.stats_only) {
          if (lane % 4 == 0)
            a.row_lse2[(b * a.heads + h) * a.q_len + i] =
                l > 0.0f ? static_cast<float>(static_cast<double>(L.m[half]) + log2(static_cast<double>(l)))
                         : -INFINITY;
          continue;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int64_t at = b * a.o_bs + i * a.o_rs + h * a.o_hs;
        PLSH_UNROLL
        for (int dt = 0; dt < Cfg::kDT; ++dt) PLSH_UNROLL
        for (int j = 0; j < 2; ++j)
          store_out(a.out, a.out_dtype, at + dt * 8 + frag_col(lane, j), L.o[dt][2 * half + j] * inv);
        if (a.lse != nullptr && lane % 4 == 0)
          a.lse[b * a.lse_bs + i * a.lse_rs + h] =
              static_cast<float>(fused_lse(L.m[half], l, head, L.row[half].nearest));
      }
    });
  });
}

// Dynamic shared memory of one forward CTA.
template <typename Cfg>
PLSH_HD inline int64_t fused_forward_smem_bytes(int max_samples) {
  return FwdSmem<Cfg>(nullptr, max_samples).bytes;
}

}  // namespace plsh::cuda
