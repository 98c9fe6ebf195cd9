#include "server/request.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>

#include "plsh/backend.h"
#include "plsh/targeted.h"
#include "proto/wire.h"

namespace plsh::server {

Status check_request_id(const std::string& id) {
  if (id.size() > 128) return invalid_argument("request_id has " + std::to_string(id.size()) + " characters, expected <= 128");
  for (unsigned char c : id)
    if (!std::isprint(c)) return invalid_argument("request_id has a non-printable byte, expected printable ASCII");
  return Status::Ok();
}

std::string next_request_id() {
  static std::atomic<uint64_t> counter{0};
  // Appended rather than "r" + to_string(...): GCC 12 warns falsely on the
  // latter (-Wrestrict, GCC bug 105329).
  std::string id = "r";
  id += std::to_string(counter.fetch_add(1) + 1);
  return id;
}

StatusOr<RequestPlan> plan_request(const v1::AttendHeader& h, const RequestLimits& limits) {
  ASSIGN_OR_RETURN(RequestPlan plan, check_request(h, limits));
  RETURN_IF_ERROR(plan_kernels(&plan, limits));
  return plan;
}

int64_t planning_bytes(const RequestPlan& plan) {
  // Per head and sample: the draw (16 bytes) and what backends derive from
  // it (a CUDA lane pass, 72 bytes), with room to spare.
  const AttentionOptions& o = plan.options;
  return o.heads * (o.mode == Mode::kLsh ? o.samples : 1) * 128;
}

StatusOr<RequestPlan> check_request(const v1::AttendHeader& h, const RequestLimits& limits) {
  RequestPlan plan;
  RETURN_IF_ERROR(check_request_id(h.request_id()));
  plan.id = h.request_id().empty() ? next_request_id() : h.request_id();

  AttentionOptions& o = plan.options;
  o.batch = h.batch() == 0 ? 1 : h.batch();
  o.q_len = h.q_len();
  o.kv_len = h.kv_len();
  o.heads = h.heads();
  o.kv_heads = h.kv_heads();
  o.head_dim = h.head_dim();
  ASSIGN_OR_RETURN(o.dtype, wire::dtype_from_wire("dtype", h.dtype(), std::nullopt));
  ASSIGN_OR_RETURN(DType out_dtype, wire::dtype_from_wire("out_dtype", h.out_dtype(), o.dtype));
  o.out_dtype = out_dtype;
  if (h.has_scale()) o.scale = h.scale();
  o.causal = h.causal();
  o.slopes.assign(h.slopes().begin(), h.slopes().end());
  if (h.has_q_pos0()) o.q_pos0 = h.q_pos0();
  o.k_pos0 = h.k_pos0();
  ASSIGN_OR_RETURN(o.mode, wire::mode_from_wire(h.mode()));
  if (h.has_samples()) o.samples = h.samples();
  o.seed = h.seed();
  ASSIGN_OR_RETURN(o.lsh_algorithm, wire::lsh_algorithm_from_wire(h.lsh_algorithm()));
  ASSIGN_OR_RETURN(o.sampling, wire::sampling_from_wire(h.sampling()));
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
  plan.return_lse = h.return_lse();
  plan.keep_context = h.keep_context();
  plan.backward = plan.keep_context;
  // A targeted request picks its configuration while it computes, after
  // the plan a context would keep: its backward would differentiate
  // another configuration than the one that ran.
  if (plan.keep_context && o.target_rel_err > 0)
    return invalid_argument("keep_context = true with target_rel_err: the configuration is chosen while computing, so "
                            "there is no plan to keep; expected one of them (run the chosen configuration, "
                            "summary.target, with keep_context)");

  if (!h.backend().empty()) RETURN_IF_ERROR(check_backend_name(h.backend()));
  // "" and "auto" leave the choice to the server's --backend.
  plan.backend_name = h.backend().empty() || h.backend() == "auto" ? limits.default_backend : h.backend();
  if (h.out_chunk_bytes() < 0)
    return invalid_argument("out_chunk_bytes = " + std::to_string(h.out_chunk_bytes()) + ", expected >= 0 (0: server's largest)");

  RETURN_IF_ERROR(validate_options(o));

  // The server's own limits (SPEC section 7: RESOURCE_EXHAUSTED).
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  if (o.mode == Mode::kLsh && o.samples > limits.max_samples)
    return resource_exhausted("samples = " + std::to_string(o.samples) + ", expected <= " +
                              std::to_string(limits.max_samples) + " (the server's --max-samples)");
  if (o.mode == Mode::kLsh && target_max_samples(o) > limits.max_samples)
    return resource_exhausted("target_rel_err with lsh tries up to samples = " + std::to_string(target_max_samples(o)) +
                              ", expected <= " + std::to_string(limits.max_samples) + " (the server's --max-samples)");
  // validate_options bounded every element count by 2^50, so these products fit.
  const int64_t tokens = o.batch * std::max(o.q_len, o.kv_len);
  if (tokens > limits.max_tokens)
    return resource_exhausted("batch * max(q_len, kv_len) = " + std::to_string(tokens) + " tokens, expected <= " +
                              std::to_string(limits.max_tokens) + " (the server's --max-tokens)");
  plan.q_rows = o.batch * o.q_len;
  plan.kv_rows = o.batch * o.kv_len;
  plan.q_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  plan.kv_row_bytes = kv_heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  plan.out_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(out_dtype));
  plan.lse_row_bytes = o.heads * static_cast<int64_t>(sizeof(float));
  plan.total_bytes =
      plan.q_bytes() + 2 * plan.kv_bytes() + plan.out_bytes() + (plan.holds_lse() ? plan.q_rows * plan.lse_row_bytes : 0);
  if (plan.total_bytes > limits.max_request_bytes)
    return resource_exhausted("request needs " + std::to_string(plan.total_bytes) +
                              " bytes (q + k + v + out" + (plan.holds_lse() ? " + lse" : "") + "), expected <= " +
                              std::to_string(limits.max_request_bytes) + " (the server's --max-request-bytes)");

  // Every message carries at least one row, so one row must fit in one.
  const int64_t payload_cap = limits.max_message_bytes - kMessageHeadroom;
  const int64_t widest_row =
      std::max({plan.q_row_bytes, plan.kv_row_bytes, plan.out_row_bytes, plan.return_lse ? plan.lse_row_bytes : 0});
  if (widest_row > payload_cap)
    return resource_exhausted("heads = " + std::to_string(o.heads) + ", head_dim = " + std::to_string(o.head_dim) +
                              (plan.return_lse ? " with return_lse" : "") + ": one row is " +
                              std::to_string(widest_row) + " bytes, expected <= " + std::to_string(payload_cap) +
                              " (the server's --max-message-bytes less framing)");
  if (summary_bytes(o) > payload_cap) {
    const bool draws = o.return_draws && o.mode == Mode::kLsh;
    return resource_exhausted(std::string(draws ? "return_draws = true with " : "") + "heads = " +
                              std::to_string(o.heads) + (draws ? " and samples = " + std::to_string(o.samples) : "") +
                              ": the summary needs ~" + std::to_string(summary_bytes(o)) + " bytes, expected <= " +
                              std::to_string(payload_cap) + " (the server's --max-message-bytes)");
  }
  const int64_t wanted = h.out_chunk_bytes() == 0 ? payload_cap : std::min(h.out_chunk_bytes(), payload_cap);
  plan.out_chunk_bytes = std::max({wanted, plan.out_row_bytes, plan.return_lse ? plan.lse_row_bytes : 0});
  return plan;
}

Status plan_kernels(RequestPlan* request, const RequestLimits& limits) {
  RequestPlan& plan = *request;
  const AttentionOptions& o = plan.options;
  // The backend and its plan, before any tensor byte: a request whose
  // workspace cannot fit is refused here, with the header.
  ASSIGN_OR_RETURN(const AttentionParams params, resolve_params(o));
  ASSIGN_OR_RETURN(plan.backend, BackendRegistry::global().select(plan.backend_name, params, plan.backward));
  PlanLimits plan_limits;
  plan_limits.threads = limits.threads;
  plan_limits.device_bytes = limits.device_bytes_per_request;
  plan_limits.backward = plan.backward;
  ASSIGN_OR_RETURN(plan.kernel, plan_attention(*plan.backend, params, plan_limits));
  const Workspace workspace = plan.kernel.workspace();
  plan.charge.host_bytes = plan.total_bytes + workspace.host_bytes;
  plan.charge.device_bytes = workspace.device_bytes;
  return Status::Ok();
}

int64_t summary_bytes(const AttentionOptions& o) {
  // The fixed fields fit in kMessageHeadroom; exact has no per-head entries.
  if (o.mode == Mode::kExact) return 0;
  const bool draws = o.return_draws && o.mode == Mode::kLsh;
  // A targeted request's summary lists its attempts (~100 bytes each).
  const int64_t attempts = o.target_rel_err > 0 ? 100 * kTargetMaxAttempts : 0;
  return o.heads * (200 + (draws ? 20 * target_max_samples(o) : 0)) + attempts;
}

RequestBuffers RequestBuffers::allocate(const RequestPlan& plan) {
  RequestBuffers b;
  // Left uninitialised: the assembler checks that every row is written.
  b.q.reset(new uint8_t[static_cast<size_t>(plan.q_bytes())]);
  b.k.reset(new uint8_t[static_cast<size_t>(plan.kv_bytes())]);
  b.v.reset(new uint8_t[static_cast<size_t>(plan.kv_bytes())]);
  b.out.reset(new uint8_t[static_cast<size_t>(plan.out_bytes())]);
  if (plan.holds_lse()) b.lse.reset(new float[static_cast<size_t>(plan.q_rows * plan.options.heads)]);
  return b;
}

TensorRefs RequestBuffers::refs() const {
  TensorRefs t;
  t.q = q.get();
  t.k = k.get();
  t.v = v.get();
  t.out = out.get();
  t.lse = lse.get();
  t.memory = MemorySpace::kHost;
  return t;
}

StatusOr<AttentionResult> compute_request(RequestPlan& plan, const RequestBuffers& buffers, const ExecContext& ctx) {
  RETURN_IF_ERROR(ctx.check_stop());
  RETURN_IF_ERROR(bind_tensors(&plan.kernel.params, buffers.refs()));
  return run_attention(*plan.backend, plan.kernel, ctx);
}

void fill_summary(const AttentionResult& r, const RequestPlan& plan, v1::Summary* s) {
  wire::result_to_summary(r, s);
  s->set_request_id(plan.id);
  s->set_out_dtype(wire::to_wire(plan.options.out_dtype.value_or(plan.options.dtype)));
}

}  // namespace plsh::server
