// What the backend tests share to set up a run: one attention case
// (AttentionCase, options_of), random inputs with their output buffers and
// the params bound to them (Problem), and a backward's gradient tensors
// (GradTensors). The CPU, CUDA, host-emulation, backward and CLI tests build
// their inputs here, so a case means the same thing in each.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "plsh/backward.h"
#include "plsh/draws.h"
#include "plsh/params.h"
#include "reference.h"

namespace plsh::testing {

// The lsh algorithm a case leaves to the backend (case tables name it).
inline constexpr LshAlgorithm kAuto = LshAlgorithm::kAuto;

// The shape, mode and options of one case; ctest lists it by its name.
// Positional initialisation follows the field order; trailing fields keep
// their defaults.
struct AttentionCase {
  std::string name;
  int64_t batch = 1, q_len = 0, kv_len = 0, heads = 1, kv_heads = 1, head_dim = 0;
  DType dtype = DType::kF32;
  Mode mode = Mode::kExact;
  bool causal = false;
  std::optional<int64_t> q_pos0 = std::nullopt;  // default Nk - Nq
  int64_t k_pos0 = 0;
  int64_t samples = 0;  // lsh; 0: kDefaultSamples
  LshAlgorithm algorithm = LshAlgorithm::kAuto;
  std::vector<double> slopes = {};                 // empty: standard
  int64_t window_width = 0;                        // window; 0: from window_eps
  std::optional<DType> out_dtype = std::nullopt;   // default dtype
  std::optional<DType> grad_dtype = std::nullopt;  // backward; default dtype
  Sampling sampling = kDefaultSampling;            // lsh: how a head's hashes depend on each other
};

// A case's per-head slopes written as a call, head_slopes(0.5, 1.0 / 64),
// not as a nested braced list: clang-format lays out a table entry that
// holds a nested list with one element a line.
template <typename... Slope>
std::vector<double> head_slopes(Slope... s) {
  return {static_cast<double>(s)...};
}

// ctest lists a case by its name, not by a byte dump of the struct (a case
// type derived from this one needs a PrintTo of its own that calls this).
inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

// INSTANTIATE_TEST_SUITE_P's name generator: the case's name.
struct CaseName {
  template <typename Case>
  std::string operator()(const ::testing::TestParamInfo<Case>& info) const {
    return info.param.name;
  }
};

// The case's options with the draws seeded by `seed`, estimates off.
AttentionOptions options_of(const AttentionCase& c, uint64_t seed);

// Random q, k, v (random_qkv(o, seed)), an output buffer, lse ([B, Nq, H],
// NaN until written) unless with_lse is false, and the params bound to them
// in host memory (status: make_params', a test failure when not ok).
struct Problem {
  RandomTensors qkv;
  std::vector<uint8_t> out;
  std::vector<float> lse;
  AttentionParams params;
  Status status;
};
Problem make_problem(const AttentionOptions& o, uint64_t seed, bool with_lse = true);

// A backward's tensors: dout ([B, Nq, H, D] in the output dtype, N(0, 1)
// from random_tensor(seed)), and dq, dk, dv in grad_dtype filled with
// `poison`, so that every element must be written.
struct GradTensors {
  std::vector<uint8_t> dout, dq, dk, dv;
  DType dout_dtype = DType::kF32;
  DType grad_dtype = DType::kF32;
  GradientRefs refs();
  std::vector<double> dout_values() const { return to_doubles(dout, dout_dtype); }
  std::vector<double> values(const std::vector<uint8_t>& grad) const { return to_doubles(grad, grad_dtype); }
};
GradTensors grad_tensors(const AttentionOptions& o, DType grad_dtype, uint64_t seed, uint8_t poison = 0xFF);

}  // namespace plsh::testing
