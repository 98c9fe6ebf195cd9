// Cutting a request into shards (plsh/sharding.h): which heads, rows and
// keys each shard carries, what it costs in bytes, and the options it is
// sent with. Pure functions of the options: no I/O, no maths library.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "plsh/draws.h"
#include "plsh/sharding.h"

namespace plsh::client {

namespace {

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

int64_t sat_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return b > 0 ? kMax : kMin;
  return r;
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os.precision(3);
  os << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return os.str();
}

// Bytes per row of each tensor, per head.
struct RowBytes {
  int64_t q = 0;    // per query row and query head
  int64_t out = 0;  // out + lse per query row and query head
  int64_t kv = 0;   // k + v per key row and kv head
};

RowBytes row_bytes(const AttentionParams& p, bool return_lse) {
  const int64_t in = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t out = static_cast<int64_t>(dtype_bytes(p.out_dtype));
  return {p.head_dim * in, p.head_dim * out + (return_lse ? 4 : 0), 2 * p.head_dim * in};
}

void add_totals(ShardPlan* plan) {
  plan->sent_bytes = plan->received_bytes = plan->max_shard_bytes = 0;
  for (const ShardSpec& s : plan->shards) {
    plan->sent_bytes += s.sent_bytes;
    plan->received_bytes += s.received_bytes;
    plan->max_shard_bytes = std::max(plan->max_shard_bytes, s.sent_bytes + s.received_bytes);
  }
}

ShardSpec whole_request(const AttentionParams& p, const RowBytes& z) {
  ShardSpec s;
  s.head_end = p.heads;
  s.kv_head_end = p.kv_heads;
  s.row_end = p.q_len;
  s.key_end = p.kv_len;
  s.sent_bytes = p.batch * (p.q_len * p.heads * z.q + p.kv_len * p.kv_heads * z.kv);
  s.received_bytes = p.batch * p.q_len * p.heads * z.out;
  return s;
}

// Whole GQA groups: kv heads split as evenly as they go.
std::vector<ShardSpec> head_shards(const AttentionParams& p, const RowBytes& z, int64_t parts) {
  const int64_t n = std::min(parts, p.kv_heads);
  std::vector<ShardSpec> shards;
  for (int64_t i = 0; i < n; ++i) {
    ShardSpec s;
    s.index = static_cast<int>(i);
    s.kv_head_begin = p.kv_heads * i / n;
    s.kv_head_end = p.kv_heads * (i + 1) / n;
    s.head_begin = s.kv_head_begin * p.head_group;
    s.head_end = s.kv_head_end * p.head_group;
    s.row_end = p.q_len;
    s.key_end = p.kv_len;
    const int64_t heads = s.head_end - s.head_begin, kv_heads = s.kv_head_end - s.kv_head_begin;
    s.sent_bytes = p.batch * (p.q_len * heads * z.q + p.kv_len * kv_heads * z.kv);
    s.received_bytes = p.batch * p.q_len * heads * z.out;
    shards.push_back(s);
  }
  return shards;
}

// The key positions [lo, hi) that query positions [first, last] may attend,
// before clamping to the request's keys.
class KeyReach {
 public:
  explicit KeyReach(const AttentionParams& p) : p_(p) {
    if (p.mode == Mode::kWindow) {
      for (int64_t w : p.window) width_ = std::max(width_, w);
    } else if (uses_draws(p.mode)) {
      for (int64_t h = 0; h < p.heads; ++h) {
        const std::vector<Draw> d = head_draws(p, h);
        draws_.insert(draws_.end(), d.begin(), d.end());
      }
      // Longest pitches first: they reach furthest, and the scans below
      // stop once no shorter pitch can reach further.
      std::sort(draws_.begin(), draws_.end(), [](const Draw& a, const Draw& b) { return a.pitch > b.pitch; });
    }
  }

  int64_t lo(int64_t first) const {
    switch (p_.mode) {
      case Mode::kExact:
        return kMin;
      // One key beyond the window too: the nearest key outside it, where
      // mask_max_err (SPEC 6) finds the window's largest error, so that each
      // shard's estimate covers the same pairs as the unsharded one's.
      case Mode::kWindow:
        return width_ == kNoWindow ? kMin : sat_add(first, -width_);
      case Mode::kLsh:
      case Mode::kFixedBlocks: {
        int64_t best = kMax;
        for (const Draw& d : draws_) {
          if (!std::isfinite(d.pitch)) return kMin;
          // A block holds at most ceil(pitch) positions.
          if (first - static_cast<int64_t>(std::ceil(d.pitch)) >= best) break;
          best = std::min(best, block_begin(first, d));
        }
        // The key just before the union: mask_max_err's largest error
        // outside a row's blocks sits at the nearest key outside them.
        return best == kMax ? first : sat_add(best, -1);
      }
    }
    return kMin;
  }

  int64_t hi(int64_t last) const {
    int64_t h = kMax;
    switch (p_.mode) {
      case Mode::kExact:
        break;
      case Mode::kWindow:
        h = width_ == kNoWindow ? kMax : sat_add(last, sat_add(width_, 1));
        break;
      case Mode::kLsh:
      case Mode::kFixedBlocks: {
        int64_t best = kMin;
        for (const Draw& d : draws_) {
          if (!std::isfinite(d.pitch)) {
            best = kMax;
            break;
          }
          if (last + static_cast<int64_t>(std::ceil(d.pitch)) <= best) break;
          best = std::max(best, block_end(last, d));
        }
        h = best == kMin ? last + 1 : sat_add(best, 1);
        break;
      }
    }
    if (p_.causal) h = std::min(h, last + 1);
    return h;
  }

 private:
  const AttentionParams& p_;
  int64_t width_ = 0;        // window: the widest W_h
  std::vector<Draw> draws_;  // lsh: every head's draws
};

// Query rows in tiles of row_align rows; a shard is a range of whole tiles
// (the last may be short), with the keys its rows may attend. The cut
// minimises the largest shard's bytes: its cost only grows with its last
// tile and shrinks with its first, so the least threshold a greedy cut
// meets (binary search) is optimal.
std::vector<ShardSpec> sequence_shards(const AttentionParams& p, const RowBytes& z, int64_t parts, int64_t row_align) {
  const int64_t tiles = (p.q_len + row_align - 1) / row_align;
  const int64_t n = std::min(parts, tiles);
  const KeyReach reach(p);
  const int64_t k_first = p.k_pos0, k_end = p.k_pos0 + p.kv_len;
  std::vector<int64_t> key_lo(static_cast<size_t>(tiles), kMin), key_hi(static_cast<size_t>(tiles), kMin);
  auto row_end_of = [&](int64_t tile) { return std::min(p.q_len, tile * row_align); };  // tile: one past
  auto first_key = [&](int64_t tile) {                                                  // key row of tile's first query
    int64_t& v = key_lo[static_cast<size_t>(tile)];
    if (v == kMin) v = std::clamp(reach.lo(p.q_pos0 + tile * row_align), k_first, k_end) - k_first;
    return v;
  };
  auto end_key = [&](int64_t tile) {  // one past the last key row of tile's last query
    int64_t& v = key_hi[static_cast<size_t>(tile)];
    if (v == kMin) v = std::clamp(reach.hi(p.q_pos0 + row_end_of(tile + 1) - 1), k_first, k_end) - k_first;
    return v;
  };
  auto spec = [&](int64_t a, int64_t b) {  // tiles [a, b)
    ShardSpec s;
    s.head_end = p.heads;
    s.kv_head_end = p.kv_heads;
    s.row_begin = a * row_align;
    s.row_end = row_end_of(b);
    s.key_begin = first_key(a);
    s.key_end = std::max(s.key_begin, end_key(b - 1));
    const int64_t rows = s.row_end - s.row_begin, keys = s.key_end - s.key_begin;
    s.sent_bytes = p.batch * (rows * p.heads * z.q + keys * p.kv_heads * z.kv);
    s.received_bytes = p.batch * rows * p.heads * z.out;
    return s;
  };
  auto cost = [&](int64_t a, int64_t b) {
    const ShardSpec s = spec(a, b);
    return s.sent_bytes + s.received_bytes;
  };
  auto cut = [&](int64_t threshold, std::vector<ShardSpec>* out) {
    int64_t count = 0;
    for (int64_t a = 0; a < tiles;) {
      if (cost(a, a + 1) > threshold) return false;
      int64_t b = a + 1;
      while (b < tiles && cost(a, b + 1) <= threshold) ++b;
      if (out != nullptr) out->push_back(spec(a, b));
      if (++count > n) return false;
      a = b;
    }
    return true;
  };
  int64_t lo = 0, hi = cost(0, tiles);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (cut(mid, nullptr))
      hi = mid;
    else
      lo = mid + 1;
  }
  std::vector<ShardSpec> shards;
  cut(lo, &shards);
  for (size_t i = 0; i < shards.size(); ++i) shards[i].index = static_cast<int>(i);
  return shards;
}

}  // namespace

const char* shard_by_name(ShardBy by) { return name_of(kShardByNames, by); }
const char* shard_kind_name(ShardKind kind) { return name_of(kShardKindNames, kind); }

StatusOr<ShardBy> parse_shard_by(const std::string& text) {
  return parse_named(kShardByNames, text, "shard_by", echo_value(text));
}

uint64_t head_shard_seed(uint64_t seed, int64_t head_begin) {
  return seed + 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(head_begin) << 26);
}

StatusOr<ShardPlan> plan_kind(const AttentionOptions& options, bool return_lse, ShardKind kind, int64_t parts,
                              int64_t row_align) {
  ASSIGN_OR_RETURN(const AttentionParams p, resolve_params(options));
  if (parts < 1) return invalid_argument("shards = " + std::to_string(parts) + ", expected >= 1");
  if (row_align < 1) return invalid_argument("row_align = " + std::to_string(row_align) + ", expected >= 1");
  const RowBytes z = row_bytes(p, return_lse);
  ShardPlan plan;
  plan.kind = kind;
  plan.slopes = p.slopes;
  plan.q_pos0 = p.q_pos0;
  switch (kind) {
    case ShardKind::kSingle:
      plan.shards = {whole_request(p, z)};
      break;
    case ShardKind::kHeads:
      plan.shards = head_shards(p, z, parts);
      break;
    case ShardKind::kSequence:
      plan.shards = sequence_shards(p, z, parts, row_align);
      break;
  }
  // A cut into one piece is the request itself.
  if (plan.shards.size() == 1) {
    plan.kind = ShardKind::kSingle;
    plan.shards = {whole_request(p, z)};
  }
  add_totals(&plan);
  return plan;
}

StatusOr<ShardPlan> plan_shards(const AttentionOptions& options, bool return_lse, const ShardingOptions& sharding,
                                int64_t replicas) {
  RETURN_IF_ERROR(validate_options(options));
  if (sharding.shards < 0) return invalid_argument("shards = " + std::to_string(sharding.shards) + ", expected >= 0");
  if (sharding.min_shard_bytes < 0)
    return invalid_argument("min_shard_bytes = " + std::to_string(sharding.min_shard_bytes) + ", expected >= 0");
  replicas = std::max<int64_t>(1, replicas);

  ASSIGN_OR_RETURN(ShardPlan whole, plan_kind(options, return_lse, ShardKind::kSingle, 1));
  int64_t parts = sharding.shards;
  std::string why;
  if (parts == 0) {
    const int64_t bytes = whole.max_shard_bytes;
    const int64_t by_size =
        sharding.min_shard_bytes > 0 ? std::max<int64_t>(1, bytes / sharding.min_shard_bytes) : replicas;
    parts = std::min(replicas, by_size);
    why = "automatic: " + std::to_string(replicas) + (replicas == 1 ? " replica" : " replicas") + ", " + mib(bytes) +
          " in and out" +
          (by_size < replicas
               ? " keeps " + std::to_string(by_size) + " shard(s) of at least " + mib(sharding.min_shard_bytes)
               : "") +
          "; ";
  } else {
    why = "asked for " + std::to_string(parts) + " shard(s); ";
  }
  // An error-targeted request picks its mode on the server, attempt by
  // attempt: the client cannot know the keys a shard needs.
  if (options.target_rel_err > 0) {
    whole.reason = "one shard: an error-targeted request picks its configuration on the server";
    return whole;
  }
  if (parts == 1) {
    whole.reason = why + "one shard: the request as is";
    return whole;
  }

  std::vector<ShardPlan> candidates;
  std::vector<ShardKind> kinds;  // what each candidate tried (a cut into one piece comes back kSingle)
  for (ShardKind kind : {ShardKind::kHeads, ShardKind::kSequence}) {
    if (sharding.by == ShardBy::kHeads && kind != ShardKind::kHeads) continue;
    if (sharding.by == ShardBy::kSequence && kind != ShardKind::kSequence) continue;
    ASSIGN_OR_RETURN(ShardPlan plan, plan_kind(options, return_lse, kind, parts,
                                               sharding.row_align > 0 ? sharding.row_align : kShardRowAlign));
    candidates.push_back(std::move(plan));
    kinds.push_back(kind);
  }
  // Fewer bytes for the largest shard (the one every other waits for), then
  // fewer in all; heads on a tie (no key sent twice, per-head estimates exact).
  const auto better = [](const ShardPlan& a, const ShardPlan& b) {
    if (a.max_shard_bytes != b.max_shard_bytes) return a.max_shard_bytes < b.max_shard_bytes;
    return a.sent_bytes + a.received_bytes < b.sent_bytes + b.received_bytes;
  };
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i)
    if (better(candidates[i], candidates[best])) best = i;
  ShardPlan plan = std::move(candidates[best]);
  std::ostringstream reason;
  reason << why << shard_kind_name(plan.kind) << " into " << plan.shards.size() << ": largest shard "
         << mib(plan.max_shard_bytes) << " in and out, " << mib(plan.sent_bytes) << " sent in all";
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (i == best) continue;
    reason << "; " << shard_kind_name(kinds[i]) << " would give " << candidates[i].shards.size() << " with largest "
           << mib(candidates[i].max_shard_bytes) << ", " << mib(candidates[i].sent_bytes) << " sent";
  }
  if (static_cast<int64_t>(plan.shards.size()) < parts)
    reason << " (fewer than " << parts << ": "
           << (kinds[best] == ShardKind::kHeads ? "one kv head per shard at least"
                                                : "one row tile of 128 per shard at least")
           << ")";
  plan.reason = reason.str();
  return plan;
}

AttentionOptions shard_options(const AttentionOptions& options, const ShardPlan& plan, const ShardSpec& s) {
  AttentionOptions o = options;
  switch (plan.kind) {
    case ShardKind::kSingle:
      break;
    case ShardKind::kHeads:
      o.heads = s.head_end - s.head_begin;
      o.kv_heads = s.kv_head_end - s.kv_head_begin;
      // The standard slopes depend on H: a shard's heads keep the request's.
      o.slopes.assign(plan.slopes.begin() + s.head_begin, plan.slopes.begin() + s.head_end);
      o.q_pos0 = plan.q_pos0;
      if (o.mode == Mode::kLsh) o.seed = head_shard_seed(options.seed, s.head_begin);
      break;
    case ShardKind::kSequence:
      o.q_len = s.row_end - s.row_begin;
      o.kv_len = s.key_end - s.key_begin;
      o.q_pos0 = plan.q_pos0 + s.row_begin;
      o.k_pos0 = options.k_pos0 + s.key_begin;
      break;
  }
  return o;
}

}  // namespace plsh::client
