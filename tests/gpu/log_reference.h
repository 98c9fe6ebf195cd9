// Exact and window ALiBi in float64 with the bias in the log domain, for the
// CUDA tests (host emulation and device): see log_domain_reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "plsh/numeric.h"
#include "plsh/params.h"
#include "reference.h"

namespace plsh::testing {

// Exact and window ALiBi in float64 with the bias kept in the log domain
// (logit = scale q.k - slope |d|): reference_attention multiplies
// by exp(-slope |d|), which is 0 in double beyond |d| ~ 745 / slope, so it
// has no answer for queries far from every key (a shard of a long
// sequence). lsh and fixed_blocks have no bias (slope 0 inside blocks): the
// shared reference.
inline ReferenceOutput log_domain_reference(const AttentionParams& p) {
  if (uses_draws(p.mode)) return reference_attention(p);
  ReferenceOutput r;
  const int64_t D = p.head_dim;
  r.out.assign(static_cast<size_t>(p.batch * p.q_len * p.heads * D), 0.0);
  r.lse.assign(static_cast<size_t>(p.batch * p.q_len * p.heads), -INFINITY);
  std::vector<double> logits(static_cast<size_t>(p.kv_len));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t hk = h / p.head_group;
      const double slope = p.slopes[static_cast<size_t>(h)];
      const int64_t window = p.mode == Mode::kWindow ? p.window[static_cast<size_t>(h)] : kNoWindow;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t pos_q = p.q_pos0 + i;
        double m = -INFINITY;
        for (int64_t j = 0; j < p.kv_len; ++j) {
          const int64_t pos_k = p.k_pos0 + j;
          const int64_t dist = pos_q > pos_k ? pos_q - pos_k : pos_k - pos_q;
          double& l = logits[static_cast<size_t>(j)];
          l = -INFINITY;
          if ((p.causal && pos_k > pos_q) || (window != kNoWindow && dist >= window)) continue;
          double dot = 0;
          for (int64_t x = 0; x < D; ++x)
            dot += load_element(p.q, p.dtype, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride + x) *
                   load_element(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride + x);
          l = p.scale * dot - slope * static_cast<double>(dist);
          m = std::max(m, l);
        }
        if (m == -INFINITY) continue;
        double sum = 0;
        double* out = &r.out[static_cast<size_t>(((b * p.q_len + i) * p.heads + h) * D)];
        for (int64_t j = 0; j < p.kv_len; ++j) {
          if (logits[static_cast<size_t>(j)] == -INFINITY) continue;
          const double e = std::exp(logits[static_cast<size_t>(j)] - m);
          sum += e;
          for (int64_t x = 0; x < D; ++x)
            out[x] +=
                e * load_element(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride + x);
        }
        for (int64_t x = 0; x < D; ++x) out[x] /= sum;
        r.lse[static_cast<size_t>((b * p.q_len + i) * p.heads + h)] = m + std::log(sum);
      }
    }
  return r;
}

}  // namespace plsh::testing
