// Float64 reference for every mode, straight from SPEC sections 2-4: dense
// O(Nq * Nk) per (batch, head), no tiling, no shortcuts. Tests and
// benchmarks compare every backend against it.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh::testing {

// The weight w_ij that multiplies exp(scale q_i.k_j) for head h between
// absolute positions pos_q and pos_k, or 0 where the key is not allowed:
// exact L*, window L* 1[|d| < W_h], lsh M~ (mean over the draws), fixed_blocks
// 1[floor(pos_q / 2 sigma_h) == floor(pos_k / 2 sigma_h)] (SPEC section 4, from
// the formula, not from any Draw).
double reference_weight(const AttentionParams& p, int64_t h, int64_t pos_q, int64_t pos_k);

struct ReferenceOutput {
  std::vector<double> out;  // [B, Nq, H, D]
  std::vector<double> lse;  // [B, Nq, H]
};

// Reads p.q, p.k, p.v (host memory, p.dtype); ignores p.out and p.lse.
ReferenceOutput reference_attention(const AttentionParams& p);

// q, k, v as float64, dense [B, N, H, D] / [B, N, Hkv, D]: the values of
// p's tensors in their dtype, or any other values (finite differences).
struct DenseInputs {
  std::vector<double> q, k, v;
};
DenseInputs dense_inputs(const AttentionParams& p);

// The log weights log w_ij of every head, [H][Nq * Nk], -inf where a key is
// not allowed: reference_weight's, with the ALiBi bias -slope |d| kept in
// the log domain (exp(-slope |d|) is 0 in double for a query ~745 / slope
// from every key); for lsh from `draws` ([H][samples]) when given instead
// of p's seed.
using HeadWeights = std::vector<std::vector<double>>;
HeadWeights reference_weights(const AttentionParams& p, const std::vector<std::vector<Draw>>* draws = nullptr);

// reference_attention on float64 inputs, with the weights given.
ReferenceOutput reference_forward(const AttentionParams& p, const DenseInputs& x, const HeadWeights& w);

// SPEC section 8 straight from the definition, dense, in float64: with
// P_ij = exp(scale q_i.k_j + log w_ij - lse_i) (lse and O recomputed in float64,
// not read from any backend), D_i = dO_i . O_i, dP = dO V^T,
// dS = P * (dP - D): dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, dK
// and dV summed over each kv head's query heads. dout is dense
// [B, Nq, H, D].
struct ReferenceGradients {
  std::vector<double> dq;  // [B, Nq, H, D]
  std::vector<double> dk;  // [B, Nk, Hkv, D]
  std::vector<double> dv;  // [B, Nk, Hkv, D]
};
ReferenceGradients reference_backward(const AttentionParams& p, const DenseInputs& x, const HeadWeights& w,
                                      const std::vector<double>& dout);

// b.forward on a plan in a HostWorkspace of plan.forward_workspace's size.
Status run_forward(Backend& b, const Plan& plan, const ExecContext& ctx = {}, ForwardStats* stats = nullptr);

// Plans p on backend b (for `threads` threads) and runs its forward: what
// the server does for a request, in one call.
Status plan_and_forward(Backend& b, const AttentionParams& p, const ExecContext& ctx = {},
                        ForwardStats* stats = nullptr, int threads = 0);

// Random tensors in a given dtype, as raw bytes (N(0, stddev) values rounded
// to the dtype).
struct RandomTensors {
  std::vector<uint8_t> q, k, v;
};
RandomTensors random_qkv(const AttentionOptions& o, uint64_t seed, double stddev = 1.0);

// n values N(0, 1) rounded to dtype t, as raw bytes, from a generator
// seeded with `seed`: random_qkv's rule for one more tensor (dout).
std::vector<uint8_t> random_tensor(int64_t n, DType t, uint64_t seed);

// Output buffer of the right size for o.out_dtype (or dtype).
std::vector<uint8_t> output_buffer(const AttentionOptions& o);

// max_i |a_i - b_i| / max_i |b_i| between a backend output (dtype t) and the
// reference, and the relative L2 error ||a - b|| / ||b||.
struct ErrorStats {
  double max_rel = 0;
  double rel_l2 = 0;
};
ErrorStats compare(const void* actual, DType t, const std::vector<double>& expected);

// The elements of raw bytes of dtype t as float64 (a backend's output, to
// compare with another's).
std::vector<double> to_doubles(const std::vector<uint8_t>& bytes, DType t);

}  // namespace plsh::testing
