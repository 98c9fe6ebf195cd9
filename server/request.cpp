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

StatusOr<int64_t> planning_bytes(const RequestPlan& plan) {
  ASSIGN_OR_RETURN(const AttentionParams params, resolve_params(plan.options));
  ASSIGN_OR_RETURN(Backend* const backend, BackendRegistry::global().select(plan.backend_name, params, plan.backward));
  return planning_host_bytes(*backend, params);
}

StatusOr<RequestPlan> check_request(const v1::AttendHeader& h, const RequestLimits& limits) {
  RequestPlan plan;
  RETURN_IF_ERROR(check_request_id(h.request_id()));
  plan.id = h.request_id().empty() ? next_request_id() : h.request_id();

  ASSIGN_OR_RETURN(plan.options, wire::options_from_header(h));
  const AttentionOptions& o = plan.options;
  plan.in_shm = {h.has_q_shm(), h.has_k_shm(), h.has_v_shm(), h.has_out_shm(), h.has_lse_shm()};
  plan.return_lse = h.return_lse() || h.has_lse_shm();  // lse_shm implies return_lse
  plan.keep_context = h.keep_context();
  plan.backward = plan.keep_context;
  // A targeted request picks its configuration while it computes, after
  // the plan a context would keep: its backward would differentiate
  // another configuration than the one that ran.
  if (plan.keep_context && o.target_rel_err > 0)
    return invalid_argument("keep_context = true with target_rel_err: the configuration is chosen while computing, so "
                            "there is no plan to keep; expected one of them (run the chosen configuration, "
                            "summary.target, with keep_context)");
  // A context holds its tensors for minutes; the client's shared memory is
  // the client's to change at any time.
  if (plan.keep_context && (h.has_q_shm() || h.has_k_shm() || h.has_v_shm() || h.has_out_shm() || h.has_lse_shm()))
    return invalid_argument("keep_context = true with tensors in shared memory (q_shm ... lse_shm): a kept context "
                            "holds its own copies, expected the tensors in chunks for a forward that keeps its context");

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
  if (o.mode == Mode::kLsh && o.heads * target_max_samples(o) > limits.max_draws)
    return resource_exhausted("heads * samples = " + std::to_string(o.heads) + " * " +
                              std::to_string(target_max_samples(o)) + " draws, expected <= " +
                              std::to_string(limits.max_draws) +
                              " (the server's limit: the draws are made with the header, 16 bytes each)");
  // validate_options bounded every element count by 2^50, so these products fit.
  const int64_t tokens = o.batch * std::max(o.q_len, o.kv_len);
  if (tokens > limits.max_tokens)
    return resource_exhausted("batch * max(q_len, kv_len) = " + std::to_string(tokens) + " tokens, expected <= " +
                              std::to_string(limits.max_tokens) + " (the server's --max-tokens)");
  plan.q_rows = o.batch * o.q_len;
  plan.kv_rows = o.batch * o.kv_len;
  plan.q_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  plan.kv_row_bytes = kv_heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.dtype));
  plan.out_row_bytes = o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(*o.out_dtype));
  plan.lse_row_bytes = o.heads * static_cast<int64_t>(sizeof(float));
  plan.total_bytes =
      plan.q_bytes() + 2 * plan.kv_bytes() + plan.out_bytes() + plan.held_lse_bytes();
  if (plan.total_bytes > limits.max_request_bytes)
    return resource_exhausted("request needs " + std::to_string(plan.total_bytes) +
                              " bytes (q + k + v + out" + (plan.holds_lse() ? " + lse" : "") + "), expected <= " +
                              std::to_string(limits.max_request_bytes) + " (the server's --max-request-bytes)");

  // Every message carries at least one row, so one row of each streamed
  // tensor must fit in one.
  const int64_t payload_cap = limits.max_message_bytes - kMessageHeadroom;
  const RequestPlan::InShm& shm = plan.in_shm;
  const int64_t widest_row = std::max({shm.q ? 0 : plan.q_row_bytes, shm.k && shm.v ? 0 : plan.kv_row_bytes,
                                       shm.out ? 0 : plan.out_row_bytes,
                                       plan.return_lse && !shm.lse ? plan.lse_row_bytes : 0});
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
  plan.charge.host_bytes = plan.host_tensor_bytes() + plan.kernel.own_host_bytes + workspace.host_bytes;
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

Status use_shared_memory(const v1::AttendHeader& h, RequestPlan* plan, SharedMemoryRegistry* registry,
                         const std::string& owner) {
  const RequestPlan::InShm& in = plan->in_shm;
  if (!(in.q || in.k || in.v || in.out || in.lse)) return Status::Ok();
  if (registry == nullptr || !registry->enabled())
    return unimplemented("q_shm, k_shm, v_shm, out_shm, lse_shm: shared memory is off on this server (it runs "
                         "without --shm-dir), expected the tensors in chunks");
  const int64_t in_size = static_cast<int64_t>(dtype_bytes(plan->options.dtype));
  const int64_t out_size = static_cast<int64_t>(dtype_bytes(plan->options.out_dtype.value_or(plan->options.dtype)));
  const struct {
    bool wanted;
    const char* field;
    const v1::SharedMemoryRef& ref;
    int64_t bytes, alignment;
    SharedMemoryRegistry::Use* use;
  } tensors[] = {{in.q, "q_shm", h.q_shm(), plan->q_bytes(), in_size, &plan->shared.q},
                 {in.k, "k_shm", h.k_shm(), plan->kv_bytes(), in_size, &plan->shared.k},
                 {in.v, "v_shm", h.v_shm(), plan->kv_bytes(), in_size, &plan->shared.v},
                 {in.out, "out_shm", h.out_shm(), plan->out_bytes(), out_size, &plan->shared.out},
                 {in.lse, "lse_shm", h.lse_shm(), plan->lse_bytes(), int64_t{sizeof(float)}, &plan->shared.lse}};
  const uint64_t holder = SharedMemoryRegistry::new_holder();  // the request: counted once per region
  for (const auto& t : tensors) {
    if (!t.wanted) continue;
    ASSIGN_OR_RETURN(*t.use, registry->use(owner, t.field, t.ref.region(), t.ref.offset(), t.ref.byte_size(), t.bytes,
                                           t.alignment, holder));
  }
  // The outputs are written while the inputs are read: no byte may be both.
  const SharedMemoryRegistry::Use* inputs[] = {&plan->shared.q, &plan->shared.k, &plan->shared.v};
  const char* input_names[] = {"q_shm", "k_shm", "v_shm"};
  for (const auto& [written, name] : {std::pair{&plan->shared.out, "out_shm"}, std::pair{&plan->shared.lse, "lse_shm"}}) {
    for (int i = 0; i < 3; ++i)
      if (written->overlaps(*inputs[i]))
        return invalid_argument(std::string(name) + " overlaps " + input_names[i] +
                                ", expected the outputs apart from the inputs");
  }
  if (plan->shared.out.overlaps(plan->shared.lse))
    return invalid_argument("out_shm overlaps lse_shm, expected them apart");
  return Status::Ok();
}

Status check_shared_memory_intact(const RequestPlan& plan) {
  RETURN_IF_ERROR(plan.shared.q.check_intact("q_shm"));
  RETURN_IF_ERROR(plan.shared.k.check_intact("k_shm"));
  RETURN_IF_ERROR(plan.shared.v.check_intact("v_shm"));
  RETURN_IF_ERROR(plan.shared.out.check_intact("out_shm"));
  return plan.shared.lse.check_intact("lse_shm");
}

RequestBuffers RequestBuffers::allocate(const RequestPlan& plan, BufferPool* pool) {
  // One block for the tensors the server holds, each at a 4 KiB boundary.
  // Left uninitialised: the assembler checks that every row is written.
  constexpr int64_t kAlign = 4096;
  auto aligned = [](int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
  const RequestPlan::InShm& shm = plan.in_shm;
  const int64_t q_at = 0;
  const int64_t k_at = q_at + (shm.q ? 0 : aligned(plan.q_bytes()));
  const int64_t v_at = k_at + (shm.k ? 0 : aligned(plan.kv_bytes()));
  const int64_t out_at = v_at + (shm.v ? 0 : aligned(plan.kv_bytes()));
  const int64_t lse_at = out_at + (shm.out ? 0 : aligned(plan.out_bytes()));
  const int64_t bytes = lse_at + (shm.lse ? 0 : aligned(plan.held_lse_bytes()));
  RequestBuffers b;
  if (bytes > 0) {
    if (pool != nullptr) {
      b.block = pool->acquire(bytes);
    } else {
      b.block = std::shared_ptr<uint8_t>(new uint8_t[static_cast<size_t>(bytes)], std::default_delete<uint8_t[]>());
    }
  }
  uint8_t* base = b.block.get();
  b.q.ptr = shm.q ? plan.shared.q.data() : base + q_at;
  b.k.ptr = shm.k ? plan.shared.k.data() : base + k_at;
  b.v.ptr = shm.v ? plan.shared.v.data() : base + v_at;
  b.out.ptr = shm.out ? plan.shared.out.data() : base + out_at;
  if (plan.holds_lse()) b.lse.ptr = reinterpret_cast<float*>(shm.lse ? plan.shared.lse.data() : base + lse_at);
  return b;
}

TensorRefs RequestBuffers::refs() const {
  TensorRefs t;
  t.q = q.ptr;
  t.k = k.ptr;
  t.v = v.ptr;
  t.out = out.ptr;
  t.lse = lse.ptr;
  t.memory = MemorySpace::kHost;
  return t;
}

StatusOr<AttentionResult> compute_request(RequestPlan& plan, const RequestBuffers& buffers, const ExecContext& ctx) {
  RETURN_IF_ERROR(ctx.check_stop());
  RETURN_IF_ERROR(bind_tensors(&plan.kernel.params, buffers.refs()));
  // The workspace the charge counted (the admission step is to hand it in).
  ASSIGN_OR_RETURN(const HostWorkspace workspace, HostWorkspace::allocate(plan.kernel.workspace().host_bytes));
  return run_attention(*plan.backend, plan.kernel, workspace.ref(), ctx);
}

void fill_summary(const AttentionResult& r, const RequestPlan& plan, v1::Summary* s) {
  wire::result_to_summary(r, s);
  s->set_request_id(plan.id);
  s->set_out_dtype(wire::to_wire(plan.options.out_dtype.value_or(plan.options.dtype)));
}

}  // namespace plsh::server
