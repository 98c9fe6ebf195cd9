// Merging the shards' results (plsh/sharding.h): FLOPs, the per-head
// estimates and their summary, as exactly as the wire allows.
//
// What each cut gives back per head (SPEC section 6):
//   - heads: every head's estimates come whole from one shard, over every
//     row and key: mask_max_err is the unsharded value (the same draws and
//     positions; with more rows than mask_row_budget both sample rows, from
//     different seeds), mask_spectral_err the same quantity from another
//     Lanczos start, the probe that head's own (its rows drawn from the
//     shard's seed, so other rows than the unsharded request's).
//   - sequence: each shard's estimates cover its own rows and the keys it
//     was sent. Its keys reach one past what any row may attend (the nearest
//     key outside a row's window or blocks, where mask_max_err's outside
//     error peaks), so the max over shards is the unsharded mask_max_err.
//     ||E||_2 of stacked row blocks lies between the largest block's norm
//     and the root sum of their squares: the merge reports the latter.
//     Each shard probes probe_rows of its own rows per head: a stratified
//     sample, pooled below.
// The probe's rel_err is sqrt(sum err2 / sum ref2) over the probe rows; a
// shard sends rel_err, not the two sums, so the sums are estimated: a
// (shard, head)'s sum ref2 as its probe rows times the mean ||out||^2 of its
// rows (o~ standing in for o*). Its standard error combines by the delta
// method, shards being independent. rows, max_abs_err and bound_max combine
// exactly (sum, max, max).
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "plsh/sharding.h"

namespace plsh::client {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct ProbeUnit {
  ProbeEstimate probe;
  double weight = 0;  // estimate of sum ||o*||^2 over its probe rows
};

ProbeEstimate pool_probes(const std::vector<ProbeUnit>& units) {
  ProbeEstimate e;
  bool any_weight = false;
  for (const ProbeUnit& u : units) {
    e.rows += u.probe.rows;
    e.max_abs_err = std::max(e.max_abs_err, u.probe.max_abs_err);
    e.bound_max = std::max(e.bound_max, u.probe.bound_max);
    if (u.probe.rows > 0 && u.weight > 0 && std::isfinite(u.weight)) any_weight = true;
  }
  if (e.rows == 0) return e;
  double w_sum = 0, q_sum = 0, var_sum = 0;
  for (const ProbeUnit& u : units) {
    if (u.probe.rows == 0) continue;
    // Without any usable weight (outputs all zero), rows alone.
    const double w = any_weight ? (std::isfinite(u.weight) ? u.weight : 0) : static_cast<double>(u.probe.rows);
    const double q = u.probe.rel_err * u.probe.rel_err;
    const double q_err = 2 * u.probe.rel_err * u.probe.rel_err_stderr;  // d(e^2) = 2 e de
    w_sum += w;
    q_sum += w * q;
    var_sum += w * w * (std::isfinite(q_err) ? q_err * q_err : kInf);
  }
  if (!(w_sum > 0)) return e;
  const double q = q_sum / w_sum;
  e.rel_err = std::sqrt(q);
  e.rel_err_stderr = q > 0 ? std::sqrt(var_sum) / w_sum / (2 * std::sqrt(q)) : 0;
  return e;
}

// Exact attention's multiply-adds x2 over the allowed pairs of the whole
// request (what the server reports as dense_flops).
double dense_flops(const AttentionOptions& o, int64_t q_pos0) {
  const int64_t kv_len = o.kv_len;
  double pairs = 0;
  if (!o.causal) {
    pairs = static_cast<double>(o.q_len) * static_cast<double>(kv_len);
  } else {
    for (int64_t i = 0; i < o.q_len; ++i)
      pairs += static_cast<double>(std::clamp<int64_t>(q_pos0 + i - o.k_pos0 + 1, 0, kv_len));
  }
  return 4.0 * static_cast<double>(std::max<int64_t>(1, o.batch)) * static_cast<double>(o.heads) *
         static_cast<double>(o.head_dim) * pairs;
}

std::string joined_distinct(const std::vector<std::string>& items) {
  std::string out;
  std::set<std::string> seen;
  for (const std::string& s : items) {
    if (!seen.insert(s).second) continue;
    out += (out.empty() ? "" : "; ") + s;
  }
  return out;
}

double weight_of(const ShardResult& r, int64_t local_head, int64_t probe_rows) {
  const size_t h = static_cast<size_t>(local_head);
  const double mean_square = h < r.out_mean_square.size() ? r.out_mean_square[h] : 0;
  return static_cast<double>(probe_rows) * mean_square;
}

}  // namespace

AttentionResult merge_results(const AttentionOptions& options, const ShardPlan& plan,
                              const std::vector<ShardResult>& shards) {
  if (shards.empty()) return {};
  if (plan.kind == ShardKind::kSingle || shards.size() == 1) return shards.front().result;

  AttentionResult m = shards.front().result;
  m.seed = options.seed;
  m.q_pos0 = plan.q_pos0;
  m.k_pos0 = options.k_pos0;
  m.heads.clear();
  m.flops = m.dense_flops = m.mask_max_err = m.mask_spectral_err = 0;
  m.timings.clear();
  std::vector<std::string> backends, devices;
  for (const ShardResult& s : shards) {
    backends.push_back(s.result.backend);
    devices.push_back(s.result.device);
    m.flops += s.result.flops;
    m.dense_flops += s.result.dense_flops;
    // Shards run side by side: the longest stands for each phase.
    for (const auto& [name, seconds] : s.result.timings) m.timings[name] = std::max(m.timings[name], seconds);
  }
  m.backend = joined_distinct(backends);
  m.device = joined_distinct(devices);

  std::vector<ProbeUnit> units;
  if (plan.kind == ShardKind::kHeads) {
    for (size_t i = 0; i < shards.size(); ++i) {
      for (const HeadEstimate& local : shards[i].result.heads) {
        HeadEstimate he = local;
        he.head = local.head + plan.shards[i].head_begin;
        units.push_back({he.probe, weight_of(shards[i], local.head, he.probe.rows)});
        m.heads.push_back(std::move(he));
      }
    }
  } else {
    // Sequence: a sequence shard's keys are not all the request's keys.
    m.dense_flops = dense_flops(options, plan.q_pos0);
    const size_t heads = shards.front().result.heads.size();
    for (size_t h = 0; h < heads; ++h) {
      HeadEstimate he = shards.front().result.heads[h];
      he.max_block = 0;
      he.mask_max_err = 0;
      he.mask_rows_checked = 0;
      he.mask_rows_sampled = false;
      he.spectral_iterations = 0;
      double spectral_square = 0;
      std::vector<ProbeUnit> head_units;
      for (const ShardResult& s : shards) {
        if (h >= s.result.heads.size()) continue;
        const HeadEstimate& part = s.result.heads[h];
        he.max_block = std::max(he.max_block, part.max_block);
        he.mask_max_err = std::max(he.mask_max_err, part.mask_max_err);
        he.mask_rows_checked += part.mask_rows_checked;
        he.mask_rows_sampled = he.mask_rows_sampled || part.mask_rows_sampled;
        spectral_square += part.mask_spectral_err * part.mask_spectral_err;
        he.spectral_iterations = std::max(he.spectral_iterations, part.spectral_iterations);
        head_units.push_back({part.probe, weight_of(s, static_cast<int64_t>(h), part.probe.rows)});
      }
      he.mask_spectral_err = std::sqrt(spectral_square);
      he.probe = pool_probes(head_units);
      units.insert(units.end(), head_units.begin(), head_units.end());
      m.heads.push_back(std::move(he));
    }
  }
  for (const HeadEstimate& he : m.heads) {
    m.mask_max_err = std::max(m.mask_max_err, he.mask_max_err);
    m.mask_spectral_err = std::max(m.mask_spectral_err, he.mask_spectral_err);
  }
  m.probe = pool_probes(units);
  return m;
}

const char* pooling_note(ShardKind kind) {
  switch (kind) {
    case ShardKind::kSingle:
      return "one shard: the server's estimates as they came";
    case ShardKind::kHeads:
      return "heads: each head's estimates come whole from its shard (mask_max_err as unsharded; the probe samples "
             "its rows from the shard's seed); the request's probe rel_err pools heads weighted by probe rows x mean "
             "||out||^2 (approximate); rows, max_abs_err, bound_max exact";
    case ShardKind::kSequence:
      return "sequence: per head, mask_max_err is the max over shards (as unsharded: each shard's keys reach one past "
             "its rows' blocks or window), mask_spectral_err the root sum of squares (an upper bound), the probe pools "
             "each shard's own rows weighted by probe rows x mean ||out||^2 (approximate); rows, max_abs_err, "
             "bound_max exact";
  }
  return "";
}

}  // namespace plsh::client
