// What the fused forward and backward bodies share: the configuration per
// (dtype, head dim), the shared-memory tiles and their loads, the warp's
// matrix products on tensor cores (mma.sync m16n8k16, bf16/f16 in, f32
// accumulate) or, for f32 inputs, on the CUDA cores in the same fragment
// layout, and the per-element weights of both rules. Every function runs
// under DeviceExec and HostExec (fused_exec.h) alike.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/fused_exec.h"
#include "cuda/fused_tile.h"

namespace plsh::cuda {

template <typename TElem, int kHeadDim>
struct FusedCfg {
  using Elem = TElem;
  using Storage = typename TElem::Storage;
  static constexpr int D = kHeadDim;
  static constexpr bool kTC = TElem::kTensorCores;
  // Shared-memory rows padded by 16 bytes: ldmatrix's 8 rows of 16 bytes
  // then fall in 8 distinct groups of 4 banks (pitch 272 bytes at d = 128).
  static constexpr int kPitch = D + 16 / static_cast<int>(sizeof(Storage));
  static constexpr int kNT = kFusedKeys / 8;      // n8 tiles of a warp's S (16 x 64)
  static constexpr int kDT = D / 8;               // n8 tiles of a warp's O (16 x D)
  static constexpr int kKQ = D / 16;              // k16 steps of Q K^T
  static constexpr int kKP = kFusedKeys / 16;     // k16 steps of P V
  static constexpr int kPPitch = kFusedKeys + 4;  // f32 path: a warp's P rows in shared memory
  static constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(Storage));
  static constexpr int kChunksPerRow = static_cast<int>(kRowBytes / 16);
  static_assert(D % 16 == 0 && kRowBytes % 16 == 0, "rows are loaded in 16-byte pieces");
};

// Offsets in a dynamic shared-memory block, each 16-byte aligned.
struct SmemCarver {
  unsigned char* base;
  int64_t at = 0;
  template <typename T>
  PLSH_HD T* take(int64_t count) {
    T* p = base == nullptr ? nullptr : reinterpret_cast<T*>(base + at);
    at += (count * static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16;
    return p;
  }
  // `count` elements of T for `first`, then for each of `rest` in order:
  // same-sized slices (the stages of k and v, the per-row terms) in one call.
  template <typename T, typename... Rest>
  PLSH_HD void take_each(int64_t count, T*& first, Rest*&... rest) {
    static_assert((std::is_same_v<T, Rest> && ...), "slices of one element type");
    first = take<T>(count);
    ((rest = take<T>(count)), ...);
  }
};

// `rows` rows of D elements from a tensor (row r at element offset
// base + (row0 + r) * row_stride) into shared rows kPitch apart, 16 bytes a
// thread at a time; rows at or past `limit` read as zeros (so that masked
// keys never bring a NaN into P V). cp.async on the device: the caller
// commits and waits.
template <typename Cfg, typename X>
PLSH_HD void fused_load_rows(X& x, typename Cfg::Storage* dst, const void* tensor, int64_t base, int64_t row_stride,
                             int64_t row0, int64_t limit, int rows) {
  using S = typename Cfg::Storage;
  x.threads([&](int tid) {
    for (int c = tid; c < rows * Cfg::kChunksPerRow; c += kFusedThreads) {
      const int r = c / Cfg::kChunksPerRow, piece = c % Cfg::kChunksPerRow;
      const bool valid = row0 + r < limit;
      const S* src = static_cast<const S*>(tensor) + (valid ? base + (row0 + r) * row_stride : 0);
      x.copy16(reinterpret_cast<unsigned char*>(dst + r * Cfg::kPitch) + 16 * piece,
               reinterpret_cast<const unsigned char*>(src) + (valid ? 16 * piece : 0), valid);
    }
  });
}

// Key tile kt's rows of K, and of V with with_v, for (batch item b, kv head
// hk) into k and v: one cp.async group, committed.
template <typename Cfg, typename X>
PLSH_HD void fused_load_kv(X& x, const FusedArgs& a, int64_t b, int64_t hk, int64_t kt, typename Cfg::Storage* k,
                           typename Cfg::Storage* v, bool with_v) {
  const int64_t row0 = kt * kFusedKeys;
  fused_load_rows<Cfg>(x, k, a.k, b * a.k_bs + hk * a.k_hs, a.k_rs, row0, a.kv_len, kFusedKeys);
  if (with_v) fused_load_rows<Cfg>(x, v, a.v, b * a.v_bs + hk * a.v_hs, a.v_rs, row0, a.kv_len, kFusedKeys);
  x.commit();
}

// One step of a double-buffered walk over the key tiles of span: tile kt
// (in stage (kt - span.begin) & 1) has landed and the CTA is in step, and
// tile kt + 1, if any, is on its way into the other stage (load(kt, stage)).
// Returns kt's stage.
template <typename X, typename Load>
PLSH_HD int fused_key_step(X& x, const TileSpan& span, int64_t kt, Load&& load) {
  const int stage = static_cast<int>((kt - span.begin) & 1);
  if (kt + 1 < span.end) {
    load(kt + 1, stage ^ 1);
    x.template wait<1>();
  } else {
    x.template wait<0>();
  }
  x.sync();
  return stage;
}

// f(L, w, lane) for every lane of the CTA, L its registers st(w, lane): one
// phase, each warp on its own lanes.
template <typename X, typename PerThread, typename F>
PLSH_HD void fused_each_lane(X& x, PerThread& st, F&& f) {
  x.warps([&](int w) { x.lanes([&](int lane) { f(st(w, lane), w, lane); }); });
}

// f(L, lane, half) for both rows of every lane of warp w (rows g and g + 8:
// half 0 and 1), L the lane's registers st(w, lane).
template <typename X, typename PerThread, typename F>
PLSH_HD void fused_each_row(X& x, PerThread& st, int w, F&& f) {
  x.lanes([&](int lane) {
    PLSH_UNROLL
    for (int half = 0; half < 2; ++half) f(st(w, lane), lane, half);
  });
}

// Zeroes a lane's accumulator fragments: N column tiles of 4 registers.
template <int N>
PLSH_HD void fused_zero(float (&acc)[N][4]) {
  PLSH_UNROLL
  for (int t = 0; t < N; ++t) PLSH_UNROLL
  for (int i = 0; i < 4; ++i) acc[t][i] = 0;
}

// A quad's reduction of its lanes' shares of the rows g and g + 8 (a member
// float[2] of each lane of warp w): afterwards every lane of the quad holds
// the max (fused_quad_max) or the sum (fused_quad_sum) of both rows.
template <typename X, typename PerThread, typename Lane>
PLSH_HD void fused_quad_max(X& x, PerThread& st, int w, float (Lane::*rows)[2]) {
  PLSH_UNROLL
  for (int half = 0; half < 2; ++half) x.quad_max([&](int lane) -> float& { return (st(w, lane).*rows)[half]; });
}
template <typename X, typename PerThread, typename Lane>
PLSH_HD void fused_quad_sum(X& x, PerThread& st, int w, float (Lane::*rows)[2]) {
  PLSH_UNROLL
  for (int half = 0; half < 2; ++half) x.quad_sum([&](int lane) -> float& { return (st(w, lane).*rows)[half]; });
}

// A warp's A fragments of 16 rows (from row r0 of a shared tile) for every
// k16 step of D: ldmatrix, matrix m = lane / 8 holding rows + 8 (m & 1),
// columns + 8 (m >> 1).
template <typename Cfg, typename X, typename Out>
PLSH_HD void fused_a_frags(X& x, const typename Cfg::Storage* tile, int r0, Out&& out) {
  PLSH_UNROLL
  for (int kk = 0; kk < Cfg::kKQ; ++kk)
    x.ldsm_x4(
        [&](int lane) {
          return tile + (r0 + lane % 8 + 8 * ((lane / 8) & 1)) * Cfg::kPitch + kk * 16 + 8 * (lane / 16);
        },
        [&](int lane) { return out(lane, kk); }, false);
}

// C (16 x kN8 * 8, C layout: acc(lane, n8)) += A B over kK16 steps of 16
// k, two m16n8k16 mmas per 16 columns: prepare(kk) runs first (for A
// fragments loaded step by step), then a(lane, kk) are A's fragments and
// B's 16 x 16 block (kk, n16) comes by one ldmatrix x4 from
// b_row(lane, kk, n16), transposed with TransB. tmp(lane): 8 registers,
// [0, 4) B.
template <typename Cfg, int kK16, int kN8, bool TransB, typename X, typename Prepare, typename AFrag, typename BRow,
          typename Acc, typename Tmp>
PLSH_HD void fused_mma_tc(X& x, Prepare&& prepare, AFrag&& a, BRow&& b_row, Acc&& acc, Tmp&& tmp) {
  typename Cfg::Elem t{};
  PLSH_UNROLL
  for (int kk = 0; kk < kK16; ++kk) {
    prepare(kk);
    PLSH_UNROLL
    for (int n16 = 0; n16 < kN8 / 2; ++n16) {
      x.ldsm_x4([&](int lane) { return b_row(lane, kk, n16); }, tmp, TransB);
      x.mma(
          t, [&](int lane) { return acc(lane, 2 * n16); }, [&](int lane) { return a(lane, kk); },
          [&](int lane) { return tmp(lane); });
      x.mma(
          t, [&](int lane) { return acc(lane, 2 * n16 + 1); }, [&](int lane) { return a(lane, kk); },
          [&](int lane) { return tmp(lane) + 2; });
    }
  }
}

// S (16 x 64, C layout: s[nt][i]) = A B^T, A a warp's 16 rows in A
// fragments a(lane, kk) for each k16 step of D (prepare(kk) runs first, for
// fragments loaded step by step), B a shared tile of 64 rows (keys) by D:
// S_ij = sum_d A_id B_jd. Tensor cores; B's fragments by ldmatrix
// (non-transposed: B's rows are the n). tmp(lane): 8 registers, [0, 4) B.
template <typename Cfg, typename X, typename Prepare, typename AFrag, typename Acc, typename Tmp>
PLSH_HD void fused_abt_tc(X& x, Prepare&& prepare, AFrag&& a, const typename Cfg::Storage* b_tile, Acc&& acc,
                          Tmp&& tmp) {
  fused_mma_tc<Cfg, Cfg::kKQ, Cfg::kNT, false>(
      x, prepare, a,
      [&](int lane, int kk, int np) {
        const int m = lane / 8;
        return b_tile + (np * 16 + 8 * (m >> 1) + lane % 8) * Cfg::kPitch + kk * 16 + 8 * (m & 1);
      },
      acc, tmp);
}

// S = A B^T with A's fragments from a shared tile (rows r0.., D columns),
// loaded one k16 step at a time into tmp(lane) + 4.
template <typename Cfg, typename X, typename Acc, typename Tmp>
PLSH_HD void fused_abt_tc_smem(X& x, const typename Cfg::Storage* a_tile, int r0, const typename Cfg::Storage* b_tile,
                               Acc&& acc, Tmp&& tmp) {
  fused_abt_tc<Cfg>(
      x,
      [&](int kk) {
        x.ldsm_x4(
            [&](int lane) {
              return a_tile + (r0 + lane % 8 + 8 * ((lane / 8) & 1)) * Cfg::kPitch + kk * 16 + 8 * (lane / 16);
            },
            [&](int lane) { return tmp(lane) + 4; }, false);
      },
      [&](int lane, int) -> const uint32_t* { return tmp(lane) + 4; }, b_tile, acc, tmp);
}

// O (16 x kN8 * 8, C layout) += A B over 64 k: prepare_a(kk) leaves the A
// fragments of k16 step kk in tmp(lane) + 4; B a shared tile of 64 rows (the
// k) by its columns, from col0: ldmatrix .trans, since the pairs an mma B
// register holds run down B's rows.
template <typename Cfg, int kN8, typename X, typename PrepareA, typename Acc, typename Tmp>
PLSH_HD void fused_ab_tc(X& x, PrepareA&& prepare_a, const typename Cfg::Storage* b_tile, int col0, Acc&& acc,
                         Tmp&& tmp) {
  fused_mma_tc<Cfg, Cfg::kKP, kN8, true>(
      x, prepare_a, [&](int lane, int) -> const uint32_t* { return tmp(lane) + 4; },
      [&](int lane, int kk, int dp) {
        const int m = lane / 8;
        return b_tile + (kk * 16 + 8 * (m & 1) + lane % 8) * Cfg::kPitch + col0 + dp * 16 + 8 * (m >> 1);
      },
      acc, tmp);
}

// prepare_a for fused_ab_tc from C-layout registers p(lane, nt) (16 x 64):
// FlashAttention-2's reuse, the C layout of two n8 tiles being the A layout
// of one k16 step.
template <typename Cfg, typename X, typename P, typename Tmp>
PLSH_HD void fused_pack_a(X& x, int kk, P&& p, Tmp&& tmp) {
  typename Cfg::Elem t{};
  x.lanes([&](int lane) {
    uint32_t* f = tmp(lane) + 4;
    const float* lo = p(lane, 2 * kk);
    const float* hi = p(lane, 2 * kk + 1);
    f[0] = pack2(t, lo[0], lo[1]);
    f[1] = pack2(t, lo[2], lo[3]);
    f[2] = pack2(t, hi[0], hi[1]);
    f[3] = pack2(t, hi[2], hi[3]);
  });
}

// The same in two parts for products that must not lose P's low bits (the
// probe's o*): part 0 packs P rounded to the dtype, part 1 the rest, P -
// round(P), so that two products sum to P V within 2^-16 of P.
template <typename Cfg, typename X, typename P, typename Tmp>
PLSH_HD void fused_pack_a_split(X& x, int kk, int part, P&& p, Tmp&& tmp) {
  typename Cfg::Elem t{};
  x.lanes([&](int lane) {
    uint32_t* f = tmp(lane) + 4;
    const float* lo = p(lane, 2 * kk);
    const float* hi = p(lane, 2 * kk + 1);
    auto piece = [&](float v) { return part == 0 ? v : v - bits_to_float(t, float_to_bits(t, v)); };
    f[0] = pack2(t, piece(lo[0]), piece(lo[1]));
    f[1] = pack2(t, piece(lo[2]), piece(lo[3]));
    f[2] = pack2(t, piece(hi[0]), piece(hi[1]));
    f[3] = pack2(t, piece(hi[2]), piece(hi[3]));
  });
}

// prepare_a for fused_ab_tc from a shared 64 x 64 tile (pitch elements per
// row): A = the tile's rows r0.. (trans = false: A[m][k] = tile[r0 + m][16 kk
// + k]) or its transpose (trans = true: A[m][k] = tile[16 kk + k][r0 + m]).
template <typename X, typename Tmp>
PLSH_HD void fused_load_a(X& x, const uint16_t* tile, int pitch, int r0, int kk, bool trans, Tmp&& tmp) {
  x.ldsm_x4(
      [&](int lane) {
        const int m = lane / 8, r = lane % 8;
        // Matrix m: A rows + 8 (m & 1), k + 8 (m >> 1); stored transposed, its rows are A's k.
        return trans ? tile + (kk * 16 + 8 * (m >> 1) + r) * pitch + r0 + 8 * (m & 1)
                     : tile + (r0 + 8 * (m & 1) + r) * pitch + kk * 16 + 8 * (m >> 1);
      },
      [&](int lane) { return tmp(lane) + 4; }, trans);
}

// The f32 path of the same products, per lane on the CUDA cores: each of
// the lane's C-layout elements of kN8 column tiles, row frag_row and column
// n8 * 8 + frag_col, gets c[i] += dot(row, column), a dot product over
// shared rows.
template <int kN8, typename X, typename Acc, typename Dot>
PLSH_HD void fused_simt_each(X& x, Acc&& acc, Dot&& dot) {
  x.lanes([&](int lane) {
    PLSH_UNROLL
    for (int n8 = 0; n8 < kN8; ++n8) {
      float* c = acc(lane, n8);
      PLSH_UNROLL
      for (int i = 0; i < 4; ++i) c[i] += dot(frag_row(lane, i >> 1), n8 * 8 + frag_col(lane, i & 1));
    }
  });
}

//   S_ij = sum_d A[r0 + i][d] B[j][d]       (A, B shared tiles of D columns)
template <typename Cfg, typename X, typename Acc>
PLSH_HD void fused_abt_simt(X& x, const float* a_tile, int r0, const float* b_tile, Acc&& acc) {
  fused_simt_each<Cfg::kNT>(x, acc, [&](int i, int j) {
    const float *ar = a_tile + (r0 + i) * Cfg::kPitch, *br = b_tile + j * Cfg::kPitch;
    float s = 0;
    for (int d = 0; d < Cfg::D; ++d) s += ar[d] * br[d];
    return s;
  });
}

//   O_ic += sum_j P[i][j] B[j][col0 + c]    (P: a warp's rows in shared memory, kPPitch apart)
template <typename Cfg, int kN8, typename X, typename Acc>
PLSH_HD void fused_pb_simt(X& x, const float* p_rows, const float* b_tile, int col0, Acc&& acc) {
  fused_simt_each<kN8>(x, acc, [&](int i, int c) {
    const float* pr = p_rows + i * Cfg::kPPitch;
    float s = 0;
    for (int j = 0; j < kFusedKeys; ++j) s += pr[j] * b_tile[j * Cfg::kPitch + col0 + c];
    return s;
  });
}

//   C_ic += sum_r A[r][r0 + i] B[r][col0 + c]  (A^T B: A a shared 64-row tile, kPPitch apart)
template <typename Cfg, int kN8, typename X, typename Acc>
PLSH_HD void fused_atb_simt(X& x, const float* a_tile, int r0, const float* b_tile, int col0, Acc&& acc) {
  fused_simt_each<kN8>(x, acc, [&](int i, int c) {
    float s = 0;
    for (int r = 0; r < kFusedRows; ++r) s += a_tile[r * Cfg::kPPitch + r0 + i] * b_tile[r * Cfg::kPitch + col0 + c];
    return s;
  });
}

// S = A B^T from two shared tiles on whichever units the dtype uses:
// fused_abt_tc_smem's tensor cores (tmp: its fragment scratch) or
// fused_abt_simt's CUDA cores.
template <typename Cfg, typename X, typename Acc, typename Tmp>
PLSH_HD void fused_abt_smem(X& x, const typename Cfg::Storage* a_tile, int r0, const typename Cfg::Storage* b_tile,
                            Acc&& acc, Tmp&& tmp) {
  if constexpr (Cfg::kTC) {
    fused_abt_tc_smem<Cfg>(x, a_tile, r0, b_tile, acc, tmp);
  } else {
    fused_abt_simt<Cfg>(x, a_tile, r0, b_tile, acc);
  }
}

// ---- the weights ---------------------------------------------------------------------

// A warp's view of one key tile: its valid key columns [c0, c1] and, under
// the hash rule, which hashes are mixed over its rows (the rest put every
// pair in one bin, counted in n_all, or none).
struct WarpKeys {
  int32_t c0 = 0, c1 = -1;
  bool empty = true;   // no pair of the warp's rows and these keys is allowed
  uint64_t mixed = 0;  // kHashes: hashes whose bins split the rectangle
  float n_all = 0;     // kHashes: hashes with every pair in one bin
};

PLSH_HD inline int lowest_bit(uint64_t m) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(m)) - 1;
#else
  return __builtin_ctzll(m);
#endif
}
PLSH_HD inline int bit_count(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __popc(m);
#else
  return __builtin_popcount(m);
#endif
}

// Which pairs of a warp's rows (first valid row rf, last valid row rl, of
// the tile's rows; FusedRow of both) and key tile kt can count, warp-uniform
// (lanes split the hashes between them, then ballot).
template <typename X>
PLSH_HD WarpKeys fused_warp_keys(X& x, const FusedArgs& a, const FusedHead& h, const FusedBlock* blocks, int rf, int rl,
                                 const FusedRow& first, const FusedRow& last, int64_t kt) {
  WarpKeys wk;
  wk.c0 = static_cast<int32_t>(kt * kFusedKeys);
  wk.c1 = static_cast<int32_t>(min64(kt * kFusedKeys + kFusedKeys, a.kv_len) - 1);
  if (rl < rf || last.limit < wk.c0) return wk;  // no valid row, or every key after the rows (causal)
  if (h.rule == FusedRule::kAlibi) {
    const int64_t lo = static_cast<int64_t>(first.anchor) - first.window_left + 1;
    const int64_t hi = min64(last.limit, static_cast<int64_t>(last.anchor) + last.window_left - 1);
    wk.empty = wk.c1 < lo || wk.c0 > hi;
    return wk;
  }
  // Hashes k = lane and lane + 32 (kFusedMaxHashes = 64): two ballots each.
  auto meet = [&](int k) {
    if (k >= h.samples) return HashMeet::kNone;
    return fused_hash_meet(blocks[k * kFusedRows + rf], blocks[k * kFusedRows + rl], wk.c0, wk.c1);
  };
  const uint32_t mixed0 = x.ballot([&](int lane) { return meet(lane) == HashMeet::kMixed; });
  const uint32_t all0 = x.ballot([&](int lane) { return meet(lane) == HashMeet::kAll; });
  uint32_t mixed1 = 0, all1 = 0;
  if (h.samples > 32) {
    mixed1 = x.ballot([&](int lane) { return meet(lane + 32) == HashMeet::kMixed; });
    all1 = x.ballot([&](int lane) { return meet(lane + 32) == HashMeet::kAll; });
  }
  wk.mixed = static_cast<uint64_t>(mixed0) | (static_cast<uint64_t>(mixed1) << 32);
  wk.n_all = static_cast<float>(bit_count(all0) + bit_count(all1));
  wk.empty = wk.mixed == 0 && wk.n_all == 0;
  return wk;
}

// The logits of one lane's C-layout tile (s[nt][i], raw scores in, base-2
// logits or -inf out) and, for the hash rule, each element's count c_ij
// (w[nt][i]); rows[half] are the lane's two rows (g, g + 8), rr[half] their
// indices in the tile. Returns nothing: the max follows.
template <int kNT>
PLSH_HD void fused_logits(const FusedArgs& a, const FusedHead& h, const WarpKeys& wk, const FusedBlock* blocks,
                          int lane, const FusedRow* rows, const int* rr, float (*s)[4], float (*w)[4]) {
  if (h.rule == FusedRule::kAlibi) {
    PLSH_UNROLL
    for (int nt = 0; nt < kNT; ++nt) PLSH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const FusedRow& r = rows[i >> 1];
      const int32_t j = wk.c0 + nt * 8 + frag_col(lane, i & 1);
      const int32_t dist = r.anchor > j ? r.anchor - j : j - r.anchor;
      const bool ok = j <= r.limit && dist < r.window_left;
      s[nt][i] = ok ? s[nt][i] * a.scale2 - static_cast<float>(dist) * h.slope2 : -INFINITY;
    }
    return;
  }
  PLSH_UNROLL
  for (int nt = 0; nt < kNT; ++nt) PLSH_UNROLL
  for (int i = 0; i < 4; ++i) w[nt][i] = wk.n_all;
  for (uint64_t m = wk.mixed; m != 0; m &= m - 1) {
    const int k = lowest_bit(m);
    const FusedBlock b0 = blocks[k * kFusedRows + rr[0]], b1 = blocks[k * kFusedRows + rr[1]];
    PLSH_UNROLL
    for (int nt = 0; nt < kNT; ++nt) PLSH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const FusedBlock& b = (i >> 1) ? b1 : b0;
      const int32_t j = wk.c0 + nt * 8 + frag_col(lane, i & 1);
      w[nt][i] += (j >= b.begin && j < b.end) ? 1.0f : 0.0f;
    }
  }
  PLSH_UNROLL
  for (int nt = 0; nt < kNT; ++nt) PLSH_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int32_t j = wk.c0 + nt * 8 + frag_col(lane, i & 1);
    const bool ok = j <= rows[i >> 1].limit && w[nt][i] > 0.0f;
    s[nt][i] = ok ? s[nt][i] * a.scale2 : -INFINITY;
  }
}

// The hash rule's blocks of query tile t of head h (every row, every hash)
// into blocks[k * kFusedRows + r], from one bin per (row, hash) in `bins`
// (scratch of max_samples * kFusedRows int64) and the outer edges in
// `edges` (2 per hash); returns the tile's key range. CTA-wide, with its
// barriers.
template <typename X>
PLSH_HD KeyRange fused_setup_blocks(X& x, const FusedArgs& a, const FusedHead& h, int64_t t, int64_t* bins,
                                    int64_t* edges, FusedBlock* blocks) {
  const int64_t row0 = t * kFusedRows;
  const int rows = static_cast<int>(min64(kFusedRows, a.q_len - row0));
  const int64_t p0 = a.q_pos0 + row0, p1 = p0 + rows - 1;
  const int s = h.samples;
  x.threads([&](int tid) {
    for (int e = tid; e < s * kFusedRows; e += kFusedThreads) {
      const int k = e / kFusedRows, r = e % kFusedRows;
      const FusedHash hh = fused_hash(a, h, k);
      if (r < rows) bins[e] = span_bin(p0 + r, hh.pitch, hh.shift);
    }
    for (int k = tid; k < s; k += kFusedThreads) {
      const FusedHash hh = fused_hash(a, h, k);
      edges[2 * k] = fused_block_begin(p0, hh, fused_search_lo(a, p0));
      edges[2 * k + 1] = fused_block_end(p1, hh, fused_search_hi(a, p1));
    }
  });
  x.sync();
  x.threads([&](int tid) {
    for (int e = tid; e < s * kFusedRows; e += kFusedThreads) {
      const int k = e / kFusedRows, r = e % kFusedRows;
      blocks[e] = r < rows ? fused_block_of_row(a, bins + k * kFusedRows, rows, r, p0, edges[2 * k], edges[2 * k + 1])
                           : FusedBlock{0, 0};
    }
  });
  x.sync();
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (int k = 0; k < s; ++k) {
    lo = min64(lo, edges[2 * k]);
    hi = max64(hi, edges[2 * k + 1]);
  }
  return fused_hash_keys(a, t, lo, hi);
}

}  // namespace plsh::cuda
