// The request plsh bench sends: one Attend (or AttendUnary) call to
// plsh-server with inputs generated once from a seed and reused by every
// request, so that the client measures the service, not its own data
// generation. A seeded share of the responses is checked against the same
// request computed in this process on the CPU backend (--verify).
//
// The client's side of the transport costs as little as the library allows:
// chunks point at the inputs (no copy), and each worker receives its
// output into a buffer of its own, reused from one request to the next (no
// fresh, page-faulted 100s of MiB per response). With shared memory
// (--shm) the inputs sit in one file of the server's --shm-dir, registered
// once, and each worker's output has its own place there.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/load.h"
#include "plsh/client.h"
#include "plsh/params.h"
#include "plsh/sharding.h"
#include "plsh/shared_memory.h"
#include "plsh/status.h"

namespace plsh::bench {

struct AttendLoadConfig {
  std::string target;              // host:port of plsh-server
  client::ChannelOptions channel;  // TLS and the bearer token
  AttentionOptions options;        // shape, wire dtype, mode and its parameters
  std::string backend = "auto";    // the server's backend to ask for
  int64_t chunk_bytes = 0;         // payload per message; 0: the largest the server allows
  double deadline = 0;             // seconds per call; 0: none
  bool unary = false;              // AttendUnary instead of the Attend stream
  // Each request a training step: a forward that keeps its context, then
  // its backward by context id with dout ~ N(0, 1) (AttendBackward).
  bool backward = false;
  int connections = 1;                     // gRPC channels (TCP connections), shared round-robin by the workers
  uint64_t input_seed = 0;                 // seed of q, k, v ~ N(0, 1)
  double verify_fraction = 0;              // share of responses checked, in [0, 1]
  std::optional<double> verify_tolerance;  // default: verify_tolerance(out dtype)
  int workers = 1;                         // the most requests in flight at once: one output buffer each
  std::string shm_dir;                     // shared memory: the server's --shm-dir as this process sees it; "": none
  // Each request cut across the replicas of `target` (a list or a dns:
  // name; plsh/sharding.h) instead of sent whole; `connections` and `unary`
  // do not apply.
  bool shard = false;
  client::ShardingOptions sharding;
};

// Largest max |out - ref| / max |ref| that counts as a match, by output
// dtype: float32 1e-5 (the same kernels give the same result; a different
// backend's summation order stays near 1e-6); float16 2e-3 and bfloat16
// 1e-2: two roundings of the output and the probabilities, at most 2^-12
// (2^-9) relative each, with room for the sums (tests/gpu uses the same).
double verify_tolerance(DType out_dtype);

// Whether request `index` is one of the `fraction` checked, from a hash of
// (seed, index): the same requests on every run with the same seed.
bool selected_for_verify(uint64_t seed, int64_t index, double fraction);

class AttendLoad {
 public:
  // Generates the inputs, asks the server for its info (so a wrong target
  // fails here, once, not in every request) and computes the reference
  // output when verifying.
  static StatusOr<std::unique_ptr<AttendLoad>> create(const AttendLoadConfig& config);

  // One request; thread-safe. worker picks the connection.
  Outcome call(int worker, int64_t index);

  const v1::GetInfoResponse& server_info() const { return info_; }
  const AttendLoadConfig& config() const { return config_; }
  int64_t input_bytes() const { return static_cast<int64_t>(q_.size() + k_.size() + v_.size()); }
  int64_t output_bytes() const { return static_cast<int64_t>(reference_size_); }
  int64_t tokens() const { return config_.options.batch * config_.options.q_len; }
  double tolerance() const { return tolerance_; }
  double reference_seconds() const { return reference_seconds_; }  // time to compute the reference (0 without)

  // max |out - ref| / max |ref| over the output, both in out dtype; +inf
  // for an output of the wrong size.
  double compare_with_reference(const std::vector<uint8_t>& out) const;
  // The same over output_bytes() bytes at out.
  double compare_with_reference(const uint8_t* out) const;

  // Unregisters the shared-memory region (the file goes with shm_).
  ~AttendLoad();

 private:
  explicit AttendLoad(AttendLoadConfig config) : config_(std::move(config)) {}
  Status setup_shared_memory();
  // Where worker w's output goes: its own buffer (or place in the file).
  uint8_t* output_of(int worker);
  AttendLoadConfig config_;
  std::vector<std::unique_ptr<client::Client>> clients_;
  std::unique_ptr<client::ShardedClient> sharded_;  // with config.shard
  std::vector<uint8_t> q_, k_, v_, dout_;
  std::vector<float> reference_;  // [B, Nq, H, D] as float, the CPU backend's output
  size_t reference_size_ = 0;     // output bytes in out dtype
  DType out_dtype_ = DType::kF32;
  double tolerance_ = 0;
  double reference_seconds_ = 0;
  v1::GetInfoResponse info_;
  std::vector<std::vector<uint8_t>> outputs_;  // per worker, allocated (and faulted in) when the load is made
  std::vector<client::BackwardReply> grads_;   // per worker (--backward): its gradients' storage kept across steps
  // Shared memory: one file, q | k | v | worker 0's out | worker 1's out ...
  std::unique_ptr<client::SharedMemoryFile> shm_;
  std::string shm_region_;
  int64_t k_at_ = 0, v_at_ = 0, outputs_at_ = 0, output_stride_ = 0;
};

}  // namespace plsh::bench
