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
  if (id.size() > 128)
    return invalid_argument("request_id has " + std::to_string(id.size()) + " characters, expected <= 128");
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

StatusOr<Request> check_and_plan(const v1::AttendHeader& h, const RequestLimits& limits) {
  ASSIGN_OR_RETURN(Request request, check_request(h, limits));
  RETURN_IF_ERROR(plan_request(&request, limits));
  return request;
}

StatusOr<int64_t> planning_bytes(const Request& request) {
  ASSIGN_OR_RETURN(const AttentionParams params, resolve_params(request.options));
  ASSIGN_OR_RETURN(Backend* const backend,
                   BackendRegistry::global().select(request.backend_name, params, request.backward));
  return planning_host_bytes(*backend, params);
}

MemoryLayout Request::memory_layout() const {
  MemoryLayout m;
  m.q = in_shm.q ? 0 : shape.q.bytes();
  m.k = in_shm.k ? 0 : shape.k.bytes();
  m.v = in_shm.v ? 0 : shape.v.bytes();
  m.out = in_shm.out ? 0 : shape.out.bytes();
  m.lse = in_shm.lse || !holds_lse() ? 0 : shape.lse.bytes();
  m.workspace = plan.workspace().host_bytes;
  return m;
}

void Request::place_shared(RequestMemory* m) const {
  if (in_shm.q) m->q = shared.q.data();
  if (in_shm.k) m->k = shared.k.data();
  if (in_shm.v) m->v = shared.v.data();
  if (in_shm.out) m->out = shared.out.data();
  if (in_shm.lse) m->lse = reinterpret_cast<float*>(shared.lse.data());
}

StatusOr<Request> check_request(const v1::AttendHeader& h, const RequestLimits& limits) {
  Request r;
  RETURN_IF_ERROR(check_request_id(h.request_id()));
  r.id = h.request_id().empty() ? next_request_id() : h.request_id();

  ASSIGN_OR_RETURN(r.options, wire::options_from_header(h));
  const AttentionOptions& o = r.options;
  r.in_shm = {h.has_q_shm(), h.has_k_shm(), h.has_v_shm(), h.has_out_shm(), h.has_lse_shm()};
  r.return_lse = h.return_lse() || h.has_lse_shm();  // lse_shm implies return_lse
  r.keep_context = h.keep_context();
  r.backward = r.keep_context;
  // A targeted request picks its configuration while it computes, after
  // the plan a context would keep: its backward would differentiate
  // another configuration than the one that ran.
  if (r.keep_context && o.target_rel_err > 0)
    return invalid_argument(
        "keep_context = true with target_rel_err: the configuration is chosen while computing, so "
        "there is no plan to keep; expected one of them (run the chosen configuration, "
        "summary.target, with keep_context)");
  // A context holds its tensors for minutes; the client's shared memory is
  // the client's to change at any time.
  if (r.keep_context && (h.has_q_shm() || h.has_k_shm() || h.has_v_shm() || h.has_out_shm() || h.has_lse_shm()))
    return invalid_argument(
        "keep_context = true with tensors in shared memory (q_shm ... lse_shm): a kept context "
        "holds its own copies, expected the tensors in chunks for a forward that keeps its context");

  if (!h.backend().empty()) RETURN_IF_ERROR(check_backend_name(h.backend()));
  // "" and "auto" leave the choice to the server's --backend.
  r.backend_name = h.backend().empty() || h.backend() == "auto" ? limits.default_backend : h.backend();
  if (h.out_chunk_bytes() < 0)
    return invalid_argument("out_chunk_bytes = " + std::to_string(h.out_chunk_bytes()) +
                            ", expected >= 0 (0: server's largest)");

  RETURN_IF_ERROR(validate_options(o));

  // The server's own limits (SPEC section 7: RESOURCE_EXHAUSTED).
  if (o.mode == Mode::kLsh && o.samples > limits.max_samples)
    return resource_exhausted("samples = " + std::to_string(o.samples) +
                              ", expected <= " + std::to_string(limits.max_samples) + " (the server's --max-samples)");
  if (o.mode == Mode::kLsh && target_max_samples(o) > limits.max_samples)
    return resource_exhausted("target_rel_err with lsh tries up to samples = " + std::to_string(target_max_samples(o)) +
                              ", expected <= " + std::to_string(limits.max_samples) + " (the server's --max-samples)");
  if (o.mode == Mode::kLsh && o.heads * target_max_samples(o) > limits.max_draws)
    return resource_exhausted("heads * samples = " + std::to_string(o.heads) + " * " +
                              std::to_string(target_max_samples(o)) +
                              " draws, expected <= " + std::to_string(limits.max_draws) +
                              " (the server's limit: the draws are made with the header, 16 bytes each)");
  // validate_options bounded every element count by 2^50, so these products fit.
  const int64_t tokens = o.batch * std::max(o.q_len, o.kv_len);
  if (tokens > limits.max_tokens)
    return resource_exhausted("batch * max(q_len, kv_len) = " + std::to_string(tokens) + " tokens, expected <= " +
                              std::to_string(limits.max_tokens) + " (the server's --max-tokens)");
  r.shape = RequestShape::of(o);
  const RequestShape& z = r.shape;
  if (r.tensor_bytes() > limits.max_request_bytes)
    return resource_exhausted("request needs " + std::to_string(r.tensor_bytes()) + " bytes (q + k + v + out" +
                              (r.holds_lse() ? " + lse" : "") + "), expected <= " +
                              std::to_string(limits.max_request_bytes) + " (the server's --max-request-bytes)");

  // Every message carries at least one row, so one row of each streamed
  // tensor must fit in one.
  const int64_t payload_cap = limits.max_message_bytes - kMessageHeadroom;
  const Request::InShm& shm = r.in_shm;
  const int64_t widest_row = std::max({shm.q ? 0 : z.q.row_bytes, shm.k && shm.v ? 0 : z.k.row_bytes,
                                       shm.out ? 0 : z.out.row_bytes, r.return_lse && !shm.lse ? z.lse.row_bytes : 0});
  if (widest_row > payload_cap)
    return resource_exhausted("heads = " + std::to_string(o.heads) + ", head_dim = " + std::to_string(o.head_dim) +
                              (r.return_lse ? " with return_lse" : "") + ": one row is " + std::to_string(widest_row) +
                              " bytes, expected <= " + std::to_string(payload_cap) +
                              " (the server's --max-message-bytes less framing)");
  if (summary_bytes(o) > payload_cap) {
    const bool draws = o.return_draws && o.mode == Mode::kLsh;
    return resource_exhausted(std::string(draws ? "return_draws = true with " : "") +
                              "heads = " + std::to_string(o.heads) +
                              (draws ? " and samples = " + std::to_string(o.samples) : "") + ": the summary needs ~" +
                              std::to_string(summary_bytes(o)) + " bytes, expected <= " + std::to_string(payload_cap) +
                              " (the server's --max-message-bytes)");
  }
  const int64_t wanted = h.out_chunk_bytes() == 0 ? payload_cap : std::min(h.out_chunk_bytes(), payload_cap);
  r.out_chunk_bytes = std::max({wanted, z.out.row_bytes, r.return_lse ? z.lse.row_bytes : 0});
  return r;
}

Status plan_request(Request* request, const RequestLimits& limits) {
  Request& r = *request;
  const AttentionOptions& o = r.options;
  // The backend and its plan, before any tensor byte: a request whose
  // workspace cannot fit is refused here, with the header.
  ASSIGN_OR_RETURN(const AttentionParams params, resolve_params(o));
  ASSIGN_OR_RETURN(r.backend, BackendRegistry::global().select(r.backend_name, params, r.backward));
  PlanLimits plan_limits;
  plan_limits.threads = limits.threads;
  plan_limits.device_bytes = limits.device_bytes_per_request;
  plan_limits.backward = r.backward;
  ASSIGN_OR_RETURN(r.plan, plan_attention(*r.backend, params, plan_limits));
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

Status use_shared_memory(const v1::AttendHeader& h, Request* r, SharedMemoryRegistry* registry,
                         const std::string& owner) {
  const Request::InShm& in = r->in_shm;
  if (!(in.q || in.k || in.v || in.out || in.lse)) return Status::Ok();
  if (registry == nullptr || !registry->enabled())
    return unimplemented(
        "q_shm, k_shm, v_shm, out_shm, lse_shm: shared memory is off on this server (it runs "
        "without --shm-dir), expected the tensors in chunks");
  const int64_t in_size = static_cast<int64_t>(dtype_bytes(r->options.dtype));
  const int64_t out_size = static_cast<int64_t>(dtype_bytes(r->options.out_dtype.value_or(r->options.dtype)));
  const struct {
    bool wanted;
    const char* field;
    const v1::SharedMemoryRef& ref;
    int64_t bytes, alignment;
    SharedMemoryRegistry::Use* use;
  } tensors[] = {{in.q, "q_shm", h.q_shm(), r->shape.q.bytes(), in_size, &r->shared.q},
                 {in.k, "k_shm", h.k_shm(), r->shape.k.bytes(), in_size, &r->shared.k},
                 {in.v, "v_shm", h.v_shm(), r->shape.v.bytes(), in_size, &r->shared.v},
                 {in.out, "out_shm", h.out_shm(), r->shape.out.bytes(), out_size, &r->shared.out},
                 {in.lse, "lse_shm", h.lse_shm(), r->lse_bytes(), int64_t{sizeof(float)}, &r->shared.lse}};
  const uint64_t holder = SharedMemoryRegistry::new_holder();  // the request: counted once per region
  for (const auto& t : tensors) {
    if (!t.wanted) continue;
    ASSIGN_OR_RETURN(*t.use, registry->use(owner, t.field, t.ref.region(), t.ref.offset(), t.ref.byte_size(), t.bytes,
                                           t.alignment, holder));
  }
  // The outputs are written while the inputs are read: no byte may be both.
  const SharedMemoryRegistry::Use* inputs[] = {&r->shared.q, &r->shared.k, &r->shared.v};
  const char* input_names[] = {"q_shm", "k_shm", "v_shm"};
  for (const auto& [written, name] : {std::pair{&r->shared.out, "out_shm"}, std::pair{&r->shared.lse, "lse_shm"}}) {
    for (int i = 0; i < 3; ++i)
      if (written->overlaps(*inputs[i]))
        return invalid_argument(std::string(name) + " overlaps " + input_names[i] +
                                ", expected the outputs apart from the inputs");
  }
  if (r->shared.out.overlaps(r->shared.lse)) return invalid_argument("out_shm overlaps lse_shm, expected them apart");
  return Status::Ok();
}

Status check_shared_memory_intact(const Request& r) {
  RETURN_IF_ERROR(r.shared.q.check_intact("q_shm"));
  RETURN_IF_ERROR(r.shared.k.check_intact("k_shm"));
  RETURN_IF_ERROR(r.shared.v.check_intact("v_shm"));
  RETURN_IF_ERROR(r.shared.out.check_intact("out_shm"));
  return r.shared.lse.check_intact("lse_shm");
}

std::unique_ptr<Assembler> assemble_inputs(const Request& r, const RequestMemory& m) {
  return std::make_unique<Assembler>(
      std::initializer_list<AssemblyTarget>{{v1::TENSOR_Q, "q", m.q, r.shape.q, "batch * q_len", r.in_shm.q},
                                            {v1::TENSOR_K, "k", m.k, r.shape.k, "batch * kv_len", r.in_shm.k},
                                            {v1::TENSOR_V, "v", m.v, r.shape.v, "batch * kv_len", r.in_shm.v}});
}

StatusOr<AttentionResult> compute_request(Request& request, const RequestMemory& memory, const ExecContext& ctx) {
  RETURN_IF_ERROR(ctx.check_stop());
  RETURN_IF_ERROR(bind_tensors(&request.plan.params, memory.refs()));
  return run_attention(*request.backend, request.plan, memory.workspace, ctx);
}

void fill_summary(const AttentionResult& result, const Request& r, v1::Summary* s) {
  wire::result_to_summary(result, s);
  s->set_request_id(r.id);
  s->set_out_dtype(wire::to_wire(r.options.out_dtype.value_or(r.options.dtype)));
}

}  // namespace plsh::server
