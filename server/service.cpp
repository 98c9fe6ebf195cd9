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

// gRPC's ByteBuffer -> a protobuf message, for the raw Attend method's
// small messages (header, end); the other way: serialize_message
// (streamed_call.h).
bool parse_message(grpc::ByteBuffer* buffer, v1::AttendRequest* message) {
  return grpc::SerializationTraits<v1::AttendRequest>::Deserialize(buffer, message).ok();
}

// The keep-alive of an output chunk's slice: a reference to the request's
// block, dropped when gRPC lets go of the slice.
void release_block(void* arg) { delete static_cast<std::shared_ptr<uint8_t>*>(arg); }

// ---------------------------------------------------------------- Attend

class AttendReactor final : public StreamedCall<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using StreamedCall::StreamedCall;

 private:
  // One received message. Chunks, the bulk of a stream, are read from the
  // slices gRPC received and copied once, straight into the tensor; the
  // rest (and any chunk the slice reader leaves to protobuf) is parsed.
  Status handle_message() override {
    if (header_received() && chunk_.read(request_)) {
      const Status status = handle_chunk();
      chunk_.clear();
      return status;
    }
    v1::AttendRequest request;
    if (!parse_message(&request_, &request))
      return invalid_argument(std::string("a message that is not an AttendRequest, expected ") + expected_next());
    return dispatch(request, [this](const v1::AttendHeader& header) { return on_header(header); });
  }

  Status handle_chunk() {
    ASSIGN_OR_RETURN(uint8_t* dst,
                     assembler_->accept(chunk_.tensor(), chunk_.row_start(), chunk_.row_count(), chunk_.data_bytes()));
    chunk_.copy_data(dst);
    received(static_cast<int64_t>(chunk_.data_bytes()));
    return Status::Ok();
  }

  Status on_header(const v1::AttendHeader& header) {
    if (plan_) return invalid_argument("header received twice, expected exactly one header as the first message");
    RETURN_IF_ERROR(plan(header));
    RETURN_IF_ERROR(reserve_and_allocate());
    // Mapping a new pool block, or unmapping idle ones for room, can take a
    // while for GiBs: the server's time, not the client's idleness.
    progress();
    assembler_ = std::make_unique<Assembler>(*plan_, &buffers_);
    publish_ack(plan_->id, *plan_->backend, plan_->out_chunk_bytes);
    return Status::Ok();
  }

  void run() override { computed(compute(end_at_), &result_, plan_->streamed_output_bytes()); }

  // Tensors in shared memory are not sent: the worker wrote them there.
  bool next_output() override {
    const RequestPlan& p = *plan_;
    if (!p.in_shm.out && out_next_ < p.q_rows) {
      const int64_t rows = std::min(p.q_rows - out_next_, std::max<int64_t>(1, p.out_chunk_bytes / p.out_row_bytes));
      set_chunk(v1::TENSOR_OUT, out_next_, rows, buffers_.out.get() + out_next_ * p.out_row_bytes, rows * p.out_row_bytes);
      out_next_ += rows;
      return true;
    }
    if (p.return_lse && !p.in_shm.lse && lse_next_ < p.q_rows) {
      const int64_t rows = std::min(p.q_rows - lse_next_, std::max<int64_t>(1, p.out_chunk_bytes / p.lse_row_bytes));
      set_chunk(v1::TENSOR_LSE, lse_next_, rows,
                reinterpret_cast<const uint8_t*>(buffers_.lse.get()) + lse_next_ * p.lse_row_bytes,
                rows * p.lse_row_bytes);
      lse_next_ += rows;
      return true;
    }
    return false;
  }

  // An output chunk whose data is a slice of the request's block, not a
  // copy: the slice holds the block until gRPC is done with it.
  void set_chunk(v1::Tensor tensor, int64_t row_start, int64_t rows, const uint8_t* data, int64_t bytes) {
    response_ = wire::encode_chunk(tensor, row_start, rows, data, static_cast<size_t>(bytes), release_block,
                                   new std::shared_ptr<uint8_t>(buffers_.block));
    sent(bytes);
  }

  void set_summary() override {
    v1::AttendResponse message;
    fill_summary_message(*result_, message.mutable_summary());
    response_ = serialize_message(message);
  }

  wire::ChunkReader chunk_;
  std::optional<AttentionResult> result_;  // under mu_, as the outputs sent
  int64_t out_next_ = 0, lse_next_ = 0;
};

// ----------------------------------------------------------- AttendUnary

class UnaryReactor final : public grpc::ServerUnaryReactor, private CallBase {
 public:
  UnaryReactor(ServiceContext& s, grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* request,
               v1::AttendUnaryResponse* response)
      : CallBase(s, ctx, "AttendUnary"), request_(request), response_(response) {
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
    RETURN_IF_ERROR(check_message_size(request_->ByteSizeLong()));
    RETURN_IF_ERROR(plan(request_->header()));
    // Sizes before memory: a response that cannot fit is refused before any
    // memory is reserved.
    RETURN_IF_ERROR(check_sizes());
    RETURN_IF_ERROR(reserve_and_allocate());
    // Tensors in shared memory are there already (check_sizes: their
    // fields are empty).
    if (!plan_->in_shm.q) std::memcpy(buffers_.q.get(), request_->q().data(), request_->q().size());
    if (!plan_->in_shm.k) std::memcpy(buffers_.k.get(), request_->k().data(), request_->k().size());
    if (!plan_->in_shm.v) std::memcpy(buffers_.v.get(), request_->v().data(), request_->v().size());
    record_.received_bytes = plan_->streamed_input_bytes();
    s_.metrics->received_bytes(static_cast<double>(record_.received_bytes));
    record_.receiving = seconds_between(record_.start, Clock::now());
    queued_at_ = Clock::now();
    return s_.scheduler->submit([this] { run(); });
  }

  // q, k and v have their shapes' bytes (none when in shared memory), and
  // out, lse and the summary fit in one response message.
  Status check_sizes() const {
    const RequestPlan& plan = *plan_;
    const struct {
      const char* name;
      const std::string& data;
      bool in_shm;
      int64_t expected;
      const char* shape;
    } inputs[] = {{"q", request_->q(), plan.in_shm.q, plan.q_bytes(), "batch * q_len * heads * head_dim"},
                  {"k", request_->k(), plan.in_shm.k, plan.kv_bytes(), "batch * kv_len * kv_heads * head_dim"},
                  {"v", request_->v(), plan.in_shm.v, plan.kv_bytes(), "batch * kv_len * kv_heads * head_dim"}};
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
      return resource_exhausted("the response needs ~" + std::to_string(response_bytes) + " bytes, expected <= " +
                                std::to_string(s_.limits.max_message_bytes) +
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
    if (!plan_->in_shm.out) response_->set_out(buffers_.out.get(), static_cast<size_t>(plan_->out_bytes()));
    if (plan_->return_lse && !plan_->in_shm.lse)
      response_->set_lse(reinterpret_cast<const char*>(buffers_.lse.get()), static_cast<size_t>(plan_->lse_bytes()));
    record_.sent_bytes = plan_->streamed_output_bytes();
    s_.metrics->sent_bytes(static_cast<double>(record_.sent_bytes));
    record_.sending = seconds_between(send_start, Clock::now());
    fill_summary_message(*result, response_->mutable_summary());
    finish(grpc::Status::OK);
  }

  void finish(grpc::Status status) {
    Finish(close(std::move(status)));  // last: OnDone may delete this at once
  }

  const v1::AttendUnaryRequest* request_;
  v1::AttendUnaryResponse* response_;
  Clock::time_point queued_at_;
};

}  // namespace

AttentionService::AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler,
                                   StreamWatchdog* watchdog, const Authenticator* auth, BufferPool* pool,
                                   SharedMemoryRegistry* shm, ContextStore* contexts) {
  shared_.config = &config;
  shared_.contexts = contexts;
  shared_.watchdog = watchdog;
  shared_.auth = auth;
  shared_.pool = pool;
  shared_.shm = shm;
  shared_.limits.max_tokens = config.max_tokens;
  shared_.limits.max_request_bytes = config.max_request_bytes;
  shared_.limits.max_samples = config.max_samples;
  shared_.limits.max_message_bytes = config.max_message_bytes;
  shared_.limits.default_backend = config.backend;
  shared_.limits.threads = static_cast<int>(config.threads);
  // Every worker may hold a request at once: each gets an equal share.
  shared_.limits.device_bytes_per_request = scheduler->budget().device_bytes / std::max<int64_t>(1, config.workers);
  shared_.metrics = metrics;
  shared_.scheduler = scheduler;
}

void AttentionService::begin_drain() {
  shared_.draining.store(true);
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
              {{"method", method_name(method)}, {"client", *client}, {"peer", ctx->peer()},
               {"status", grpc_code_name(status.error_code())}, {"message", status.error_message()}});
  else
    log_shm_call(ctx, method, *client, "", a.status);
  reactor->Finish(status);
  return false;
}

grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* AttentionService::AttendBackward(
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
