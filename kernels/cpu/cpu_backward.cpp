// The CPU backward pass; the structure is described in cpu_backward.h.
//
// One pair is `rows` query rows of one query head against the keys
// [lo, hi) of a key tile that those rows may see, key-major like the
// forward's tiles (microkernels.h; ^T: keys x queries):
//   S^T  = K (scale Q)^T + log W^T   (qk_bias_tile with AlibiBias; lsh: qk_tile + log(c/s))
//   P^T  = exp(S^T - lse)            (probs_tile)
//   dP^T = V dO^T,  dS^T = P^T * (dP^T - D)   (qk_tile, dscores_tile)
//   dV += P^T dO,  dK += dS^T Q      (ab_tile; the job's accumulators, dK
//                                      scaled once at the store)
//   dQ += scale dS K                 (pv_tile; the shared accumulator, locked)
// five products against the forward's two, hence about 2.5 forwards of work.
#include "cpu/cpu_backward.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "cpu/tiles.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"

namespace plsh::cpu {

namespace {

// Keys per job and query rows per pair (and per dQ lock). Measured with
// bench_cpu_backward at n = 8192 (H = 8, D = 64, causal, two threads) on
// the microkernels, backward / forward wall, exact / window / lsh s=16, in
// one run (bench/RESULTS.md): 256 x 64 gave 2.21 / 2.07 / 2.11; 256 x 32
// 2.22 / 1.94 / 1.95 (a row tile's lsh band is narrower); 512 x 64 2.16 /
// 1.96 / 2.07; 512 x 32 2.15 / 2.02 / 1.88; 1024 x 32 2.13 / 1.96 / 2.01;
// 128 x 64 and 128 x 128 were 5-10% worse in an earlier run. 256 keys
// keep twice the jobs of 512 for the same figures within the noise. S^T
// and dP^T (48 KiB each) and the K, V, dK, dV tiles (80 KiB each at D =
// 64) stay within L2.
constexpr int64_t kBwdKeyTile = 256;
constexpr int64_t kBwdRowTile = 32;
static_assert(kBwdKeyTile <= kMaxBiasKeys && kBwdRowTile <= kMaxRowTile, "AlibiEpilogue holds a tile");

// One work item: a key tile of one (batch item, kv head), across every
// query head of the kv head's group.
struct BackwardJob {
  int64_t b = 0, hk = 0, j0 = 0, len = 0;
};

// Per-thread buffers, carved from the workspace once per backward call.
// Tiles of rows are copied at value_stride(D) (tiles.h: in place, rows H * D
// floats apart fall into few L1 sets as the products walk down them).
struct BackwardScratch {
  float* k = nullptr;          // [Kt, ldt] the job's key rows, as float32
  float* v = nullptr;          // [Kt, ldt] its value rows
  float* q = nullptr;          // [R, ldt] one pair's query rows
  float* dout = nullptr;       // [R, ldt] its dout rows
  float* qt = nullptr;         // [R, D] the query rows, scaled and packed (pack_queries)
  float* dot = nullptr;        // [R, D] the dout rows, packed
  float* st = nullptr;         // [Kt, ldst] S^T, then P^T
  float* dpt = nullptr;        // [Kt, ldst] dP^T, then dS^T
  float* dk = nullptr;         // [Kt, ldt] the job's accumulator, sum dS^T Q
  float* dv = nullptr;         // [Kt, ldt] the job's accumulator
  float* dq = nullptr;         // [R, D] one pair's share of dQ, sum dS K
  float* row_a = nullptr;      // [D] out row for D_i
  float* row_b = nullptr;      // [D] dout row for D_i
  int64_t* nearest = nullptr;  // [R] exact/window: AlibiBias's reference distances
  int32_t* counts = nullptr;   // lsh: [Kt + 1, R] c_ij's differences down the keys, then c_ij
};

// Leading dimensions of the scratch's row tiles and of S^T and dP^T.
int64_t tile_stride(const AttentionParams& p) { return value_stride(p.head_dim); }
constexpr int64_t kLogitsStride = logits_stride(kBwdRowTile);

void carve_scratch(const AttentionParams& p, Carver& c, BackwardScratch* s) {
  const int64_t D = p.head_dim, ldt = tile_stride(p);
  s->k = c.take<float>(kBwdKeyTile * ldt);
  s->v = c.take<float>(kBwdKeyTile * ldt);
  s->q = c.take<float>(kBwdRowTile * ldt);
  s->dout = c.take<float>(kBwdRowTile * ldt);
  s->qt = c.take<float>(kBwdRowTile * D);
  s->dot = c.take<float>(kBwdRowTile * D);
  s->st = c.take<float>(kBwdKeyTile * kLogitsStride);
  s->dpt = c.take<float>(kBwdKeyTile * kLogitsStride);
  s->dk = c.take<float>(kBwdKeyTile * ldt);
  s->dv = c.take<float>(kBwdKeyTile * ldt);
  s->dq = c.take<float>(kBwdRowTile * D);
  s->row_a = c.take<float>(D);
  s->row_b = c.take<float>(D);
  s->nearest = c.take<int64_t>(kBwdRowTile);
  s->counts = c.take<int32_t>(uses_draws(p.mode) ? (kBwdKeyTile + 1) * kBwdRowTile : 0);
}

int64_t scratch_bytes(const AttentionParams& p) {
  Carver counting;
  BackwardScratch s;
  carve_scratch(p, counting, &s);
  return counting.used();
}

int64_t job_count(const AttentionParams& p) {
  return p.batch * p.kv_heads * ((p.kv_len + kBwdKeyTile - 1) / kBwdKeyTile);
}
int64_t lock_count(const AttentionParams& p) { return p.batch * p.heads * ((p.q_len + kBwdRowTile - 1) / kBwdRowTile); }

int64_t saturating_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
  return r;
}

// Distance from a query position to the key positions [k_pos0, k_pos0 +
// Nk): what the backward takes each row's logits relative to (AlibiBias).
// No key is nearer, so every biased logit stays <= the score.
int64_t nearest_key(const AttentionParams& p, int64_t pos) {
  const int64_t first = p.k_pos0, last = p.k_pos0 + p.kv_len - 1;
  return pos < first ? first - pos : pos > last ? pos - last : 0;
}

// What every job reads; the accumulators it writes under their locks.
struct Shared {
  const AttentionParams& p;
  const BackwardParams& g;
  const std::vector<std::vector<Draw>>& draws;  // lsh: the plan's
  float* dq_acc;                                // [B, Nq, H, D] scale * sum_j dS_ij k_j
  const float* row_d;                           // [B, H, Nq] D_i = dO_i . O_i
  const float* row_lse;    // [B, H, Nq] lse_i as the logits see it (+ slope * nearest for exact/window)
  std::mutex* locks;       // [B, H, ceil(Nq / R)]: one per query tile of dq_acc
  const float* log_count;  // lsh: [s + 1] log(c / s), -inf for c = 0
};

// Query positions [*lo, *hi) that may see some key of positions [kp0, kp1)
// under head h's weights (causality aside).
void query_reach(const Shared& sh, int64_t h, int64_t kp0, int64_t kp1, int64_t* lo, int64_t* hi) {
  const AttentionParams& p = sh.p;
  *lo = std::numeric_limits<int64_t>::min();
  *hi = std::numeric_limits<int64_t>::max();
  if (p.mode == Mode::kWindow) {
    const int64_t w = p.window[static_cast<size_t>(h)];
    if (w != kNoWindow) {
      *lo = saturating_add(kp0, -(w - 1));
      *hi = saturating_add(kp1 - 1, w);
    }
  } else if (uses_draws(p.mode)) {
    *lo = std::numeric_limits<int64_t>::max();
    *hi = std::numeric_limits<int64_t>::min();
    for (const Draw& d : sh.draws[static_cast<size_t>(h)]) {
      *lo = std::min(*lo, block_begin(kp0, d));
      *hi = std::max(*hi, block_end(kp1 - 1, d));
    }
  }
}

// lsh: for rows [pos_first, pos_first + rows), the differences of c_ij (the
// hashes that put query and key in one bin) down the tile's keys [kp0,
// kp1), key-major in counts [kp1 - kp0 + 1, rows]; returns through lo/hi
// the keys with any weight.
void lsh_count_steps(const std::vector<Draw>& draws, int64_t pos_first, int64_t rows, int64_t kp0, int64_t kp1,
                     int32_t* counts, int64_t* lo, int64_t* hi) {
  std::fill_n(counts, (kp1 - kp0 + 1) * rows, 0);
  *lo = kp1;
  *hi = kp0;
  for (const Draw& d : draws) {
    int64_t first = block_begin(pos_first, d), last = block_end(pos_first, d);
    for (int64_t r = 0; r < rows; ++r) {
      while (pos_first + r >= last) {
        first = last;
        last = block_end(first, d);
      }
      const int64_t b = std::clamp(first, kp0, kp1), e = std::clamp(last, kp0, kp1);
      if (b >= e) continue;
      ++counts[(b - kp0) * rows + r];
      --counts[(e - kp0) * rows + r];
      *lo = std::min(*lo, b);
      *hi = std::max(*hi, e);
    }
  }
}

// One pair: query rows [i0, i1) of head h against the job's key tile.
// Returns the GEMM FLOPs done.
double backward_pair(const Shared& sh, const BackwardJob& job, int64_t h, int64_t i0, int64_t i1, const float* kt,
                     const float* vt, BackwardScratch& sc) {
  const AttentionParams& p = sh.p;
  const BackwardParams& g = sh.g;
  const int64_t D = p.head_dim;
  const int64_t rows = i1 - i0;
  const int64_t pos_first = p.q_pos0 + i0, pos_last = pos_first + rows - 1;
  const int64_t kp0 = p.k_pos0 + job.j0, kp1 = kp0 + job.len;

  // The tile's keys [lo, hi) that these rows may see.
  int64_t lo = kp0, hi = kp1;
  int64_t width = kNoWindow;
  if (uses_draws(p.mode)) {
    lsh_count_steps(sh.draws[static_cast<size_t>(h)], pos_first, rows, kp0, kp1, sc.counts, &lo, &hi);
  } else if (p.mode == Mode::kWindow) {
    width = p.window[static_cast<size_t>(h)];
    if (width != kNoWindow) {
      lo = std::max(lo, saturating_add(pos_first, -(width - 1)));
      hi = std::min(hi, saturating_add(pos_last, width));
    }
  }
  if (p.causal) hi = std::min(hi, pos_last + 1);
  if (lo >= hi) return 0;
  const int64_t c0 = lo - kp0, len = hi - lo;
  const float scale = static_cast<float>(p.scale);

  const int64_t ldt = tile_stride(p), ldst = kLogitsStride;
  rows_into_f32(q_slice(p, job.b, h), i0, rows, sc.q, ldt);
  const SliceView dout_view{g.dout, g.out_dtype, job.b * g.do_batch_stride + h * g.do_head_stride, g.do_row_stride, D};
  rows_into_f32(dout_view, i0, rows, sc.dout, ldt);
  pack_queries(sc.q, ldt, rows, D, scale, sc.qt);
  pack_queries(sc.dout, ldt, rows, D, 1.0f, sc.dot);
  const float* k = kt + c0 * ldt;
  const float* v = vt + c0 * ldt;

  float* st = sc.st;
  if (uses_draws(p.mode)) {
    qk_tile(k, ldt, len, D, sc.qt, rows, st, ldst);
    add_counted_log_weight(st, ldst, sc.counts, rows, rows, c0, len, lo, pos_first, p.causal, sh.log_count);
  } else {
    for (int64_t r = 0; r < rows; ++r) sc.nearest[r] = nearest_key(p, pos_first + r);
    const AlibiBias bias{p, width, p.slopes[static_cast<size_t>(h)], pos_first, rows, sc.nearest};
    AlibiEpilogue epilogue;
    bias.epilogue(job.j0 + c0, len, &epilogue);
    qk_bias_tile(k, ldt, len, D, sc.qt, rows, st, ldst, epilogue.bias, nullptr);
  }
  const int64_t stat = (job.b * p.heads + h) * p.q_len + i0;
  probs_tile(st, ldst, len, rows, sh.row_lse + stat);

  float* dpt = sc.dpt;
  qk_tile(v, ldt, len, D, sc.dot, rows, dpt, ldst);
  dscores_tile(dpt, st, ldst, len, rows, sh.row_d + stat);
  ab_tile(st, ldst, len, rows, sc.dout, ldt, D, sc.dv + c0 * ldt, ldt);
  ab_tile(dpt, ldst, len, rows, sc.q, ldt, D, sc.dk + c0 * ldt, ldt);
  std::fill_n(sc.dq, rows * D, 0.0f);
  pv_tile(dpt, ldst, len, k, ldt, rows, D, sc.dq, D);
  {
    std::lock_guard<std::mutex> lock(
        sh.locks[(job.b * p.heads + h) * ((p.q_len + kBwdRowTile - 1) / kBwdRowTile) + i0 / kBwdRowTile]);
    for (int64_t r = 0; r < rows; ++r) {
      float* acc = sh.dq_acc + ((job.b * p.q_len + i0 + r) * p.heads + h) * D;
      const float* part = sc.dq + r * D;
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) acc[x] += scale * part[x];
    }
  }
  return 10.0 * static_cast<double>(rows) * static_cast<double>(len) * static_cast<double>(D);
}

// One job: every pair of its key tile, then dK and dV of the tile. On a
// stop it returns early with *why set, leaving its dk/dv rows unwritten.
double backward_job(const Shared& sh, const BackwardJob& job, const ExecContext& ctx, BackwardScratch& sc,
                    Status* why) {
  const AttentionParams& p = sh.p;
  const BackwardParams& g = sh.g;
  const int64_t D = p.head_dim;
  const int64_t h_first = job.hk * p.head_group;
  const int64_t ldt = tile_stride(p);
  rows_into_f32(k_slice(p, job.b, h_first), job.j0, job.len, sc.k, ldt);
  rows_into_f32(v_slice(p, job.b, h_first), job.j0, job.len, sc.v, ldt);
  std::fill_n(sc.dk, job.len * ldt, 0.0f);
  std::fill_n(sc.dv, job.len * ldt, 0.0f);
  const int64_t kp0 = p.k_pos0 + job.j0, kp1 = kp0 + job.len;
  double flops = 0;
  for (int64_t h = h_first; h < h_first + p.head_group; ++h) {
    int64_t qlo = 0, qhi = 0;
    query_reach(sh, h, kp0, kp1, &qlo, &qhi);
    if (p.causal) qlo = std::max(qlo, kp0);
    const int64_t i_lo = std::clamp(qlo, p.q_pos0, p.q_pos0 + p.q_len) - p.q_pos0;
    const int64_t i_hi = std::clamp(qhi, p.q_pos0, p.q_pos0 + p.q_len) - p.q_pos0;
    for (int64_t i0 = i_lo; i0 < i_hi;) {
      const int64_t i1 = std::min(i_hi, (i0 / kBwdRowTile + 1) * kBwdRowTile);
      *why = ctx.check_stop();
      if (!why->ok()) return flops;
      flops += backward_pair(sh, job, h, i0, i1, sc.k, sc.v, sc);
      i0 = i1;
    }
  }
  // dK's products left out the scale (it is the same for every pair).
  const float scale = static_cast<float>(p.scale);
  for (int64_t r = 0; r < job.len; ++r) {
    const int64_t j = job.j0 + r;
    float* dk = sc.dk + r * ldt;
#pragma omp simd
    for (int64_t x = 0; x < D; ++x) dk[x] *= scale;
    store_row(g.dk, g.grad_dtype, job.b * g.dk_batch_stride + j * g.dk_row_stride + job.hk * g.dk_head_stride, D, dk);
    store_row(g.dv, g.grad_dtype, job.b * g.dv_batch_stride + j * g.dv_row_stride + job.hk * g.dv_head_stride, D,
              sc.dv + r * ldt);
  }
  return flops;
}

}  // namespace

namespace {

// Everything one backward call works in, carved in this order from its
// workspace (or counted, when `c` counts): the one layout that
// backward_workspace_bytes sizes and backward slices.
struct BackwardBuffers {
  BackwardScratch* scratch = nullptr;  // [threads]
  float* dq_acc = nullptr;             // [B, Nq, H, D]
  float* row_d = nullptr;              // [B, H, Nq]
  float* row_lse = nullptr;            // [B, H, Nq]
  std::mutex* locks = nullptr;         // [lock_count], constructed by backward
  float* log_count = nullptr;          // lsh: [s + 1]
};

BackwardBuffers carve_buffers(const AttentionParams& p, int threads, Carver& c) {
  BackwardBuffers b;
  b.scratch = c.take<BackwardScratch>(threads);
  const int64_t per_thread = scratch_bytes(p);
  for (int t = 0; t < threads; ++t) {
    Carver slice = c.split(per_thread);
    BackwardScratch s;
    carve_scratch(p, slice, &s);
    if (b.scratch != nullptr) new (&b.scratch[t]) BackwardScratch(s);
  }
  b.dq_acc = c.take<float>(p.batch * p.q_len * p.heads * p.head_dim);
  b.row_d = c.take<float>(p.batch * p.heads * p.q_len);
  b.row_lse = c.take<float>(p.batch * p.heads * p.q_len);
  b.locks = c.take<std::mutex>(lock_count(p));
  b.log_count = c.take<float>(uses_draws(p.mode) ? p.samples + 1 : 0);
  return b;
}

// Job n: key tiles in order (under causality the first see the most
// queries, and starting them first keeps the dynamic schedule's tail
// short), then batch items, then kv heads. Computed, not listed.
BackwardJob backward_job_at(const AttentionParams& p, int64_t n) {
  const int64_t per_tile = p.batch * p.kv_heads;
  const int64_t t = n / per_tile;
  const int64_t b = (n % per_tile) / p.kv_heads, hk = n % p.kv_heads;
  return {b, hk, t * kBwdKeyTile, std::min(kBwdKeyTile, p.kv_len - t * kBwdKeyTile)};
}

}  // namespace

int64_t backward_workspace_bytes(const AttentionParams& p, int threads) {
  Carver counting;
  carve_buffers(p, threads, counting);
  return counting.used();
}

Status backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace, const ExecContext& ctx,
                BackwardStats* stats) {
  const AttentionParams& p = plan.params;
  const int threads = plan.threads;
  const int64_t D = p.head_dim;
  RETURN_IF_ERROR(ctx.check_stop());

  Carver carver(workspace);
  const BackwardBuffers buf = carve_buffers(p, threads, carver);
  if (carver.overflowed())
    return internal_error("cpu backend: the backward carved " + std::to_string(carver.used()) +
                          " bytes, the plan sized " + std::to_string(plan.backward_workspace.host_bytes));
  BackwardScratch* scratch = buf.scratch;
  float* dq_acc = buf.dq_acc;
  float* row_d = buf.row_d;
  float* row_lse = buf.row_lse;
  const int64_t locks = lock_count(p);
  for (int64_t i = 0; i < locks; ++i) new (&buf.locks[i]) std::mutex;
  struct DestroyLocks {
    std::mutex* locks;
    int64_t n;
    ~DestroyLocks() {
      for (int64_t i = 0; i < n; ++i) locks[i].~mutex();
    }
  } destroy_locks{buf.locks, locks};
  if (uses_draws(p.mode)) {
    buf.log_count[0] = kNegInf;
    for (int64_t c = 1; c <= p.samples; ++c)
      buf.log_count[c] = static_cast<float>(std::log(static_cast<double>(c) / static_cast<double>(p.samples)));
  }

  // D_i = dO_i . O_i (FlashAttention's dot_do_o) and the lse each row's
  // logits are measured against, per (b, i) with every head; dq_acc zeroed.
  const int64_t rows_total = p.batch * p.q_len;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < rows_total; ++n) {
    BackwardScratch& s = scratch[omp_get_thread_num()];
    const int64_t b = n / p.q_len, i = n % p.q_len;
    const int64_t shift_distance = nearest_key(p, p.q_pos0 + i);
    for (int64_t h = 0; h < p.heads; ++h) {
      load_row(g.out, g.out_dtype, b * g.o_batch_stride + i * g.o_row_stride + h * g.o_head_stride, D, s.row_a);
      load_row(g.dout, g.out_dtype, b * g.do_batch_stride + i * g.do_row_stride + h * g.do_head_stride, D, s.row_b);
      double dot = 0;
      for (int64_t x = 0; x < D; ++x) dot += static_cast<double>(s.row_a[x]) * s.row_b[x];
      const double lse = g.lse[b * g.lse_batch_stride + i * g.lse_row_stride + h];
      // Exact and window logits leave out -slope * nearest (AlibiBias);
      // lsh weighs by log(c / s) with nothing left out.
      const double shift =
          uses_draws(p.mode) ? 0.0 : p.slopes[static_cast<size_t>(h)] * static_cast<double>(shift_distance);
      const int64_t stat = (b * p.heads + h) * p.q_len + i;
      row_d[stat] = static_cast<float>(dot);
      // An lse of -inf (a row that saw no key, which validation refuses
      // for the forward, but lse is the caller's input here) gives the row
      // no probabilities: +inf makes every exp(s - lse) 0, where s - (-inf)
      // would be +inf or NaN and P would come out as exp(80).
      row_lse[stat] = lse == -std::numeric_limits<double>::infinity() ? std::numeric_limits<float>::infinity()
                                                                      : static_cast<float>(lse + shift);
    }
    std::fill_n(dq_acc + n * p.heads * D, p.heads * D, 0.0f);
  }

  const Shared shared{p, g, plan.draws, dq_acc, row_d, row_lse, buf.locks, buf.log_count};
  const auto job = [&](int t, int64_t n, Status* why) {
    return backward_job(shared, backward_job_at(p, n), ctx, scratch[t], why);
  };
  ASSIGN_OR_RETURN(const double flops, run_jobs(threads, job_count(p), ctx, job));

  // dq from its accumulator, in dq's dtype and strides.
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < rows_total; ++n) {
    const int64_t b = n / p.q_len, i = n % p.q_len;
    for (int64_t h = 0; h < p.heads; ++h)
      store_row(g.dq, g.grad_dtype, b * g.dq_batch_stride + i * g.dq_row_stride + h * g.dq_head_stride, D,
                dq_acc + (n * p.heads + h) * D);
  }

  if (stats != nullptr) {
    stats->flops = flops;
    stats->workspace = {carver.used(), 0};
  }
  return Status::Ok();
}

}  // namespace plsh::cpu
