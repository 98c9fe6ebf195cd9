// The probe (SPEC section 6): r seeded query rows per head, computed
// exactly in float64 with their rigorous bound by the sweeps of
// probe_sweep.cpp, pooled here into a relative error with its standard
// error; and what the sweeps read first: the keys' statistics and each
// row's reach.
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>

#include <omp.h>

#include "estimates_internal.h"
#include "plsh/numeric.h"
#include "vector_clones.h"

namespace plsh {

namespace estimates_detail {

ProbeStats probe_stats(const std::vector<ProbeRow>& rows, int64_t population) {
  ProbeStats st;
  st.population = population;
  for (const ProbeRow& pr : rows) {
    ++st.rows;
    st.se += pr.err2;
    st.sn += pr.ref2;
    st.see += pr.err2 * pr.err2;
    st.snn += pr.ref2 * pr.ref2;
    st.sen += pr.err2 * pr.ref2;
    st.max_abs = std::max(st.max_abs, pr.max_abs);
    st.bound_max = std::max(st.bound_max, pr.bound);
    st.err2.push_back(pr.err2);
  }
  return st;
}

// rel_err = sqrt(Q), Q = sum err2 / sum ref2 over the probe rows (pooled over
// heads). Its standard error is the delta method for a ratio of sample means:
// Q - Q_true ~ sum_i z_i / sum_i ref2_i with z_i = err2_i - Q ref2_i, whose
// variance per head is r s_z^2 (1 - r/N) (simple random sampling without
// replacement of r of the head's N rows; our stratified sample is at least
// as precise, so this errs on the safe side), summed over heads; then
// d sqrt(Q) = dQ / (2 sqrt(Q)).
ProbeEstimate summarize_probe(const std::vector<ProbeStats>& heads) {
  ProbeEstimate e;
  double se = 0, sn = 0;
  for (const ProbeStats& h : heads) {
    e.rows += h.rows;
    se += h.se;
    sn += h.sn;
    e.max_abs_err = std::max(e.max_abs_err, h.max_abs);
    e.bound_max = std::max(e.bound_max, h.bound_max);
  }
  if (e.rows == 0) return e;
  if (sn <= 0) {
    e.rel_err = se > 0 ? kInf : 0;
    e.rel_err_stderr = se > 0 ? kInf : 0;
    e.rel_err_upper = se > 0 ? kInf : 0;
    return e;
  }
  const double q = se / sn;
  e.rel_err = std::sqrt(q);
  double var = 0;
  for (const ProbeStats& h : heads) {
    if (h.rows == 0 || h.rows == h.population) continue;  // a full census has no sampling error
    if (h.rows < 2) {
      var = kInf;  // one row of many says nothing about the spread
      break;
    }
    const double r = static_cast<double>(h.rows);
    const double sum_z = h.se - q * h.sn;
    const double sum_z2 = std::max(0.0, h.see - 2 * q * h.sen + q * q * h.snn);
    const double s2 = std::max(0.0, (sum_z2 - sum_z * sum_z / r) / (r - 1));
    var += r * s2 * (1 - r / static_cast<double>(h.population));
  }
  const double se_q = std::sqrt(var) / sn;
  e.rel_err_stderr = q > 0 ? se_q / (2 * std::sqrt(q)) : 0;
  e.rel_err_upper = probe_rel_err_upper(heads, q, se_q);
  return e;
}

}  // namespace estimates_detail

using namespace estimates_detail;

namespace {

// ||row||^2 in double; float32 rows read in place. `omp simd` lets the
// sum run in vector lanes (the order differs from the sequential sum by
// ~64 ulp of double at most, far inside the (1 + 1e-12) that probe_rows
// allows the norms' rounding), built for AVX2+FMA too and picked at load
// time.
PLSH_VECTOR_CLONES double squared_norm_f32(const float* x, int64_t n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += static_cast<double>(x[d]) * x[d];
  return s;
}

double squared_norm(const void* data, DType t, int64_t offset, int64_t n, float* buf) {
  return squared_norm_f32(row_as_f32(data, t, offset, n, buf), n);
}

// Key rows [j0, j1) of batch item b, every kv head with wanted[hk] set:
// ||v_j||^2 into stats[hk].v2_prefix_max[j] (the running max comes later)
// and the largest ||k_j||^2 into max_k2[hk]. Rows outer, heads inner, so k
// and v are read in their memory order: one head's rows alone are a walk
// with a stride of H * D elements that touches a new page every row or two
// (probe key statistics at n = 32768, 8 heads: 83 ms of CPU that way).
void key_norms(const AttentionParams& p, int64_t b, int64_t j0, int64_t j1, const char* wanted, ProbeKeyStats* stats,
               double* max_k2, float* buf) {
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
      if (!wanted[hk]) continue;
      const double k2 =
          squared_norm(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride, p.head_dim, buf);
      max_k2[hk] = std::max(max_k2[hk], k2);
      stats[hk].v2_prefix_max[static_cast<size_t>(j)] =
          squared_norm(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride, p.head_dim, buf);
    }
  }
}

void running_max(std::vector<double>& x) {
  double m = 0;
  for (double& e : x) e = m = std::max(m, e);
}

}  // namespace

ProbeKeyStats probe_key_stats(const AttentionParams& p, int64_t b, int64_t kv_head) {
  const size_t n = static_cast<size_t>(b * p.kv_heads + kv_head);
  std::vector<char> wanted(static_cast<size_t>(p.batch * p.kv_heads), 0);
  wanted[n] = 1;
  std::vector<ProbeKeyStats> all;
  if (!probe_key_stats_all(p, wanted, 1, &all).ok()) throw std::bad_alloc();  // its one failure
  return std::move(all[n]);
}

Status probe_key_stats_all(const AttentionParams& p, const std::vector<char>& wanted, int threads,
                           std::vector<ProbeKeyStats>* out) {
  const int64_t heads = p.kv_heads;
  out->assign(static_cast<size_t>(p.batch * heads), ProbeKeyStats{});
  try {
    for (size_t n = 0; n < out->size(); ++n)
      if (wanted[n]) (*out)[n].v2_prefix_max.resize(static_cast<size_t>(p.kv_len));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("probe key statistics ran out of host memory");
  }
  // Chunks of 4096 rows of one batch item: enough work to spread over the
  // threads, each chunk's maxima kept apart and merged after.
  constexpr int64_t kChunk = 4096;
  const int64_t per_item = (p.kv_len + kChunk - 1) / kChunk;
  const int64_t chunks = p.batch * per_item;
  std::vector<double> chunk_max_k2(static_cast<size_t>(chunks * heads), 0.0);
  const int t = std::max(threads, 1);
  std::vector<float> bufs(static_cast<size_t>(t * p.head_dim));
#pragma omp parallel for schedule(dynamic, 1) num_threads(t)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c / per_item, j0 = (c % per_item) * kChunk;
    key_norms(p, b, j0, std::min(p.kv_len, j0 + kChunk), wanted.data() + b * heads, out->data() + b * heads,
              chunk_max_k2.data() + c * heads, bufs.data() + omp_get_thread_num() * p.head_dim);
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t hk = 0; hk < heads; ++hk) {
      const size_t n = static_cast<size_t>(b * heads + hk);
      if (!wanted[n]) continue;
      double max_k2 = 0;
      for (int64_t c = b * per_item; c < (b + 1) * per_item; ++c)
        max_k2 = std::max(max_k2, chunk_max_k2[static_cast<size_t>(c * heads + hk)]);
      (*out)[n].max_k_norm = std::sqrt(max_k2);
      running_max((*out)[n].v2_prefix_max);
    }
  }
  return Status::Ok();
}

int64_t probe_reach(double sigma, double a_max, int64_t nearest) {
  if (!std::isfinite(sigma) || !std::isfinite(a_max)) return INT64_MAX;
  const double reach = static_cast<double>(nearest) + sigma * (2 * a_max + std::log(2 * sigma + 2) + 40);
  return reach < 4e18 ? static_cast<int64_t>(std::ceil(reach)) : INT64_MAX;
}

}  // namespace plsh
