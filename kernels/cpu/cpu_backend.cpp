#include "cpu/cpu_backend.h"

#include <omp.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <cblas.h>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "cpu/tiles.h"
#include "plsh/draws.h"

namespace plsh {

namespace {

int default_threads() { return std::max(1, omp_get_num_procs()); }

std::string blas_name() {
#ifdef PLSH_OPENBLAS
  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21 (Zen)"
  std::string config = openblas_get_config();
  const size_t first = config.find(' ');
  const size_t second = first == std::string::npos ? first : config.find(' ', first + 1);
  return config.substr(0, second) + " (" + openblas_get_corename() + ")";
#else
  return "CBLAS";
#endif
}

// The draws of every head, or nothing outside lsh mode.
std::vector<std::vector<Draw>> head_draws(const AttentionParams& p) {
  std::vector<std::vector<Draw>> draws;
  if (p.mode != Mode::kLsh) return draws;
  draws.reserve(static_cast<size_t>(p.heads));
  for (int64_t h = 0; h < p.heads; ++h) draws.push_back(draw_hashes(p.seed, h, p.sigma(h), p.samples));
  return draws;
}

LshAlgorithm resolve_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws) {
  if (p.mode != Mode::kLsh) return LshAlgorithm::kAuto;
  if (p.lsh_algorithm != LshAlgorithm::kAuto) return p.lsh_algorithm;
  return cpu::choose_lsh_algorithm(p, draws);
}

// Row tiles of every (batch, head), the last rows first: under causal they
// see the most keys, and starting them first keeps the dynamic schedule's
// tail short.
std::vector<cpu::TileJob> tile_jobs(const AttentionParams& p) {
  std::vector<cpu::TileJob> jobs;
  const int64_t rows = cpu::row_tile(p.mode);
  const int64_t tiles = (p.q_len + rows - 1) / rows;
  jobs.reserve(static_cast<size_t>(p.batch * p.heads * tiles));
  for (int64_t t = tiles - 1; t >= 0; --t)
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h) {
        const int64_t i0 = t * rows;
        jobs.push_back({b, h, i0, std::min(rows, p.q_len - i0)});
      }
  return jobs;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend() {
#ifdef PLSH_OPENBLAS
    // We thread over tiles with OpenMP; OpenBLAS's own threads would
    // oversubscribe the cores from inside every tile's GEMM.
    static std::once_flag once;
    std::call_once(once, [] { openblas_set_num_threads(1); });
#endif
  }

  std::string name() const override { return "cpu"; }

  std::string device() const override {
    utsname u{};
    const std::string arch = uname(&u) == 0 ? u.machine : "unknown";
    const int threads = default_threads();
    return arch + ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads") + " (OpenMP), " +
           blas_name();
  }

  Status supports(const AttentionParams& p) const override {
    if (p.memory != MemorySpace::kHost)
      return failed_precondition("memory = device, expected host memory: the cpu backend reads q, k, v and writes "
                                 "out through host pointers");
    if (p.mode == Mode::kLsh && p.samples < 1)
      return invalid_argument("samples = " + std::to_string(p.samples) + ", expected >= 1 in lsh mode");
    // BLAS takes int leading dimensions.
    for (auto [name, stride] : {std::pair{"q_row_stride", p.q_row_stride}, std::pair{"k_row_stride", p.k_row_stride},
                                std::pair{"v_row_stride", p.v_row_stride}}) {
      if (stride > std::numeric_limits<int>::max())
        return failed_precondition(std::string(name) + " = " + std::to_string(stride) +
                                   ", expected <= 2^31 - 1 for the cpu backend's BLAS calls");
    }
    if (p.mode == Mode::kWindow && static_cast<int64_t>(p.window.size()) != p.heads)
      return invalid_argument("window has " + std::to_string(p.window.size()) + " widths, expected one per head (" +
                              std::to_string(p.heads) + ")");
    return Status::Ok();
  }

  // Per-thread tile buffers for the default thread count, and the draws.
  int64_t workspace_bytes(const AttentionParams& p) const override {
    return workspace_for(p, default_threads(), resolve_algorithm(p, head_draws(p)));
  }

  Status forward(const AttentionParams& p, const ExecContext& ctx, ForwardStats* stats) override {
    RETURN_IF_ERROR(supports(p));
    RETURN_IF_ERROR(ctx.check_stop());
    const int threads = ctx.threads > 0 ? ctx.threads : default_threads();
    // No exception crosses the backend boundary: the draws and the job list
    // allocate too.
    std::vector<std::vector<Draw>> draws;
    std::vector<cpu::TileJob> jobs;
    LshAlgorithm algorithm = LshAlgorithm::kAuto;
    std::vector<cpu::Scratch> scratch;
    try {
      draws = head_draws(p);
      algorithm = resolve_algorithm(p, draws);
      jobs = tile_jobs(p);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("cpu backend: the draws and tile list for heads = " + std::to_string(p.heads) +
                                ", samples = " + std::to_string(p.samples) + " could not be allocated");
    }
    const bool banded = algorithm == LshAlgorithm::kBanded;
    try {
      scratch.resize(static_cast<size_t>(threads));
      for (cpu::Scratch& s : scratch) cpu::size_scratch(p, banded, &s);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("cpu backend workspace of " + std::to_string(workspace_for(p, threads, algorithm)) +
                                " bytes could not be allocated");
    }

    std::atomic<bool> stopped{false};
    Status stop_status;
    std::mutex stop_mutex;
    std::atomic<int64_t> done{0};
    std::atomic<int> reported_percent{-1};
    std::vector<double> flops(static_cast<size_t>(threads), 0.0);
    const int64_t total = static_cast<int64_t>(jobs.size());

#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      cpu::Scratch& s = scratch[static_cast<size_t>(t)];
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < total; ++n) {
        if (stopped.load(std::memory_order_relaxed)) continue;
        Status why = ctx.check_stop();
        if (why.ok()) {
          const cpu::TileJob& job = jobs[static_cast<size_t>(n)];
          double f = 0;
          if (p.mode != Mode::kLsh) {
            f = cpu::exact_tile(p, job, s);
          } else {
            const std::vector<Draw>& d = draws[static_cast<size_t>(job.h)];
            f = banded ? cpu::lsh_banded_tile(p, job, d, s) : cpu::lsh_per_sample_tile(p, job, d, ctx, s);
          }
          flops[static_cast<size_t>(t)] += f;
          why = ctx.check_stop();  // a per-sample tile may have stopped half way
        }
        if (!why.ok()) {
          std::lock_guard<std::mutex> lock(stop_mutex);
          if (!stopped.load()) stop_status = why;
          stopped.store(true);
          continue;
        }
        report_progress(ctx, ++done, total, &reported_percent);
      }
    }
    if (stopped.load()) return stop_status;

    if (stats != nullptr) {
      stats->flops = 0;
      for (double f : flops) stats->flops += f;
      stats->lsh_algorithm = algorithm;
      stats->workspace_bytes = workspace_for(p, threads, algorithm);
    }
    return Status::Ok();
  }

 private:
  static int64_t workspace_for(const AttentionParams& p, int threads, LshAlgorithm algorithm) {
    const int64_t draws = p.mode == Mode::kLsh ? p.heads * p.samples * static_cast<int64_t>(sizeof(Draw)) : 0;
    const int64_t rows = cpu::row_tile(p.mode);
    const int64_t jobs = p.batch * p.heads * ((p.q_len + rows - 1) / rows);
    return threads * cpu::scratch_bytes(p, algorithm == LshAlgorithm::kBanded) + draws +
           jobs * static_cast<int64_t>(sizeof(cpu::TileJob));
  }

  // At most once per percent, so a slow callback cannot serialise the tiles.
  static void report_progress(const ExecContext& ctx, int64_t done, int64_t total, std::atomic<int>* reported) {
    if (!ctx.progress) return;
    const int percent = static_cast<int>(100 * done / total);
    int last = reported->load(std::memory_order_relaxed);
    while (percent > last) {
      if (reported->compare_exchange_weak(last, percent)) {
        ctx.progress(static_cast<double>(done) / static_cast<double>(total));
        return;
      }
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace plsh
