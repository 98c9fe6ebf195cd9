// Float64 reference for every mode, straight from SPEC sections 2-4: dense
// O(Nq * Nk) per (batch, head), no tiling, no shortcuts. Tests and
// benchmarks compare every backend against it.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "plsh/backend.h"
#include "plsh/params.h"

namespace plsh::testing {

// The weight w_ij that multiplies exp(scale q_i.k_j) for head h between
// absolute positions pos_q and pos_k, or 0 where the key is not allowed:
// exact L*, window L* 1[|d| < W_h], lsh M~ (mean over the draws).
double reference_weight(const AttentionParams& p, int64_t h, int64_t pos_q, int64_t pos_k);

struct ReferenceOutput {
  std::vector<double> out;  // [B, Nq, H, D]
  std::vector<double> lse;  // [B, Nq, H]
};

// Reads p.q, p.k, p.v (host memory, p.dtype); ignores p.out and p.lse.
ReferenceOutput reference_attention(const AttentionParams& p);

// Plans p on backend b (for `threads` threads) and runs its forward: what
// the server does for a request, in one call.
Status plan_and_forward(Backend& b, const AttentionParams& p, const ExecContext& ctx = {}, ForwardStats* stats = nullptr,
                        int threads = 0);

// Random tensors in a given dtype, as raw bytes (N(0, stddev) values rounded
// to the dtype).
struct RandomTensors {
  std::vector<uint8_t> q, k, v;
};
RandomTensors random_qkv(const AttentionOptions& o, uint64_t seed, double stddev = 1.0);

// Output buffer of the right size for o.out_dtype (or dtype).
std::vector<uint8_t> output_buffer(const AttentionOptions& o);

// max_i |a_i - b_i| / max_i |b_i| between a backend output (dtype t) and the
// reference, and the relative L2 error ||a - b|| / ||b||.
struct ErrorStats {
  double max_rel = 0;
  double rel_l2 = 0;
};
ErrorStats compare(const void* actual, DType t, const std::vector<double>& expected);

}  // namespace plsh::testing
