// A case's options with its dimensions in one positional line:
//   shaped({2, 33, 40, 4, 2, 16}, {.causal = true, .mode = Mode::kExact})
// is the AttentionOptions with batch 2, q_len 33, kv_len 40, heads 4,
// kv_heads 2, head_dim 16 and the rest as designated. Written out field by
// field, clang-format puts every designated initialiser of a long list on a
// line of its own, so each case took a dozen lines and every two tables
// read alike; this keeps a case on one or two.
#pragma once

#include <cstdint>
#include <tuple>

#include "plsh/params.h"

namespace plsh::testing {

// {batch, q_len, kv_len, heads, kv_heads, head_dim}; trailing ones may be
// left out (kv_heads 0: heads).
struct Dims {
  int64_t batch = 1, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

// `rest` (whose dimensions are left unset) with d's dimensions.
inline AttentionOptions shaped(const Dims& d, AttentionOptions rest = {}) {
  std::tie(rest.batch, rest.q_len, rest.kv_len, rest.heads, rest.kv_heads, rest.head_dim) =
      std::tie(d.batch, d.q_len, d.kv_len, d.heads, d.kv_heads, d.head_dim);
  return rest;
}

}  // namespace plsh::testing
