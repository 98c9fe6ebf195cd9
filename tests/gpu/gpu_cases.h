// The cases the GPU suites (forward, test_cuda_backend.cpp; backward,
// test_cuda_backward.cpp) both run in every dtype.
#pragma once

#include <string>
#include <vector>

#include "plsh/params.h"
#include "problem.h"

namespace plsh::testing {

// Per dtype (f32, bf16, f16): exact, causal, GQA, n = 97, d = 40, batch 2
// (named exact_prefix + dtype); lsh with sigma from 1.1 to 20 and a head
// without bias (lsh_causal_gqa_<dtype>); the fixed-blocks baseline on the
// same heads (fixed_blocks_causal_gqa_<dtype>); window, d = 59 (window_<dtype>).
inline std::vector<AttentionCase> every_dtype_cases(const std::string& exact_prefix) {
  const std::vector<double> mixed = {0.9, 0.31, 0.05, 0.0};
  std::vector<AttentionCase> v;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const std::string d = dtype_name(t);
    v.push_back({exact_prefix + d, 2, 97, 97, 4, 2, 40, t, Mode::kExact, true});
    v.push_back({"lsh_causal_gqa_" + d, 1, 300, 300, 4, 2, 64, t, Mode::kLsh, true, std::nullopt, 0, 16,
                 LshAlgorithm::kAuto, mixed});
    v.push_back({"fixed_blocks_causal_gqa_" + d, 1, 300, 300, 4, 2, 64, t, Mode::kFixedBlocks, true, std::nullopt, 0, 0,
                 LshAlgorithm::kAuto, mixed});
    v.push_back({"window_" + d, 1, 129, 129, 3, 3, 59, t, Mode::kWindow, true});
  }
  return v;
}

}  // namespace plsh::testing
