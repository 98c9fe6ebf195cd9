// One attention request cut into shards that several plsh-server replicas
// compute at once, stitched back into one output (issue 14).
//
//   std::unique_ptr<plsh::client::ShardedClient> c;
//   grpc::Status s = plsh::client::ShardedClient::connect("a:50051,b:50051,c:50051", {}, &c);
//   // or "dns:///plsh-headless.ns.svc.cluster.local:50051": every address of the name is a replica
//   plsh::client::ShardedReply reply;
//   s = c->attend(call, plsh::client::ShardingOptions{}, &reply);
//   // reply.reply.out / .lse / .result as from Client::attend; reply.sharding says how it was cut
//
// Two cuts, both exact (SPEC section 1: positions are absolute, so shards of
// one sequence agree):
//   - heads: each shard takes whole GQA groups (kv heads and their query
//     heads), every row and key. Slopes go explicitly (the standard slopes
//     depend on H) and for lsh the seed is translated so that the shard's
//     local head h draws what global head h0 + h draws (head_shard_seed).
//   - sequence: each shard takes a range of query rows, aligned to the CPU
//     backend's row tiles (kShardRowAlign), and only the key rows those rows
//     may attend: causal limits, the window W_h, or for lsh the union of the
//     blocks that meet the rows under the request's draws (plsh_core's
//     draw_hashes / block_begin / block_end); exact attends every key.
//     q_pos0 and k_pos0 are the shard's absolute positions.
// plan_shards picks the cut that sends fewer bytes per shard (the critical
// path when replicas run in parallel); see ShardPlan::reason.
//
// Failures: a shard whose replica fails with a retryable status (UNAVAILABLE,
// RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN, CANCELLED, or a replica's
// own DEADLINE_EXCEEDED before the call's deadline) is sent again to another
// replica, within the call's deadline; a shard is idempotent. The summary
// names every failed attempt. Other statuses (INVALID_ARGUMENT, ...) fail the
// call with the replica's status.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plsh/client.h"
#include "plsh/params.h"
#include "plsh/result.h"
#include "plsh/status.h"
#include "plsh/text.h"

namespace plsh::client {

// The CPU backend computes query rows in tiles of 128 (exact, window) or 64
// (lsh) from row 0 of the request (kernels/cpu/tiles.h, kMaxRowTile and
// row_tile): a sequence shard that starts on a multiple of 128 gives every
// row the same tile, the same key tiles and so the same float summation
// order as the unsharded request. tests/integration/test_sharding.cpp checks
// the bits. The servers say it (GetInfoResponse.shard_row_align), and
// ShardedClient plans with theirs; this is what servers before that field
// aligned to, and what a plan made without a server uses.
inline constexpr int64_t kShardRowAlign = 128;

// Automatic shard count: one shard per replica, but no more shards than
// leave each at least this many bytes (sent + received). Below it a shard's
// fixed cost (a stream, the ack, the summary and the estimates, about a
// millisecond on loopback) outweighs what splitting saves; bench/RESULTS.md,
// "Sharding".
inline constexpr int64_t kDefaultMinShardBytes = int64_t{4} << 20;

enum class ShardBy { kAuto, kHeads, kSequence };
// How a plan cut the request: kSingle sends it unchanged to one replica.
enum class ShardKind { kSingle, kHeads, kSequence };
// What the name functions print and parse_shard_by reads.
inline constexpr EnumName<ShardBy> kShardByNames[] = {
    {ShardBy::kAuto, "auto"}, {ShardBy::kHeads, "heads"}, {ShardBy::kSequence, "sequence"}};
inline constexpr EnumName<ShardKind> kShardKindNames[] = {
    {ShardKind::kSingle, "single"}, {ShardKind::kHeads, "heads"}, {ShardKind::kSequence, "sequence"}};

const char* shard_by_name(ShardBy by);        // "auto", "heads", "sequence"
const char* shard_kind_name(ShardKind kind);  // "single", "heads", "sequence"
StatusOr<ShardBy> parse_shard_by(const std::string& text);

struct ShardingOptions {
  int64_t shards = 0;           // P; 0: automatic (one per replica when each shard keeps min_shard_bytes)
  ShardBy by = ShardBy::kAuto;  // auto: the cut with fewer bytes per shard
  int64_t min_shard_bytes = kDefaultMinShardBytes;  // automatic P only
  int max_attempts = 0;                             // per shard, first try included; 0: replicas + 1
  int64_t row_align =
      0;  // sequence shards start at multiples of it; 0: the servers' (ShardedClient), else kShardRowAlign
};

// One shard: which heads, rows and keys of the request it carries. Ranges
// are half-open; rows and keys are per batch item (every item is cut alike).
struct ShardSpec {
  int index = 0;
  int64_t head_begin = 0, head_end = 0;        // query heads
  int64_t kv_head_begin = 0, kv_head_end = 0;  // their kv heads
  int64_t row_begin = 0, row_end = 0;          // query rows
  int64_t key_begin = 0, key_end = 0;          // key (and value) rows
  int64_t sent_bytes = 0;                      // q + k + v payload of this shard
  int64_t received_bytes = 0;                  // out (+ lse) payload
};

struct ShardPlan {
  ShardKind kind = ShardKind::kSingle;
  std::vector<ShardSpec> shards;
  int64_t sent_bytes = 0, received_bytes = 0;  // totals over the shards
  int64_t max_shard_bytes = 0;                 // largest sent + received of one shard
  std::string reason;                          // why this cut and this many shards, for people
  std::vector<double> slopes;                  // the request's slopes, resolved ([H])
  int64_t q_pos0 = 0;                          // the request's q_pos0, resolved
};

// Cuts a request (validated with plsh_core's rules) into at most `parts`
// shards (0: automatic for `replicas` replicas). Pure: no I/O.
StatusOr<ShardPlan> plan_shards(const AttentionOptions& options, bool return_lse, const ShardingOptions& sharding,
                                int64_t replicas);

// The cut of one kind into exactly the shards it can make up to `parts`
// (heads: at most Hkv; sequence: at most one per kShardRowAlign rows).
StatusOr<ShardPlan> plan_kind(const AttentionOptions& options, bool return_lse, ShardKind kind, int64_t parts,
                              int64_t row_align = kShardRowAlign);

// SPEC section 5's word index is linear in the head (1 + 4 (h 2^24 + k) + j),
// so the draws of head h0 + h under `seed` are those of head h under this
// seed (uint64 arithmetic wraps alike): what a head shard starting at h0 sends.
uint64_t head_shard_seed(uint64_t seed, int64_t head_begin);

// The options of shard `spec` of `plan` (slopes, positions and seed made
// explicit where the cut needs them).
AttentionOptions shard_options(const AttentionOptions& options, const ShardPlan& plan, const ShardSpec& spec);

// What one shard's replica answered, for merging.
struct ShardResult {
  AttentionResult result;
  std::vector<double> out_mean_square;  // per shard head: mean ||out_i||^2 over the shard's rows
};

// The merged result of a plan's shards (in plan order). Exact: flops,
// dense_flops, per-head mask_max_err (rows not sampled), max_abs_err and
// bound_max of the probe, rows. Pooled: the probe's rel_err, weighting each
// (shard, head) by its probe rows times its mean ||out||^2 (the server
// weights by sum ||o*||^2 over the probe rows, which the wire does not
// carry); sequence shards' mask_spectral_err per head as the root sum of
// squares of the shards' (an upper bound for the stacked row blocks).
AttentionResult merge_results(const AttentionOptions& options, const ShardPlan& plan,
                              const std::vector<ShardResult>& shards);

// How merge_results combined the estimates for a cut, one line for people.
const char* pooling_note(ShardKind kind);

// One failed attempt of a shard.
struct ShardFailure {
  std::string replica;
  std::string status;  // "UNAVAILABLE: ..."
  double seconds = 0;  // from the attempt's start to its failure
};

struct ShardReport {
  ShardSpec spec;
  std::string replica;  // the one that answered
  std::string request_id;
  int attempts = 0;
  std::vector<ShardFailure> failures;
  double seconds = 0;     // client wall time of the answering attempt
  ServerTimings timings;  // the answering server's
  std::string backend;
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;
  int64_t sent_bytes = 0, received_bytes = 0;  // tensor payload of the answering attempt
};

struct ShardingSummary {
  ShardKind kind = ShardKind::kSingle;
  std::string reason;
  std::vector<std::string> replicas;  // every replica the client knows
  std::vector<ShardReport> shards;
  int retries = 0;      // failed attempts that were sent again
  double seconds = 0;   // client wall time of the whole call
  std::string pooling;  // how the estimates were combined, for people
};

struct ShardedReply {
  AttendReply reply;  // out, lse, the merged result; bytes and messages summed over shards
  ShardingSummary sharding;
};

// Replica addresses from a --target value: a comma list of host:port, each
// item either a gRPC target used as is or "dns:[//authority]/host:port",
// which is resolved here (getaddrinfo) into one "ipv4:" / "ipv6:" target per
// address. tls_name: the DNS host of the first dns: item ("" otherwise), the
// name a TLS certificate must carry when connecting to its addresses.
grpc::Status resolve_replicas(const std::string& targets, std::vector<std::string>* replicas, std::string* tls_name);

// True for a --target value that names more than one server or a dns: name.
bool is_replica_list(const std::string& targets);

class ShardedClient {
 public:
  static grpc::Status connect(const std::string& targets, const ChannelOptions& options,
                              std::unique_ptr<ShardedClient>* client);
  // Replicas given directly (already resolved), each with the same options.
  static grpc::Status connect(const std::vector<std::string>& replicas, const ChannelOptions& options,
                              std::unique_ptr<ShardedClient>* client);

  // Cuts, sends and stitches. Errors: INVALID_ARGUMENT for options that fail
  // plsh_core's validation (before anything is sent), else the status of the
  // first shard that could not be completed.
  grpc::Status attend(const AttendCall& call, const ShardingOptions& sharding, ShardedReply* reply);

  size_t size() const { return replicas_.size(); }
  const std::vector<std::string>& replicas() const { return replicas_; }
  Client& replica(size_t i) { return *clients_[i]; }

 private:
  struct Run;
  ShardedClient() = default;
  // A replica for a shard's next attempt: not failed in this shard, not
  // marked down, fewest shards in flight; `preferred` on ties.
  size_t pick_replica(size_t preferred, const std::vector<bool>& tried);
  void mark_down(size_t replica);
  void run_shard(Run& run, size_t index);
  // GetInfoResponse.shard_row_align of the first replica that answers, once
  // (kShardRowAlign from servers before the field, or when none answers).
  int64_t servers_row_align();

  std::vector<std::string> replicas_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::mutex mutex_;                                               // guards the two below
  std::vector<int> in_flight_;                                     // shards running on each replica
  std::vector<std::chrono::steady_clock::time_point> down_until_;  // after UNAVAILABLE: avoided until then
  uint64_t next_first_ = 0;                                        // round robin of shard 0's replica over calls
  int64_t row_align_ = 0;                                          // servers_row_align(), once asked
};

}  // namespace plsh::client
