// plsh demo: what a first-time user runs (scripts/dev.sh run, the README's
// first command). Random q, k, v; exact, window, lsh (iid and ash draws) and
// an error-targeted request in this process; one table row per run with the
// time, the true error against exact, the error estimates the library
// reports without knowing the truth (with the probe's upper bound), and the
// FLOPs against dense attention. Seeing the estimates next to the true
// errors is the point: on real inputs only the estimates exist.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/draws.h"

namespace plsh::cli {
namespace {

struct DemoArgs {
  int64_t n = 4096;  // q_len = kv_len
  int64_t heads = 8;
  int64_t head_dim = 64;
  int64_t samples = kDefaultSamples;
  uint64_t seed = 0;    // of q, k, v and of the lsh draws
  bool causal = false;  // as plsh attend and compute (and SDPA's is_causal)
  double window_eps = kDefaultWindowEps;
  std::string backend = "auto";
  int64_t threads = 0;
  bool per_head = false;
  double target_error = 1e-2;  // the error-targeted row's target (0: no such row)
};

// N(0, 1) floats from a counter-based generator (SPEC's mix64 and a
// Box-Muller pair), so the demo's inputs are the same on every platform and
// standard library.
std::vector<float> normal_tensor(int64_t count, uint64_t seed, uint64_t stream) {
  std::vector<float> t(static_cast<size_t>(count));
  const uint64_t base = mix64(seed ^ mix64(stream + 1));
  auto uniform = [base](uint64_t i) {
    return (static_cast<double>(mix64(base + 0x9E3779B97F4A7C15ULL * (i + 1)) >> 11) + 0.5) * 0x1.0p-53;
  };
  for (int64_t i = 0; i < count; i += 2) {
    const double r = std::sqrt(-2.0 * std::log(uniform(static_cast<uint64_t>(i))));
    const double theta = 2.0 * M_PI * uniform(static_cast<uint64_t>(i) + 1);
    t[static_cast<size_t>(i)] = static_cast<float>(r * std::cos(theta));
    if (i + 1 < count) t[static_cast<size_t>(i) + 1] = static_cast<float>(r * std::sin(theta));
  }
  return t;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    err += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

struct ModeRun {
  AttentionResult result;
  std::vector<float> out;  // [1, n, H, D]
};

AttentionOptions demo_options(const DemoArgs& a, Mode mode, Sampling sampling = Sampling::kIid, double target = 0) {
  AttentionOptions o;
  o.q_len = o.kv_len = a.n;
  o.heads = o.kv_heads = a.heads;
  o.head_dim = a.head_dim;
  o.causal = a.causal;
  o.mode = mode;
  o.samples = a.samples;
  o.seed = a.seed;
  o.window_eps = a.window_eps;
  o.sampling = sampling;
  o.target_rel_err = target;
  return o;
}

StatusOr<ModeRun> run_mode(const DemoArgs& a, Mode mode, const std::vector<float>& q, const std::vector<float>& k,
                           const std::vector<float>& v, Sampling sampling = Sampling::kIid, double target = 0) {
  const AttentionOptions o = demo_options(a, mode, sampling, target);
  ModeRun run;
  run.out.resize(q.size());
  TensorRefs t;
  t.q = q.data();
  t.k = k.data();
  t.v = v.data();
  t.out = run.out.data();
  ASSIGN_OR_RETURN(const AttentionParams p, make_params(o, t));
  ASSIGN_OR_RETURN(Backend * backend, BackendRegistry::global().select(a.backend, p));
  PlanLimits limits;
  limits.threads = static_cast<int>(a.threads);
  ASSIGN_OR_RETURN(run.result, run_attention(*backend, p, limits, ExecContext{}));
  return run;
}

std::string sci(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", v);
  return buf;
}

double timing(const AttentionResult& r, const char* name) {
  const auto it = r.timings.find(name);
  return it == r.timings.end() ? 0.0 : it->second;
}

void print_per_head(const AttentionResult& r) {
  std::printf("  %-4s %-10s %-10s %-9s %-9s %-12s %-12s %-22s\n", "head", "slope", "sigma", "window", "max_block",
              "mask max", "spectral", "probe rel err");
  for (const HeadEstimate& h : r.heads) {
    const std::string window = r.mode != Mode::kWindow ? "-" : h.window == kNoWindow ? "all" : std::to_string(h.window);
    const std::string block = r.mode != Mode::kLsh ? "-" : std::to_string(h.max_block);
    std::printf("  %-4" PRId64 " %-10s %-10s %-9s %-9s %-12s %-12s %-22s\n", h.head, sci(h.slope).c_str(),
                sci(h.sigma).c_str(), window.c_str(), block.c_str(), sci(h.mask_max_err).c_str(),
                sci(h.mask_spectral_err).c_str(),
                (sci(h.probe.rel_err) + " +- " + sci(h.probe.rel_err_stderr)).c_str());
  }
}

Status demo(const DemoArgs& a) {
  // Sizes and options first, before allocating anything of their size.
  for (Mode mode : {Mode::kWindow, Mode::kLsh}) RETURN_IF_ERROR(validate_options(demo_options(a, mode)));
  if (a.target_error != 0)
    RETURN_IF_ERROR(validate_options(demo_options(a, kDefaultTargetMode, Sampling::kIid, a.target_error)));
  RETURN_IF_ERROR(check_backend_name(a.backend));
  if (a.threads < 0)
    return invalid_argument("threads = " + std::to_string(a.threads) + ", expected >= 0 (0: all cores)");
  const int64_t count = a.n * a.heads * a.head_dim;
  const std::vector<float> q = normal_tensor(count, a.seed, 0);
  const std::vector<float> k = normal_tensor(count, a.seed, 1);
  const std::vector<float> v = normal_tensor(count, a.seed, 2);

  ASSIGN_OR_RETURN(ModeRun exact, run_mode(a, Mode::kExact, q, k, v));
  ASSIGN_OR_RETURN(ModeRun window, run_mode(a, Mode::kWindow, q, k, v));
  ASSIGN_OR_RETURN(ModeRun lsh, run_mode(a, Mode::kLsh, q, k, v));
  ASSIGN_OR_RETURN(ModeRun ash, run_mode(a, Mode::kLsh, q, k, v, Sampling::kAsh));
  ModeRun targeted;
  if (a.target_error != 0) {
    ASSIGN_OR_RETURN(targeted, run_mode(a, kDefaultTargetMode, q, k, v, Sampling::kIid, a.target_error));
  }

  std::printf("plsh demo: q, k, v ~ N(0, 1), n = %" PRId64 ", heads = %" PRId64 ", head_dim = %" PRId64
              ", %s, standard ALiBi slopes, seed %" PRIu64 "\n",
              a.n, a.heads, a.head_dim, a.causal ? "causal" : "not causal", a.seed);
  std::printf("backend: %s (%s)\n\n", exact.result.backend.c_str(), exact.result.device.c_str());
  std::printf("%-16s %-8s %-10s %-12s %-15s %-12s %-12s %-22s %-12s %s\n", "run", "samples", "compute s", "estimates s",
              "rel L2 vs exact", "mask max", "spectral", "probe rel err", "probe upper", "FLOPs/dense");
  const std::string target_name = "target " + sci(a.target_error);
  const std::pair<const ModeRun*, std::string> runs[] = {
      {&exact, "exact"}, {&window, "window"}, {&lsh, "lsh iid"}, {&ash, "lsh ash"}, {&targeted, target_name}};
  for (const auto& [run, name] : runs) {
    if (run == &targeted && a.target_error == 0) continue;
    const AttentionResult& r = run->result;
    const bool approx = r.mode != Mode::kExact;
    const std::string samples = r.mode == Mode::kLsh ? std::to_string(r.samples) : "-";
    const std::string probe = approx ? sci(r.probe.rel_err) + " +- " + sci(r.probe.rel_err_stderr) : "-";
    char estimates_s[32] = "-";
    if (approx) std::snprintf(estimates_s, sizeof estimates_s, "%.3f", timing(r, "estimates"));
    std::printf("%-16s %-8s %-10.3f %-12s %-15s %-12s %-12s %-22s %-12s %.3f\n", name.c_str(), samples.c_str(),
                timing(r, "compute"), estimates_s, sci(rel_l2(run->out, exact.out)).c_str(),
                approx ? sci(r.mask_max_err).c_str() : "-", approx ? sci(r.mask_spectral_err).c_str() : "-",
                probe.c_str(), approx ? sci(r.probe.rel_err_upper).c_str() : "-",
                r.dense_flops > 0 ? r.flops / r.dense_flops : 0.0);
  }
  if (a.target_error != 0) {
    const TargetReport& t = targeted.result.target;
    std::printf("\n%s: the library tried, cheapest first, and kept the first whose probe upper bound met it:\n",
                target_name.c_str());
    for (size_t i = 0; i < t.attempts.size(); ++i) {
      const TargetAttempt& at = t.attempts[i];
      std::string what = mode_name(at.mode);
      if (at.mode == Mode::kWindow)
        what += " eps " + sci(std::exp(-at.window_scale)) + " (W <= " + std::to_string(at.window_max) + ")";
      if (at.mode == Mode::kLsh) what += " s " + std::to_string(at.samples);
      std::printf("  %s%-34s probe %s, upper %s, %.2f GFLOP, %.3f s%s\n",
                  static_cast<int64_t>(i) == t.chosen ? "* " : "  ", what.c_str(), sci(at.rel_err).c_str(),
                  sci(at.rel_err_upper).c_str(), at.flops / 1e9, at.seconds, at.met ? "  <= target" : "");
    }
  }
  std::printf(
      "\nrel L2 vs exact: the true error, known here only because exact ran too. mask max, spectral and\n"
      "probe are what every lsh/window result carries (plsh compute --meta): max |L* - M~|, ~||L* - M~||_2,\n"
      "the error on a seeded sample of rows computed exactly, and its upper bound for the whole output\n"
      "(coverage measured in bench/RESULTS.md). lsh ash: the same s with stratified pitches and systematic\n"
      "shifts (--sampling ash). target: plsh compute --target-error picks the cheapest window that promises it.\n");
  if (a.per_head) {
    std::printf("\nwindow, per head:\n");
    print_per_head(window.result);
    std::printf("\nlsh, per head:\n");
    print_per_head(lsh.result);
  }
  return Status::Ok();
}

RunFn setup_demo(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  app.add_option("--n", a->n, "sequence length (queries = keys)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--heads", a->heads, "heads")->capture_default_str()->transform(decimal_integer(true));
  app.add_option("--head-dim", a->head_dim, "head dimension")->capture_default_str()->transform(decimal_integer(true));
  app.add_option("--samples", a->samples, "lsh hashes per head")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_option("--seed", a->seed, "seed of q, k, v and of the draws")
      ->capture_default_str()
      ->transform(decimal_integer(false));
  app.add_flag("--causal", a->causal, "causal masking (off by default, as in plsh attend and compute)");
  app.add_flag_callback(
      "--no-causal", [a] { a->causal = false; }, "every query sees every key (the default)");
  app.add_option("--window-eps", a->window_eps, "window mode: W_h = ceil(sigma_h ln(1/eps))")->capture_default_str();
  app.add_option("--backend", a->backend, backend_names_text())->capture_default_str();
  app.add_option("--threads", a->threads, "CPU threads (0: all cores)")
      ->capture_default_str()
      ->transform(decimal_integer(true));
  app.add_flag("--per-head", a->per_head, "also print the estimates of every head");
  app.add_option("--target-error", a->target_error, "the error-targeted row's target (0: leave the row out)")
      ->capture_default_str();
  return [a] {
    const Status s = demo(*a);
    return s.ok() ? kExitOk : report_error("demo", s);
  };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(demo, "Random inputs, exact vs window vs lsh: time, true error, estimates, FLOPs",
                      plsh::cli::setup_demo);
