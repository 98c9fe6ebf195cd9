// The flags shared by every plsh subcommand that runs attention (compute,
// and attend, which sends the same request to a server): the input arrays,
// the attention options, and where the outputs go. One contract, so that
// `plsh compute ... ` and `plsh attend ...` take the same command line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/npy.h"
#include "plsh/params.h"
#include "plsh/status.h"
#include "plsh/text.h"

namespace plsh::cli {

// How the .npy files hold their axes (--layout): plsh's own [B, N, H, D]
// (FlashAttention's too), or scaled_dot_product_attention's [B, H, N, D].
// Outputs are written in the inputs' layout. The rules that refuse shapes
// that look transposed are client/python/plsh_client/_layout.py's, kept
// alike (tests/python/test_cli_attend.py runs both on the same files).
enum class Layout { kBnhd, kBhnd };
inline constexpr EnumName<Layout> kLayoutNames[] = {{Layout::kBnhd, "bnhd"}, {Layout::kBhnd, "bhnd"}};
// No published model has more query heads than this (the largest have 128):
// more heads than positions and more than this is a transposition.
inline constexpr int64_t kMaxPlausibleHeads = 256;

// What the attention flags hold after parsing; strings stay strings until
// options_from_args() turns them into typed options with Status errors.
struct AttentionCliArgs {
  std::string q_path, k_path, v_path;  // .npy: [B, N, H, D] or [N, H, D]
  bool bf16_bits = false;              // read/write '<u2' arrays as bfloat16 bit patterns
  // The flags that set an option as it is (--samples, --seed, --causal,
  // --scale, --window-eps, --window-width, --q-pos0, --k-pos0, --probe-rows,
  // --return-draws) are bound to it directly, with the library's defaults;
  // the rest stay strings here. Defaults are AttentionOptions' (plsh/params.h),
  // not restated here.
  AttentionOptions options;
  std::string mode = mode_name(AttentionOptions{}.mode);  // exact | lsh | window
  std::string slopes;                                     // "a,b,..." one per query head; empty: standard ALiBi slopes
  std::string lsh_algorithm = lsh_algorithm_name(AttentionOptions{}.lsh_algorithm);  // auto | per_sample | banded
  std::string sampling = sampling_name(kDefaultSampling);                            // lsh: iid | stratified | ash
  double target_error = 0;  // > 0: error-targeted request (target_rel_err)
  bool mode_given = false;  // --mode was on the command line (a target without it searches windows)
  bool no_estimates = false;
  std::string out_dtype;         // f32 | f16 | bf16; empty: the inputs' dtype
  std::string backend = "auto";  // one of plsh::kBackendNames
  int64_t threads = 0;           // CPU threads; 0: all cores
  std::string layout = "bnhd";   // of every .npy in and out: bnhd | bhnd
  bool no_layout_check = false;  // accept shapes that look transposed as given
};

// Where the results go.
struct OutputCliArgs {
  std::string out_path;   // .npy, [B, Nq, H, D] (or [Nq, H, D])
  std::string lse_path;   // optional .npy float32, [B, Nq, H] (or [Nq, H])
  std::string meta_path;  // optional JSON metadata and estimates
};

// The backward pass (plsh compute only): dout in, dq, dk, dv out; the
// four together or none.
struct BackwardCliArgs {
  std::string dout_path;   // .npy, [B, Nq, H, D] (or [Nq, H, D]), the dtype of out
  std::string dq_path;     // .npy, [B, Nq, H, D] (or [Nq, H, D])
  std::string dk_path;     // .npy, [B, Nk, Hkv, D] (or [Nk, Hkv, D])
  std::string dv_path;     // .npy, [B, Nk, Hkv, D] (or [Nk, Hkv, D])
  std::string grad_dtype;  // f32 | f16 | bf16; empty: the inputs' dtype

  bool requested() const { return !dout_path.empty() || !dq_path.empty() || !dk_path.empty() || !dv_path.empty(); }
};

// An integer flag's transform: base 10 only (CLI11 alone would read "010"
// as octal), with 0x hex allowed for unsigned values (seeds).
CLI::Validator decimal_integer(bool allow_negative);

// --q --k --v and every attention option. Integers are read in base 10
// (CLI11 alone would take "010" as octal); --seed also takes 0x hex.
void add_attention_flags(CLI::App& app, AttentionCliArgs& args);
// --out (required) --lse --meta.
void add_output_flags(CLI::App& app, OutputCliArgs& args);
// --dout --dq --dk --dv --grad-dtype.
void add_backward_flags(CLI::App& app, BackwardCliArgs& args);

// The backward flags come as a set (all four paths or none; --grad-dtype
// only with them, bf16 only with --bf16-bits), their directories exist and
// are writable; INVALID_ARGUMENT naming the flags otherwise. The grad dtype
// when given.
StatusOr<std::optional<DType>> check_backward_args(const BackwardCliArgs& args, bool bf16_bits);

// "auto, cpu or cuda": plsh::kBackendNames, for help texts.
std::string backend_names_text();

// "0.5,0.25" -> {0.5, 0.25}; INVALID_ARGUMENT naming the bad item.
StatusOr<std::vector<double>> parse_slopes(const std::string& text);

// Everything the flags alone determine, checked before any file is read;
// the shape fields are left for apply_shapes().
StatusOr<AttentionOptions> options_from_args(const AttentionCliArgs& args);
// --mode, --sampling and --target-error (plsh compute, attend and bench):
// a target without --mode searches windows (kDefaultTargetMode). A target
// outside [0, 1] (or not a number) is INVALID_ARGUMENT here, because a
// client sends none when it is 0 or less.
Status apply_mode_flags(const std::string& mode, bool mode_given, const std::string& sampling, double target_error,
                        AttentionOptions* o);

// The output and lse directories exist and are writable, so that a long
// computation is not lost to a typo in --out.
Status check_output_paths(const OutputCliArgs& args);
// The same for one path of flag `flag` (empty: nothing to check).
Status check_output_path(const char* flag, const std::string& path);

struct AttentionInputs {
  NpyArray q, k, v;               // in plsh's bnhd, whatever the files' layout
  bool batched = true;            // the inputs had a batch axis (rank 4); outputs keep the same form
  Layout layout = Layout::kBnhd;  // the files'
  AttentionOptions options;
};

// Fills batch, lengths, heads, kv_heads, head_dim and dtype from the
// arrays: q [B, Nq, H, D], k and v [B, Nk, Hkv, D] (or all without B) in
// bnhd, their [B, H, N, D] in bhnd; one dtype. Names are what messages call
// the arrays (their paths); each message names the array that is wrong.
Status apply_shapes(const NpyArray& q, const NpyArray& k, const NpyArray& v, const std::string& q_name,
                    const std::string& k_name, const std::string& v_name, AttentionOptions* options, bool* batched,
                    Layout layout = Layout::kBnhd);

// Shapes that read as the other layout would, where the declared reading is
// implausible: INVALID_ARGUMENT naming the probable transposition (q's
// positions and heads are k's heads and positions; or every tensor has
// more heads than positions and more than kMaxPlausibleHeads, with the
// standard slopes). More heads than positions within that: *warning says
// so (it cannot be decided). q_shape, k_shape are the files' shapes.
Status check_layout_plausible(const AttentionOptions& o, const std::vector<int64_t>& q_shape,
                              const std::vector<int64_t>& k_shape, const std::string& q_name, const std::string& k_name,
                              const std::string& v_name, Layout layout, std::string* warning);

// options_from_args + read the three files + apply_shapes + the layout
// check (unless --no-layout-check; its warning on stderr), the arrays
// turned to bnhd.
StatusOr<AttentionInputs> load_attention_inputs(const AttentionCliArgs& args);

// The shape of a bnhd output ([B, N, H, D] / [N, H, D]; with_head_dim
// false: lse's [B, N, H] / [N, H]) in `layout`.
std::vector<int64_t> in_layout(std::vector<int64_t> bnhd_shape, Layout layout, bool with_head_dim = true);
// write_npy of a bnhd output in `layout`.
Status write_in_layout(const std::string& path, DType dtype, const std::vector<int64_t>& bnhd_shape, const void* data,
                       Layout layout, bool with_head_dim = true);

// [B, Nq, H, D] / [B, Nq, H] / [B, Nk, Hkv, D], without B when the inputs
// had none.
std::vector<int64_t> output_shape(const AttentionOptions& o, bool batched);
std::vector<int64_t> kv_shape(const AttentionOptions& o, bool batched);
std::vector<int64_t> lse_shape(const AttentionOptions& o, bool batched);

}  // namespace plsh::cli
