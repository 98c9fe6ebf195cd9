// The shapes the cuBLAS pipeline's host emulations run both forward
// (test_cuda_host_pipeline.cpp) and backward (test_cuda_host_backward.cpp),
// defined once so that the two directions are checked on the same ones;
// each test adds its own budget and its own cases.
#pragma once

#include <optional>
#include <vector>

#include "plsh/params.h"
#include "problem.h"

namespace plsh::testing {

struct PipelineShapes {
  // 200 rows, GQA 4 on 2, d = 40, sigma from 1.1 to 300 and a slope of 0:
  // a tight budget chunks it over lanes and tiles. lsh, and fixed_blocks
  // (SPEC section 4) on the same draws path, one pass per head.
  AttentionCase lsh_chunked, fixed_blocks_chunked;
  AttentionCase lsh_noncausal_bf16;  // batch 2, MQA, d = 64
  AttentionCase lsh_tail_offsets;    // 50 queries at the end of 640 keys 7000 positions in
  AttentionCase exact_two_key_chunks;
  AttentionCase window;
};

inline PipelineShapes pipeline_shapes() {
  const std::vector<double> spread = {0.9, 0.05, 1.0 / 300, 0.0}, two = {0.7, 0.02}, tail = {0.5, 1.0 / 200};
  const DType f32 = DType::kF32;
  return {
      {"lsh_causal_gqa_f32_chunked", 1, 200, 200, 4, 2, 40, f32, Mode::kLsh, true, std::nullopt, 0, 16, kAuto, spread},
      {"fixed_blocks_causal_gqa_f32_chunked", 1, 200, 200, 4, 2, 40, f32, Mode::kFixedBlocks, true, std::nullopt, 0, 0,
       kAuto, spread},
      {"lsh_noncausal_bf16", 2, 97, 97, 2, 1, 64, DType::kBF16, Mode::kLsh, false, std::nullopt, 0, 8, kAuto, two},
      {"lsh_tail_offsets_f32", 1, 50, 640, 2, 2, 40, f32, Mode::kLsh, true, int64_t{7000 + 590}, 7000, 5, kAuto, tail},
      {"exact_causal_two_key_chunks_f32", 1, 70, 1100, 2, 1, 40, f32, Mode::kExact, true},
      {"window_f32", 1, 150, 150, 3, 1, 40, f32, Mode::kWindow, true},
  };
}

}  // namespace plsh::testing
