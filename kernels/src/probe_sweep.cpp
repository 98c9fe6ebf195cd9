// The probe's passes over the keys (SPEC section 6): a task's query rows
// computed exactly in float64 with their rigorous bound's sums, from key
// tiles that one sweep converts for the tasks of several heads
// (estimates_internal.h: ProbeTask, probe_sweep). probe.cpp pools the rows
// and holds what the sweeps read first (the key statistics, the reach).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "estimates_internal.h"
#include "plsh/exact_rows.h"
#include "plsh/numeric.h"

namespace plsh {

namespace {

// ||v_j||^2 of a tile's float64 value row, summed in index order.
double squared_norm64(const double* v, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += v[d] * v[d];
  return s;
}

}  // namespace

namespace estimates_detail {

namespace {

// Per row: the exact output's online softmax (weights exp(logit - |d| /
// sigma)), the bound's sums with their own online maximum (a_ij =
// exp(logit)), and the hash blocks around the row's position for M~.
struct RowState {
  int64_t pos = 0, keys = 0;  // allowed keys: rows [0, keys)
  int64_t lo = 0, hi = 0;     // the key rows visited: [lo, hi)
  double a_max = kInf;        // |logit| <= a_max (with keys)
  double tail = 0;            // keys dropped: their weight's bound, relative to exp(a_max)
  double max_a = -kInf, bound_num = 0, bound_den = 0, max_v2 = 0;
  // Window: the bound's sums over the keys outside and inside the window,
  // in the exact softmax's scale (see ProbeTask::State::fold).
  double out_w = 0, in_w = 0;
  std::vector<int64_t> begins, ends;  // sorted
  size_t opened = 0, closed = 0;      // begins / ends at or before the current key
};

// Rows of a task whose key ranges overlap, scored together in one pass over
// the union of their ranges; rows whose ranges are apart (steep slopes,
// rows far apart) are groups of their own, so no row is scored where it has
// nothing to visit.
struct RowGroup {
  KeyRange span;
  std::vector<int64_t> members;   // the task's rows, by their ranges' starts
  std::vector<KeyRange> windows;  // each member's [lo, hi)
  std::vector<double> q;          // [members][D]: their query rows in double
};

// A sweep's scratch: one tile's scores and a row's logits and exps.
struct SweepScratch {
  std::vector<double> scores, logit, logw, weight, a_of;
  explicit SweepScratch(int64_t rows)
      : scores(static_cast<size_t>(kExactRowsKeyTile * rows)),
        logit(kExactRowsKeyTile),
        logw(kExactRowsKeyTile),
        weight(kExactRowsKeyTile),
        a_of(kExactRowsKeyTile) {}
};

}  // namespace

struct ProbeTask::State {
  const AttentionParams& p;
  const HeadMask& m;
  int64_t h, b;
  std::vector<int64_t> rows;
  std::vector<RowState> st;
  std::vector<SoftmaxRow64> exact;
  std::vector<RowGroup> groups;  // by span, disjoint
  size_t next_group = 0;         // the first group a sweep has not finished
  const ProbeKeyStats* keys;

  State(const AttentionParams& p_, const HeadMask& m_, int64_t h_, int64_t b_, std::span<const int64_t> rows_,
        const ProbeKeyStats* keys_)
      : p(p_), m(m_), h(h_), b(b_), rows(rows_.begin(), rows_.end()), keys(keys_) {}
  void start();
  void fold(const RowGroup& g, const KeyTile& tile, const DecayTable& lstar_of, SweepScratch& scratch);
};

void ProbeTask::State::start() {
  const int64_t R = static_cast<int64_t>(rows.size());
  const int64_t D = p.head_dim;
  st.resize(static_cast<size_t>(R));
  exact.assign(static_cast<size_t>(R), SoftmaxRow64(D));
  std::vector<float> qbuf(static_cast<size_t>(D));
  for (int64_t r = 0; r < R; ++r) {
    RowState& row = st[static_cast<size_t>(r)];
    row.pos = p.q_pos0 + rows[static_cast<size_t>(r)];
    row.keys = p.causal ? std::clamp<int64_t>(row.pos - p.k_pos0 + 1, 0, p.kv_len) : p.kv_len;
    row.lo = 0;
    row.hi = row.keys;
    if (keys != nullptr && row.keys > 0) {
      load_row(p.q, p.dtype, b * p.q_batch_stride + rows[static_cast<size_t>(r)] * p.q_row_stride + h * p.q_head_stride,
               D, qbuf.data());
      double q2 = 0;
      for (float x : qbuf) q2 += static_cast<double>(x) * x;
      // (1 + 1e-12): the norms' own rounding cannot make the bound too small.
      row.a_max = p.scale * std::sqrt(q2) * keys->max_k_norm * (1 + 1e-12);
      // The nearest allowed key (lsh and window keep queries among the keys: 0).
      const int64_t key_pos_last = p.k_pos0 + row.keys - 1;
      const int64_t nearest = row.pos < p.k_pos0       ? p.k_pos0 - row.pos
                              : row.pos > key_pos_last ? row.pos - key_pos_last
                                                       : 0;
      const int64_t reach = probe_reach(m.sigma, row.a_max, nearest);
      if (reach != INT64_MAX) {
        const int64_t at = row.pos - p.k_pos0;  // key row of the query's position
        row.lo = std::clamp<int64_t>(at - reach, 0, row.keys);
        row.hi = std::clamp<int64_t>(at + reach + 1, 0, row.keys);
        // Each side's dropped keys sum to at most (sigma + 1) exp(a_max - reach / sigma).
        const double side = (m.sigma + 1) * std::exp(-static_cast<double>(reach) / m.sigma);
        row.tail = (row.lo > 0 ? side : 0.0) + (row.hi < row.keys ? side : 0.0);
      }
      row.max_v2 = keys->v2_prefix_max[static_cast<size_t>(row.keys - 1)];
    }
    if (uses_draws(m.mode)) {
      for (const Draw& d : m.draws) {
        row.begins.push_back(block_begin(row.pos, d));
        row.ends.push_back(block_end(row.pos, d));
      }
      std::sort(row.begins.begin(), row.begins.end());
      std::sort(row.ends.begin(), row.ends.end());
    }
    // Every key where M~ > 0 is visited whatever the reach (a block longer
    // than the reach is possible, if rare): the dropped keys all have
    // M~ = 0, which the tail bound assumes.
    if (uses_draws(m.mode) && !row.begins.empty()) {
      row.lo = std::min(row.lo, std::clamp<int64_t>(row.begins.front() - p.k_pos0, 0, row.keys));
      row.hi = std::max(row.hi, std::clamp<int64_t>(row.ends.back() - p.k_pos0, 0, row.keys));
    } else if (m.mode == Mode::kWindow && m.window < (int64_t{1} << 60) && row.keys > 0) {
      const int64_t at = row.pos - p.k_pos0;
      row.lo = std::min(row.lo, std::clamp<int64_t>(at - (m.window - 1), 0, row.keys));
      row.hi = std::max(row.hi, std::clamp<int64_t>(at + m.window, 0, row.keys));
    } else if (m.mode == Mode::kWindow && row.keys > 0) {
      row.lo = 0;
      row.hi = row.keys;
    }
  }

  std::vector<int64_t> order(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) order[static_cast<size_t>(r)] = r;
  std::sort(order.begin(), order.end(),
            [&](int64_t x, int64_t y) { return st[static_cast<size_t>(x)].lo < st[static_cast<size_t>(y)].lo; });
  for (size_t g = 0; g < order.size();) {
    RowGroup group;
    group.span = {st[static_cast<size_t>(order[g])].lo, st[static_cast<size_t>(order[g])].hi};
    while (g < order.size() && st[static_cast<size_t>(order[g])].lo <= group.span.end) {
      const RowState& row = st[static_cast<size_t>(order[g])];
      group.span.end = std::max(group.span.end, row.hi);
      if (row.lo < row.hi) {
        group.members.push_back(order[g]);
        group.windows.push_back({row.lo, row.hi});
      }
      ++g;
    }
    if (group.members.empty()) continue;
    group.q.resize(group.members.size() * static_cast<size_t>(D));
    for (size_t i = 0; i < group.members.size(); ++i) {
      load_row(
          p.q, p.dtype,
          b * p.q_batch_stride + rows[static_cast<size_t>(group.members[i])] * p.q_row_stride + h * p.q_head_stride, D,
          qbuf.data());
      for (int64_t d = 0; d < D; ++d) group.q[i * static_cast<size_t>(D) + static_cast<size_t>(d)] = qbuf[d];
    }
    groups.push_back(std::move(group));
  }
}

// Folds the tile's keys (those of [tile.j0, tile.j0 + tile.count) in each
// member's range) into the group's rows, in key order.
void ProbeTask::State::fold(const RowGroup& g, const KeyTile& tile, const DecayTable& lstar_of, SweepScratch& scratch) {
  const int64_t D = p.head_dim;
  const size_t s = m.draws.size();
  const double inv_s = uses_draws(m.mode) ? 1.0 / static_cast<double>(s) : 0.0;
  double* logit = scratch.logit.data();
  double* logw = scratch.logw.data();
  double* weight = scratch.weight.data();
  double* a_of = scratch.a_of.data();
  const int64_t G = tile.rows;
  for (int64_t gr = tile.row_begin; gr < tile.row_end; ++gr) {
    RowState& row = st[static_cast<size_t>(g.members[static_cast<size_t>(gr)])];
    SoftmaxRow64& exact_row = exact[static_cast<size_t>(g.members[static_cast<size_t>(gr)])];
    const int64_t first = std::max<int64_t>(0, row.lo - tile.j0);
    const int64_t last = std::min(tile.count, row.hi - tile.j0);
    const int64_t n = last - first;
    if (n <= 0) continue;
    double tile_max_a = -kInf;
    for (int64_t jj = first; jj < last; ++jj) {
      const double distance = static_cast<double>(std::llabs(row.pos - (p.k_pos0 + tile.j0 + jj)));
      logit[jj - first] = p.scale * tile.scores[jj * G + gr];
      logw[jj - first] = logit[jj - first] - distance / m.sigma;
      tile_max_a = std::max(tile_max_a, logit[jj - first]);
    }
    const double old_max = exact_row.max;
    exact_row.fold(logw, n, tile.values + first * D, weight);
    if (m.mode == Mode::kWindow) {
      if (exact_row.max == -kInf) continue;  // no allowed key yet: nothing to add
      // a_ij L*_ij = exp(logit - d / sigma) is the exact softmax's weight
      // times exp(its max), and the window's M~ is L* inside the window and
      // 0 outside: the bound's numerator sums the weights outside, its
      // denominator those inside, in one scale that cancels. One exp a key
      // instead of two.
      const double rescale = std::exp(old_max - exact_row.max);  // 0 on the first tile
      row.out_w *= rescale;
      row.in_w *= rescale;
      const int64_t x0 = p.k_pos0 + tile.j0 + first;
      double out_sum = 0, in_sum = 0;
      for (int64_t jj = 0; jj < n; ++jj) {
        const bool inside = m.window == kNoWindow || std::llabs(row.pos - (x0 + jj)) < m.window;
        (inside ? in_sum : out_sum) += weight[jj];
      }
      row.out_w += out_sum;
      row.in_w += in_sum;
      if (keys == nullptr)
        for (int64_t jj = first; jj < last; ++jj)
          row.max_v2 = std::max(row.max_v2, squared_norm64(tile.values + jj * D, D));
      continue;
    }

    const double max_a = std::max(row.max_a, tile_max_a);
    const double rescale_a = std::exp(row.max_a - max_a);
    row.bound_num *= rescale_a;
    row.bound_den *= rescale_a;
    row.max_a = max_a;
    exp_shifted(logit, n, max_a, a_of);  // a_ij relative to the row's largest
    for (int64_t jj = first; jj < last; ++jj) {
      const int64_t x = p.k_pos0 + tile.j0 + jj;
      if (keys == nullptr) row.max_v2 = std::max(row.max_v2, squared_norm64(tile.values + jj * D, D));
      const int64_t distance = std::llabs(row.pos - x);
      const double lstar = lstar_of(distance);
      double mask;
      if (uses_draws(m.mode)) {
        // Hashes whose block holds x: begin <= x < end; x only grows.
        while (row.opened < s && row.begins[row.opened] <= x) ++row.opened;
        while (row.closed < s && row.ends[row.closed] <= x) ++row.closed;
        mask = static_cast<double>(row.opened - row.closed) * inv_s;
      } else {
        mask = m.window == kNoWindow || distance < m.window ? lstar : 0.0;
      }
      const double a = a_of[jj - first];
      row.bound_num += a * std::fabs(lstar - mask);
      row.bound_den += a * mask;
    }
  }
}

ProbeTask::ProbeTask(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, std::span<const int64_t> rows,
                     const ProbeKeyStats* keys)
    : s_(std::make_unique<State>(p, m, h, b, rows, keys)) {
  s_->start();
}
ProbeTask::ProbeTask(ProbeTask&&) noexcept = default;
ProbeTask& ProbeTask::operator=(ProbeTask&&) noexcept = default;
ProbeTask::~ProbeTask() = default;

int64_t ProbeTask::head() const { return s_->h; }
int64_t ProbeTask::batch() const { return s_->b; }

int64_t ProbeTask::farthest() const {
  int64_t far = 0;
  for (const RowState& row : s_->st)
    if (row.lo < row.hi)
      far = std::max<int64_t>(
          {far, std::llabs(row.pos - (s_->p.k_pos0 + row.lo)), std::llabs(row.pos - (s_->p.k_pos0 + row.hi - 1))});
  return far;
}

int64_t ProbeTask::pairs() const {
  int64_t n = 0;
  for (const RowState& row : s_->st) n += std::max<int64_t>(0, row.hi - row.lo);
  return n;
}

void ProbeTask::finish(ProbeRow* out) const {
  const AttentionParams& p = s_->p;
  const int64_t D = p.head_dim;
  for (size_t r = 0; r < s_->rows.size(); ++r) {
    const RowState& row = s_->st[r];
    const SoftmaxRow64& e = s_->exact[r];
    ProbeRow& pr = out[r];
    pr = ProbeRow{};
    if (row.keys <= 0) continue;  // no key at all: validation rules this out for causal requests
    const int64_t o_off = s_->b * p.o_batch_stride + s_->rows[r] * p.o_row_stride + s_->h * p.o_head_stride;
    for (int64_t d = 0; d < D; ++d) {
      const double o_star = e.acc[static_cast<size_t>(d)] / e.sum;
      const double o_tilde = load_element(p.out, p.out_dtype, o_off + d);
      const double diff = std::fabs(o_tilde - o_star);
      pr.err2 += diff * diff;
      pr.ref2 += o_star * o_star;
      pr.max_abs = std::max(pr.max_abs, std::isnan(diff) ? kInf : diff);
    }
    if (std::isnan(pr.err2)) pr.err2 = kInf;
    // The dropped keys' share of sum_j a_ij |L* - M~| (where M~ = 0, at most
    // a_ij L*_ij) keeps the bound rigorous.
    // The window's sums are in the exact softmax's scale, exp(e.max).
    const bool window = s_->m.mode == Mode::kWindow;
    const double scale_max = window ? e.max : row.max_a;
    const double num =
        (window ? row.out_w : row.bound_num) + (row.tail > 0 ? row.tail * std::exp(row.a_max - scale_max) : 0.0);
    const double den = window ? row.in_w : row.bound_den;
    // The bound holds for o~ in exact arithmetic; the stored output adds its
    // own rounding (float32 ~1e-7, bf16 ~4e-3 relative) on top.
    pr.bound = den > 0 ? 2 * std::sqrt(row.max_v2) * num / den : kInf;
  }
}

int64_t probe_sweep_cost(const AttentionParams& p, std::span<ProbeTask* const> tasks) {
  // A key row converted (k and v of one kv head, mostly waiting on memory)
  // took about as long as 7 (row, key) pairs' sums: 220 ns against 33 ns at
  // n = 32768, D = 64 (temporary timers, 2026-12-07).
  constexpr int64_t kConvertPairs = 7;
  int64_t cost = 0;
  std::vector<std::pair<int64_t, KeyRange>> spans;  // (kv head, span)
  for (const ProbeTask* t : tasks) {
    cost += t->pairs();
    for (const RowGroup& g : t->s_->groups) spans.push_back({t->head() / p.head_group, g.span});
  }
  std::sort(spans.begin(), spans.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second.begin < y.second.begin;
  });
  for (size_t i = 0; i < spans.size();) {  // the union of each kv head's spans
    const int64_t hk = spans[i].first;
    int64_t begin = spans[i].second.begin, end = spans[i].second.end;
    for (++i; i < spans.size() && spans[i].first == hk; ++i) {
      if (spans[i].second.begin > end) {
        cost += kConvertPairs * (end - begin);
        begin = spans[i].second.begin;
      }
      end = std::max(end, spans[i].second.end);
    }
    cost += kConvertPairs * (end - begin);
  }
  return cost;
}

bool probe_sweep(const AttentionParams& p, std::span<ProbeTask* const> tasks, std::span<const DecayTable* const> lstar,
                 const ExecContext* ctx) {
  if (tasks.empty()) return true;
  const int64_t b = tasks.front()->batch();
  // Tasks of one kv head together, kv heads in order.
  std::vector<ProbeTask::State*> order;
  int64_t rows = 1, first = INT64_MAX, end = 0;
  for (ProbeTask* t : tasks) {
    ProbeTask::State& s = *t->s_;
    s.next_group = 0;
    order.push_back(&s);
    for (const RowGroup& g : s.groups) {
      rows = std::max<int64_t>(rows, static_cast<int64_t>(g.members.size()));
      first = std::min(first, g.span.begin);
      end = std::max(end, g.span.end);
    }
  }
  const int64_t hg = p.head_group;  // query heads per kv head
  std::stable_sort(order.begin(), order.end(),
                   [hg](const ProbeTask::State* x, const ProbeTask::State* y) { return x->h / hg < y->h / hg; });
  SweepScratch scratch(rows);
  KeyTileBuffer tile(p.head_dim);
  // The key tiles sit on a grid fixed by the key rows alone, so a row's
  // figures do not depend on which tasks share its sweep.
  constexpr int64_t kTile = kExactRowsKeyTile;
  struct Load {
    int64_t hk, c0, c1;           // kv head, its key rows [c0, c1) this tile
    size_t task_begin, task_end;  // into order
  };
  std::vector<Load> loads, next_loads;
  // Per kv head, the key rows of tile [j0, j0 + kTile) that its tasks need:
  // the union of their groups' spans there.
  auto plan_tile = [&](int64_t j0, std::vector<Load>* out) {
    out->clear();
    for (size_t i = 0; i < order.size();) {
      size_t k = i;
      int64_t c0 = INT64_MAX, c1 = 0;
      for (; k < order.size() && order[k]->h / hg == order[i]->h / hg; ++k) {
        const ProbeTask::State& s = *order[k];
        for (size_t g = s.next_group; g < s.groups.size() && s.groups[g].span.begin < j0 + kTile; ++g) {
          if (s.groups[g].span.end <= j0) continue;
          c0 = std::min(c0, std::max(j0, s.groups[g].span.begin));
          c1 = std::max(c1, std::min(j0 + kTile, s.groups[g].span.end));
        }
      }
      if (c0 < c1) out->push_back({order[i]->h / hg, c0, c1, i, k});
      i = k;
    }
  };
  // Folds the loaded tile into every group of the kv head's tasks that it
  // reaches.
  auto fold_load = [&](const Load& ld) {
    for (size_t k = ld.task_begin; k < ld.task_end; ++k) {
      ProbeTask::State& s = *order[k];
      const DecayTable& lstar_of = *lstar[static_cast<size_t>(s.h)];
      for (size_t g = s.next_group; g < s.groups.size() && s.groups[g].span.begin < ld.c1; ++g) {
        const RowGroup& group = s.groups[g];
        const int64_t g0 = std::max(ld.c0, group.span.begin), g1 = std::min(ld.c1, group.span.end);
        if (g0 >= g1) continue;
        // Scores start at a panel of the loaded keys.
        const int64_t k0 = ld.c0 + (g0 - ld.c0) / kExactRowsKeyScoreAlign * kExactRowsKeyScoreAlign;
        const int64_t G = static_cast<int64_t>(group.members.size());
        int64_t r0 = 0, r1 = G;
        while (r0 < G && group.windows[static_cast<size_t>(r0)].end <= k0) ++r0;
        while (r1 > r0 && group.windows[static_cast<size_t>(r1 - 1)].begin >= g1) --r1;
        if (r0 == r1) continue;
        tile.score(group.q.data(), G, r0, r1, k0, g1 - k0, scratch.scores.data());
        s.fold(group,
               KeyTile{.j0 = k0,
                       .count = g1 - k0,
                       .rows = G,
                       .row_begin = r0,
                       .row_end = r1,
                       .scores = scratch.scores.data(),
                       .values = tile.values(k0)},
               lstar_of, scratch);
      }
    }
  };
  int64_t tiles = 0;
  const int64_t grid0 = first == INT64_MAX ? end : first / kTile * kTile;
  int64_t j0 = grid0;
  if (j0 < end) plan_tile(j0, &loads);
  for (; j0 < end; j0 += kTile) {
    if (++tiles % 8 == 0 && stop_requested(ctx)) return false;  // 8 tiles: 1k keys of every head
    // Past the groups that ended before this tile.
    for (ProbeTask::State* s : order)
      while (s->next_group < s->groups.size() && s->groups[s->next_group].span.end <= j0) ++s->next_group;
    // The next tile's loads (the folds of this one do not change them), so
    // that each load can ask for the next one's rows. Loading a tile's kv
    // heads one after another, each asking for the next, took 0.079-0.110 s
    // for the probe at n = 32768 (lsh, 8 heads); loading them a key row at
    // a time for up to 2, 4 or 8 heads (the heads of a row lie side by side
    // in memory), 0.095-0.12 s (2026-12-07).
    if (j0 + kTile < end)
      plan_tile(j0 + kTile, &next_loads);
    else
      next_loads.clear();
    for (size_t l = 0; l < loads.size(); ++l) {
      const Load& ld = loads[l];
      const Load* next = l + 1 < loads.size() ? &loads[l + 1] : next_loads.empty() ? nullptr : &next_loads.front();
      tile.load(p, b, ld.hk, ld.c0, ld.c1 - ld.c0, next != nullptr ? next->hk : -1, next != nullptr ? next->c0 : 0);
      fold_load(ld);
    }
    std::swap(loads, next_loads);
  }
  return true;
}

}  // namespace estimates_detail

using estimates_detail::DecayTable;
using estimates_detail::ProbeTask;

void probe_rows(const AttentionParams& p, const HeadMask& m, int64_t h, int64_t b, const std::vector<int64_t>& rows,
                ProbeRow* out, const ExecContext* ctx, const ProbeKeyStats* keys) {
  if (rows.empty()) return;
  ProbeTask task(p, m, h, b, rows, keys);
  const DecayTable lstar_of(m.sigma, task.farthest());
  std::vector<const DecayTable*> lstar(static_cast<size_t>(p.heads), nullptr);
  lstar[static_cast<size_t>(h)] = &lstar_of;
  ProbeTask* one = &task;
  if (!probe_sweep(p, std::span<ProbeTask* const>(&one, 1), lstar, ctx)) return;
  task.finish(out);
}

}  // namespace plsh
