// The error estimates' probe rows (SPEC section 6) on the device, while the
// forward's copies of k and v are still there: a few seeded query rows per
// head computed exactly (ALiBi weights exp(-slope |d|) on every allowed key,
// float32 accumulation on the tensor cores, as the exact mode), with the
// sums of the per-row bound beside them:
//   num = sum_j a_ij |L*_ij - M~_ij|,  den = sum_j a_ij M~_ij,  a_ij = e^(scale q_i.k_j),
// and max_j ||v_j||^2 over the allowed keys, each sum under its own running
// maximum. One CTA per (group of up to 64 rows of one head and batch item,
// split of the keys); fused_probe_merge then folds the splits of a row.
// The host turns them into the probe's err2, ref2, max_abs and bound
// (plsh/device_estimates.h). Runs under DeviceExec and HostExec alike.
#pragma once

#include <cstdint>

#include "cuda/fused_exec.h"
#include "cuda/fused_math.h"
#include "cuda/fused_tile.h"

namespace plsh::cuda {

// One group's rows: query rows of one (head, batch item), sorted, at most 64.
struct ProbeGroup {
  int32_t head = 0;
  int32_t batch = 0;
  int32_t rows = 0;
  int32_t first = 0;  // index of its first row in ProbeArgs::row_index and the outputs
};

// What a probe launch reads besides FusedArgs (whose q, k, v, strides,
// tables and positions it shares with the forward).
struct ProbeArgs {
  const ProbeGroup* groups = nullptr;  // [G]
  const int32_t* row_index = nullptr;  // [rows]: query row i
  int32_t splits = 1;                  // key splits per group
  int32_t mode = 1;                    // Mode of the request: kLsh (1) or kWindow (2): what M~ is
  float* partial = nullptr;            // [G][splits][kFusedRows][kProbeFloats(D)]
  float* result = nullptr;             // [rows][D + 3]: o*, num / den scale, max ||v||^2 (fused_probe_merge)
  int64_t head_dim = 0;
};

// A partial row: m, l (exact softmax, base 2), O[D]; m_a, num, den (the
// bound's sums, base 2); max ||v||^2.
PLSH_HD inline int64_t probe_floats(int64_t head_dim) { return head_dim + 6; }

template <typename Cfg>
struct ProbeSmem {
  using S = typename Cfg::Storage;
  S* q = nullptr;  // [kFusedRows][kPitch], gathered
  S* k0 = nullptr;
  S* k1 = nullptr;
  S* v0 = nullptr;
  S* v1 = nullptr;
  float* vnorm0 = nullptr;  // [kFusedKeys]: ||v_j||^2 per stage
  float* vnorm1 = nullptr;
  float* p = nullptr;            // f32 path
  FusedBlock* blocks = nullptr;  // [max_samples][kFusedRows]
  int32_t* rows = nullptr;       // [kFusedRows]: the group's query rows
  int64_t bytes = 0;
  PLSH_HD ProbeSmem(unsigned char* base, int max_samples) {
    SmemCarver c{base};
    q = c.take<S>(kFusedRows * Cfg::kPitch);
    c.take_each(kFusedKeys * Cfg::kPitch, k0, v0, k1, v1);
    c.take_each(kFusedKeys, vnorm0, vnorm1);
    if (!Cfg::kTC) p = c.take<float>(kFusedWarps * 16 * Cfg::kPPitch);
    blocks = c.take<FusedBlock>(static_cast<int64_t>(max_samples) * kFusedRows);
    rows = c.take<int32_t>(kFusedRows);
    bytes = c.at;
  }
  PLSH_HD S* k(int st) const { return st == 0 ? k0 : k1; }
  PLSH_HD S* v(int st) const { return st == 0 ? v0 : v1; }
  PLSH_HD float* vnorm(int st) const { return st == 0 ? vnorm0 : vnorm1; }
};

template <typename Cfg>
struct ProbeLane {
  float o[Cfg::kDT][4];
  float s[Cfg::kNT][4];
  float w[Cfg::kNT][4];         // lsh: c_ij
  float m[2], l[2];             // exact softmax, base 2
  float ma[2], num[2], den[2];  // the bound's sums under their own max (base 2)
  float vmax[2];
  float tmax[2], tmax_a[2];
  uint32_t tmp[8];
  FusedRow row[2];
};

// The key tiles split `split` of `splits` covers of [0, kt_end).
PLSH_HD inline TileSpan probe_split(int64_t kt_end, int64_t split, int64_t splits) {
  const int64_t per = fused_tiles(kt_end, splits);
  return {min64(kt_end, split * per), min64(kt_end, (split + 1) * per)};
}

template <typename Cfg, typename X>
PLSH_HD void fused_probe_cta(const FusedArgs& a, const ProbeArgs& pa, int64_t group, int64_t split,
                             unsigned char* smem_base, X& x) {
  using Lane = ProbeLane<Cfg>;
  using S = typename Cfg::Storage;
  const ProbeGroup g = pa.groups[group];
  const FusedHead head = a.head_table[g.head];
  // The exact weights: ALiBi on every allowed key.
  FusedHead exact = head;
  exact.rule = FusedRule::kAlibi;
  exact.window = kNoWindow;
  const int64_t hk = g.head / a.head_group, b = g.batch;
  ProbeSmem<Cfg> sm(smem_base, a.max_samples);
  const bool hashes = head.rule == FusedRule::kHashes;
  const float slope2 = head.slope2;  // L* = 2^(-slope2 |d|), for either rule
  const float inv_s = hashes ? 1.0f / static_cast<float>(head.samples) : 0.0f;

  x.threads([&](int tid) {
    if (tid < kFusedRows)
      sm.rows[tid] = tid < g.rows ? pa.row_index[g.first + tid] : pa.row_index[g.first + g.rows - 1];
  });
  x.sync();
  // Q's gathered rows, 16 bytes a thread.
  x.threads([&](int tid) {
    for (int c = tid; c < kFusedRows * Cfg::kChunksPerRow; c += kFusedThreads) {
      const int r = c / Cfg::kChunksPerRow, piece = c % Cfg::kChunksPerRow;
      const S* src =
          static_cast<const S*>(a.q) + b * a.q_bs + static_cast<int64_t>(sm.rows[r]) * a.q_rs + g.head * a.q_hs;
      x.copy16(reinterpret_cast<unsigned char*>(sm.q + r * Cfg::kPitch) + 16 * piece,
               reinterpret_cast<const unsigned char*>(src) + 16 * piece, r < g.rows);
    }
  });
  x.commit();
  if (hashes) {
    x.threads([&](int tid) {
      for (int e = tid; e < head.samples * kFusedRows; e += kFusedThreads) {
        const int k = e / kFusedRows, r = e % kFusedRows;
        const FusedHash hh = fused_hash(a, head, k);
        const int64_t pos = a.q_pos0 + sm.rows[r];
        sm.blocks[e] = r < g.rows ? FusedBlock{fused_key_row(a, fused_block_begin(pos, hh, fused_search_lo(a, pos))),
                                               fused_key_row(a, fused_block_end(pos, hh, fused_search_hi(a, pos)))}
                                  : FusedBlock{0, 0};
      }
    });
  }
  // Every key the group's last row may see, split.
  const int64_t last_row = pa.row_index[g.first + g.rows - 1];
  const int64_t key_end = a.causal ? min64(a.kv_len, max64(0, last_row + a.qk_offset + 1)) : a.kv_len;
  const TileSpan span = probe_split(fused_tiles(key_end, kFusedKeys), split, pa.splits);
  auto load_kv = [&](int64_t kt, int stage) { fused_load_kv<Cfg>(x, a, b, hk, kt, sm.k(stage), sm.v(stage), true); };
  if (span.begin < span.end) load_kv(span.begin, 0);

  typename X::template PerThread<Lane> st;
  fused_each_lane(x, st, [&](Lane& L, int w, int lane) {
    PLSH_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = w * 16 + frag_row(lane, half);
      L.row[half] = fused_row(a, head, r < g.rows ? sm.rows[r] : a.q_len);  // past the group: no key
      L.m[half] = L.ma[half] = -INFINITY;
      L.l[half] = L.num[half] = L.den[half] = L.vmax[half] = 0;
    }
    fused_zero(L.o);
  });
  for (int64_t kt = span.begin; kt < span.end; ++kt) {
    const int stage = fused_key_step(x, span, kt, load_kv);
    // ||v_j||^2 of the tile's keys.
    x.threads([&](int tid) {
      if (tid >= kFusedKeys) return;
      const S* vr = sm.v(stage) + tid * Cfg::kPitch;
      float n2 = 0;
      for (int d = 0; d < Cfg::D; ++d)
        n2 += bits_to_float(typename Cfg::Elem{}, vr[d]) * bits_to_float(typename Cfg::Elem{}, vr[d]);
      sm.vnorm(stage)[tid] = n2;
    });
    x.sync();
    x.warps([&](int w) {
      const int rf = w * 16;
      const int rl = rf + 15 < g.rows - 1 ? rf + 15 : g.rows - 1;
      if (rl < rf) return;
      const FusedRow first = fused_row(a, exact, sm.rows[rf]), last = fused_row(a, exact, sm.rows[rl]);
      if (fused_warp_keys(x, a, exact, sm.blocks, rf, rl, first, last, kt).empty) return;
      const WarpKeys wk = hashes ? fused_warp_keys(x, a, head, sm.blocks, rf, rl, first, last, kt) : WarpKeys{};
      x.lanes([&](int lane) {
        Lane& L = st(w, lane);
        fused_zero(L.s);
      });
      fused_abt_smem<Cfg>(
          x, sm.q, rf, sm.k(stage), [&](int lane, int nt) { return st(w, lane).s[nt]; },
          [&](int lane) { return st(w, lane).tmp; });
      // Per element: the exact logit (into s), a's logit, L* and M~ (into w: |L* - M~| and M~ after the max).
      x.lanes([&](int lane) {
        Lane& L = st(w, lane);
        const int rr[2] = {rf + frag_row(lane, 0), rf + frag_row(lane, 1)};
        if (hashes) {
          float scratch[Cfg::kNT][4];
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int i = 0; i < 4; ++i) scratch[nt][i] = 0;
          fused_logits<Cfg::kNT>(a, head, wk, sm.blocks, lane, L.row, rr, scratch, L.w);  // counts only
        }
        PLSH_UNROLL
        for (int half = 0; half < 2; ++half) L.tmax[half] = L.tmax_a[half] = -INFINITY;
        PLSH_UNROLL
        for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
        for (int i = 0; i < 4; ++i) {
          const FusedRow& r = L.row[i >> 1];
          const int32_t j = static_cast<int32_t>(kt * kFusedKeys) + nt * 8 + frag_col(lane, i & 1);
          const int32_t dist = r.anchor > j ? r.anchor - j : j - r.anchor;
          const bool ok = j <= r.limit;
          const float xa = L.s[nt][i] * a.scale2;
          const float lstar = exp2f(-slope2 * static_cast<float>(dist));
          const float mask = hashes ? L.w[nt][i] * inv_s : (dist < r.window_left ? lstar : 0.0f);
          L.w[nt][i] = ok ? mask : -1.0f;  // -1: not allowed
          L.s[nt][i] = ok ? xa - slope2 * static_cast<float>(dist) : -INFINITY;
          if (ok) {
            L.tmax[i >> 1] = fmaxf(L.tmax[i >> 1], L.s[nt][i]);
            L.tmax_a[i >> 1] = fmaxf(L.tmax_a[i >> 1], xa);
            L.vmax[i >> 1] = fmaxf(L.vmax[i >> 1], sm.vnorm(stage)[nt * 8 + frag_col(lane, i & 1)]);
          }
        }
      });
      fused_quad_max(x, st, w, &Lane::tmax);
      fused_quad_max(x, st, w, &Lane::tmax_a);
      fused_each_row(x, st, w, [&](Lane& L, int lane, int half) {
        const RowScale rs = fused_rescale(L.m[half], L.tmax[half]);
        const RowScale ra = fused_rescale(L.ma[half], L.tmax_a[half]);
        L.m[half] = rs.m_new;
        L.l[half] *= rs.alpha;
        L.ma[half] = ra.m_new;
        L.num[half] *= ra.alpha;
        L.den[half] *= ra.alpha;
        PLSH_UNROLL
        for (int dt = 0; dt < Cfg::kDT; ++dt) PLSH_UNROLL
        for (int j = 0; j < 2; ++j) L.o[dt][2 * half + j] *= rs.alpha;
        float sum = 0, num = 0, den = 0;
        PLSH_UNROLL
        for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
        for (int j = 0; j < 2; ++j) {
          float& e = L.s[nt][2 * half + j];
          const float mask = L.w[nt][2 * half + j];
          if (e == -INFINITY) {
            e = 0;
            continue;
          }
          const float dist_part = e;  // xa - slope2 dist
          const float p = fused_prob(dist_part, rs.m_new);
          // a relative to its own max: 2^(xa - m_a), xa = e + slope2 dist.
          const int32_t jj = static_cast<int32_t>(kt * kFusedKeys) + nt * 8 + frag_col(lane, j);
          const FusedRow& r = L.row[half];
          const float dist = static_cast<float>(r.anchor > jj ? r.anchor - jj : jj - r.anchor);
          const float av = exp2f(e + slope2 * dist - ra.m_new);
          const float lstar = exp2f(-slope2 * dist);
          num += av * fabsf(lstar - mask);
          den += av * mask;
          e = p;
          sum += p;
        }
        L.l[half] += sum;
        L.num[half] += num;
        L.den[half] += den;
      });
      if constexpr (Cfg::kTC) {
        // P in two parts (fused_pack_a_split): o* to float32's accuracy on 16-bit inputs too.
        auto tmp = [&](int lane) { return st(w, lane).tmp; };
        auto p_acc = [&](int lane, int nt) { return st(w, lane).s[nt]; };
        for (int part = 0; part < 2; ++part)
          fused_ab_tc<Cfg, Cfg::kDT>(
              x, [&](int kk) { fused_pack_a_split<Cfg>(x, kk, part, p_acc, tmp); }, sm.v(stage), 0,
              [&](int lane, int dt) { return st(w, lane).o[dt]; }, tmp);
      } else {
        float* prow = sm.p + w * 16 * Cfg::kPPitch;
        x.lanes([&](int lane) {
          PLSH_UNROLL
          for (int nt = 0; nt < Cfg::kNT; ++nt) PLSH_UNROLL
          for (int i = 0; i < 4; ++i)
            prow[frag_row(lane, i >> 1) * Cfg::kPPitch + nt * 8 + frag_col(lane, i & 1)] = st(w, lane).s[nt][i];
        });
        x.syncwarp();
        fused_pb_simt<Cfg, Cfg::kDT>(x, prow, reinterpret_cast<const float*>(sm.v(stage)), 0,
                                     [&](int lane, int dt) { return st(w, lane).o[dt]; });
        x.syncwarp();
      }
    });
    x.sync();
  }
  x.template wait<0>();

  // The partial rows: quad sums of the lanes' shares, one lane per row writes.
  x.warps([&](int w) {
    fused_quad_sum(x, st, w, &Lane::l);
    fused_quad_sum(x, st, w, &Lane::num);
    fused_quad_sum(x, st, w, &Lane::den);
    fused_quad_max(x, st, w, &Lane::vmax);
    fused_each_row(x, st, w, [&](Lane& L, int lane, int half) {
      const int r = w * 16 + frag_row(lane, half);
      if (r >= g.rows) return;
      float* out = pa.partial + ((group * pa.splits + split) * kFusedRows + r) * probe_floats(Cfg::D);
      PLSH_UNROLL
      for (int dt = 0; dt < Cfg::kDT; ++dt) PLSH_UNROLL
      for (int j = 0; j < 2; ++j) out[6 + dt * 8 + frag_col(lane, j)] = L.o[dt][2 * half + j];
      if (lane % 4 == 0) {
        out[0] = L.m[half];
        out[1] = L.l[half];
        out[2] = L.ma[half];
        out[3] = L.num[half];
        out[4] = L.den[half];
        out[5] = L.vmax[half];
      }
    });
  });
}

// Row r of group `group`: its splits folded (log-sum-exp in base 2, double)
// into result[(first + r) * (D + 3)]: o* [D], num / den, max ||v||^2 (the
// bound's scale: bound = 2 sqrt(max ||v||^2) num / den).
PLSH_HD inline void fused_probe_merge(const ProbeArgs& pa, int64_t group, int64_t r) {
  const ProbeGroup g = pa.groups[group];
  const int64_t D = pa.head_dim, F = probe_floats(D);
  double m = -INFINITY, ma = -INFINITY, vmax = 0;
  for (int64_t c = 0; c < pa.splits; ++c) {
    const float* p = pa.partial + ((group * pa.splits + c) * kFusedRows + r) * F;
    if (p[1] > 0) m = fmax(m, static_cast<double>(p[0]));
    if (p[3] > 0 || p[4] > 0) ma = fmax(ma, static_cast<double>(p[2]));
    vmax = fmax(vmax, static_cast<double>(p[5]));
  }
  double l = 0, num = 0, den = 0;
  float* out = pa.result + (g.first + r) * (D + 3);
  for (int64_t d = 0; d < D; ++d) out[d] = 0;
  for (int64_t c = 0; c < pa.splits; ++c) {
    const float* p = pa.partial + ((group * pa.splits + c) * kFusedRows + r) * F;
    if (p[1] > 0) {
      const double f = exp2(static_cast<double>(p[0]) - m);
      l += f * p[1];
      for (int64_t d = 0; d < D; ++d) out[d] += static_cast<float>(f * p[6 + d]);
    }
    if (p[3] > 0 || p[4] > 0) {
      const double f = exp2(static_cast<double>(p[2]) - ma);
      num += f * p[3];
      den += f * p[4];
    }
  }
  for (int64_t d = 0; d < D; ++d) out[d] = l > 0 ? static_cast<float>(out[d] / l) : 0.0f;
  out[D] = den > 0 ? static_cast<float>(num / den) : INFINITY;
  out[D + 1] = static_cast<float>(vmax);
  out[D + 2] = static_cast<float>(l);
}

template <typename Cfg>
PLSH_HD inline int64_t fused_probe_smem_bytes(int max_samples) {
  return ProbeSmem<Cfg>(nullptr, max_samples).bytes;
}

}  // namespace plsh::cuda
