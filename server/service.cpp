#include "server/service.h"

#include <cstring>
#include <memory>
#include <optional>

#include "cpu/tiles.h"
#include "plsh/backend.h"
#include "proto/chunk_codec.h"
#include "proto/wire.h"
#include "server/assembler.h"
#include "server/backward_call.h"
#include "server/call.h"
#include "server/logging.h"
#include "server/status_map.h"
#include "server/streamed_call.h"

#ifndef PLSH_VERSION
#define PLSH_VERSION "unknown"
#endif

namespace plsh::server {

namespace {

// ---------------------------------------------------------------- Attend

class AttendReactor final : public TypedStreamedCall<v1::AttendRequest, v1::AttendResponse> {
 public:
  using TypedStreamedCall::TypedStreamedCall;

 private:
  Status on_header(const v1::AttendHeader& header) override {
    if (request_) return invalid_argument("header received twice, expected exactly one header as the first message");
    RETURN_IF_ERROR(admit_header(header));
    // Mapping a new pool block, or unmapping idle ones for room, can take a
    // while for GiBs: the server's time, not the client's idleness.
    progress();
    const Request& r = *request_;
    assembler_ = assemble_inputs(r, memory_);
    publish_ack(r.id, *r.backend, r.out_chunk_bytes);
    return Status::Ok();
  }

  void run() override { computed(compute(end_at_), &result_, request_->streamed_output_bytes()); }

  // Tensors in shared memory are not sent: the worker wrote them there.
  bool next_output() override {
    const Request& r = *request_;
    return next_output_chunk({{!r.in_shm.out, v1::TENSOR_OUT, memory_.out, r.shape.out, &next_[0]},
                              {r.return_lse && !r.in_shm.lse, v1::TENSOR_LSE,
                               reinterpret_cast<const uint8_t*>(memory_.lse), r.shape.lse, &next_[1]}},
                             r.out_chunk_bytes, memory_.block);
  }

  void set_summary() override {
    v1::AttendResponse message;
    fill_summary_message(*result_, message.mutable_summary());
    response_ = serialize_message(message);
  }

  std::optional<AttentionResult> result_;  // under mu_, as the outputs sent
  int64_t next_[2] = {0, 0};               // out, lse rows sent
};

// ----------------------------------------------------------- AttendUnary

class UnaryReactor final : public grpc::ServerUnaryReactor, private CallBase {
 public:
  UnaryReactor(ServiceContext& s, grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* message,
               v1::AttendUnaryResponse* response)
      : CallBase(s, ctx, "AttendUnary"), message_(message), response_(response) {
    const Status status = start();
    if (!status.ok()) finish(to_grpc_status(status));
  }

  void OnCancel() override { cancel_.store(true); }
  void OnDone() override { delete this; }
  // Unary calls have no reading or sending phase to wait in: never watched.
  void expire(const grpc::Status&, const char*) override {}

 private:
  Status start() {
    RETURN_IF_ERROR(open(/*watched=*/false));
    RETURN_IF_ERROR(check_message_size(message_->ByteSizeLong()));
    // Sizes before memory: a request whose tensors or response cannot fit
    // is refused before any memory is reserved.
    RETURN_IF_ERROR(admit_header(message_->header(), [this](const Request& r) { return check_sizes(r); }));
    // Tensors in shared memory are there already (check_sizes: their
    // fields are empty).
    if (!request_->in_shm.q) std::memcpy(memory_.q, message_->q().data(), message_->q().size());
    if (!request_->in_shm.k) std::memcpy(memory_.k, message_->k().data(), message_->k().size());
    if (!request_->in_shm.v) std::memcpy(memory_.v, message_->v().data(), message_->v().size());
    record_.received_bytes = request_->streamed_input_bytes();
    s_.metrics->received_bytes(static_cast<double>(record_.received_bytes));
    record_.receiving = seconds_between(record_.start, Clock::now());
    queued_at_ = Clock::now();
    return s_.scheduler->submit([this] { run(); });
  }

  // q, k and v have their shapes' bytes (none when in shared memory), and
  // out, lse and the summary fit in one response message.
  Status check_sizes(const Request& plan) const {
    const struct {
      const char* name;
      const std::string& data;
      bool in_shm;
      int64_t expected;
      const char* shape;
    } inputs[] = {{"q", message_->q(), plan.in_shm.q, plan.shape.q.bytes(), "batch * q_len * heads * head_dim"},
                  {"k", message_->k(), plan.in_shm.k, plan.shape.k.bytes(), "batch * kv_len * kv_heads * head_dim"},
                  {"v", message_->v(), plan.in_shm.v, plan.shape.v.bytes(), "batch * kv_len * kv_heads * head_dim"}};
    for (const auto& in : inputs) {
      if (in.in_shm && !in.data.empty())
        return invalid_argument(std::string(in.name) + " = " + std::to_string(in.data.size()) + " bytes with " +
                                in.name + "_shm set, expected none (the tensor is in shared memory)");
      if (!in.in_shm && static_cast<int64_t>(in.data.size()) != in.expected)
        return invalid_argument(std::string(in.name) + " = " + std::to_string(in.data.size()) + " bytes, expected " +
                                std::to_string(in.expected) + " (" + in.shape + " * dtype bytes)");
    }
    const int64_t response_bytes = plan.streamed_output_bytes() + kMessageHeadroom + summary_bytes(plan.options);
    if (response_bytes > s_.limits.max_message_bytes)
      return resource_exhausted("the response needs ~" + std::to_string(response_bytes) +
                                " bytes, expected <= " + std::to_string(s_.limits.max_message_bytes) +
                                " (the server's --max-message-bytes); use the streaming Attend");
    return Status::Ok();
  }

  void run() {
    StatusOr<AttentionResult> result = compute(queued_at_);
    if (!result.ok()) {
      finish(to_grpc_status(result.status()));
      return;
    }
    const Clock::time_point send_start = Clock::now();
    const Request& r = *request_;
    if (!r.in_shm.out) response_->set_out(memory_.out, static_cast<size_t>(r.shape.out.bytes()));
    if (r.return_lse && !r.in_shm.lse)
      response_->set_lse(reinterpret_cast<const char*>(memory_.lse), static_cast<size_t>(r.lse_bytes()));
    record_.sent_bytes = r.streamed_output_bytes();
    s_.metrics->sent_bytes(static_cast<double>(record_.sent_bytes));
    record_.sending = seconds_between(send_start, Clock::now());
    fill_summary_message(*result, response_->mutable_summary());
    finish(grpc::Status::OK);
  }

  void finish(grpc::Status status) {
    Finish(close(std::move(status)));  // last: OnDone may delete this at once
  }

  const v1::AttendUnaryRequest* message_;
  v1::AttendUnaryResponse* response_;
  Clock::time_point queued_at_;
};

}  // namespace

AttentionService::AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler,
                                   Admission* admission, StreamWatchdog* watchdog, const Authenticator* auth,
                                   SharedMemoryRegistry* shm) {
  shared_.config = &config;
  shared_.admission = admission;
  shared_.contexts = admission->contexts();
  shared_.watchdog = watchdog;
  shared_.auth = auth;
  shared_.shm = shm;
  shared_.limits.max_tokens = config.max_tokens;
  shared_.limits.max_request_bytes = config.max_request_bytes;
  shared_.limits.max_samples = config.max_samples;
  shared_.limits.max_message_bytes = config.max_message_bytes;
  shared_.limits.default_backend = config.backend;
  shared_.limits.threads = static_cast<int>(config.threads);
  // Every worker may hold a request at once: each gets an equal share.
  shared_.limits.device_bytes_per_request =
      admission->budget().budget().device_bytes / std::max<int64_t>(1, config.workers);
  shared_.metrics = metrics;
  shared_.scheduler = scheduler;
}

void AttentionService::begin_drain() {
  shared_.admission->begin_drain();
  // Streams still receiving have not started their work: end them now (a
  // silent client must not hold up the drain); they may retry elsewhere.
  if (shared_.watchdog != nullptr)
    shared_.watchdog->expire_receiving(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica"), "drain");
  if (shared_.contexts != nullptr) shared_.contexts->close();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::Attend(
    grpc::CallbackServerContext* ctx) {
  return AttendReactor::start<AttendReactor>(shared_, ctx, "Attend", "AttendRequest");
}

grpc::ServerUnaryReactor* AttentionService::AttendUnary(grpc::CallbackServerContext* ctx,
                                                        const v1::AttendUnaryRequest* request,
                                                        v1::AttendUnaryResponse* response) {
  return new UnaryReactor(shared_, ctx, request, response);
}

bool AttentionService::authorize(grpc::CallbackServerContext* ctx, Method method, grpc::ServerUnaryReactor* reactor,
                                 std::string* client) {
  client->clear();
  if (shared_.auth == nullptr) return true;
  // These calls go through no CallBase (they hold no request): the check is
  // here, and only GetInfo's refusals are logged, as before.
  const Authorization a = shared_.auth->authorize(ctx->client_metadata(), method);
  *client = a.client ? a.client->name() : "unauthenticated";
  const grpc::Status status = to_grpc_status(a.status);
  if (method == Method::kGetInfo)
    shared_.metrics->client_request(*client, "GetInfo", grpc_code_name(status.error_code()), 0, 0);
  if (status.ok()) return true;
  if (method == Method::kGetInfo)
    log_event(spdlog::level::info, "request",
              {{"method", method_name(method)},
               {"client", *client},
               {"peer", ctx->peer()},
               {"status", grpc_code_name(status.error_code())},
               {"message", status.error_message()}});
  else
    log_shm_call(ctx, method, *client, "", a.status);
  reactor->Finish(status);
  return false;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::AttendBackward(
    grpc::CallbackServerContext* ctx) {
  return start_attend_backward(shared_, ctx);
}

grpc::ServerUnaryReactor* AttentionService::ReleaseContext(grpc::CallbackServerContext* ctx,
                                                           const v1::ReleaseContextRequest* request,
                                                           v1::ReleaseContextResponse* response) {
  return release_context(shared_, ctx, request, response);
}

grpc::ServerUnaryReactor* AttentionService::GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest*,
                                                    v1::GetInfoResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string client;
  if (!authorize(ctx, Method::kGetInfo, reactor, &client)) return reactor;
  const ServerConfig& c = *shared_.config;
  response->set_version(PLSH_VERSION);
  for (Backend* b : BackendRegistry::global().backends()) {
    v1::BackendInfo* info = response->add_backends();
    info->set_name(b->name());
    info->set_device(b->device());
  }
  for (const std::string& note : BackendRegistry::global().notes()) response->add_backend_notes(note);
  v1::Limits* l = response->mutable_limits();
  l->set_max_tokens(c.max_tokens);
  l->set_max_request_bytes(c.max_request_bytes);
  l->set_memory_budget(c.memory_budget);
  l->set_max_samples(c.max_samples);
  l->set_max_draws(shared_.limits.max_draws);
  l->set_max_message_bytes(c.max_message_bytes);
  l->set_max_concurrent(c.max_concurrent);
  l->set_queue_depth(c.queue_depth);
  l->set_workers(c.workers);
  l->set_max_chunk_payload_bytes(wire::max_chunk_payload_bytes(c.max_message_bytes));
  const bool shm = shared_.shm != nullptr && shared_.shm->enabled();
  l->set_shared_memory(shm);
  l->set_max_shared_memory_regions(shm ? SharedMemoryRegistry::kMaxRegions : 0);
  l->set_max_heads(kMaxHeads);
  l->set_max_head_dim(kMaxHeadDim);
  l->set_max_shared_memory_bytes(shm ? shared_.shm->max_mapped_bytes() : 0);
  l->set_context_ttl_seconds(shared_.contexts != nullptr ? shared_.contexts->options().ttl_seconds : 0);
  l->set_max_contexts(shared_.contexts != nullptr ? shared_.contexts->options().max_contexts : 0);
  const AttentionOptions defaults;
  v1::Defaults* d = response->mutable_defaults();
  d->set_mode(v1::MODE_LSH);
  d->set_samples(defaults.samples);
  d->set_seed(defaults.seed);
  d->set_window_eps(defaults.window_eps);
  d->set_probe_rows(defaults.probe_rows);
  d->set_mask_row_budget(defaults.mask_row_budget);
  d->set_estimates(defaults.estimates);
  d->set_check_finite(defaults.check_finite);
  d->set_out_chunk_bytes(c.max_message_bytes - kMessageHeadroom);
  d->set_backend(c.backend);
  d->set_sampling(wire::to_wire(defaults.sampling));
  d->set_lsh_algorithm(wire::to_wire(defaults.lsh_algorithm));
  d->set_target_mode(wire::to_wire(kDefaultTargetMode));
  // The CPU backend's row tiles decide where a sequence shard may start
  // (GetInfoResponse.shard_row_align): its constant, not a copy.
  response->set_shard_row_align(cpu::kMaxRowTile);
  for (const char* name : kBackendNames) response->add_backend_names(name);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace plsh::server
