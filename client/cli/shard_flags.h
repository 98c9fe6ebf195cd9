// What plsh attend and plsh bench share for sharding one request across
// replicas (client/lib, plsh/sharding.h): the --shards and --shard-by flags
// and the "sharding" section of META.json:
//
//   "sharding": {"kind": "heads" | "sequence" | "single", "reason",
//                "replicas": [target, ...], "retries", "seconds", "pooling",
//                "shards": [{"index", "replica", "request_id", "attempts",
//                            "heads": [begin, end], "kv_heads": [begin, end],
//                            "rows": [begin, end], "keys": [begin, end],
//                            "sent_bytes", "received_bytes", "seconds",
//                            "backend", "lsh_algorithm",
//                            "timings": {"queued", "receiving", "computing", "sending", "total"},
//                            "failures": [{"replica", "status", "seconds"}]}]}
//
// Header-only: the subcommands link the client library, plsh_cli_support
// does not.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>

#include "plsh/sharding.h"

namespace plsh::cli {

struct ShardCliArgs {
  int64_t shards = 0;       // 0: automatic
  std::string by = "auto";  // auto | heads | sequence
};

// True when the request goes through the sharding client: a list of
// targets, a dns: name, or --shards given.
inline bool wants_sharding(const std::string& target, const ShardCliArgs& a) {
  return client::is_replica_list(target) || a.shards > 0;
}

// --target, one server or the replicas that `what` ("the request", "each
// request") is sharded across, and the sharding flags --shards, --shard-by.
inline void add_target_and_shard_flags(CLI::App& app, std::string& target, ShardCliArgs& a, const std::string& what) {
  app.add_option("--target", target,
                 "plsh-server address host:port (or $PLSH_TARGET); a list a:1,b:2 or dns:///name:port shards " + what +
                     " across them")
      ->envname("PLSH_TARGET")
      ->capture_default_str();
  app.add_option("--shards", a.shards,
                 "split the request into this many shards, sent to the replicas of --target at once (a list a:1,b:2 "
                 "or dns:///name:port, every address a replica); 0: one per replica when each shard keeps at least "
                 "4 MiB, else one")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--shard-by", a.by,
                 "heads (whole GQA groups), sequence (query rows and the keys they reach) or auto "
                 "(whichever sends fewer bytes per shard)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "heads", "sequence"}));
}

inline client::ShardingOptions sharding_options(const ShardCliArgs& a) {
  client::ShardingOptions o;
  o.shards = a.shards;
  o.by = client::parse_shard_by(a.by).ok() ? *client::parse_shard_by(a.by) : client::ShardBy::kAuto;
  return o;
}

inline nlohmann::ordered_json timings_json(const client::ServerTimings& t) {
  return {{"queued", t.queued},
          {"receiving", t.receiving},
          {"computing", t.computing},
          {"sending", t.sending},
          {"total", t.total}};
}

inline nlohmann::ordered_json sharding_json(const client::ShardingSummary& s) {
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const client::ShardReport& r : s.shards) {
    nlohmann::ordered_json failures = nlohmann::ordered_json::array();
    for (const client::ShardFailure& f : r.failures)
      failures.push_back({{"replica", f.replica}, {"status", f.status}, {"seconds", f.seconds}});
    shards.push_back({{"index", r.spec.index},
                      {"replica", r.replica},
                      {"request_id", r.request_id},
                      {"attempts", r.attempts},
                      {"heads", {r.spec.head_begin, r.spec.head_end}},
                      {"kv_heads", {r.spec.kv_head_begin, r.spec.kv_head_end}},
                      {"rows", {r.spec.row_begin, r.spec.row_end}},
                      {"keys", {r.spec.key_begin, r.spec.key_end}},
                      {"sent_bytes", r.sent_bytes},
                      {"received_bytes", r.received_bytes},
                      {"seconds", r.seconds},
                      {"backend", r.backend},
                      {"lsh_algorithm", lsh_algorithm_name(r.lsh_algorithm)},
                      {"timings", timings_json(r.timings)},
                      {"failures", std::move(failures)}});
  }
  return {{"kind", client::shard_kind_name(s.kind)},
          {"reason", s.reason},
          {"replicas", s.replicas},
          {"retries", s.retries},
          {"seconds", s.seconds},
          {"pooling", s.pooling},
          {"shards", std::move(shards)}};
}

}  // namespace plsh::cli
