// The cases the fused kernels are checked on, by the host emulation
// (test_cuda_host_fused*.cpp) and on the GPU (test_cuda_fused.cpp) alike:
// all three modes; head dims 64 and 128; f32, bf16, f16; odd lengths; GQA
// and MQA; causal and not; offsets, and queries 1e6 positions from every
// key (the ALiBi logits measured from the nearest key); lsh with 1 to 64
// hashes, a slope of 0 among them, and the other samplers. Plus the
// tolerances by precision and the error measure they apply to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "plsh/params.h"
#include "problem.h"

namespace plsh::testing {

inline std::vector<AttentionCase> fused_cases() {
  const std::vector<double> mixed = {0.9, 0.31, 0.05, 0.0};
  return {
      {"lsh_causal_gqa_bf16_d64", 1, 300, 300, 4, 2, 64, DType::kBF16, Mode::kLsh, true, std::nullopt, 0, 16, kAuto,
       mixed},
      {"lsh_noncausal_f16_d128_batch2", 2, 97, 97, 2, 1, 128, DType::kF16, Mode::kLsh, false, std::nullopt, 0, 8, kAuto,
       head_slopes(0.7, 0.02)},
      {"lsh_causal_f32_d64_64_hashes", 1, 201, 201, 2, 2, 64, DType::kF32, Mode::kLsh, true, std::nullopt, 0, 64, kAuto,
       head_slopes(0.5, 1.0 / 200)},
      {"lsh_offsets_bf16_d128", 1, 50, 640, 2, 2, 128, DType::kBF16, Mode::kLsh, true, int64_t{7000 + 590}, 7000, 5,
       kAuto, head_slopes(0.5, 1.0 / 200)},
      {"lsh_ash_causal_bf16_d64", 1, 260, 260, 2, 1, 64, DType::kBF16, Mode::kLsh, true, std::nullopt, 0, 64, kAuto,
       head_slopes(0.9, 1.0 / 300), 0, std::nullopt, std::nullopt, Sampling::kAsh},
      {"lsh_one_hash_f32_d128", 1, 70, 70, 1, 1, 128, DType::kF32, Mode::kLsh, false, std::nullopt, 0, 1, kAuto, {0.1}},
      {"window_causal_gqa_bf16_d128", 1, 257, 257, 4, 2, 128, DType::kBF16, Mode::kWindow, true},
      {"window_noncausal_f32_d64", 1, 130, 130, 3, 3, 64, DType::kF32, Mode::kWindow, false},
      {"exact_causal_mqa_bf16_d128", 1, 333, 333, 2, 1, 128, DType::kBF16, Mode::kExact, true},
      {"exact_noncausal_f16_d64_long_keys", 1, 70, 1100, 2, 1, 64, DType::kF16, Mode::kExact, false},
      {"exact_far_queries_noncausal_f32_d64", 1, 40, 300, 2, 1, 64, DType::kF32, Mode::kExact, false, int64_t{1000000},
       0, 0, kAuto, head_slopes(0.5, 1.0 / 64)},
      {"exact_far_queries_causal_bf16_d128", 1, 40, 300, 2, 1, 128, DType::kBF16, Mode::kExact, true, int64_t{1000000},
       0, 0, kAuto, head_slopes(0.5, 1.0 / 64)},
      {"exact_queries_before_keys_f32_d128", 1, 40, 300, 2, 2, 128, DType::kF32, Mode::kExact, false, int64_t{-200000},
       0, 0, kAuto, head_slopes(0.5, 0.125)},
      {"exact_single_row_f32_d64", 1, 1, 1, 1, 1, 64, DType::kF32, Mode::kExact, true},
      {"exact_bf16_in_f32_out_d64", 1, 65, 129, 2, 2, 64, DType::kBF16, Mode::kExact, true, std::nullopt, 0, 0, kAuto,
       head_slopes(), 0, DType::kF32},
  };
}

// A fused case's options (draws of seed 99). With on_cpu, the same for the
// CPU backend that the fused results are compared with: lsh banded, the
// fused kernels' algorithm.
inline AttentionOptions fused_options(const AttentionCase& c, bool on_cpu = false) {
  AttentionOptions o = options_of(c, 99);
  if (on_cpu) o.lsh_algorithm = c.mode == Mode::kLsh ? LshAlgorithm::kBanded : LshAlgorithm::kAuto;
  return o;
}

// Error tolerances by precision (the GPU tests' for the cuBLAS path):
// float32 inputs and outputs 1e-4 of the largest output (lse 1e-5); 16-bit
// ones 1e-2, two roundings of 2^-9 and the P fed to P V (lse 4e-3).
struct FusedTolerance {
  double out, lse;
};
inline FusedTolerance fused_tolerance(DType dtype, DType out_dtype) {
  const bool f32 = dtype == DType::kF32 && out_dtype == DType::kF32;
  return {f32 ? 1e-4 : 1e-2, f32 ? 1e-5 : 4e-3};
}

// The backward's tolerance on dq, dk, dv. 16-bit inputs: P and dS are
// rounded for the products, O through D_i and the gradients themselves: four
// units (2^-11 f16, 2^-8 bf16), three for float32 gradients. float32:
// f32_floor, 1e-4 on the GPU (fp32 GEMMs, no TF32, long sums in another
// order) and 1e-5 in the host emulation (SPEC, STYLE).
inline double backward_tolerance(DType dtype, DType grad_dtype, double f32_floor) {
  const double unit = dtype == DType::kF16 ? 0x1.0p-11 : dtype == DType::kBF16 ? 0x1.0p-8 : 0.0;
  return std::max(f32_floor, (grad_dtype == DType::kF32 ? 3 : 4) * unit);
}

// max |a - b| / max |b| over the outputs, max |a - b| / max(1, |b|) over
// the lse (-inf = -inf is no error), and how many outputs are not finite
// (never written: the buffers start as NaN).
struct FusedErrors {
  double max_rel = 0, lse = 0;
  int64_t unwritten = 0;
};
inline FusedErrors fused_errors(const std::vector<double>& out, const std::vector<float>& lse,
                                const std::vector<double>& ref_out, const std::vector<double>& ref_lse) {
  FusedErrors e;
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++e.unwritten;
      continue;
    }
    max_err = std::max(max_err, std::fabs(out[i] - ref_out[i]));
    max_ref = std::max(max_ref, std::fabs(ref_out[i]));
  }
  e.max_rel = max_ref > 0 ? max_err / max_ref : max_err;
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    const double a = lse[i], b = ref_lse[i];
    if (a == b) continue;  // both -inf included
    if (!std::isfinite(a)) {
      ++e.unwritten;
      continue;
    }
    e.lse = std::max(e.lse, std::fabs(a - b) / std::max(1.0, std::fabs(b)));
  }
  return e;
}

}  // namespace plsh::testing
