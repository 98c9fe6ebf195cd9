// Shared by the server unit tests that plan requests (test_request.cpp
// directly, test_call.cpp through CallBase): a small float32 header and
// limits roomy enough that a test tightens only the one it is about.
#pragma once

#include <cstdint>

#include "plsh/v1/plsh.pb.h"
#include "server/request.h"

namespace plsh::server::testing {

// B = 1, Nq = Nk = len, float32 q, k, v.
inline v1::AttendHeader f32_header(int64_t len, int64_t heads, int64_t head_dim, v1::Mode mode) {
  v1::AttendHeader h;
  h.set_q_len(len);
  h.set_kv_len(len);
  h.set_heads(heads);
  h.set_head_dim(head_dim);
  h.set_dtype(v1::DTYPE_F32);
  h.set_mode(mode);
  return h;
}

inline RequestLimits roomy_limits() {
  RequestLimits l;
  l.max_tokens = int64_t{1} << 20;
  l.max_request_bytes = int64_t{1} << 30;
  l.max_samples = 4096;
  l.max_message_bytes = int64_t{4} << 20;
  l.default_backend = "cpu";
  l.threads = 1;
  return l;
}

}  // namespace plsh::server::testing
