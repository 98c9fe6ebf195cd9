#include "plsh/params.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "plsh/numeric.h"

namespace plsh {

const char* dtype_name(DType t) { return name_of(kDTypeNames, t); }
const char* mode_name(Mode m) { return name_of(kModeNames, m); }
const char* lsh_algorithm_name(LshAlgorithm a) { return name_of(kLshAlgorithmNames, a); }

size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

StatusOr<DType> parse_dtype(const std::string& s) {
  if (std::optional<DType> t = value_named(kDTypeAliases, s)) return *t;
  return parse_named(kDTypeNames, s, "dtype");
}

StatusOr<Mode> parse_mode(const std::string& s) { return parse_named(kModeNames, s, "mode"); }

StatusOr<LshAlgorithm> parse_lsh_algorithm(const std::string& s) {
  if (std::optional<LshAlgorithm> a = value_named(kLshAlgorithmAliases, s)) return *a;
  return parse_named(kLshAlgorithmNames, s, "lsh_algorithm");
}

StatusOr<Sampling> parse_sampling(const std::string& s) { return parse_named(kSamplingNames, s, "sampling"); }

double AttentionParams::sigma(int64_t h) const {
  const double m = slopes[static_cast<size_t>(h)];
  return m > 0 ? 1.0 / m : std::numeric_limits<double>::infinity();
}

std::vector<double> standard_slopes(int64_t heads) {
  auto power_of_two_slopes = [](int64_t n) {
    std::vector<double> s(static_cast<size_t>(n));
    const double start = std::pow(2.0, -8.0 / static_cast<double>(n));
    double value = start;
    for (int64_t i = 0; i < n; ++i) {
      s[static_cast<size_t>(i)] = value;
      value *= start;
    }
    return s;
  };
  if (heads <= 0) return {};
  int64_t p = 1;
  while (p * 2 <= heads) p *= 2;
  std::vector<double> slopes = power_of_two_slopes(p);
  if (p == heads) return slopes;
  const std::vector<double> extra = power_of_two_slopes(2 * p);
  for (int64_t i = 0; static_cast<int64_t>(slopes.size()) < heads; i += 2)
    slopes.push_back(extra[static_cast<size_t>(i)]);
  return slopes;
}

namespace {

template <typename T>
std::string str(const T& v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

Status field_error(const char* field, const std::string& value, const std::string& expected) {
  return invalid_argument(std::string(field) + " = " + value + ", expected " + expected);
}

// Non-zero slopes outside [2^-32, 2^10] are refused: sigma up to 2^32
// positions is wider than any sequence, and a slope of 2^10 already makes
// exp(-slope) underflow to 0 off the diagonal.
constexpr double kMinSlope = 0x1.0p-32;
// Largest |score| accepted: float32 holds up to 3.4e38.
constexpr double kMaxScore = 1e38;
constexpr double kMaxSlope = 0x1.0p10;

// a * b without overflow, or -1.
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

}  // namespace

Status validate_options(const AttentionOptions& o) {
  if (o.batch < 1) return field_error("batch", str(o.batch), ">= 1");
  if (o.q_len < 1) return field_error("q_len", str(o.q_len), ">= 1");
  if (o.kv_len < 1) return field_error("kv_len", str(o.kv_len), ">= 1");
  if (o.heads < 1 || o.heads > kMaxHeads) return field_error("heads", str(o.heads), "in [1, " + str(kMaxHeads) + "]");
  if (o.kv_heads < 0) return field_error("kv_heads", str(o.kv_heads), ">= 1 (or 0 for kv_heads = heads)");
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  if (kv_heads > o.heads || o.heads % kv_heads != 0)
    return field_error("kv_heads", str(kv_heads), "a divisor of heads = " + str(o.heads));
  if (o.head_dim < 1 || o.head_dim > kMaxHeadDim)
    return field_error("head_dim", str(o.head_dim), "in [1, " + str(kMaxHeadDim) + "]");
  const int64_t q_elems = checked_mul(checked_mul(checked_mul(o.batch, o.q_len), o.heads), o.head_dim);
  const int64_t kv_elems = checked_mul(checked_mul(checked_mul(o.batch, o.kv_len), kv_heads), o.head_dim);
  if (q_elems < 0 || q_elems > (int64_t{1} << 50))
    return field_error("q_len", str(o.q_len), "a shape whose element count fits in 2^50");
  if (kv_elems < 0 || kv_elems > (int64_t{1} << 50))
    return field_error("kv_len", str(o.kv_len), "a shape whose element count fits in 2^50");
  // The backends compute scores in float32: a scale float32 cannot hold
  // makes every score infinite.
  if (o.scale && !(std::isfinite(*o.scale) && *o.scale > 0 && *o.scale <= kMaxScore))
    return field_error("scale", str(*o.scale), "a number in (0, 1e38] (scores are float32)");
  if (!o.slopes.empty()) {
    if (static_cast<int64_t>(o.slopes.size()) != o.heads)
      return field_error("slopes", str(o.slopes.size()) + " values", "one per query head (" + str(o.heads) + ")");
    for (size_t h = 0; h < o.slopes.size(); ++h) {
      if (!(std::isfinite(o.slopes[h]) && o.slopes[h] >= 0))
        return invalid_argument("slopes[" + str(h) + "] = " + str(o.slopes[h]) + ", expected a finite number >= 0");
      // Beyond these the draws break: a pitch near 1e300 never finds its
      // block's end (block_end counts up from INT64_MIN), a pitch near 1e-300
      // overflows bin_of's cast and puts every position in one bin.
      if (o.slopes[h] != 0 && (o.slopes[h] < kMinSlope || o.slopes[h] > kMaxSlope))
        return invalid_argument("slopes[" + str(h) + "] = " + str(o.slopes[h]) +
                                ", expected 0 or a number in [2^-32, 2^10]");
    }
  }
  constexpr int64_t kMaxPos = int64_t{1} << 52;  // positions stay exact in double
  const int64_t q_pos0 = o.q_pos0 ? *o.q_pos0 : o.kv_len - o.q_len;
  if (q_pos0 < -kMaxPos || q_pos0 > kMaxPos) return field_error("q_pos0", str(q_pos0), "in [-2^52, 2^52]");
  if (o.k_pos0 < -kMaxPos || o.k_pos0 > kMaxPos) return field_error("k_pos0", str(o.k_pos0), "in [-2^52, 2^52]");
  if (o.mode == Mode::kLsh) {
    if (o.samples < 1 || o.samples > kMaxSamples)
      return field_error("samples", str(o.samples), "in [1, " + str(kMaxSamples) + "]");
  }
  if (o.mode == Mode::kWindow) {
    if (o.window_width < 0) return field_error("window_width", str(o.window_width), ">= 0 (0: from window_eps)");
    if (o.window_width == 0 && !(o.window_eps > 0 && o.window_eps < 1))
      return field_error("window_eps", str(o.window_eps), "in (0, 1)");
  }
  if (o.sampling != Sampling::kIid && o.sampling != Sampling::kStratified && o.sampling != Sampling::kAsh)
    return field_error("sampling", str(static_cast<int>(o.sampling)), "iid, stratified or ash");
  if (!(o.target_rel_err >= 0 && o.target_rel_err <= 1))
    return field_error("target_rel_err", str(o.target_rel_err), "in (0, 1] (0: no target)");
  // A fixed baseline has no cheaper or dearer configuration to search.
  if (o.target_rel_err > 0 && o.mode == Mode::kFixedBlocks)
    return field_error("target_rel_err", str(o.target_rel_err),
                       "0 in fixed_blocks mode (a fixed, biased baseline: nothing to search)");
  if (o.target_rel_err > 0 && o.estimates == false)
    return field_error("estimates", "false", "true with target_rel_err (the target is checked by the probe)");
  if (o.target_rel_err > 0 && o.mode != Mode::kExact && o.probe_rows < kMinTargetProbeRows)
    return field_error("probe_rows", str(o.probe_rows),
                       ">= " + str(kMinTargetProbeRows) + " with target_rel_err (the target is checked by the probe)");
  if (o.probe_rows < 0 || o.probe_rows > kMaxProbeRows)
    return field_error("probe_rows", str(o.probe_rows), "in [0, " + str(kMaxProbeRows) + "]");
  if (o.mask_row_budget < 1) return field_error("mask_row_budget", str(o.mask_row_budget), ">= 1");
  // q_pos0 left to its default (Nk - Nq) is negative when Nq > Nk: say so
  // in the caller's terms, not as a q_pos0 they never set.
  const auto defaulted_q_pos0 = [&](const std::string& why) {
    return invalid_argument("q_len = " + str(o.q_len) + " > kv_len = " + str(o.kv_len) +
                            ": queries are aligned to "
                            "the end of the keys by default (q_pos0 = kv_len - q_len = " +
                            str(q_pos0) + "), so " + why +
                            "; expected q_len <= kv_len, or an explicit q_pos0 (and k_pos0)");
  };
  if (o.causal) {
    // Every query row needs at least one allowed key, or its softmax is empty.
    if (q_pos0 < o.k_pos0 && !o.q_pos0 && o.q_len > o.kv_len)
      return defaulted_q_pos0("query row 0 would see no key when causal");
    if (q_pos0 < o.k_pos0)
      return field_error("q_pos0", str(q_pos0),
                         ">= k_pos0 = " + str(o.k_pos0) + " when causal (query row 0 would see no key)");
  }
  if (o.mode != Mode::kExact) {
    // lsh and window weigh only keys near the query (in its block, inside
    // its window). A query position that is not a key position may have
    // none, and its output would be empty where exact ALiBi's is not; with
    // every query position among the key positions, M~_ii = 1 (SPEC 3) and
    // the distance-0 key is inside every window, so no row is empty.
    const int64_t k_end = o.k_pos0 + o.kv_len;
    if ((q_pos0 < o.k_pos0 || q_pos0 + o.q_len > k_end) && !o.q_pos0 && o.q_len > o.kv_len)
      return defaulted_q_pos0(std::string("some query positions are no key positions, which ") + mode_name(o.mode) +
                              " mode needs (each query weighs only keys near it)");
    if (q_pos0 < o.k_pos0 || q_pos0 + o.q_len > k_end)
      return field_error("q_pos0", str(q_pos0),
                         "query positions [q_pos0, q_pos0 + q_len) = [" + str(q_pos0) + ", " + str(q_pos0 + o.q_len) +
                             ") inside the key positions [k_pos0, k_pos0 + kv_len) = [" + str(o.k_pos0) + ", " +
                             str(k_end) + ") in " + mode_name(o.mode) + " mode");
  }
  return Status::Ok();
}

StatusOr<AttentionParams> resolve_params(const AttentionOptions& o) {
  RETURN_IF_ERROR(validate_options(o));
  AttentionParams p{};
  p.batch = o.batch;
  p.q_len = o.q_len;
  p.kv_len = o.kv_len;
  p.heads = o.heads;
  p.kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  p.head_dim = o.head_dim;
  p.head_group = p.heads / p.kv_heads;

  p.q_head_stride = p.head_dim;
  p.q_row_stride = p.heads * p.head_dim;
  p.q_batch_stride = p.q_len * p.q_row_stride;
  p.k_head_stride = p.v_head_stride = p.head_dim;
  p.k_row_stride = p.v_row_stride = p.kv_heads * p.head_dim;
  p.k_batch_stride = p.v_batch_stride = p.kv_len * p.k_row_stride;
  p.o_head_stride = p.head_dim;
  p.o_row_stride = p.heads * p.head_dim;
  p.o_batch_stride = p.q_len * p.o_row_stride;
  p.lse_row_stride = p.heads;
  p.lse_batch_stride = p.q_len * p.heads;

  p.dtype = o.dtype;
  p.out_dtype = o.out_dtype ? *o.out_dtype : o.dtype;
  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  p.causal = o.causal;
  p.slopes = o.slopes.empty() ? standard_slopes(o.heads) : o.slopes;
  p.q_pos0 = o.q_pos0 ? *o.q_pos0 : o.kv_len - o.q_len;
  p.k_pos0 = o.k_pos0;

  p.mode = o.mode;
  p.samples = o.mode == Mode::kLsh ? o.samples : o.mode == Mode::kFixedBlocks ? 1 : 0;
  p.seed = o.seed;
  p.lsh_algorithm = o.lsh_algorithm;
  p.sampling = o.mode == Mode::kLsh ? o.sampling : Sampling::kIid;
  p.window_eps = o.window_eps;
  if (o.mode == Mode::kWindow) {
    p.window.resize(static_cast<size_t>(p.heads));
    for (int64_t h = 0; h < p.heads; ++h) {
      const double sigma = p.sigma(h);
      if (o.window_width > 0) {
        p.window[static_cast<size_t>(h)] = o.window_width;
      } else if (!std::isfinite(sigma)) {
        p.window[static_cast<size_t>(h)] = kNoWindow;
      } else {
        const double w = std::ceil(sigma * std::log(1.0 / o.window_eps));
        p.window[static_cast<size_t>(h)] = w >= 9.0e18 ? kNoWindow : std::max<int64_t>(1, static_cast<int64_t>(w));
      }
    }
  }

  p.estimates = o.estimates;
  p.probe_rows = o.probe_rows;
  p.mask_row_budget = o.mask_row_budget;
  p.return_draws = o.return_draws;
  p.check_finite = o.check_finite;
  p.target_rel_err = o.target_rel_err;
  return p;
}

Status bind_tensors(AttentionParams* p, const TensorRefs& t) {
  if (t.q == nullptr) return invalid_argument("q = null, expected a tensor [B, Nq, H, D]");
  if (t.k == nullptr) return invalid_argument("k = null, expected a tensor [B, Nk, Hkv, D]");
  if (t.v == nullptr) return invalid_argument("v = null, expected a tensor [B, Nk, Hkv, D]");
  if (t.out == nullptr) return invalid_argument("out = null, expected a tensor [B, Nq, H, D]");
  set_tensors(p, t);
  if (p->check_finite && p->memory == MemorySpace::kHost) RETURN_IF_ERROR(check_finite_inputs(*p));
  return Status::Ok();
}

TensorRefs tensors_of(const AttentionParams& p) { return {p.q, p.k, p.v, p.out, p.lse, p.memory}; }

void set_tensors(AttentionParams* p, const TensorRefs& t) {
  p->q = t.q;
  p->k = t.k;
  p->v = t.v;
  p->out = t.out;
  p->lse = t.lse;
  p->memory = t.memory;
}

std::vector<Draw> head_draws(const AttentionParams& p, int64_t h) {
  if (p.mode == Mode::kLsh) return draw_hashes(p.seed, h, p.sigma(h), p.samples, p.sampling);
  if (p.mode == Mode::kFixedBlocks) return {fixed_block_draw(p.sigma(h))};
  return {};
}

StatusOr<AttentionParams> make_params(const AttentionOptions& o, const TensorRefs& t) {
  ASSIGN_OR_RETURN(AttentionParams p, resolve_params(o));
  RETURN_IF_ERROR(bind_tensors(&p, t));
  return p;
}

Status check_finite_inputs(const AttentionParams& p) {
  struct Item {
    const char* name;
    const void* data;
    int64_t rows, heads;
  };
  const Item items[] = {
      {"q", p.q, p.q_len, p.heads}, {"k", p.k, p.kv_len, p.kv_heads}, {"v", p.v, p.kv_len, p.kv_heads}};
  for (const Item& it : items) {
    const int64_t n = p.batch * it.rows * it.heads * p.head_dim;
    const int64_t bad = first_non_finite(it.data, p.dtype, n);
    if (bad < 0) continue;
    const int64_t d = bad % p.head_dim;
    const int64_t h = (bad / p.head_dim) % it.heads;
    const int64_t r = (bad / (p.head_dim * it.heads)) % it.rows;
    const int64_t b = bad / (p.head_dim * it.heads * it.rows);
    const double value = load_element(it.data, p.dtype, bad);
    return invalid_argument(std::string(it.name) + " has a non-finite value (" + str(value) + ") at [b=" + str(b) +
                            ", n=" + str(r) + ", h=" + str(h) + ", d=" + str(d) + "], expected finite values");
  }
  // |scale * q.k| <= scale * D * max|q| * max|k|: past float32's range a
  // score is infinite and its row's softmax NaN.
  const double max_q = max_abs(p.q, p.dtype, p.batch * p.q_len * p.heads * p.head_dim);
  const double max_k = max_abs(p.k, p.dtype, p.batch * p.kv_len * p.kv_heads * p.head_dim);
  const double bound = p.scale * static_cast<double>(p.head_dim) * max_q * max_k;
  if (bound > kMaxScore)
    return invalid_argument("scale * head_dim * max|q| * max|k| = " + str(p.scale) + " * " + str(p.head_dim) + " * " +
                            str(max_q) + " * " + str(max_k) + " = " + str(bound) +
                            ", expected <= 1e38: scores would overflow float32");
  return Status::Ok();
}

}  // namespace plsh
