#include "proto/wire.h"

#include <string>

#include "plsh/text.h"

namespace plsh::wire {

namespace {

// One table per enum, read both ways: the library's value beside the wire's,
// in the order the errors list them.
template <class Value, class Wire>
struct EnumPair {
  Value value;
  Wire wire;
};

constexpr EnumPair<DType, v1::DType> kDTypes[] = {
    {DType::kF32, v1::DTYPE_F32}, {DType::kF16, v1::DTYPE_F16}, {DType::kBF16, v1::DTYPE_BF16}};
constexpr EnumPair<Mode, v1::Mode> kModes[] = {{Mode::kExact, v1::MODE_EXACT},
                                               {Mode::kLsh, v1::MODE_LSH},
                                               {Mode::kWindow, v1::MODE_WINDOW},
                                               {Mode::kFixedBlocks, v1::MODE_FIXED_BLOCKS}};
constexpr EnumPair<LshAlgorithm, v1::LshAlgorithm> kLshAlgorithms[] = {
    {LshAlgorithm::kAuto, v1::LSH_ALGORITHM_AUTO},
    {LshAlgorithm::kPerSample, v1::LSH_ALGORITHM_PER_SAMPLE},
    {LshAlgorithm::kBanded, v1::LSH_ALGORITHM_BANDED}};
constexpr EnumPair<Sampling, v1::Sampling> kSamplings[] = {{Sampling::kIid, v1::SAMPLING_IID},
                                                           {Sampling::kStratified, v1::SAMPLING_STRATIFIED},
                                                           {Sampling::kAsh, v1::SAMPLING_ASH}};

template <class Value, class Wire, size_t N>
Wire wire_of(const EnumPair<Value, Wire> (&table)[N], Value value, Wire otherwise) {
  for (const auto& p : table)
    if (p.value == value) return p.wire;
  return otherwise;
}

// INVALID_ARGUMENT "<field> = <shown>, expected A, B or C" for a value
// outside the table.
template <class Value, class Wire, size_t N>
StatusOr<Value> value_of(const EnumPair<Value, Wire> (&table)[N], int wire, const char* field,
                         const std::string& shown) {
  for (const auto& p : table)
    if (static_cast<int>(p.wire) == wire) return p.value;
  const google::protobuf::EnumDescriptor* names = google::protobuf::GetEnumDescriptor<Wire>();
  const std::string expected = or_list(N, [&](size_t i) { return names->FindValueByNumber(table[i].wire)->name(); });
  return invalid_argument(std::string(field) + " = " + shown + ", expected " + expected);
}

std::string dtype_enum_name(int value) {
  const std::string name = v1::DType_Name(static_cast<v1::DType>(value));
  return name.empty() ? std::to_string(value) : name + " (" + std::to_string(value) + ")";
}

ProbeEstimate probe_from_wire(const v1::ProbeEstimate& p) {
  ProbeEstimate e;
  e.rows = p.rows();
  e.rel_err = p.rel_err();
  e.rel_err_stderr = p.rel_err_stderr();
  e.max_abs_err = p.max_abs_err();
  e.bound_max = p.bound_max();
  e.rel_err_upper = p.rel_err_upper();
  return e;
}

void probe_to_wire(const ProbeEstimate& p, v1::ProbeEstimate* w) {
  w->set_rows(p.rows);
  w->set_rel_err(p.rel_err);
  w->set_rel_err_stderr(p.rel_err_stderr);
  w->set_max_abs_err(p.max_abs_err);
  w->set_bound_max(p.bound_max);
  w->set_rel_err_upper(p.rel_err_upper);
}

}  // namespace

v1::DType to_wire(DType t) { return wire_of(kDTypes, t, v1::DTYPE_UNSPECIFIED); }
v1::Mode to_wire(Mode m) { return wire_of(kModes, m, v1::MODE_UNSPECIFIED); }
v1::LshAlgorithm to_wire(LshAlgorithm a) { return wire_of(kLshAlgorithms, a, v1::LSH_ALGORITHM_AUTO); }
v1::Sampling to_wire(Sampling s) { return wire_of(kSamplings, s, v1::SAMPLING_IID); }

StatusOr<DType> dtype_from_wire(const char* field, int value, std::optional<DType> if_unspecified) {
  if (value == v1::DTYPE_UNSPECIFIED && if_unspecified) return *if_unspecified;
  return value_of(kDTypes, value, field, dtype_enum_name(value));
}

StatusOr<Mode> mode_from_wire(int value) {
  if (value == v1::MODE_UNSPECIFIED) return Mode::kLsh;
  return value_of(kModes, value, "mode", std::to_string(value));
}

StatusOr<LshAlgorithm> lsh_algorithm_from_wire(int value) {
  return value_of(kLshAlgorithms, value, "lsh_algorithm", std::to_string(value));
}

StatusOr<Sampling> sampling_from_wire(int value) {
  return value_of(kSamplings, value, "sampling", std::to_string(value));
}

const char* mode_label(v1::Mode m) {
  const StatusOr<Mode> mode = mode_from_wire(m);
  return mode.ok() ? mode_name(*mode) : "unknown";
}

void options_to_header(const AttentionOptions& o, v1::AttendHeader* h) {
  h->set_batch(o.batch);
  h->set_q_len(o.q_len);
  h->set_kv_len(o.kv_len);
  h->set_heads(o.heads);
  h->set_kv_heads(o.kv_heads);
  h->set_head_dim(o.head_dim);
  h->set_dtype(to_wire(o.dtype));
  if (o.out_dtype) h->set_out_dtype(to_wire(*o.out_dtype));
  if (o.scale) h->set_scale(*o.scale);
  h->set_causal(o.causal);
  for (double s : o.slopes) h->add_slopes(s);
  if (o.q_pos0) h->set_q_pos0(*o.q_pos0);
  h->set_k_pos0(o.k_pos0);
  h->set_mode(to_wire(o.mode));
  h->set_samples(o.samples);
  h->set_seed(o.seed);
  h->set_lsh_algorithm(to_wire(o.lsh_algorithm));
  h->set_sampling(to_wire(o.sampling));
  if (o.target_rel_err > 0) h->set_target_rel_err(o.target_rel_err);
  h->set_window_eps(o.window_eps);
  h->set_window_width(o.window_width);
  h->set_estimates(o.estimates);
  h->set_probe_rows(o.probe_rows);
  h->set_mask_row_budget(o.mask_row_budget);
  h->set_return_draws(o.return_draws);
  h->set_check_finite(o.check_finite);
}

StatusOr<AttentionOptions> options_from_header(const v1::AttendHeader& h) {
  AttentionOptions o;
  o.batch = h.batch() == 0 ? 1 : h.batch();
  o.q_len = h.q_len();
  o.kv_len = h.kv_len();
  o.heads = h.heads();
  o.kv_heads = h.kv_heads();
  o.head_dim = h.head_dim();
  ASSIGN_OR_RETURN(o.dtype, dtype_from_wire("dtype", h.dtype(), std::nullopt));
  ASSIGN_OR_RETURN(DType out_dtype, dtype_from_wire("out_dtype", h.out_dtype(), o.dtype));
  o.out_dtype = out_dtype;
  if (h.has_scale()) o.scale = h.scale();
  o.causal = h.causal();
  o.slopes.assign(h.slopes().begin(), h.slopes().end());
  if (h.has_q_pos0()) o.q_pos0 = h.q_pos0();
  o.k_pos0 = h.k_pos0();
  ASSIGN_OR_RETURN(o.mode, mode_from_wire(h.mode()));
  if (h.has_samples()) o.samples = h.samples();
  o.seed = h.seed();
  ASSIGN_OR_RETURN(o.lsh_algorithm, lsh_algorithm_from_wire(h.lsh_algorithm()));
  ASSIGN_OR_RETURN(o.sampling, sampling_from_wire(h.sampling()));
  if (h.has_target_rel_err()) {
    o.target_rel_err = h.target_rel_err();
    // 0 is "no target" in the library; on the wire an unset field says that.
    if (!(o.target_rel_err > 0))
      return invalid_argument("target_rel_err = " + std::to_string(o.target_rel_err) + ", expected in (0, 1]");
    if (h.mode() == v1::MODE_UNSPECIFIED) o.mode = kDefaultTargetMode;
  }
  if (h.has_window_eps()) o.window_eps = h.window_eps();
  o.window_width = h.window_width();
  if (h.has_estimates()) o.estimates = h.estimates();
  if (h.has_probe_rows()) o.probe_rows = h.probe_rows();
  if (h.has_mask_row_budget()) o.mask_row_budget = h.mask_row_budget();
  o.return_draws = h.return_draws();
  if (h.has_check_finite()) o.check_finite = h.check_finite();
  return o;
}

void result_to_summary(const AttentionResult& r, v1::Summary* s) {
  s->set_backend(r.backend);
  s->set_device(r.device);
  s->set_mode(to_wire(r.mode));
  s->set_lsh_algorithm(to_wire(r.lsh_algorithm));
  s->set_samples(r.samples);
  s->set_seed(r.seed);
  s->set_scale(r.scale);
  s->set_q_pos0(r.q_pos0);
  s->set_k_pos0(r.k_pos0);
  s->set_flops(r.flops);
  s->set_dense_flops(r.dense_flops);
  s->set_mask_max_err(r.mask_max_err);
  s->set_mask_spectral_err(r.mask_spectral_err);
  probe_to_wire(r.probe, s->mutable_probe());
  for (const HeadEstimate& h : r.heads) {
    v1::HeadEstimate* w = s->add_heads();
    w->set_head(h.head);
    w->set_slope(h.slope);
    w->set_sigma(h.sigma);
    w->set_window(h.window);
    w->set_max_block(h.max_block);
    w->set_mask_max_err(h.mask_max_err);
    w->set_mask_rows_checked(h.mask_rows_checked);
    w->set_mask_rows_sampled(h.mask_rows_sampled);
    w->set_mask_spectral_err(h.mask_spectral_err);
    w->set_spectral_iterations(h.spectral_iterations);
    probe_to_wire(h.probe, w->mutable_probe());
    for (const Draw& d : h.draws) {
      v1::Draw* wd = w->add_draws();
      wd->set_pitch(d.pitch);
      wd->set_shift(d.shift);
    }
  }
  auto* backend_timings = s->mutable_timings()->mutable_backend();
  for (const auto& [name, seconds] : r.timings) (*backend_timings)[name] = seconds;
  s->set_sampling(to_wire(r.sampling));
  if (r.target.target_rel_err > 0) {
    v1::TargetReport* t = s->mutable_target();
    t->set_target_rel_err(r.target.target_rel_err);
    t->set_met(r.target.met);
    t->set_chosen(static_cast<int32_t>(r.target.chosen));
    for (const TargetAttempt& a : r.target.attempts) {
      v1::TargetAttempt* w = t->add_attempts();
      w->set_mode(to_wire(a.mode));
      w->set_samples(a.samples);
      w->set_window_scale(a.window_scale);
      w->set_window_max(a.window_max);
      w->set_flops(a.flops);
      w->set_rel_err(a.rel_err);
      w->set_rel_err_upper(a.rel_err_upper);
      w->set_met(a.met);
      w->set_seconds(a.seconds);
    }
  }
}

StatusOr<AttentionResult> result_from_summary(const v1::Summary& s) {
  AttentionResult r;
  r.backend = s.backend();
  r.device = s.device();
  ASSIGN_OR_RETURN(r.mode, mode_from_wire(s.mode()));
  ASSIGN_OR_RETURN(r.lsh_algorithm, lsh_algorithm_from_wire(s.lsh_algorithm()));
  r.samples = s.samples();
  r.seed = s.seed();
  r.scale = s.scale();
  r.q_pos0 = s.q_pos0();
  r.k_pos0 = s.k_pos0();
  r.flops = s.flops();
  r.dense_flops = s.dense_flops();
  r.mask_max_err = s.mask_max_err();
  r.mask_spectral_err = s.mask_spectral_err();
  r.probe = probe_from_wire(s.probe());
  for (const v1::HeadEstimate& w : s.heads()) {
    HeadEstimate h;
    h.head = w.head();
    h.slope = w.slope();
    h.sigma = w.sigma();
    h.window = w.window();
    h.max_block = w.max_block();
    h.mask_max_err = w.mask_max_err();
    h.mask_rows_checked = w.mask_rows_checked();
    h.mask_rows_sampled = w.mask_rows_sampled();
    h.mask_spectral_err = w.mask_spectral_err();
    h.spectral_iterations = w.spectral_iterations();
    h.probe = probe_from_wire(w.probe());
    for (const v1::Draw& d : w.draws()) h.draws.push_back(Draw{d.pitch(), d.shift()});
    r.heads.push_back(std::move(h));
  }
  for (const auto& [name, seconds] : s.timings().backend()) r.timings[name] = seconds;
  ASSIGN_OR_RETURN(r.sampling, sampling_from_wire(s.sampling()));
  if (s.has_target()) {
    const v1::TargetReport& t = s.target();
    r.target.target_rel_err = t.target_rel_err();
    r.target.met = t.met();
    r.target.chosen = t.chosen();
    for (const v1::TargetAttempt& w : t.attempts()) {
      TargetAttempt a;
      ASSIGN_OR_RETURN(a.mode, mode_from_wire(w.mode()));
      a.samples = w.samples();
      a.window_scale = w.window_scale();
      a.window_max = w.window_max();
      a.flops = w.flops();
      a.rel_err = w.rel_err();
      a.rel_err_upper = w.rel_err_upper();
      a.met = w.met();
      a.seconds = w.seconds();
      r.target.attempts.push_back(a);
    }
  }
  return r;
}

void backward_result_to_summary(const BackwardResult& r, v1::BackwardSummary* s) {
  s->set_backend(r.backend);
  s->set_device(r.device);
  s->set_flops(r.flops);
  s->set_dense_flops(r.dense_flops);
  s->set_host_workspace_bytes(r.host_workspace_bytes);
  s->set_device_workspace_bytes(r.device_workspace_bytes);
  auto* backend_timings = s->mutable_timings()->mutable_backend();
  for (const auto& [name, seconds] : r.timings) (*backend_timings)[name] = seconds;
}

BackwardResult backward_result_from_summary(const v1::BackwardSummary& s) {
  BackwardResult r;
  r.backend = s.backend();
  r.device = s.device();
  r.flops = s.flops();
  r.dense_flops = s.dense_flops();
  r.host_workspace_bytes = s.host_workspace_bytes();
  r.device_workspace_bytes = s.device_workspace_bytes();
  for (const auto& [name, seconds] : s.timings().backend()) r.timings[name] = seconds;
  return r;
}

}  // namespace plsh::wire
