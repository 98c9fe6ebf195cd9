// Error estimates of SPEC section 6, shared by every backend: they depend on
// the draws and positions (mask errors) and on host copies of q, k, v and the
// output (probe), never on how a backend computed the output.
#pragma once

#include <cstdint>
#include <vector>

#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh {

// The positions a head's estimates range over: query rows q_pos0 + [0, q_len),
// key rows k_pos0 + [0, kv_len), and whether keys after the query are masked.
struct PositionRange {
  int64_t q_pos0 = 0, q_len = 0;
  int64_t k_pos0 = 0, kv_len = 0;
  bool causal = false;
};

PositionRange position_range(const AttentionParams& p);

// Largest block (positions) of any of the draws within the union of the
// query and key positions.
int64_t max_block_size(const std::vector<Draw>& draws, const PositionRange& r);

// Fills result->heads (slope, sigma, window, max_block, draws on request) and,
// when p.estimates, the error estimates per head and their summary. Needs
// host tensors for the probe; p.out must already hold the output.
Status compute_estimates(const AttentionParams& p, const ExecContext& ctx, AttentionResult* result);

}  // namespace plsh
