#include "bench/attend_load.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"

namespace plsh::bench {

namespace {

// N(0, 1) values in the wire dtype. One generator per tensor, seeded from
// (seed, tensor), so q does not change when only the kv shape does.
std::vector<uint8_t> random_tensor(int64_t elements, DType dtype, uint64_t seed, uint64_t tensor) {
  std::vector<uint8_t> bytes(static_cast<size_t>(elements) * dtype_bytes(dtype));
  std::mt19937_64 rng(mix64(seed + 0x9E3779B97F4A7C15ull * (tensor + 1)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kRow = 4096;
  std::vector<float> row(kRow);
  for (int64_t at = 0; at < elements; at += kRow) {
    const int64_t n = std::min(kRow, elements - at);
    for (int64_t i = 0; i < n; ++i) row[static_cast<size_t>(i)] = normal(rng);
    store_row(bytes.data(), dtype, at, n, row.data());
  }
  return bytes;
}

grpc::ChannelArguments channel_arguments(int connection) {
  // The server enforces its own message limit; the client never refuses first.
  grpc::ChannelArguments args = client::default_channel_arguments();
  // Channels with equal arguments share one TCP connection through gRPC's
  // global subchannel pool; a local pool and a distinct argument give each
  // --connections channel its own.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("plsh.bench.connection", connection);
  return args;
}

}  // namespace

double verify_tolerance(DType out_dtype) {
  switch (out_dtype) {
    case DType::kF32:
      return 1e-5;
    case DType::kF16:
      return 2e-3;
    case DType::kBF16:
      return 1e-2;
  }
  return 0;
}

bool selected_for_verify(uint64_t seed, int64_t index, double fraction) {
  if (fraction <= 0) return false;
  if (fraction >= 1) return true;
  const uint64_t word = mix64(seed ^ mix64(static_cast<uint64_t>(index) + 0x632BE59BD9B4E019ull));
  return static_cast<double>(word >> 11) * 0x1.0p-53 < fraction;
}

StatusOr<std::unique_ptr<AttendLoad>> AttendLoad::create(const AttendLoadConfig& config) {
  if (config.connections < 1)
    return invalid_argument("connections = " + std::to_string(config.connections) + ", expected >= 1");
  if (!(config.verify_fraction >= 0 && config.verify_fraction <= 1))
    return invalid_argument("verify = " + std::to_string(config.verify_fraction) + ", expected a fraction in [0, 1]");
  if (config.chunk_bytes < 0)
    return invalid_argument("chunk_bytes = " + std::to_string(config.chunk_bytes) + ", expected >= 0");
  if (config.deadline < 0)
    return invalid_argument("deadline = " + std::to_string(config.deadline) + ", expected >= 0 seconds");
  RETURN_IF_ERROR(validate_options(config.options));

  std::unique_ptr<AttendLoad> load(new AttendLoad(config));
  const AttentionOptions& o = load->config_.options;
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  load->q_ = random_tensor(o.batch * o.q_len * o.heads * o.head_dim, o.dtype, config.input_seed, 0);
  load->k_ = random_tensor(o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype, config.input_seed, 1);
  load->v_ = random_tensor(o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype, config.input_seed, 2);
  load->out_dtype_ = o.out_dtype.value_or(o.dtype);
  if (config.backward) {
    if (config.unary) return invalid_argument("backward and unary: a training step streams (Attend, AttendBackward)");
    if (config.shard)
      return invalid_argument(
          "backward and sharding: a kept context lives on one replica, expected one target with --backward");
    load->dout_ = random_tensor(o.batch * o.q_len * o.heads * o.head_dim, load->out_dtype_, config.input_seed, 3);
  }
  load->reference_size_ = static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(load->out_dtype_);
  load->tolerance_ = config.verify_tolerance.value_or(verify_tolerance(load->out_dtype_));

  if (config.shard) {
    const grpc::Status made = client::ShardedClient::connect(config.target, config.channel, &load->sharded_);
    if (!made.ok()) return Status(static_cast<StatusCode>(made.error_code()), made.error_message());
    const grpc::Status info = load->sharded_->replica(0).info(&load->info_, 10);
    if (!info.ok())
      return unavailable("target " + load->sharded_->replicas()[0] +
                         ": GetInfo failed: " + client::status_string(info));
  }
  for (int c = 0; !config.shard && c < config.connections; ++c) {
    std::shared_ptr<grpc::Channel> channel;
    std::string token;
    const grpc::Status made =
        client::make_channel(config.target, config.channel, channel_arguments(c), &channel, &token);
    if (!made.ok()) return invalid_argument(made.error_message());
    load->clients_.push_back(std::make_unique<client::Client>(std::move(channel), std::move(token)));
  }
  if (!config.shard) {
    const grpc::Status info = load->clients_.front()->info(&load->info_, 10);
    if (!info.ok()) return unavailable("target " + config.target + ": GetInfo failed: " + client::status_string(info));
  }
  if (config.workers < 1) return invalid_argument("workers = " + std::to_string(config.workers) + ", expected >= 1");
  if (!config.shm_dir.empty()) {
    if (config.unary) return invalid_argument("shm: AttendUnary is not used with shared memory, expected no --unary");
    if (config.shard) return invalid_argument("shm with sharding: shared memory is one host's, expected one target");
    if (config.backward)
      return invalid_argument(
          "shm with backward: a kept context holds its own copies, expected no --shm with --backward");
    RETURN_IF_ERROR(load->setup_shared_memory());
  } else {
    // Written (faulted in) now, not in the first measured request.
    load->outputs_.assign(static_cast<size_t>(config.workers), std::vector<uint8_t>(load->reference_size_, 0));
  }
  if (config.backward) load->grads_.resize(static_cast<size_t>(config.workers));

  if (config.verify_fraction > 0) {
    // The reference needs only the output: no estimates, except where the
    // output depends on them (an error-targeted request keeps the first
    // configuration whose estimate meets the target).
    AttentionOptions ref_options = o;
    ref_options.estimates = o.target_rel_err > 0;
    std::vector<uint8_t> out(load->reference_size_);
    TensorRefs t;
    t.q = load->q_.data();
    t.k = load->k_.data();
    t.v = load->v_.data();
    t.out = out.data();
    ASSIGN_OR_RETURN(const AttentionParams params, make_params(ref_options, t));
    ASSIGN_OR_RETURN(Backend * cpu, BackendRegistry::global().select("cpu", params));
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(const AttentionResult result, run_attention(*cpu, params, PlanLimits{}, ExecContext{}));
    (void)result;
    load->reference_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t n = static_cast<int64_t>(load->reference_size_ / dtype_bytes(load->out_dtype_));
    load->reference_.resize(static_cast<size_t>(n));
    load_row(out.data(), load->out_dtype_, 0, n, load->reference_.data());
  }
  return load;
}

Status AttendLoad::setup_shared_memory() {
  if (!info_.limits().shared_memory())
    return failed_precondition("shm: the server at " + config_.target +
                               " has no shared memory (start it with --shm-dir on this host)");
  auto aligned = [](int64_t n) { return (n + 4095) / 4096 * 4096; };
  k_at_ = aligned(static_cast<int64_t>(q_.size()));
  v_at_ = k_at_ + aligned(static_cast<int64_t>(k_.size()));
  outputs_at_ = v_at_ + aligned(static_cast<int64_t>(v_.size()));
  output_stride_ = aligned(static_cast<int64_t>(reference_size_));
  const int64_t total = outputs_at_ + output_stride_ * config_.workers;
  const std::string key = client::unique_shared_memory_key("plsh-bench");
  const grpc::Status created = client::SharedMemoryFile::create(config_.shm_dir, key, total, &shm_);
  if (!created.ok()) return failed_precondition("shm: " + created.error_message());
  std::memcpy(shm_->data(), q_.data(), q_.size());
  std::memcpy(shm_->data() + k_at_, k_.data(), k_.size());
  std::memcpy(shm_->data() + v_at_, v_.data(), v_.size());
  const grpc::Status registered = clients_.front()->register_shared_memory(key, key, 0, total);
  if (!registered.ok())
    return Status(static_cast<StatusCode>(registered.error_code()),
                  "shm: RegisterSharedMemory: " + registered.error_message());
  shm_region_ = key;
  return Status::Ok();
}

AttendLoad::~AttendLoad() {
  if (!shm_region_.empty()) clients_.front()->unregister_shared_memory(shm_region_);
}

uint8_t* AttendLoad::output_of(int worker) {
  const int slot = worker % config_.workers;
  if (shm_) return shm_->data() + outputs_at_ + output_stride_ * slot;
  return outputs_[static_cast<size_t>(slot)].data();
}

double AttendLoad::compare_with_reference(const std::vector<uint8_t>& out) const {
  if (out.size() != reference_size_) return std::numeric_limits<double>::infinity();
  return compare_with_reference(out.data());
}

double AttendLoad::compare_with_reference(const uint8_t* out) const {
  double max_diff = 0, max_ref = 0;
  constexpr int64_t kRow = 4096;
  std::vector<float> row(kRow);
  const int64_t n = static_cast<int64_t>(reference_.size());
  for (int64_t at = 0; at < n; at += kRow) {
    const int64_t m = std::min(kRow, n - at);
    load_row(out, out_dtype_, at, m, row.data());
    for (int64_t i = 0; i < m; ++i) {
      const double ref = reference_[static_cast<size_t>(at + i)];
      const double got = row[static_cast<size_t>(i)];
      // NaN anywhere is a mismatch, whatever the tolerance.
      if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
      max_diff = std::max(max_diff, std::fabs(got - ref));
      max_ref = std::max(max_ref, std::fabs(ref));
    }
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

Outcome AttendLoad::call(int worker, int64_t index) {
  client::AttendCall call;
  call.options = config_.options;
  call.q = q_.data();
  call.k = k_.data();
  call.v = v_.data();
  call.backend = config_.backend;
  call.chunk_bytes = config_.chunk_bytes;
  call.deadline_seconds = config_.deadline;
  call.request_id = "bench-" + std::to_string(index);
  uint8_t* out = output_of(worker);
  call.out = out;
  if (shm_) {
    call.q_shm = {shm_region_, 0};
    call.k_shm = {shm_region_, k_at_};
    call.v_shm = {shm_region_, v_at_};
    call.out_shm = {shm_region_, out - shm_->data()};
  }
  call.keep_context = config_.backward;
  client::AttendReply reply;
  const auto t0 = std::chrono::steady_clock::now();
  grpc::Status status;
  if (sharded_) {
    client::ShardedReply sharded;
    status = sharded_->attend(call, config_.sharding, &sharded);
    reply = std::move(sharded.reply);
  } else {
    client::Client& c = *clients_[static_cast<size_t>(worker) % clients_.size()];
    status = config_.unary ? c.attend_unary(call, &reply) : c.attend(call, &reply);
  }

  Outcome o;
  o.code = client::status_code_name(status.error_code());
  o.bytes_up = reply.sent_bytes;
  o.bytes_down = reply.received_bytes;
  if (!status.ok()) {
    o.message = status.error_message();
    return o;
  }
  // The worker's reply, used again every step (its gradients' storage kept).
  client::BackwardReply* grads = config_.backward ? &grads_[static_cast<size_t>(worker % config_.workers)] : nullptr;
  if (grads != nullptr) {  // never sharded (create refuses both)
    client::Client& c = *clients_[static_cast<size_t>(worker) % clients_.size()];
    const auto t1 = std::chrono::steady_clock::now();
    o.forward_seconds = std::chrono::duration<double>(t1 - t0).count();
    client::BackwardCall b;
    b.options = config_.options;
    b.context_id = reply.context_id;
    b.dout = dout_.data();
    b.chunk_bytes = config_.chunk_bytes;
    b.deadline_seconds = config_.deadline;
    b.request_id = call.request_id + "-backward";
    o.rpcs = 2;
    const grpc::Status bs = c.backward(b, grads);
    o.backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    o.bytes_up += grads->sent_bytes;
    o.bytes_down += grads->received_bytes;
    if (!bs.ok()) {
      // A failed backward leaves its context: give it back now.
      c.release_context(reply.context_id);
      o.ok_rpcs = 1;
      o.code = client::status_code_name(bs.error_code());
      o.message = "backward: " + bs.error_message();
      return o;
    }
  }
  o.tokens = tokens();
  o.has_server_timings = true;
  o.queued = reply.timings.queued;
  o.receiving = reply.timings.receiving;
  o.computing = reply.timings.computing;
  o.sending = reply.timings.sending;
  if (grads != nullptr) {
    // A step's server phases: its two calls' summed; each call's
    // receiving phase alone too (bench/ingest.sh: dout's ingest against
    // the same steps' q, k, v).
    o.forward_receiving = reply.timings.receiving;
    o.backward_receiving = grads->timings.receiving;
    o.queued += grads->timings.queued;
    o.receiving += grads->timings.receiving;
    o.computing += grads->timings.computing;
    o.sending += grads->timings.sending;
  }
  if (!reference_.empty() && selected_for_verify(config_.input_seed, index, config_.verify_fraction)) {
    o.verified = true;
    // AttendUnary answers in reply.out; Attend wrote to `out`.
    o.verify_error = config_.unary ? compare_with_reference(reply.out) : compare_with_reference(out);
    o.mismatch = !(o.verify_error <= tolerance_);
  }
  return o;
}

}  // namespace plsh::bench
