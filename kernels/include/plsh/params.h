// The one params struct (FlashAttention's Flash_fwd_params habit): what a
// caller asks for (AttentionOptions, with SPEC defaults for what it leaves
// out), resolved and validated once by make_params() into AttentionParams,
// which every backend takes by const reference.
//
// Layout (SPEC section 1): q [B, Nq, H, D], k and v [B, Nk, Hkv, D], out
// [B, Nq, H, D], lse [B, Nq, H] float32, all row-major; strides are in
// elements so that a backend never assumes more than it is told.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plsh/draws.h"
#include "plsh/status.h"
#include "plsh/text.h"

namespace plsh {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
// kFixedBlocks is the paper's --fixed_block_size baseline (SPEC section 4):
// one deterministic hash per head, pitch 2 sigma_h and shift 0, its mask used
// as is. It is biased (M != L*) and is not a sampler: a baseline for
// experiments, never an approximation of ALiBi.
enum class Mode : int { kExact = 0, kLsh = 1, kWindow = 2, kFixedBlocks = 3 };
// SPEC section 3: the two algorithms that compute the same lsh output.
enum class LshAlgorithm : int { kAuto = 0, kPerSample = 1, kBanded = 2 };
enum class MemorySpace : int { kHost = 0, kDevice = 1 };

// The names that the name functions print and the parsers read.
inline constexpr EnumName<DType> kDTypeNames[] = {{DType::kF32, "f32"}, {DType::kF16, "f16"}, {DType::kBF16, "bf16"}};
// Other spellings parse_dtype accepts (numpy's and torch's); never printed.
inline constexpr EnumName<DType> kDTypeAliases[] = {{DType::kF32, "float32"},
                                                    {DType::kF32, "fp32"},
                                                    {DType::kF16, "float16"},
                                                    {DType::kF16, "fp16"},
                                                    {DType::kBF16, "bfloat16"}};
inline constexpr EnumName<Mode> kModeNames[] = {
    {Mode::kExact, "exact"}, {Mode::kLsh, "lsh"}, {Mode::kWindow, "window"}, {Mode::kFixedBlocks, "fixed_blocks"}};
inline constexpr EnumName<LshAlgorithm> kLshAlgorithmNames[] = {
    {LshAlgorithm::kAuto, "auto"}, {LshAlgorithm::kPerSample, "per_sample"}, {LshAlgorithm::kBanded, "banded"}};
inline constexpr EnumName<LshAlgorithm> kLshAlgorithmAliases[] = {{LshAlgorithm::kPerSample, "per-sample"}};

const char* dtype_name(DType t);                 // "f32", "f16", "bf16"
const char* mode_name(Mode m);                   // "exact", "lsh", "window", "fixed_blocks"
const char* lsh_algorithm_name(LshAlgorithm a);  // "auto", "per_sample", "banded"
size_t dtype_bytes(DType t);
StatusOr<DType> parse_dtype(const std::string& s);  // f32|float32|fp32|f16|float16|fp16|bf16|bfloat16
StatusOr<Mode> parse_mode(const std::string& s);
StatusOr<LshAlgorithm> parse_lsh_algorithm(const std::string& s);
StatusOr<Sampling> parse_sampling(const std::string& s);  // iid | stratified | ash (plsh/draws.h)

// Hard limits of the library itself (the server adds configurable ones,
// e.g. --max-samples, 4096 by default).
inline constexpr int64_t kMaxSamples = int64_t{1} << 24;  // draws index 2^24 * head + sample
inline constexpr int64_t kMaxHeads = int64_t{1} << 20;
inline constexpr int64_t kMaxHeadDim = 1024;
inline constexpr int64_t kMaxProbeRows = 4096;
// Fewest probe rows per head an error-targeted request may ask for: the
// upper bound's coverage was calibrated at 64 (bench/RESULTS.md).
inline constexpr int64_t kMinTargetProbeRows = 32;

// Defaults of what a caller may leave out: the one source that the server's
// GetInfo, the CLI, plsh bench and (through GetInfo) the Python client read.
inline constexpr int64_t kDefaultSamples = 16;
inline constexpr double kDefaultWindowEps = 1e-4;
inline constexpr int64_t kDefaultProbeRows = 64;
inline constexpr int64_t kDefaultMaskRowBudget = 65536;
inline constexpr Sampling kDefaultSampling = Sampling::kIid;
// A request with target_rel_err and no mode of its own (the wire's
// MODE_UNSPECIFIED, a CLI or Python call without --mode / mode=) searches
// windows: at equal FLOPs they beat lsh on every input measured
// (bench/RESULTS.md, "Accuracy users can choose").
inline constexpr Mode kDefaultTargetMode = Mode::kWindow;

// The modes whose positional weights are the mean M~ of the block masks of a
// plan's draws (SPEC sections 3 and 4): lsh (s hashes drawn from the seed)
// and fixed_blocks (one fixed hash per head). Every backend, the estimates
// and the backward run both on one path; only the draws differ (head_draws).
inline bool uses_draws(Mode m) { return m == Mode::kLsh || m == Mode::kFixedBlocks; }

// kv_heads = 0 means one kv head per query head (no grouping).
inline int64_t resolved_kv_heads(int64_t heads, int64_t kv_heads) { return kv_heads == 0 ? heads : kv_heads; }

// What a caller asks for. Field names are the names used in error messages,
// on the command line and on the wire.
struct AttentionOptions {
  int64_t batch = 1;               // B
  int64_t q_len = 0;               // Nq
  int64_t kv_len = 0;              // Nk
  int64_t heads = 0;               // H, query heads
  int64_t kv_heads = 0;            // Hkv; 0 means H (no grouping)
  int64_t head_dim = 0;            // D
  DType dtype = DType::kF32;       // of q, k, v
  std::optional<DType> out_dtype;  // default: dtype
  std::optional<double> scale;     // default 1/sqrt(D)
  bool causal = false;             // key allowed iff pos_k <= pos_q
  std::vector<double> slopes;      // per query head, >= 0; empty: standard ALiBi slopes
  std::optional<int64_t> q_pos0;   // default Nk - Nq
  int64_t k_pos0 = 0;              // absolute position of key row 0
  Mode mode = Mode::kLsh;
  // lsh: hashes per head (s). fixed_blocks reads none of samples, seed and
  // sampling: its one hash per head is fixed.
  int64_t samples = kDefaultSamples;
  uint64_t seed = 0;  // lsh: draws seed (SPEC section 5)
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;
  Sampling sampling = kDefaultSampling;             // lsh: how the s hashes of a head depend on each other (SPEC 5)
  double window_eps = kDefaultWindowEps;            // window: W_h = ceil(sigma_h ln(1/eps))
  int64_t window_width = 0;                         // window: one W for every head; 0: from window_eps
  bool estimates = true;                            // section-6 estimates for lsh and window results
  int64_t probe_rows = kDefaultProbeRows;           // exact rows per head for the probe; 0: no probe
  int64_t mask_row_budget = kDefaultMaskRowBudget;  // rows checked exactly for mask_max_err before sampling
  bool return_draws = false;                        // copy the draws into the result
  bool check_finite = true;                         // reject NaN/Inf inputs with the first bad position
  // > 0: an error-targeted request (plsh/targeted.h): the library tries
  // configurations of `mode` from the cheapest up (window: wider windows;
  // lsh: more samples) and then exact, and keeps the first whose probe's
  // rel_err_upper is <= this; 0: off. In (0, 1].
  double target_rel_err = 0;
};

// Pointers to the caller's tensors; all dense row-major in the layout above.
struct TensorRefs {
  const void* q = nullptr;  // [B, Nq, H, D]   dtype
  const void* k = nullptr;  // [B, Nk, Hkv, D] dtype
  const void* v = nullptr;  // [B, Nk, Hkv, D] dtype
  void* out = nullptr;      // [B, Nq, H, D]   out_dtype
  float* lse = nullptr;     // [B, Nq, H]      optional, natural log incl. the bias
  MemorySpace memory = MemorySpace::kHost;
};

// Resolved and validated: no optionals, no defaults left to apply.
struct AttentionParams {
  const void* q = nullptr;  // [B, Nq, H, D]
  const void* k = nullptr;  // [B, Nk, Hkv, D]
  const void* v = nullptr;  // [B, Nk, Hkv, D]
  void* out = nullptr;      // [B, Nq, H, D]
  float* lse = nullptr;     // [B, Nq, H] or null
  MemorySpace memory = MemorySpace::kHost;

  // Element strides.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_row_stride = 0;  // lse head stride is 1

  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t head_group = 1;  // H / Hkv: query head h reads kv head h / head_group
  DType dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  double scale = 0;
  bool causal = false;
  std::vector<double> slopes;  // [H], >= 0
  int64_t q_pos0 = 0, k_pos0 = 0;

  Mode mode = Mode::kLsh;
  int64_t samples = 0;  // hashes per head: lsh's s, 1 for fixed_blocks, 0 otherwise
  uint64_t seed = 0;
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;
  Sampling sampling = Sampling::kIid;
  double window_eps = 0;
  std::vector<int64_t> window;  // [H]: keys with |pos_i - pos_j| < window[h]; kNoWindow: all

  bool estimates = true;
  int64_t probe_rows = 0;
  int64_t mask_row_budget = 0;
  bool return_draws = false;
  bool check_finite = true;
  double target_rel_err = 0;  // > 0: error-targeted (plsh/targeted.h)

  double sigma(int64_t h) const;  // 1 / slope; +inf for slope 0
};

inline constexpr int64_t kNoWindow = INT64_MAX;

// Head h's hashes under p's mode: lsh's s draws of p.sampling from p.seed
// (SPEC section 5), fixed_blocks' one fixed_block_draw, none otherwise. The
// one place that turns a mode into draws (plan_draws, the client's shard
// planner).
std::vector<Draw> head_draws(const AttentionParams& p, int64_t h);

// Standard ALiBi slopes for H heads (Press et al.; BLOOM's rule when H is
// not a power of two).
std::vector<double> standard_slopes(int64_t heads);

// Fills defaults, checks every field and the pointers; the message names the
// field, the value and what was expected. resolve_params + bind_tensors.
StatusOr<AttentionParams> make_params(const AttentionOptions& options, const TensorRefs& tensors);

// Everything but the tensors (their pointers stay null): what a plan is made
// from before the data has arrived.
StatusOr<AttentionParams> resolve_params(const AttentionOptions& options);
// Points p at the tensors (dense, in the layout above) after checking them,
// and with p->check_finite their values (host memory).
Status bind_tensors(AttentionParams* p, const TensorRefs& tensors);
// The tensors p points at, and pointing p at them unchecked: for params
// made from ones already bound (a targeted plan's attempts). The one place
// that pairs TensorRefs' fields with AttentionParams'.
TensorRefs tensors_of(const AttentionParams& p);
void set_tensors(AttentionParams* p, const TensorRefs& tensors);

// Validates options alone (no tensors yet): what the server does on a header.
Status validate_options(const AttentionOptions& options);

// The first non-finite value of q, k or v (host memory), or OK.
// "q has a non-finite value (nan) at [b=0, n=17, h=3, d=5]"
Status check_finite_inputs(const AttentionParams& p);

}  // namespace plsh
