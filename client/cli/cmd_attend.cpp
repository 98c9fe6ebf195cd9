// plsh attend: plsh compute's request sent to a plsh-server. Same flags and
// the same .npy / META.json contract, plus where to send it (--target), the
// dtype on the wire, the chunk size and a deadline; META.json also gets the
// server's timings. Errors print the gRPC status name and message.
//
// --shm (a server on this host with --shm-dir): q, k and v go into one file
// of --shm-dir instead of over the socket, registered as a region for the
// call, and the server writes out and lse there; the file and the region
// are removed afterwards.
// With --dout --dq --dk --dv it also runs the backward on the server (SPEC
// section 8): the forward keeps its context there (keep_context), and the
// backward sends only dout (AttendBackward by context id), so q, k and v
// go up once; dq, dk, dv are those plsh compute --dout writes.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <vector>

#include "cli/cmd_compute.h"
#include "cli/commands.h"
#include "cli/connection_flags.h"
#include "cli/flags.h"
#include "cli/meta_json.h"
#include "cli/npy.h"
#include "cli/shard_flags.h"
#include "plsh/client.h"
#include "plsh/numeric.h"
#include "plsh/shared_memory.h"

namespace plsh::cli {
namespace {

// compute's flags, then attend's own.
struct AttendArgs : ComputeCliArgs {
  std::string target = "127.0.0.1:50051";
  client::ChannelOptions channel;    // TLS and the bearer token
  std::string wire_dtype;            // f32 | f16 | bf16; empty: the inputs' dtype
  int64_t chunk_bytes = 0;           // 0: the largest the server allows
  double deadline = 0;               // seconds; 0: none
  ShardCliArgs sharding;             // --shards, --shard-by: with a list of targets
  bool shm = false;                  // tensors through a shared-memory file instead of the socket
  std::string shm_dir = "/dev/shm";  // the server's --shm-dir, as this process sees it
};

// One shared-memory file holding q, k, v, out and lse for one call, each
// at a 4 KiB boundary, registered as a region of the same name.
class SharedCall {
 public:
  static grpc::Status setup(client::Client& c, const std::string& dir, client::AttendCall* call,
                            std::unique_ptr<SharedCall>* out) {
    auto shared = std::unique_ptr<SharedCall>(new SharedCall(c));
    const AttentionOptions& o = call->options;
    const int64_t batch = std::max<int64_t>(1, o.batch);
    const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
    const int64_t in_size = static_cast<int64_t>(dtype_bytes(o.dtype));
    const int64_t q_bytes = batch * o.q_len * o.heads * o.head_dim * in_size;
    const int64_t kv_bytes = batch * o.kv_len * kv_heads * o.head_dim * in_size;
    const int64_t out_bytes =
        batch * o.q_len * o.heads * o.head_dim * static_cast<int64_t>(dtype_bytes(o.out_dtype.value_or(o.dtype)));
    const int64_t lse_bytes = call->return_lse ? batch * o.q_len * o.heads * 4 : 0;
    auto aligned = [](int64_t n) { return (n + 4095) / 4096 * 4096; };
    const int64_t k_at = aligned(q_bytes), v_at = k_at + aligned(kv_bytes), out_at = v_at + aligned(kv_bytes);
    const int64_t lse_at = out_at + aligned(out_bytes), total = lse_at + aligned(lse_bytes);
    const std::string key = client::unique_shared_memory_key("plsh-attend");
    if (grpc::Status s = client::SharedMemoryFile::create(dir, key, total, &shared->file_); !s.ok()) return s;
    uint8_t* base = shared->file_->data();
    std::memcpy(base, call->q, static_cast<size_t>(q_bytes));
    std::memcpy(base + k_at, call->k, static_cast<size_t>(kv_bytes));
    std::memcpy(base + v_at, call->v, static_cast<size_t>(kv_bytes));
    if (grpc::Status s = c.register_shared_memory(key, key, 0, total); !s.ok()) return s;
    shared->region_ = key;
    call->q_shm = {key, 0};
    call->k_shm = {key, k_at};
    call->v_shm = {key, v_at};
    call->out_shm = {key, out_at};
    if (call->return_lse) call->lse_shm = {key, lse_at};
    shared->out_ = base + out_at;
    shared->lse_ = reinterpret_cast<const float*>(base + lse_at);
    *out = std::move(shared);
    return grpc::Status::OK;
  }
  ~SharedCall() {
    if (!region_.empty()) c_.unregister_shared_memory(region_);
  }
  const uint8_t* out() const { return out_; }
  const float* lse() const { return lse_; }

 private:
  explicit SharedCall(client::Client& c) : c_(c) {}
  client::Client& c_;
  std::unique_ptr<client::SharedMemoryFile> file_;
  std::string region_;
  const uint8_t* out_ = nullptr;
  const float* lse_ = nullptr;
};

// The array's elements in another dtype (through float, as the backends read them).
std::vector<uint8_t> convert(const NpyArray& a, DType to) {
  const int64_t n = a.elements();
  std::vector<float> values(static_cast<size_t>(n));
  load_row(a.ptr(), a.dtype, 0, n, values.data());
  std::vector<uint8_t> out(static_cast<size_t>(n) * dtype_bytes(to));
  store_row(out.data(), to, 0, n, values.data());
  return out;
}

// A failed call: the gRPC status as the server sent it.
int report_rpc_error(const grpc::Status& s) {
  std::cerr << "plsh attend: " << client::status_string(s) << std::endl;
  return s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? kExitUsage : kExitRuntime;
}

int attend(const AttendArgs& args) {
  const auto t_start = std::chrono::steady_clock::now();
  // The shared flags include compute's --threads, which means nothing here:
  // refuse it rather than ignore it.
  if (args.attention.threads != 0)
    return report_error("attend", invalid_argument("--threads = " + std::to_string(args.attention.threads) +
                                                   ", expected 0: the server's own --threads decides"));
  if (Status s = check_output_paths(args.outputs); !s.ok()) return report_error("attend", s);
  StatusOr<std::optional<DType>> grad_dtype_flag = check_backward_args(args.backward, args.attention.bf16_bits);
  if (!grad_dtype_flag.ok()) return report_error("attend", grad_dtype_flag.status());
  StatusOr<AttentionInputs> loaded = load_attention_inputs(args.attention);
  if (!loaded.ok()) return report_error("attend", loaded.status());
  AttentionInputs& in = *loaded;

  // The output keeps the files' dtype unless asked otherwise, as compute's does.
  const DType file_dtype = in.options.dtype;
  if (!in.options.out_dtype) in.options.out_dtype = file_dtype;
  // dout, checked before anything is sent: out's shape and dtype.
  const bool backward = args.backward.requested();
  NpyArray dout;
  if (backward) {
    StatusOr<NpyArray> read = read_npy(args.backward.dout_path, NpyReadOptions{args.attention.bf16_bits});
    if (!read.ok()) return report_error("attend", read.status());
    dout = std::move(read).value();
    if (Status s = check_dout(&dout, args.backward.dout_path, in); !s.ok()) return report_error("attend", s);
  }
  if (args.shm && wants_sharding(args.target, args.sharding))
    return report_error("attend", invalid_argument("--shm with a list of targets or --shards: shared memory is one "
                                                   "host's, expected one --target with --shm"));
  if (args.shm && backward)
    return report_error("attend", invalid_argument("--shm with --dout: a kept context holds its own copies of the "
                                                   "tensors, expected no --shm for a backward"));
  if (backward && wants_sharding(args.target, args.sharding))
    return report_error("attend",
                        invalid_argument("--dout with a list of targets or --shards: a kept context lives on one "
                                         "replica, expected one --target for a backward"));
  const DType grad_dtype = grad_dtype_flag->value_or(file_dtype);
  const double load_seconds = seconds_since(t_start);
  DType wire = file_dtype;
  if (!args.wire_dtype.empty()) {
    StatusOr<DType> parsed = parse_dtype(args.wire_dtype);
    if (!parsed.ok())
      return report_error("attend",
                          invalid_argument("--wire-dtype = '" + args.wire_dtype + "', expected f32, f16 or bf16"));
    wire = *parsed;
  }
  std::vector<uint8_t> q, k, v;
  const void *q_ptr = in.q.ptr(), *k_ptr = in.k.ptr(), *v_ptr = in.v.ptr();
  if (wire != file_dtype) {
    q = convert(in.q, wire);
    k = convert(in.k, wire);
    v = convert(in.v, wire);
    q_ptr = q.data();
    k_ptr = k.data();
    v_ptr = v.data();
  }

  client::AttendCall call;
  call.options = in.options;
  call.options.dtype = wire;
  call.q = q_ptr;
  call.k = k_ptr;
  call.v = v_ptr;
  call.return_lse = !args.outputs.lse_path.empty();
  call.backend = args.attention.backend;
  call.chunk_bytes = args.chunk_bytes;
  call.deadline_seconds = args.deadline;
  call.keep_context = backward;

  client::AttendReply reply;
  std::optional<client::ShardingSummary> sharding;  // with a list of targets (plsh/sharding.h)
  const auto t_call = std::chrono::steady_clock::now();
  grpc::Status status;
  std::unique_ptr<client::Client> c;  // unsharded: the backward goes where its context is
  std::unique_ptr<SharedCall> shared;
  if (wants_sharding(args.target, args.sharding)) {
    std::unique_ptr<client::ShardedClient> sharded_client;
    if (const grpc::Status s = client::ShardedClient::connect(args.target, args.channel, &sharded_client); !s.ok())
      return report_rpc_error(s);
    client::ShardedReply sharded;
    status = sharded_client->attend(call, sharding_options(args.sharding), &sharded);
    reply = std::move(sharded.reply);
    sharding = std::move(sharded.sharding);
  } else {
    if (const grpc::Status s = client::Client::connect(args.target, args.channel, &c); !s.ok())
      return report_rpc_error(s);
    if (args.shm) {
      if (const grpc::Status s = SharedCall::setup(*c, args.shm_dir, &call, &shared); !s.ok())
        return report_rpc_error(s);
    }
    status = c->attend(call, &reply);
  }
  const double call_seconds = seconds_since(t_call);
  if (!status.ok()) return report_rpc_error(status);

  // The backward on the kept context: only dout goes up.
  client::BackwardReply grads;
  double backward_seconds = 0;
  if (backward) {
    client::BackwardCall bw;
    bw.options = call.options;
    bw.context_id = reply.context_id;
    bw.dout = dout.ptr();
    bw.grad_dtype = grad_dtype;
    bw.chunk_bytes = args.chunk_bytes;
    bw.deadline_seconds = args.deadline;
    const auto t_backward = std::chrono::steady_clock::now();
    const grpc::Status s = c->backward(bw, &grads);
    backward_seconds = seconds_since(t_backward);
    if (!s.ok()) {
      c->release_context(reply.context_id);  // a failed backward leaves it; nothing else will use it
      return report_rpc_error(s);
    }
  }

  const auto t_save = std::chrono::steady_clock::now();
  const AttentionOptions& o = in.options;
  const void* out = shared ? static_cast<const void*>(shared->out()) : reply.out.data();
  const float* lse = shared ? shared->lse() : reply.lse.data();
  Status saved = write_in_layout(args.outputs.out_path, reply.out_dtype, output_shape(o, in.batched), out, in.layout);
  if (saved.ok() && call.return_lse)
    saved = write_in_layout(args.outputs.lse_path, DType::kF32, lse_shape(o, in.batched), lse, in.layout, false);
  if (saved.ok() && backward) {
    const auto t_grads = std::chrono::steady_clock::now();
    saved = write_gradients(args.backward, grad_dtype, in, grads.dq.data(), grads.dk.data(), grads.dv.data());
    grads.result.timings["call"] = backward_seconds;
    grads.result.timings["save"] = seconds_since(t_grads);
  }
  if (!saved.ok()) return report_error("attend", saved);

  if (!args.outputs.meta_path.empty()) {
    AttentionResult result = reply.result;
    result.timings["load"] = load_seconds;
    result.timings["call"] = call_seconds;
    result.timings["save"] = seconds_since(t_save);
    nlohmann::ordered_json meta = result_to_json(result);
    // What was sent (with the wire dtype), and the defaults as the server
    // resolved them (scale, q_pos0, k_pos0 in its summary).
    add_params_json(call.options, result, in.batched, &meta);
    meta["shape"]["layout"] = name_of(kLayoutNames, in.layout);
    meta["server"] = {{"target", args.target},
                      {"request_id", reply.request_id},
                      {"wire_dtype", dtype_name(wire)},
                      {"shared_memory", args.shm},
                      {"timings", timings_json(reply.timings)},
                      {"messages", reply.messages},
                      {"largest_message_bytes", reply.largest_message_bytes},
                      {"sent_bytes", reply.sent_bytes},
                      {"received_bytes", reply.received_bytes}};
    if (sharding) meta["sharding"] = sharding_json(*sharding);
    if (backward) {
      meta["backward"] = backward_to_json(grads.result, grad_dtype);
      meta["backward"]["server"] = {{"request_id", grads.request_id},         {"context_id", grads.context_id},
                                    {"timings", timings_json(grads.timings)}, {"messages", grads.messages},
                                    {"sent_bytes", grads.sent_bytes},         {"received_bytes", grads.received_bytes}};
    }
    if (Status s = write_meta_file(args.outputs.meta_path, meta); !s.ok()) return report_error("attend", s);
  }
  return kExitOk;
}

RunFn setup_attend(CLI::App& app) {
  auto args = std::make_shared<AttendArgs>();
  add_compute_flags(app, *args);
  add_target_and_shard_flags(app, args->target, args->sharding, "the request");
  add_connection_flags(app, args->channel);
  app.add_option("--wire-dtype", args->wire_dtype,
                 "dtype of q, k, v on the wire: f32, f16 or bf16 (default: the files')")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--chunk-bytes", args->chunk_bytes, "payload bytes per message (0: the server's largest)")
      ->capture_default_str()
      ->transform(decimal_integer(false));
  app.add_option("--deadline", args->deadline, "seconds for the whole call (0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--shm", args->shm,
               "hand q, k, v and the outputs over in a shared-memory file of --shm-dir instead of the socket (a "
               "server on this host started with the same --shm-dir, running as the same user)");
  app.add_option("--shm-dir", args->shm_dir, "with --shm: the server's shared-memory directory")->capture_default_str();
  return [args] { return attend(*args); };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(attend, "Send plsh compute's request to a plsh-server (same flags, plus --target)",
                      plsh::cli::setup_attend);
