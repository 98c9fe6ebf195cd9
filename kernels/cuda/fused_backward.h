// The fused backward's body (FlashAttention-2's, SPEC section 8): one CTA
// per (key tile of 64 keys, kv head, batch item), 4 warps. K and V stay in
// shared memory; dK and dV accumulate in registers (warp w owns keys 16w ..
// 16w + 15) over every query head of the kv head's group and every query
// tile that reaches the key tile (fused_query_tiles on the forward's spans),
// so they are written once, without atomics. Per query tile: S = Q K^T,
// P = c_ij 2^(x - lse2) (or the ALiBi logit's), dP = dO V^T, dS = P (dP -
// D_i); P and dS go through shared memory (every warp's rows feed every
// warp's keys), then dV += P^T dO, dK += dS^T Q, and dQ += dS K is added
// into a float32 accumulator by atomics, one per (row, column) per key tile
// (FlashAttention-2's dQaccum), since a row's dQ sums over key tiles that
// other CTAs hold. lse2 and D_i come per row from fused_row_terms (and the
// statistics pass far from the keys). Runs under DeviceExec and HostExec.
#pragma once

#include <cstdint>

#include "cuda/fused_exec.h"
#include "cuda/fused_math.h"
#include "cuda/fused_tile.h"

namespace plsh::cuda {

template <typename Cfg>
struct BwdSmem {
  using S = typename Cfg::Storage;
  // P and dS rows: 16-bit with 16 bytes of padding on the tensor-core path
  // (ldmatrix's banks), float32 kPPitch apart on the f32 path.
  static constexpr int kSP = Cfg::kTC ? kFusedKeys + 8 : Cfg::kPPitch;
  using PS = S;
  S* k = nullptr;  // [kFusedKeys][kPitch]
  S* v = nullptr;
  S* q = nullptr;  // [kFusedRows][kPitch]
  S* dout = nullptr;
  PS* p = nullptr;  // [kFusedRows][kSP]
  PS* ds = nullptr;
  float* lse2 = nullptr;  // [kFusedRows]
  float* dsum = nullptr;  // [kFusedRows]: D_i
  FusedBlock* blocks = nullptr;
  int64_t* edges = nullptr;
  int64_t* bins = nullptr;
  int64_t bytes = 0;

  PLSH_HD BwdSmem(unsigned char* base, int max_samples) {
    SmemCarver c{base};
    c.take_each(kFusedKeys * Cfg::kPitch, k, v);
    c.take_each(kFusedRows * Cfg::kPitch, q, dout);
    c.take_each(kFusedRows * kSP, p, ds);
    c.take_each(kFusedRows, lse2, dsum);
    blocks = c.take<FusedBlock>(static_cast<int64_t>(max_samples) * kFusedRows);
    edges = c.take<int64_t>(2 * static_cast<int64_t>(max_samples));
    bins = c.take<int64_t>(static_cast<int64_t>(max_samples) * kFusedRows);
    bytes = c.at;
  }
};

template <typename Cfg>
struct BwdLane {
  float dk[Cfg::kDT][4];  // keys 16w + g (+ 8) by D, C layout
  float dv[Cfg::kDT][4];
  float s[Cfg::kNT][4];   // S, logits, P, then dS
  float dp[Cfg::kNT][4];  // dP
  float w[Cfg::kNT][4];   // kHashes: c_ij
  float dq[2][4];         // 16 columns of dQ at a time
  uint32_t tmp[8];
  FusedRow row[2];
  unsigned long long tiles = 0;
};

template <typename Cfg, typename X>
PLSH_HD void fused_backward_cta(const FusedArgs& a, int64_t kt, int64_t hk, int64_t b, unsigned char* smem_base, X& x) {
  using Lane = BwdLane<Cfg>;
  using PS = typename BwdSmem<Cfg>::PS;
  constexpr int kSP = BwdSmem<Cfg>::kSP;
  typename Cfg::Elem elem{};
  BwdSmem<Cfg> sm(smem_base, a.max_samples);
  const int64_t k0 = kt * kFusedKeys;
  fused_load_kv<Cfg>(x, a, b, hk, kt, sm.k, sm.v, true);

  typename X::template PerThread<Lane> st;
  fused_each_lane(x, st, [&](Lane& L, int, int) {
    fused_zero(L.dk);
    fused_zero(L.dv);
    L.tiles = 0;
  });
  const int64_t tiles = fused_tiles(a.q_len, kFusedRows);
  const float scale = a.scale2 * 0.6931471805599453f;  // back from base 2

  for (int64_t h = hk * a.head_group; h < (hk + 1) * a.head_group; ++h) {
    const FusedHead head = a.head_table[h];
    const TileSpan qs = fused_query_tiles(a.spans + 2 * h * tiles, tiles, kt);
    for (int64_t qt = qs.begin; qt < qs.end; ++qt) {
      const int64_t row0 = qt * kFusedRows;
      x.sync();  // the last tile's readers of q, dout, p, ds and the blocks are done
      if (head.rule == FusedRule::kHashes) fused_setup_blocks(x, a, head, qt, sm.bins, sm.edges, sm.blocks);
      fused_load_rows<Cfg>(x, sm.q, a.q, b * a.q_bs + h * a.q_hs, a.q_rs, row0, a.q_len, kFusedRows);
      fused_load_rows<Cfg>(x, sm.dout, a.dout, b * a.do_bs + h * a.do_hs, a.do_rs, row0, a.q_len, kFusedRows);
      x.commit();
      x.threads([&](int tid) {
        if (tid >= kFusedRows) return;
        const int64_t i = row0 + tid;
        const int64_t at = (b * a.heads + h) * a.q_len + i;
        sm.lse2[tid] = i < a.q_len ? a.row_lse2_in[at] : 0.0f;
        sm.dsum[tid] = i < a.q_len ? a.row_d[at] : 0.0f;
      });
      x.template wait<0>();
      x.sync();

      // S, P, dP, dS for the warp's 16 query rows; P and dS to shared memory.
      x.warps([&](int w) {
        const int rf = w * 16;
        const int rl = static_cast<int>(min64(rf + 15, a.q_len - 1 - row0));
        const FusedRow first = fused_row(a, head, row0 + rf), last = fused_row(a, head, row0 + (rl >= rf ? rl : rf));
        const WarpKeys wk = fused_warp_keys(x, a, head, sm.blocks, rf, rl, first, last, kt);
        auto put = [&](PS* tile, int lane, int nt, int i, float value) {
          PS* at = tile + (rf + frag_row(lane, i >> 1)) * kSP + nt * 8 + frag_col(lane, i & 1);
          if constexpr (Cfg::kTC)
            *at = float_to_bits(elem, value);
          else
            *at = value;
        };
        if (wk.empty) {
          x.lanes([&](int lane) {
            PLSH_UNROLL
            for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
            for (int i = 0; i < 4; ++i) {
              put(sm.p, lane, nt, i, 0.0f);
              put(sm.ds, lane, nt, i, 0.0f);
            }
          });
          return;
        }
        auto s_acc = [&](int lane, int nt) { return st(w, lane).s[nt]; };
        auto dp_acc = [&](int lane, int nt) { return st(w, lane).dp[nt]; };
        auto tmp = [&](int lane) { return st(w, lane).tmp; };
        x.lanes([&](int lane) {
          Lane& L = st(w, lane);
          ++L.tiles;
          PLSH_UNROLL
          for (int half = 0; half < 2; ++half) L.row[half] = fused_row(a, head, row0 + rf + frag_row(lane, half));
          fused_zero(L.s);
          fused_zero(L.dp);
        });
        fused_abt_smem<Cfg>(x, sm.q, rf, sm.k, s_acc, tmp);
        x.lanes([&](int lane) {
          Lane& L = st(w, lane);
          const int rr[2] = {rf + frag_row(lane, 0), rf + frag_row(lane, 1)};
          fused_logits<Cfg::kNT>(a, head, wk, sm.blocks, lane, L.row, rr, L.s, L.w);
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int i = 0; i < 4; ++i) {
            const float x2 = L.s[nt][i];
            const float lse2 = sm.lse2[rr[i >> 1]];
            // A logit may pass its row's lse by rounding, never far.
            float p = x2 == -INFINITY ? 0.0f : exp2f(fminf(x2 - lse2, 64.0f));
            if (head.rule == FusedRule::kHashes) p *= L.w[nt][i];
            L.s[nt][i] = p;
            put(sm.p, lane, nt, i, p);
          }
        });
        fused_abt_smem<Cfg>(x, sm.dout, rf, sm.v, dp_acc, tmp);
        x.lanes([&](int lane) {
          Lane& L = st(w, lane);
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int i = 0; i < 4; ++i) {
            const float ds = L.s[nt][i] * (L.dp[nt][i] - sm.dsum[rf + frag_row(lane, i >> 1)]);
            put(sm.ds, lane, nt, i, ds);
          }
        });
      });
      x.sync();

      // dV += P^T dO and dK += dS^T Q for the warp's 16 keys; dQ += dS K for its rows.
      x.warps([&](int w) {
        auto tmp = [&](int lane) { return st(w, lane).tmp; };
        auto dq_acc = [&](int lane, int dt) { return st(w, lane).dq[dt]; };
        if constexpr (Cfg::kTC) {
          fused_ab_tc<Cfg, Cfg::kDT>(
              x, [&](int kk) { fused_load_a(x, sm.p, kSP, w * 16, kk, true, tmp); }, sm.dout, 0,
              [&](int lane, int dt) { return st(w, lane).dv[dt]; }, tmp);
          fused_ab_tc<Cfg, Cfg::kDT>(
              x, [&](int kk) { fused_load_a(x, sm.ds, kSP, w * 16, kk, true, tmp); }, sm.q, 0,
              [&](int lane, int dt) { return st(w, lane).dk[dt]; }, tmp);
        } else {
          fused_atb_simt<Cfg, Cfg::kDT>(x, sm.p, w * 16, sm.dout, 0,
                                        [&](int lane, int dt) { return st(w, lane).dv[dt]; });
          fused_atb_simt<Cfg, Cfg::kDT>(x, sm.ds, w * 16, sm.q, 0,
                                        [&](int lane, int dt) { return st(w, lane).dk[dt]; });
        }
        const int rf = w * 16;
        if (row0 + rf >= a.q_len) return;
        for (int c = 0; c < Cfg::kDT / 2; ++c) {
          x.lanes([&](int lane) {
            Lane& L = st(w, lane);
            PLSH_UNROLL
            for (int dt = 0; dt < 2; ++dt) PLSH_UNROLL
            for (int i = 0; i < 4; ++i) L.dq[dt][i] = 0;
          });
          if constexpr (Cfg::kTC) {
            fused_ab_tc<Cfg, 2>(
                x, [&](int kk) { fused_load_a(x, sm.ds, kSP, rf, kk, false, tmp); }, sm.k, 16 * c, dq_acc, tmp);
          } else {
            fused_pb_simt<Cfg, 2>(x, sm.ds + rf * kSP, sm.k, 16 * c, dq_acc);
          }
          x.lanes([&](int lane) {
            Lane& L = st(w, lane);
            PLSH_UNROLL
            for (int i = 0; i < 4; ++i) {
              const int64_t row = row0 + rf + frag_row(lane, i >> 1);
              if (row >= a.q_len) continue;
              float* at = a.dq_acc + ((b * a.q_len + row) * a.heads + h) * Cfg::D + 16 * c + frag_col(lane, i & 1);
              PLSH_UNROLL
              for (int dt = 0; dt < 2; ++dt) x.atomic_add(at + 8 * dt, scale * L.dq[dt][i]);
            }
          });
        }
      });
    }
  }

  // dK (times the scale) and dV of the warp's keys, in the gradients' dtype.
  x.template wait<0>();  // K and V, where no query tile reached this key tile
  fused_each_lane(x, st, [&](Lane& L, int w, int lane) {
    if (lane == 0 && a.tiles_done != nullptr) x.count(a.tiles_done, L.tiles);
    PLSH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int64_t j = k0 + w * 16 + frag_row(lane, i >> 1);
      if (j >= a.kv_len) continue;
      const int64_t at = ((b * a.kv_len + j) * a.kv_heads + hk) * Cfg::D + frag_col(lane, i & 1);
      PLSH_UNROLL
      for (int dt = 0; dt < Cfg::kDT; ++dt) {
        store_out(a.dk, a.grad_dtype, at + 8 * dt, scale * L.dk[dt][i]);
        store_out(a.dv, a.grad_dtype, at + 8 * dt, L.dv[dt][i]);
      }
    }
  });
}

template <typename Cfg>
PLSH_HD inline int64_t fused_backward_smem_bytes(int max_samples) {
  return BwdSmem<Cfg>(nullptr, max_samples).bytes;
}

// ---- the forward's spans, one thread each ----------------------------------------------

// Every (head, query tile)'s key tiles, [H][tiles][2].
PLSH_HD inline void fused_span(const FusedArgs& a, int64_t h, int64_t t, int32_t* spans) {
  const TileSpan s = fused_key_tiles(fused_key_range(a, a.head_table[h], t));
  const int64_t tiles = fused_tiles(a.q_len, kFusedRows);
  spans[2 * (h * tiles + t)] = static_cast<int32_t>(s.begin);
  spans[2 * (h * tiles + t) + 1] = static_cast<int32_t>(s.end);
}

}  // namespace plsh::cuda
