// compute_estimates: the section-6 estimates of every head, on the plan's
// threads, from the plan's draws.
#include "plsh/estimates.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "estimates_internal.h"
#include "plsh/exact_rows.h"

namespace plsh {

using namespace estimates_detail;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The head's description and its mask estimates; the probe runs later, in
// tasks that spread each head's rows over the threads.
void estimate_head_masks(const AttentionParams& p, const PositionRange& range, int64_t h, const HeadMask& m,
                         const ExecContext& ctx, HeadEstimate* he) {
  he->head = h;
  he->slope = p.slopes[static_cast<size_t>(h)];
  he->sigma = m.sigma;
  if (p.mode == Mode::kWindow) he->window = m.window;
  if (uses_draws(p.mode)) {
    he->max_block = max_block_size(m.draws, range);
    if (p.return_draws) he->draws.assign(m.draws.begin(), m.draws.end());
  }
  if (!p.estimates) return;

  const MaskMaxError max_err = mask_max_error(m, range, p.mask_row_budget, head_seed(p.seed, h, kMaskRowSalt), &ctx);
  he->mask_max_err = max_err.value;
  he->mask_rows_checked = max_err.rows_checked;
  he->mask_rows_sampled = max_err.rows_sampled;
  if (max_err.stopped) return;

  // Stops when the Ritz value moved by under 1e-3 of itself twice in a row.
  // At 1e-4 (until issue 23) n = 32768, s = 16, 8 heads took 9-22
  // iterations a head; at 1e-3, 7-15, and every head's value moved by at
  // most 0.32% (bench/RESULTS.md, "The estimates: before and after, one run"): an estimate
  // of a random matrix's norm gains nothing from a fourth digit.
  const SpectralError spectral = mask_spectral_error(m, range, head_seed(p.seed, h, kSpectralSalt), 100, 1e-3, &ctx);
  he->mask_spectral_err = spectral.value;
  he->spectral_iterations = spectral.iterations;
}

}  // namespace

Status compute_estimates(const Plan& plan, const WorkspaceRef& workspace, const ExecContext& ctx,
                         AttentionResult* result) {
  const AttentionParams& p = plan.params;
  if (result == nullptr) return internal_error("compute_estimates: result = null, expected an AttentionResult");
  if (p.mode == Mode::kExact) return Status::Ok();
  RETURN_IF_ERROR(check_workspace(workspace, plan.estimates_workspace, "compute_estimates"));
  const PositionRange range = position_range(p);
  const int64_t heads = p.heads;
  result->heads.assign(static_cast<size_t>(heads), HeadEstimate{});
  std::vector<HeadMask> masks(static_cast<size_t>(heads));

  std::atomic<bool> failed{false};
  std::mutex failure_mutex;
  Status failure;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(failure_mutex);
    if (failure.ok()) failure = std::move(s);
    failed.store(true);
  };
  // Polled between units of work; nothing may escape an OpenMP region, and
  // memory is the one thing that can run out here.
  auto run = [&](const std::string& what, auto&& work) {
    if (failed.load()) return;
    Status s = ctx.check_stop();
    if (!s.ok()) return fail(std::move(s));
    try {
      work();
    } catch (const std::bad_alloc&) {
      return fail(resource_exhausted(what + " ran out of host memory"));
    }
    s = ctx.check_stop();
    if (!s.ok()) fail(std::move(s));
  };
  const int threads = plan.threads;

  auto phase_start = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t h = 0; h < heads; ++h) {
    run("mask estimates for head " + std::to_string(h), [&] {
      masks[static_cast<size_t>(h)] = head_mask(plan, h);
      estimate_head_masks(p, range, h, masks[static_cast<size_t>(h)], ctx, &result->heads[static_cast<size_t>(h)]);
    });
  }
  if (!failure.ok()) return failure;
  result->timings["estimates_masks"] = seconds_since(phase_start);
  if (!p.estimates) return Status::Ok();
  for (const HeadEstimate& he : result->heads) {
    result->mask_max_err = std::max(result->mask_max_err, he.mask_max_err);
    result->mask_spectral_err = std::max(result->mask_spectral_err, he.mask_spectral_err);
  }

  // The probe reads q, k, v and the output: only where they are host memory.
  if (p.memory != MemorySpace::kHost || p.probe_rows <= 0 || p.out == nullptr) return Status::Ok();
  // Tasks of up to kProbeRowsPerTask rows of one (head, batch item): one
  // pass over that item's keys serves them all, and even a single head's
  // probe spreads over the threads.
  struct Task {
    int64_t head, batch;
    size_t first;               // into the head's sample
    std::vector<int64_t> rows;  // query rows of this batch item
  };
  const int64_t population = p.batch * p.q_len;
  std::vector<std::vector<int64_t>> samples(static_cast<size_t>(heads));
  std::vector<std::vector<ProbeRow>> probed(static_cast<size_t>(heads));
  std::vector<Task> tasks;
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<int64_t>& sample = samples[static_cast<size_t>(h)];
    sample = sample_indices(population, p.probe_rows, head_seed(p.seed, h, kProbeSalt));
    probed[static_cast<size_t>(h)].resize(sample.size());
    for (size_t n = 0; n < sample.size();) {  // sorted, so each batch item's rows are contiguous
      Task t{h, sample[n] / p.q_len, n, {}};
      while (n < sample.size() && sample[n] / p.q_len == t.batch && t.rows.size() < kProbeRowsPerTask)
        t.rows.push_back(sample[n++] % p.q_len);
      tasks.push_back(std::move(t));
    }
  }
  // Per (batch item, kv head) with probe rows: the largest key norm and the
  // running largest value norm, so that each row visits only the keys that
  // can matter (probe_reach; one pass over k and v instead of one per task).
  std::vector<char> needed(static_cast<size_t>(p.batch * p.kv_heads), 0);
  for (const Task& t : tasks) needed[static_cast<size_t>(t.batch * p.kv_heads + t.head / p.head_group)] = 1;
  phase_start = std::chrono::steady_clock::now();
  std::vector<ProbeKeyStats> key_stats;
  RETURN_IF_ERROR(probe_key_stats_all(p, needed, threads, &key_stats));
  RETURN_IF_ERROR(ctx.check_stop());
  // Every task's rows, their reach and groups; then L* by distance per head,
  // shared by its tasks.
  std::vector<ProbeTask> probes;
  try {
    probes.reserve(tasks.size());
    for (const Task& t : tasks)
      probes.emplace_back(p, masks[static_cast<size_t>(t.head)], t.head, t.batch, t.rows,
                          &key_stats[static_cast<size_t>(t.batch * p.kv_heads + t.head / p.head_group)]);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("the probe's rows ran out of host memory");
  }
  std::vector<int64_t> farthest(static_cast<size_t>(heads), -1);
  for (const ProbeTask& t : probes)
    farthest[static_cast<size_t>(t.head())] = std::max(farthest[static_cast<size_t>(t.head())], t.farthest());
  std::vector<std::unique_ptr<DecayTable>> tables(static_cast<size_t>(heads));
  std::vector<const DecayTable*> lstar(static_cast<size_t>(heads), nullptr);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t h = 0; h < heads; ++h) {
    if (farthest[static_cast<size_t>(h)] < 0) continue;
    run("the probe's decay table for head " + std::to_string(h), [&] {
      tables[static_cast<size_t>(h)] = std::make_unique<DecayTable>(
          masks[static_cast<size_t>(h)].sigma, std::min(farthest[static_cast<size_t>(h)], kProbeDecayEntries - 1));
      lstar[static_cast<size_t>(h)] = tables[static_cast<size_t>(h)].get();
    });
  }
  if (!failure.ok()) return failure;
  // Sweeps: each batch item's tasks split into as many sweeps as there are
  // threads (or units), so that every thread reads each key tile once for
  // all the tasks it serves. A unit is a kv head's tasks (halved, largest
  // first, while there are fewer units than threads), so that no two
  // threads convert the same tiles; units go largest first onto the least
  // loaded sweep, by what they cost (probe_sweep_cost).
  struct Unit {
    std::vector<ProbeTask*> tasks;
    int64_t cost = 0;
  };
  std::vector<std::vector<ProbeTask*>> sweeps;
  const size_t want = static_cast<size_t>(std::max(threads, 1));
  for (int64_t b = 0; b < p.batch; ++b) {
    std::vector<Unit> units(static_cast<size_t>(p.kv_heads));
    for (ProbeTask& t : probes)
      if (t.batch() == b) units[static_cast<size_t>(t.head() / p.head_group)].tasks.push_back(&t);
    std::erase_if(units, [](const Unit& u) { return u.tasks.empty(); });
    if (units.empty()) continue;
    for (Unit& u : units) u.cost = probe_sweep_cost(p, u.tasks);
    auto by_cost = [](const Unit& x, const Unit& y) { return x.cost > y.cost; };
    for (;;) {
      std::stable_sort(units.begin(), units.end(), by_cost);
      if (units.size() >= want) break;
      auto split = std::find_if(units.begin(), units.end(), [](const Unit& u) { return u.tasks.size() > 1; });
      if (split == units.end()) break;
      Unit half;
      const size_t keep = split->tasks.size() / 2;
      half.tasks.assign(split->tasks.begin() + static_cast<std::ptrdiff_t>(keep), split->tasks.end());
      split->tasks.resize(keep);
      split->cost = probe_sweep_cost(p, split->tasks);
      half.cost = probe_sweep_cost(p, half.tasks);
      units.push_back(std::move(half));
    }
    const size_t count = std::min(units.size(), want);
    std::vector<int64_t> load(count, 0);
    const size_t base = sweeps.size();
    sweeps.resize(base + count);
    for (const Unit& u : units) {
      const size_t least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[least] += u.cost;
      sweeps[base + least].insert(sweeps[base + least].end(), u.tasks.begin(), u.tasks.end());
    }
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t n = 0; n < sweeps.size(); ++n) {
    run("the probe", [&] {
      if (!probe_sweep(p, sweeps[n], lstar, &ctx)) return;
      for (const ProbeTask* t : sweeps[n]) {
        const Task& task = tasks[static_cast<size_t>(t - probes.data())];
        t->finish(&probed[static_cast<size_t>(task.head)][task.first]);
      }
    });
  }
  if (!failure.ok()) return failure;

  std::vector<ProbeStats> stats(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    stats[static_cast<size_t>(h)] = probe_stats(probed[static_cast<size_t>(h)], population);
    result->heads[static_cast<size_t>(h)].probe = summarize_probe({stats[static_cast<size_t>(h)]});
  }
  result->timings["estimates_probe"] = seconds_since(phase_start);
  result->probe = summarize_probe(stats);
  return Status::Ok();
}

namespace estimates_detail {

int64_t head_estimate_bytes(const AttentionParams& p) {
  const int64_t s = uses_draws(p.mode) ? p.samples : 0;
  const int64_t wide = std::max(p.q_len, p.kv_len);
  const PositionRange r = position_range(p);
  // mask_max_err: the decay table, the row sample, four arrays of block
  // edges per hash.
  const int64_t mask = DecayTable::bytes(max_distance(r)) + 8 * std::min(p.q_len, p.mask_row_budget) + 32 * s;
  // Lanczos: four vectors over the smaller side, the product's intermediate
  // and exponential sums and prefix sums over the wider one, and the block
  // edges cached for both sides (spectral.cpp's BlockEdges): 13 bytes a
  // block change (at most 8M of them, at most a block per position per
  // hash plus two), 8 a target, 8 per hash every 256 targets.
  const int64_t edges =
      s > 0
          ? 2 * (std::min<int64_t>(int64_t{104} << 20, 13 * s * (wide + 3)) + 8 * (wide + 1) + 8 * s * (wide / 256 + 1))
          : 0;
  const int64_t spectral = 8 * (4 * std::min(p.q_len, p.kv_len) + 4 * wide + 1) + edges;
  return mask + spectral;
}

int64_t probe_sweep_bytes(const AttentionParams& p) {
  const int64_t rows = static_cast<int64_t>(kProbeRowsPerTask);
  // The key tile (k in panels and v in double, four rows in float32), a task's
  // scores against it, and four rows of a tile (logits, weighted logits,
  // and the exps of each).
  return 8 * (2 * kExactRowsKeyTile * p.head_dim + kExactRowsKeyTile * rows + 4 * kExactRowsKeyTile) + 16 * p.head_dim;
}

int64_t probe_rows_bytes(const AttentionParams& p) {
  const int64_t s = uses_draws(p.mode) ? p.samples : 0;
  const int64_t rows = p.heads * std::min(p.probe_rows, p.batch * p.q_len);
  // Every probe row from the tasks' start to their finish: its query row
  // and accumulator in double, its sorted block edges, its state; and each
  // head's L* by distance.
  return rows * (16 * p.head_dim + 16 * s + 256) +
         p.heads * DecayTable::bytes(std::min(max_distance(position_range(p)), kProbeDecayEntries - 1));
}

}  // namespace estimates_detail

int64_t estimates_host_bytes(const AttentionParams& p, int threads) {
  if (p.mode == Mode::kExact) return 0;
  // The per-head results (draws copied with return_draws) and, per head,
  // its probe sample and rows (and their err2 twice over: kept per head and
  // pooled for rel_err_upper, probe_bound.cpp).
  const int64_t per_request = p.heads * static_cast<int64_t>(sizeof(HeadEstimate) + sizeof(HeadMask)) +
                              (p.return_draws ? draw_bytes(p) : 0) +
                              p.heads * p.probe_rows * static_cast<int64_t>(8 + sizeof(ProbeRow) + 8 + 16) +
                              (p.probe_rows > 0 ? 8 * p.batch * p.kv_heads * p.kv_len : 0);  // probe key statistics
  if (!p.estimates) return per_request;
  const int64_t probe = p.probe_rows > 0 ? probe_rows_bytes(p) : 0;
  const int64_t per_thread = std::max(head_estimate_bytes(p), p.probe_rows > 0 ? probe_sweep_bytes(p) : 0);
  return per_request + probe + static_cast<int64_t>(std::max(threads, 1)) * per_thread;
}

}  // namespace plsh
