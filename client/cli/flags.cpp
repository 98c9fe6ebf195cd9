#include "cli/flags.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "plsh/backend.h"
#include "plsh/text.h"

namespace plsh::cli {

// CLI11 reads integers with strtoll(..., base 0): "010" would be 8, and a
// value past the type's range is clamped to its maximum without a word.
// Accept decimal only (and 0x hex for the unsigned seed) within range, and
// strip leading zeros so that the conversion after this check reads what
// the user meant.
CLI::Validator decimal_integer(bool allow_negative) {
  return CLI::Validator(
      [allow_negative](std::string& s) -> std::string {
        const bool hex = !allow_negative && s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
        const bool negative = !s.empty() && s[0] == '-';
        if (negative && !allow_negative) return "'" + s + "' is negative, expected >= 0";
        const size_t start = hex ? 2 : (negative || (!s.empty() && s[0] == '+')) ? 1 : 0;
        const char* first = s.data() + start;
        const char* last = s.data() + s.size();
        std::from_chars_result r{};
        if (allow_negative) {
          int64_t v = 0;
          r = std::from_chars(negative ? first - 1 : first, last, v);
        } else {
          uint64_t v = 0;
          r = std::from_chars(first, last, v, hex ? 16 : 10);
        }
        if (first == last || r.ptr != last || r.ec == std::errc::invalid_argument)
          return "'" + s + "' is not a " + (hex ? "hexadecimal" : "decimal") + " integer";
        if (r.ec == std::errc::result_out_of_range)
          return "'" + s + "' is out of range for a " + (allow_negative ? "64-bit integer" : "64-bit unsigned integer");
        if (!hex) {
          size_t digits = start;
          while (digits + 1 < s.size() && s[digits] == '0') ++digits;
          s = (negative ? "-" : "") + s.substr(digits);
        }
        return {};
      },
      "");
}

std::string backend_names_text() { return names_text(kBackendNames); }

void add_attention_flags(CLI::App& app, AttentionCliArgs& a) {
  app.add_option("--q", a.q_path,
                 "queries, .npy [B, Nq, H, D] or [Nq, H, D] (--layout bhnd: [B, H, Nq, D]), float32 or float16")
      ->required();
  app.add_option("--k", a.k_path, "keys, .npy [B, Nk, Hkv, D] (H % Hkv == 0; bhnd: [B, Hkv, Nk, D]), same dtype as q")
      ->required();
  app.add_option("--v", a.v_path, "values, .npy, same shape and dtype as k")->required();
  app.add_flag("--bf16-bits", a.bf16_bits,
               "read '<u2' (uint16) arrays as bfloat16 bit patterns, and write bf16 outputs the same way");

  app.add_option("--mode", a.mode,
                 "exact, lsh, window or fixed_blocks (a biased baseline; with --target-error and no --mode: window)")
      ->capture_default_str()
      ->each([&a](const std::string&) { a.mode_given = true; });
  app.add_option("--samples", a.options.samples, "lsh: hashes per head (s)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--seed", a.options.seed, "lsh: seed of the hash draws (uint64)")
      ->capture_default_str()
      ->transform(decimal_integer(false));
  app.add_flag("--causal", a.options.causal, "mask keys after the query's position");
  app.add_option("--slopes", a.slopes, "ALiBi slope per query head, comma-separated (default: the standard slopes)");
  app.add_option_function<double>(
      "--scale", [&a](const double& v) { a.options.scale = v; }, "softmax scale (default 1/sqrt(D))");
  app.add_option("--lsh-algorithm", a.lsh_algorithm, "auto, per_sample or banded")->capture_default_str();
  app.add_option("--sampling", a.sampling,
                 "lsh: how a head's hashes depend on each other: iid, stratified or ash (SPEC 5; README)")
      ->capture_default_str();
  app.add_option("--target-error", a.target_error,
                 "relative L2 error to promise (0: off): the cheapest configuration of --mode (window widths, "
                 "lsh samples) whose probe upper bound is under it, else exact")
      ->capture_default_str();
  app.add_option("--window-eps", a.options.window_eps, "window: W_h = ceil(sigma_h ln(1/eps))")->capture_default_str();
  app.add_option("--window-width", a.options.window_width, "window: one width W for every head (0: from --window-eps)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option_function<int64_t>(
         "--q-pos0", [&a](const int64_t& v) { a.options.q_pos0 = v; },
         "absolute position of query row 0 (default Nk - Nq)")
      ->transform(decimal_integer(true));
  app.add_option("--k-pos0", a.options.k_pos0, "absolute position of key row 0")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--probe-rows", a.options.probe_rows,
                 "rows per head computed exactly for the probe estimate (0: none)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_flag("--no-estimates", a.no_estimates, "skip the error estimates (lsh and window)");
  app.add_flag("--return-draws", a.options.return_draws, "put every head's draws (pitch, shift) into the metadata");
  // The old name, hidden from --help (an empty group) but still accepted.
  app.add_flag("--return-hashes", a.options.return_draws, "the former name of --return-draws")->group("");
  app.add_option("--out-dtype", a.out_dtype, "f32, f16 or bf16 (default: the inputs' dtype)");
  app.add_option("--backend", a.backend, backend_names_text())->capture_default_str();
  app.add_option("--threads", a.threads, "CPU threads (0: all cores)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--layout", a.layout,
                 "axes of every .npy in and out: bnhd [B, N, H, D] (plsh's, FlashAttention's) or bhnd [B, H, N, D] "
                 "(scaled_dot_product_attention's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bnhd", "bhnd"}));
  app.add_flag(
      "--no-layout-check", a.no_layout_check,
      "accept shapes that look transposed (q's positions are k's heads, or more heads than positions) as given");
}

void add_output_flags(CLI::App& app, OutputCliArgs& a) {
  app.add_option("--out", a.out_path, "output .npy, [B, Nq, H, D] (or [Nq, H, D] for rank-3 inputs)")->required();
  app.add_option("--lse", a.lse_path, "log-sum-exp per row and head, .npy float32 [B, Nq, H] (or [Nq, H])");
  app.add_option("--meta", a.meta_path, "metadata and error estimates, JSON");
}

void add_backward_flags(CLI::App& app, BackwardCliArgs& a) {
  app.add_option("--dout", a.dout_path,
                 "backward: dLoss/dout, .npy shaped like --out and of its dtype; with --dq --dk --dv");
  app.add_option("--dq", a.dq_path, "backward: dLoss/dq, .npy [B, Nq, H, D] (or [Nq, H, D])");
  app.add_option("--dk", a.dk_path, "backward: dLoss/dk, .npy [B, Nk, Hkv, D], summed over each kv head's query heads");
  app.add_option("--dv", a.dv_path, "backward: dLoss/dv, .npy [B, Nk, Hkv, D], summed likewise");
  app.add_option("--grad-dtype", a.grad_dtype,
                 "backward: f32, f16 or bf16 for dq, dk, dv (default: the inputs' dtype)");
}

StatusOr<std::optional<DType>> check_backward_args(const BackwardCliArgs& a, bool bf16_bits) {
  const std::pair<const char*, const std::string*> flags[] = {
      {"--dout", &a.dout_path}, {"--dq", &a.dq_path}, {"--dk", &a.dk_path}, {"--dv", &a.dv_path}};
  if (!a.requested()) {
    if (!a.grad_dtype.empty())
      return invalid_argument("--grad-dtype = '" + a.grad_dtype +
                              "' without the backward, expected it with --dout, "
                              "--dq, --dk and --dv");
    return std::optional<DType>{};
  }
  std::string missing, given;
  for (const auto& [flag, path] : flags) {
    std::string& into = path->empty() ? missing : given;
    into += (into.empty() ? "" : ", ") + std::string(flag);
  }
  if (!missing.empty())
    return invalid_argument("the backward needs --dout, --dq, --dk and --dv together: " + given + " given, " + missing +
                            " missing");
  for (const auto& [flag, path] : flags)
    if (path != &a.dout_path) RETURN_IF_ERROR(check_output_path(flag + 2, *path));
  if (a.grad_dtype.empty()) return std::optional<DType>{};
  StatusOr<DType> t = parse_dtype(a.grad_dtype);
  if (!t.ok()) return invalid_argument("grad_" + t.status().message());
  if (*t == DType::kBF16 && !bf16_bits)
    return invalid_argument(
        "grad_dtype = bf16 needs --bf16-bits (.npy has no bfloat16; it is written as '<u2' bit patterns)");
  return std::optional<DType>{*t};
}

StatusOr<std::vector<double>> parse_slopes(const std::string& text) {
  std::vector<double> slopes;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    char* end = nullptr;
    errno = 0;
    const double v = item.empty() ? 0 : std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || errno == ERANGE)
      return invalid_argument("slopes = '" + text + "': item " + std::to_string(slopes.size()) + " ('" + item +
                              "') is not a number, expected comma-separated numbers, one per query head");
    slopes.push_back(v);
    start = comma + 1;
  }
  return slopes;
}

Status apply_mode_flags(const std::string& mode, bool mode_given, const std::string& sampling, double target_error,
                        AttentionOptions* o) {
  ASSIGN_OR_RETURN(o->mode, parse_mode(mode));
  ASSIGN_OR_RETURN(o->sampling, parse_sampling(sampling));
  if (!(target_error >= 0 && target_error <= 1))
    return invalid_argument("target_rel_err = " + g_text(target_error, 17) + ", expected in (0, 1] (0: no target)");
  o->target_rel_err = target_error;
  if (o->target_rel_err > 0 && !mode_given) o->mode = kDefaultTargetMode;
  return Status::Ok();
}

StatusOr<AttentionOptions> options_from_args(const AttentionCliArgs& a) {
  AttentionOptions o = a.options;
  RETURN_IF_ERROR(apply_mode_flags(a.mode, a.mode_given, a.sampling, a.target_error, &o));
  ASSIGN_OR_RETURN(o.lsh_algorithm, parse_lsh_algorithm(a.lsh_algorithm));
  if (!a.slopes.empty()) {
    ASSIGN_OR_RETURN(o.slopes, parse_slopes(a.slopes));
  }
  o.estimates = !a.no_estimates;
  if (!a.out_dtype.empty()) {
    ASSIGN_OR_RETURN(DType out, parse_dtype(a.out_dtype));
    if (out == DType::kBF16 && !a.bf16_bits)
      return invalid_argument(
          "out_dtype = bf16 needs --bf16-bits (.npy has no bfloat16; it is written as '<u2' bit patterns)");
    o.out_dtype = out;
  }
  RETURN_IF_ERROR(check_backend_name(a.backend));
  if (a.threads < 0)
    return invalid_argument("threads = " + std::to_string(a.threads) + ", expected >= 0 (0: all cores)");
  if (!std::isfinite(o.window_eps))
    return invalid_argument("window_eps = " + g_text(o.window_eps, 17) + ", expected in (0, 1)");
  return o;
}

Status check_output_path(const char* flag, const std::string& path) {
  if (path.empty()) return Status::Ok();
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return invalid_argument(std::string(flag) + " = '" + path + "': directory '" + dir.string() + "' does not exist");
  if (access(dir.c_str(), W_OK) != 0)
    return invalid_argument(std::string(flag) + " = '" + path + "': directory '" + dir.string() +
                            "' is not writable: " + std::strerror(errno));
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument(std::string(flag) + " = '" + path + "' is a directory, expected a file name");
  return Status::Ok();
}

Status check_output_paths(const OutputCliArgs& a) {
  RETURN_IF_ERROR(check_output_path("out", a.out_path));
  RETURN_IF_ERROR(check_output_path("lse", a.lse_path));
  return check_output_path("meta", a.meta_path);
}

namespace {

// Axis indices of a rank-3 or rank-4 tensor in a layout (batch -1 when absent).
struct Axes {
  int b, n, h, d;
};
Axes axes_of(Layout layout, size_t rank) {
  const int first = rank == 4 ? 1 : 0;
  return layout == Layout::kBnhd ? Axes{first - 1, first, first + 1, first + 2}
                                 : Axes{first - 1, first + 1, first, first + 2};
}

const char* form_of(Layout layout, bool batched) {
  if (layout == Layout::kBnhd) return batched ? "[B, N, H, D]" : "[N, H, D]";
  return batched ? "[B, H, N, D]" : "[H, N, D]";
}

}  // namespace

Status apply_shapes(const NpyArray& q, const NpyArray& k, const NpyArray& v, const std::string& q_name,
                    const std::string& k_name, const std::string& v_name, AttentionOptions* o, bool* batched,
                    Layout layout) {
  const size_t rank = q.shape.size();
  const char* layout_name = name_of(kLayoutNames, layout);
  if (rank != 3 && rank != 4)
    return invalid_argument(q_name + ": shape " + shape_string(q.shape) + " has rank " + std::to_string(rank) +
                            ", expected " + form_of(layout, true) + " or " + form_of(layout, false) + " (--layout " +
                            layout_name + ")");
  for (const auto& [name, a] : {std::pair{&k_name, &k}, std::pair{&v_name, &v}})
    if (a->shape.size() != rank)
      return invalid_argument(*name + ": shape " + shape_string(a->shape) + ", expected rank " + std::to_string(rank) +
                              " like q " + shape_string(q.shape) + " (" + form_of(layout, rank == 4) + ")");
  const Axes x = axes_of(layout, rank);
  // k, then v, against q: the message names the one that differs.
  for (const auto& [name, a] : {std::pair{&k_name, &k}, std::pair{&v_name, &v}}) {
    if (rank == 4 && a->shape[0] != q.shape[0])
      return invalid_argument(*name + ": batch = " + std::to_string(a->shape[0]) + ", expected the batch of q (" +
                              std::to_string(q.shape[0]) + ")");
    if (a->shape[x.d] != q.shape[x.d])
      return invalid_argument(*name + ": head_dim = " + std::to_string(a->shape[x.d]) + " (shape " +
                              shape_string(a->shape) + "), expected the head_dim of q (" +
                              std::to_string(q.shape[x.d]) + ")");
  }
  if (v.shape != k.shape)
    return invalid_argument(v_name + ": shape " + shape_string(v.shape) + ", expected the shape of k " +
                            shape_string(k.shape));
  if (k.dtype != q.dtype || v.dtype != q.dtype) {
    const bool k_bad = k.dtype != q.dtype;
    return invalid_argument((k_bad ? k_name : v_name) + ": dtype " + dtype_name(k_bad ? k.dtype : v.dtype) +
                            ", expected the dtype of q (" + dtype_name(q.dtype) + ")");
  }
  *batched = rank == 4;
  o->batch = rank == 4 ? q.shape[0] : 1;
  o->q_len = q.shape[x.n];
  o->heads = q.shape[x.h];
  o->head_dim = q.shape[x.d];
  o->kv_len = k.shape[x.n];
  // kv_heads = 0 would mean "same as heads" to the library; an empty kv
  // head axis must be reported as such instead.
  o->kv_heads = k.shape[x.h];
  if (o->kv_heads == 0)
    return invalid_argument(k_name + ": kv_heads = 0 (shape " + shape_string(k.shape) + "), expected >= 1");
  o->dtype = q.dtype;
  return Status::Ok();
}

Status check_layout_plausible(const AttentionOptions& o, const std::vector<int64_t>& q_shape,
                              const std::vector<int64_t>& k_shape, const std::string& q_name, const std::string& k_name,
                              const std::string& v_name, Layout layout, std::string* warning) {
  if (!o.slopes.empty() && static_cast<int64_t>(o.slopes.size()) == o.heads) return Status::Ok();  // heads meant
  const bool batched = q_shape.size() == 4;
  const Layout other = layout == Layout::kBnhd ? Layout::kBhnd : Layout::kBnhd;
  const std::string read_as = std::string(name_of(kLayoutNames, layout)) + " " + form_of(layout, batched);
  const std::string fix = std::string("pass --layout ") + name_of(kLayoutNames, other) + " if every file is " +
                          form_of(other, batched) +
                          ", transpose the one that is not, or --no-layout-check if the "
                          "shapes are meant";
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  if (o.q_len == kv_heads && o.heads == o.kv_len && o.q_len != o.heads) {
    const std::string suspect = o.heads > o.q_len ? q_name : k_name + " and " + v_name;
    return invalid_argument(
        q_name + " " + shape_string(q_shape) + " read as " + read_as + " has " + std::to_string(o.q_len) +
        " positions and " + std::to_string(o.heads) + " heads, and " + k_name + ", " + v_name + " " +
        shape_string(k_shape) + " have " + std::to_string(o.kv_len) + " positions and " + std::to_string(kv_heads) +
        " heads: one side's positions are the "
        "other's heads, so " +
        suspect + " is probably in the other layout (" + name_of(kLayoutNames, other) + "); " + fix);
  }
  if (o.slopes.empty() && o.heads > o.q_len && kv_heads > o.kv_len) {
    const std::string text = q_name + " " + shape_string(q_shape) + ", " + k_name + " and " + v_name + " " +
                             shape_string(k_shape) + " read as " + read_as + " have more heads (" +
                             std::to_string(o.heads) + ", " + std::to_string(kv_heads) + ") than positions (" +
                             std::to_string(o.q_len) + ", " + std::to_string(o.kv_len) + ")";
    if (o.heads > kMaxPlausibleHeads)
      return invalid_argument(text + ": they are probably all in the other layout (" + name_of(kLayoutNames, other) +
                              "); " + fix);
    *warning = text + "; read as " + name_of(kLayoutNames, layout) + " (if they are " + form_of(other, batched) +
               ", pass --layout " + name_of(kLayoutNames, other) + ")";
  }
  return Status::Ok();
}

StatusOr<AttentionInputs> load_attention_inputs(const AttentionCliArgs& a) {
  AttentionInputs in;
  ASSIGN_OR_RETURN(in.options, options_from_args(a));
  ASSIGN_OR_RETURN(in.layout, parse_named(kLayoutNames, a.layout, "layout"));
  const NpyReadOptions read_options{a.bf16_bits};
  ASSIGN_OR_RETURN(in.q, read_npy(a.q_path, read_options));
  ASSIGN_OR_RETURN(in.k, read_npy(a.k_path, read_options));
  ASSIGN_OR_RETURN(in.v, read_npy(a.v_path, read_options));
  RETURN_IF_ERROR(apply_shapes(in.q, in.k, in.v, a.q_path, a.k_path, a.v_path, &in.options, &in.batched, in.layout));
  if (!a.no_layout_check) {
    std::string warning;
    RETURN_IF_ERROR(
        check_layout_plausible(in.options, in.q.shape, in.k.shape, a.q_path, a.k_path, a.v_path, in.layout, &warning));
    if (!warning.empty()) std::fprintf(stderr, "plsh: warning: %s\n", warning.c_str());
  }
  RETURN_IF_ERROR(validate_options(in.options));
  if (in.layout == Layout::kBhnd) {
    const size_t axis = in.batched ? 1 : 0;
    in.q = swap_axes(in.q, axis);
    in.k = swap_axes(in.k, axis);
    in.v = swap_axes(in.v, axis);
  }
  return in;
}

std::vector<int64_t> in_layout(std::vector<int64_t> shape, Layout layout, bool with_head_dim) {
  if (layout == Layout::kBhnd) {
    const size_t axis = shape.size() - (with_head_dim ? 3 : 2);
    std::swap(shape[axis], shape[axis + 1]);
  }
  return shape;
}

Status write_in_layout(const std::string& path, DType dtype, const std::vector<int64_t>& bnhd_shape, const void* data,
                       Layout layout, bool with_head_dim) {
  if (layout == Layout::kBnhd) return write_npy(path, dtype, bnhd_shape, data);
  const size_t axis = bnhd_shape.size() - (with_head_dim ? 3 : 2);
  const std::vector<uint8_t> swapped = swap_axes(data, dtype_bytes(dtype), bnhd_shape, axis);
  return write_npy(path, dtype, in_layout(bnhd_shape, layout, with_head_dim), swapped.data());
}

std::vector<int64_t> output_shape(const AttentionOptions& o, bool batched) {
  if (batched) return {o.batch, o.q_len, o.heads, o.head_dim};
  return {o.q_len, o.heads, o.head_dim};
}

std::vector<int64_t> kv_shape(const AttentionOptions& o, bool batched) {
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  if (batched) return {o.batch, o.kv_len, kv_heads, o.head_dim};
  return {o.kv_len, kv_heads, o.head_dim};
}

std::vector<int64_t> lse_shape(const AttentionOptions& o, bool batched) {
  if (batched) return {o.batch, o.q_len, o.heads};
  return {o.q_len, o.heads};
}

}  // namespace plsh::cli
