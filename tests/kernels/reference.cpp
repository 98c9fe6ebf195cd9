#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "plsh/draws.h"
#include "plsh/numeric.h"

namespace plsh::testing {

namespace {

// Draws for every head, made once per params (keyed by address and seed).
const std::vector<std::vector<Draw>>& head_draws(const AttentionParams& p) {
  thread_local const AttentionParams* cached_for = nullptr;
  thread_local uint64_t cached_seed = 0;
  thread_local int64_t cached_samples = -1;
  thread_local Sampling cached_sampling = Sampling::kIid;
  thread_local std::vector<double> cached_slopes;
  thread_local std::vector<std::vector<Draw>> draws;
  if (cached_for != &p || cached_seed != p.seed || cached_samples != p.samples || cached_slopes != p.slopes ||
      cached_sampling != p.sampling) {
    draws.assign(static_cast<size_t>(p.heads), {});
    for (int64_t h = 0; h < p.heads; ++h)
      draws[static_cast<size_t>(h)] = draw_hashes(p.seed, h, p.sigma(h), p.samples, p.sampling);
    cached_for = &p;
    cached_seed = p.seed;
    cached_samples = p.samples;
    cached_sampling = p.sampling;
    cached_slopes = p.slopes;
  }
  return draws;
}

}  // namespace

double reference_weight(const AttentionParams& p, int64_t h, int64_t pos_q, int64_t pos_k) {
  if (p.causal && pos_k > pos_q) return 0;
  const double distance = std::fabs(static_cast<double>(pos_q - pos_k));
  const double slope = p.slopes[static_cast<size_t>(h)];
  switch (p.mode) {
    case Mode::kExact:
      return std::exp(-slope * distance);
    case Mode::kWindow: {
      const int64_t w = p.window[static_cast<size_t>(h)];
      if (w != kNoWindow && distance >= static_cast<double>(w)) return 0;
      return std::exp(-slope * distance);
    }
    case Mode::kLsh: {
      const std::vector<Draw>& draws = head_draws(p)[static_cast<size_t>(h)];
      int64_t same = 0;
      for (const Draw& d : draws) same += bin_of(pos_q, d) == bin_of(pos_k, d) ? 1 : 0;
      return static_cast<double>(same) / static_cast<double>(draws.size());
    }
    case Mode::kFixedBlocks: {
      // SPEC section 4 as written, not through any Draw: blocks of width
      // 2 sigma_h from position 0, bin(p) = floor(p / (2 sigma_h)).
      if (slope == 0) return 1;
      const double width = 2.0 * (1.0 / slope);
      return std::floor(static_cast<double>(pos_q) / width) == std::floor(static_cast<double>(pos_k) / width) ? 1 : 0;
    }
  }
  return 0;
}

ReferenceOutput reference_attention(const AttentionParams& p) {
  ReferenceOutput r;
  const int64_t D = p.head_dim;
  r.out.assign(static_cast<size_t>(p.batch * p.q_len * p.heads * D), 0.0);
  r.lse.assign(static_cast<size_t>(p.batch * p.q_len * p.heads), 0.0);
  std::vector<double> logits(static_cast<size_t>(p.kv_len));
  std::vector<double> qrow(static_cast<size_t>(D));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t hk = h / p.head_group;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t q_off = b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
        for (int64_t d = 0; d < D; ++d) qrow[static_cast<size_t>(d)] = load_element(p.q, p.dtype, q_off + d);
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < p.kv_len; ++j) {
          const double w = reference_weight(p, h, p.q_pos0 + i, p.k_pos0 + j);
          if (w <= 0) {
            logits[static_cast<size_t>(j)] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const int64_t k_off = b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qrow[static_cast<size_t>(d)] * load_element(p.k, p.dtype, k_off + d);
          logits[static_cast<size_t>(j)] = p.scale * dot + std::log(w);
          max_logit = std::max(max_logit, logits[static_cast<size_t>(j)]);
        }
        double sum = 0;
        double* out = &r.out[static_cast<size_t>(((b * p.q_len + i) * p.heads + h) * D)];
        for (int64_t j = 0; j < p.kv_len; ++j) {
          const double l = logits[static_cast<size_t>(j)];
          if (l == -std::numeric_limits<double>::infinity()) continue;
          const double e = std::exp(l - max_logit);
          sum += e;
          const int64_t v_off = b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride;
          for (int64_t d = 0; d < D; ++d) out[d] += e * load_element(p.v, p.dtype, v_off + d);
        }
        for (int64_t d = 0; d < D; ++d) out[d] /= sum;
        r.lse[static_cast<size_t>((b * p.q_len + i) * p.heads + h)] = max_logit + std::log(sum);
      }
    }
  }
  return r;
}

DenseInputs dense_inputs(const AttentionParams& p) {
  DenseInputs x;
  const int64_t D = p.head_dim;
  x.q.resize(static_cast<size_t>(p.batch * p.q_len * p.heads * D));
  x.k.resize(static_cast<size_t>(p.batch * p.kv_len * p.kv_heads * D));
  x.v.resize(x.k.size());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.q_len; ++i)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t d = 0; d < D; ++d)
          x.q[static_cast<size_t>(((b * p.q_len + i) * p.heads + h) * D + d)] =
              load_element(p.q, p.dtype, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride + d);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t j = 0; j < p.kv_len; ++j)
      for (int64_t h = 0; h < p.kv_heads; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const size_t at = static_cast<size_t>(((b * p.kv_len + j) * p.kv_heads + h) * D + d);
          x.k[at] = load_element(p.k, p.dtype, b * p.k_batch_stride + j * p.k_row_stride + h * p.k_head_stride + d);
          x.v[at] = load_element(p.v, p.dtype, b * p.v_batch_stride + j * p.v_row_stride + h * p.v_head_stride + d);
        }
  return x;
}

HeadWeights reference_weights(const AttentionParams& p, const std::vector<std::vector<Draw>>* draws) {
  HeadWeights w(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) {
    std::vector<double>& wh = w[static_cast<size_t>(h)];
    wh.resize(static_cast<size_t>(p.q_len * p.kv_len));
    for (int64_t i = 0; i < p.q_len; ++i)
      for (int64_t j = 0; j < p.kv_len; ++j) {
        const int64_t pos_q = p.q_pos0 + i, pos_k = p.k_pos0 + j;
        double log_weight = -std::numeric_limits<double>::infinity();
        if (p.causal && pos_k > pos_q) {
          // not allowed
        } else if (!uses_draws(p.mode)) {
          const double distance = std::fabs(static_cast<double>(pos_q - pos_k));
          const int64_t w = p.mode == Mode::kWindow ? p.window[static_cast<size_t>(h)] : kNoWindow;
          if (w == kNoWindow || distance < static_cast<double>(w))
            log_weight = -p.slopes[static_cast<size_t>(h)] * distance;
        } else if (draws != nullptr) {
          const std::vector<Draw>& dh = (*draws)[static_cast<size_t>(h)];
          int64_t same = 0;
          for (const Draw& d : dh) same += bin_of(pos_q, d) == bin_of(pos_k, d) ? 1 : 0;
          if (same > 0) log_weight = std::log(static_cast<double>(same) / static_cast<double>(dh.size()));
        } else {
          const double weight = reference_weight(p, h, pos_q, pos_k);
          if (weight > 0) log_weight = std::log(weight);
        }
        wh[static_cast<size_t>(i * p.kv_len + j)] = log_weight;
      }
  }
  return w;
}

namespace {

// Row i of head h, batch b: P_ij = exp(scale q_i.k_j + log w_ij - lse_i) into
// prob [Nk], and lse_i.
double reference_probs(const AttentionParams& p, const DenseInputs& x, const HeadWeights& w, int64_t b, int64_t h,
                       int64_t i, double* prob) {
  const int64_t D = p.head_dim, hk = h / p.head_group;
  const double* q = &x.q[static_cast<size_t>(((b * p.q_len + i) * p.heads + h) * D)];
  const double* wr = &w[static_cast<size_t>(h)][static_cast<size_t>(i * p.kv_len)];
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < p.kv_len; ++j) {
    if (wr[j] == -std::numeric_limits<double>::infinity()) {
      prob[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    const double* k = &x.k[static_cast<size_t>(((b * p.kv_len + j) * p.kv_heads + hk) * D)];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
    prob[j] = p.scale * dot + wr[j];
    max_logit = std::max(max_logit, prob[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < p.kv_len; ++j)
    if (prob[j] != -std::numeric_limits<double>::infinity()) sum += std::exp(prob[j] - max_logit);
  const double lse = max_logit + std::log(sum);
  for (int64_t j = 0; j < p.kv_len; ++j)
    prob[j] = prob[j] == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(prob[j] - lse);
  return lse;
}

}  // namespace

ReferenceOutput reference_forward(const AttentionParams& p, const DenseInputs& x, const HeadWeights& w) {
  ReferenceOutput r;
  const int64_t D = p.head_dim;
  r.out.assign(static_cast<size_t>(p.batch * p.q_len * p.heads * D), 0.0);
  r.lse.assign(static_cast<size_t>(p.batch * p.q_len * p.heads), 0.0);
  std::vector<double> prob(static_cast<size_t>(p.kv_len));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t hk = h / p.head_group;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const size_t row = static_cast<size_t>((b * p.q_len + i) * p.heads + h);
        r.lse[row] = reference_probs(p, x, w, b, h, i, prob.data());
        double* out = &r.out[row * static_cast<size_t>(D)];
        for (int64_t j = 0; j < p.kv_len; ++j) {
          if (prob[static_cast<size_t>(j)] == 0) continue;
          const double* v = &x.v[static_cast<size_t>(((b * p.kv_len + j) * p.kv_heads + hk) * D)];
          for (int64_t d = 0; d < D; ++d) out[d] += prob[static_cast<size_t>(j)] * v[d];
        }
      }
    }
  return r;
}

ReferenceGradients reference_backward(const AttentionParams& p, const DenseInputs& x, const HeadWeights& w,
                                      const std::vector<double>& dout) {
  ReferenceGradients g;
  const int64_t D = p.head_dim;
  g.dq.assign(x.q.size(), 0.0);
  g.dk.assign(x.k.size(), 0.0);
  g.dv.assign(x.v.size(), 0.0);
  std::vector<double> prob(static_cast<size_t>(p.kv_len)), out(static_cast<size_t>(D));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t hk = h / p.head_group;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const size_t row = static_cast<size_t>((b * p.q_len + i) * p.heads + h);
        reference_probs(p, x, w, b, h, i, prob.data());
        const double* q = &x.q[row * static_cast<size_t>(D)];
        const double* dO = &dout[row * static_cast<size_t>(D)];
        // O_i and D_i = dO_i . O_i.
        std::fill(out.begin(), out.end(), 0.0);
        for (int64_t j = 0; j < p.kv_len; ++j) {
          const double* v = &x.v[static_cast<size_t>(((b * p.kv_len + j) * p.kv_heads + hk) * D)];
          for (int64_t d = 0; d < D; ++d) out[static_cast<size_t>(d)] += prob[static_cast<size_t>(j)] * v[d];
        }
        double d_i = 0;
        for (int64_t d = 0; d < D; ++d) d_i += dO[d] * out[static_cast<size_t>(d)];
        double* dq = &g.dq[row * static_cast<size_t>(D)];
        for (int64_t j = 0; j < p.kv_len; ++j) {
          const double pij = prob[static_cast<size_t>(j)];
          if (pij == 0) continue;
          const size_t kv_row = static_cast<size_t>(((b * p.kv_len + j) * p.kv_heads + hk) * D);
          const double* k = &x.k[kv_row];
          const double* v = &x.v[kv_row];
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += dO[d] * v[d];
          const double ds = pij * (dp - d_i);
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += p.scale * ds * k[d];
            g.dk[kv_row + static_cast<size_t>(d)] += p.scale * ds * q[d];
            g.dv[kv_row + static_cast<size_t>(d)] += pij * dO[d];
          }
        }
      }
    }
  return g;
}

Status run_forward(Backend& b, const Plan& plan, const ExecContext& ctx, ForwardStats* stats) {
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.forward_workspace.host_bytes));
  return b.forward(plan, workspace.ref(), ctx, stats);
}

Status plan_and_forward(Backend& b, const AttentionParams& p, const ExecContext& ctx, ForwardStats* stats,
                        int threads) {
  PlanLimits limits;
  limits.threads = threads;
  ASSIGN_OR_RETURN(const Plan plan, b.plan(p, limits));
  return run_forward(b, plan, ctx, stats);
}

namespace {

// n draws of `normal` rounded to dtype t. One generator and distribution
// serve all of random_qkv's tensors (the distribution keeps a spare draw).
std::vector<uint8_t> normal_bytes(std::mt19937_64& rng, std::normal_distribution<double>& normal, int64_t n, DType t) {
  std::vector<uint8_t> buf(static_cast<size_t>(n) * dtype_bytes(t));
  for (int64_t i = 0; i < n; ++i) store_element(buf.data(), t, i, static_cast<float>(normal(rng)));
  return buf;
}

}  // namespace

RandomTensors random_qkv(const AttentionOptions& o, uint64_t seed, double stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  RandomTensors t;
  t.q = normal_bytes(rng, normal, o.batch * o.q_len * o.heads * o.head_dim, o.dtype);
  t.k = normal_bytes(rng, normal, o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype);
  t.v = normal_bytes(rng, normal, o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype);
  return t;
}

std::vector<uint8_t> random_tensor(int64_t n, DType t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  return normal_bytes(rng, normal, n, t);
}

std::vector<uint8_t> output_buffer(const AttentionOptions& o) {
  const DType t = o.out_dtype ? *o.out_dtype : o.dtype;
  return std::vector<uint8_t>(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(t));
}

ErrorStats compare(const void* actual, DType t, const std::vector<double>& expected) {
  double max_abs_err = 0, max_ref = 0, err2 = 0, ref2 = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = load_element(actual, t, static_cast<int64_t>(i));
    const double e = expected[i];
    // A non-finite value on either side is an infinite error, never skipped.
    const double diff =
        std::isfinite(a) && std::isfinite(e) ? std::fabs(a - e) : std::numeric_limits<double>::infinity();
    max_abs_err = std::max(max_abs_err, diff);
    if (std::isfinite(e)) {
      max_ref = std::max(max_ref, std::fabs(e));
      ref2 += e * e;
    }
    err2 += diff * diff;
  }
  ErrorStats s;
  s.max_rel = max_ref > 0 ? max_abs_err / max_ref : max_abs_err;
  s.rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  return s;
}

std::vector<double> to_doubles(const std::vector<uint8_t>& bytes, DType t) {
  std::vector<double> d(bytes.size() / dtype_bytes(t));
  for (size_t i = 0; i < d.size(); ++i) d[i] = load_element(bytes.data(), t, static_cast<int64_t>(i));
  return d;
}

}  // namespace plsh::testing
