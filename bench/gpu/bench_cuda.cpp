// Times the CUDA backend with CUDA events: median of repeated calls after
// warm-up, per case. Reads q, k, v as raw little-endian files written by
// bench/gpu/peers.py (so that both sides see identical inputs), writes each
// case's output beside them for the error comparison, and appends one JSON
// object per case to --json.
//
//   bench_cuda --n 131072 --inputs DIR [--heads 32 --kv-heads 32 --dim 128
//              --dtype bf16 --samples 16 --seed 0
//              --modes lsh,lsh_per_sample,window,exact,lsh_estimates
//              --backward --warmup 1 --repeats 5 --max-seconds 20 --json FILE --write-out]
//
// Cases (device tensors unless said):
//   lsh              lsh_algorithm = auto: the fused banded kernel (SPEC's cost model)
//   lsh_per_sample   lsh_algorithm = per_sample: the cuBLAS pipeline
//   window, exact    the fused kernel
//   lsh_estimates    host tensors through run_attention with the estimates:
//                    forward (its transfers included) and the estimates' seconds
// With --backward, every device case but lsh_estimates times its backward
// too (the forward's out and lse, dout ~ N(0, 1) on the device).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "cuda/cuda_backend.h"
#include "plsh/attention.h"
#include "plsh/numeric.h"
#include "plsh/params.h"
#include "plsh/workspace.h"

namespace {

struct Args {
  int64_t n = 8192;
  int64_t heads = 32;
  int64_t kv_heads = 32;
  int64_t dim = 128;
  std::string dtype = "bf16";
  int64_t samples = 16;
  uint64_t seed = 0;
  std::string modes = "lsh,lsh_per_sample,window,exact";
  bool backward = false;
  int warmup = 1;
  int repeats = 5;
  double max_seconds = 20;  // per case: fewer repeats when one run is slow
  std::string inputs;
  std::string json;
  bool write_out = false;
  bool causal = true;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(
      stderr,
      "bench_cuda: %s\nusage: bench_cuda --n N --inputs DIR [--heads H] [--kv-heads HKV] [--dim D] "
      "[--dtype bf16|f16|f32] [--samples S] [--seed X] [--modes lsh,lsh_per_sample,window,exact,lsh_estimates] "
      "[--backward] [--warmup W] [--repeats R] [--max-seconds T] [--json FILE] [--write-out] [--noncausal]\n",
      why);
  std::exit(2);
}

// A value's text into the field's type; nullopt where it is not one.
template <typename T>
std::optional<T> parse_value(const std::string& text) {
  if constexpr (std::is_same_v<T, std::string>) {
    return text;
  } else {
    std::istringstream in(text);
    T value{};
    if (!(in >> value) || !in.eof()) return std::nullopt;
    return value;
  }
}

Args parse(int argc, char** argv) {
  Args a;
  using Field = std::variant<int64_t*, uint64_t*, int*, double*, std::string*>;
  const std::map<std::string, Field> options = {{"--n", &a.n},
                                                {"--heads", &a.heads},
                                                {"--kv-heads", &a.kv_heads},
                                                {"--dim", &a.dim},
                                                {"--dtype", &a.dtype},
                                                {"--samples", &a.samples},
                                                {"--seed", &a.seed},
                                                {"--modes", &a.modes},
                                                {"--warmup", &a.warmup},
                                                {"--repeats", &a.repeats},
                                                {"--max-seconds", &a.max_seconds},
                                                {"--inputs", &a.inputs},
                                                {"--json", &a.json}};
  // Flags: the field and the value they set.
  const std::map<std::string, std::pair<bool*, bool>> flags = {
      {"--backward", {&a.backward, true}}, {"--write-out", {&a.write_out, true}}, {"--noncausal", {&a.causal, false}}};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") usage("help");
    if (const auto flag = flags.find(k); flag != flags.end()) {
      *flag->second.first = flag->second.second;
      continue;
    }
    const auto option = options.find(k);
    if (option == options.end()) usage(("unknown argument " + k).c_str());
    if (i + 1 >= argc) usage(("missing value after " + k).c_str());
    const std::string text = argv[++i];
    std::visit(
        [&](auto* field) {
          const auto value = parse_value<std::remove_pointer_t<decltype(field)>>(text);
          if (!value) usage(("bad value '" + text + "' for " + k).c_str());
          *field = *value;
        },
        option->second);
  }
  if (a.inputs.empty()) usage("--inputs DIR is required (q.bin, k.bin, v.bin from peers.py prepare)");
  if (a.repeats < 1) usage("--repeats must be >= 1");
  return a;
}

#define CHECK_CUDA(expr)                                                                                   \
  do {                                                                                                     \
    const cudaError_t e_ = (expr);                                                                         \
    if (e_ != cudaSuccess) {                                                                               \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)

std::vector<char> read_file(const std::string& path, size_t bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "bench_cuda: cannot open %s\n", path.c_str());
    std::exit(1);
  }
  std::vector<char> buf(bytes);
  f.read(buf.data(), static_cast<std::streamsize>(bytes));
  if (static_cast<size_t>(f.gcount()) != bytes) {
    std::fprintf(stderr, "bench_cuda: %s has %lld bytes, expected %zu\n", path.c_str(),
                 static_cast<long long>(f.gcount()), bytes);
    std::exit(1);
  }
  return buf;
}

// The slopes (hex, bit for bit) and window widths this run used, as JSON
// fields: peers.py checks its own against them.
std::string json_params(const plsh::AttentionParams& p) {
  std::string s = ", \"slopes_hex\": [";
  char buf[64];
  for (size_t h = 0; h < p.slopes.size(); ++h) {
    std::snprintf(buf, sizeof buf, "%s\"%a\"", h ? ", " : "", p.slopes[h]);
    s += buf;
  }
  s += "]";
  if (!p.window.empty()) {
    s += ", \"windows\": [";
    for (size_t h = 0; h < p.window.size(); ++h) s += (h ? ", " : "") + std::to_string(p.window[h]);
    s += "]";
  }
  return s;
}

// JSON string contents: quotes, backslashes and control characters escaped.
std::string json_escape(const std::string& in) {
  std::string out;
  for (const char c : in) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

// The median of `call`'s event-timed runs (ms) after the warm-up, fewer
// repeats when one run would push the case past max_seconds; the first
// failing status instead.
struct Timing {
  plsh::Status status;
  std::vector<float> ms;
  double median() const {
    std::vector<float> s = ms;
    std::sort(s.begin(), s.end());
    return s.size() % 2 ? s[s.size() / 2] : 0.5 * (s[s.size() / 2 - 1] + s[s.size() / 2]);
  }
};
Timing time_calls(const Args& a, cudaStream_t stream, const std::function<plsh::Status()>& call) {
  cudaEvent_t start = nullptr, stop = nullptr;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  Timing t;
  int repeats = a.repeats;
  for (int r = 0; r < a.warmup + repeats && t.status.ok(); ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    t.status = call();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (r >= a.warmup) t.ms.push_back(ms);
    if (r == 0 && ms * 1e-3 * (a.warmup + repeats) > a.max_seconds)
      repeats = std::max(1, static_cast<int>(a.max_seconds / (ms * 1e-3)) - a.warmup);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return t;
}

struct DeviceTensors {
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *dout = nullptr, *dq = nullptr, *dk = nullptr,
       *dv = nullptr;
  float* lse = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::string why;
  std::unique_ptr<plsh::Backend> backend = plsh::cuda::make_cuda_backend(&why);
  if (backend == nullptr) {
    std::fprintf(stderr, "bench_cuda: %s\n", why.c_str());
    return 1;
  }
  plsh::StatusOr<plsh::DType> dtype = plsh::parse_dtype(a.dtype);
  if (!dtype.ok()) usage(dtype.status().message().c_str());

  const size_t esz = plsh::dtype_bytes(*dtype);
  const size_t q_bytes = static_cast<size_t>(a.n * a.heads * a.dim) * esz;
  const size_t kv_bytes = static_cast<size_t>(a.n * a.kv_heads * a.dim) * esz;
  const std::vector<char> hq = read_file(a.inputs + "/q.bin", q_bytes), hk = read_file(a.inputs + "/k.bin", kv_bytes),
                          hv = read_file(a.inputs + "/v.bin", kv_bytes);
  DeviceTensors d;
  CHECK_CUDA(cudaMalloc(&d.q, q_bytes));
  CHECK_CUDA(cudaMalloc(&d.k, kv_bytes));
  CHECK_CUDA(cudaMalloc(&d.v, kv_bytes));
  CHECK_CUDA(cudaMalloc(&d.out, q_bytes));
  CHECK_CUDA(cudaMalloc(&d.lse, static_cast<size_t>(a.n * a.heads) * 4));
  CHECK_CUDA(cudaMemcpy(d.q, hq.data(), q_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.k, hk.data(), kv_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.v, hv.data(), kv_bytes, cudaMemcpyHostToDevice));
  if (a.backward) {
    CHECK_CUDA(cudaMalloc(&d.dout, q_bytes));
    CHECK_CUDA(cudaMalloc(&d.dq, q_bytes));
    CHECK_CUDA(cudaMalloc(&d.dk, kv_bytes));
    CHECK_CUDA(cudaMalloc(&d.dv, kv_bytes));
    const std::vector<uint8_t> g = [&] {
      std::vector<uint8_t> bytes(q_bytes);
      std::mt19937_64 rng(77);
      std::normal_distribution<float> n01;
      for (size_t i = 0; i < q_bytes / esz; ++i)
        plsh::store_element(bytes.data(), *dtype, static_cast<int64_t>(i), n01(rng));
      return bytes;
    }();
    CHECK_CUDA(cudaMemcpy(d.dout, g.data(), q_bytes, cudaMemcpyHostToDevice));
  }
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::ofstream json;
  if (!a.json.empty()) {
    json.open(a.json, std::ios::app);
    if (!json) {
      std::fprintf(stderr, "bench_cuda: cannot open --json %s\n", a.json.c_str());
      return 1;
    }
  }

  std::stringstream modes(a.modes);
  std::string name;
  int failures = 0;
  while (std::getline(modes, name, ',')) {
    const bool host_estimates = name == "lsh_estimates";
    const std::string mode_name = name == "lsh_per_sample" || host_estimates ? "lsh" : name;
    plsh::StatusOr<plsh::Mode> mode = plsh::parse_mode(mode_name);
    if (!mode.ok()) usage(("unknown case " + name).c_str());
    plsh::AttentionOptions o;
    o.q_len = o.kv_len = a.n;
    o.heads = a.heads;
    o.kv_heads = a.kv_heads;
    o.head_dim = a.dim;
    o.dtype = *dtype;
    o.causal = a.causal;
    o.mode = *mode;
    o.samples = a.samples;
    o.seed = a.seed;
    o.lsh_algorithm = name == "lsh_per_sample" ? plsh::LshAlgorithm::kPerSample : plsh::LshAlgorithm::kAuto;
    o.estimates = host_estimates;
    o.check_finite = false;  // checked once by peers.py's generator; not part of any timing
    std::vector<char> host_out;
    std::vector<float> host_lse;
    plsh::TensorRefs refs{d.q, d.k, d.v, d.out, d.lse, plsh::MemorySpace::kDevice};
    if (host_estimates) {
      host_out.resize(q_bytes);
      host_lse.resize(static_cast<size_t>(a.n * a.heads));
      refs = {hq.data(), hk.data(), hv.data(), host_out.data(), host_lse.data(), plsh::MemorySpace::kHost};
    }
    plsh::StatusOr<plsh::AttentionParams> p = plsh::make_params(o, refs);
    if (!p.ok()) {
      std::fprintf(stderr, "bench_cuda: %s: %s\n", name.c_str(), p.status().to_string().c_str());
      return 1;
    }
    plsh::PlanLimits limits;
    limits.backward = a.backward && !host_estimates;
    plsh::StatusOr<plsh::Plan> plan = plsh::plan_attention(*backend, *p, limits);
    // The host part of the plan's workspace, for every step it planned (the
    // backend reserves its device bytes itself, for now).
    plsh::StatusOr<plsh::HostWorkspace> workspace =
        plsh::HostWorkspace::allocate(plan.ok() ? plan->workspace().host_bytes : 0);
    if (!workspace.ok()) {
      std::fprintf(stderr, "bench_cuda: %s\n", workspace.status().to_string().c_str());
      return 1;
    }
    plsh::ExecContext ctx;
    ctx.stream = stream;
    plsh::ForwardStats stats;
    plsh::AttentionResult result;
    Timing fwd{plan.status(), {}};
    if (plan.ok()) {
      fwd = time_calls(a, stream, [&]() -> plsh::Status {
        if (!host_estimates) return backend->forward(*plan, workspace->ref(), ctx, &stats);
        plsh::StatusOr<plsh::AttentionResult> r = plsh::run_attention(*backend, *plan, workspace->ref(), ctx);
        if (r.ok()) result = *r;
        return r.status();
      });
    }
    Timing bwd;
    plsh::BackwardStats bstats;
    if (fwd.status.ok() && limits.backward) {
      const plsh::GradientRefs g{.dout = d.dout,
                                 .dq = d.dq,
                                 .dk = d.dk,
                                 .dv = d.dv,
                                 .grad_dtype = std::nullopt,
                                 .memory = plsh::MemorySpace::kDevice};
      plsh::StatusOr<plsh::BackwardParams> bp = plsh::make_backward_params(plan->params, g);
      bwd.status = bp.status();
      if (bp.ok())
        bwd = time_calls(a, stream, [&] { return backend->backward(*plan, *bp, workspace->ref(), ctx, &bstats); });
    }
    const plsh::Status status = fwd.status.ok() ? bwd.status : fwd.status;
    if (!status.ok()) {
      std::fprintf(stderr, "bench_cuda: %s n=%lld: %s\n", name.c_str(), static_cast<long long>(a.n),
                   status.to_string().c_str());
      // One line per case, failed ones too, so the table says why a case has no time.
      if (json.is_open()) {
        json << "{\"impl\": \"ours\", \"mode\": \"" << name << "\", \"n\": " << a.n << ", \"error\": \""
             << json_escape(status.to_string()) << "\"" << json_params(*p) << "}\n";
        json.flush();
      }
      ++failures;
      continue;
    }
    const double median = fwd.median();
    const double dense = plsh::dense_flops(*p);
    const double done = host_estimates ? result.flops : stats.flops;
    std::printf("ours %-15s n=%-7lld %10.3f ms  (min %.3f, %zu runs)  done %.1f TFLOP/s  exact-equivalent %.1f TFLOP/s",
                name.c_str(), static_cast<long long>(a.n), median, *std::min_element(fwd.ms.begin(), fwd.ms.end()),
                fwd.ms.size(), done / (median * 1e-3) / 1e12, dense / (median * 1e-3) / 1e12);
    if (limits.backward) std::printf("  backward %.3f ms (%.2fx)", bwd.median(), bwd.median() / median);
    std::printf("\n");
    if (json.is_open()) {
      json << "{\"impl\": \"ours\", \"mode\": \"" << name << "\", \"n\": " << a.n << ", \"heads\": " << a.heads
           << ", \"dim\": " << a.dim << ", \"dtype\": \"" << a.dtype << "\", \"samples\": " << a.samples
           << ", \"lsh_algorithm\": \"" << plsh::lsh_algorithm_name(plan->lsh_algorithm) << "\""
           << ", \"ms\": " << median << ", \"ms_min\": " << *std::min_element(fwd.ms.begin(), fwd.ms.end())
           << ", \"runs\": " << fwd.ms.size() << ", \"flops_done\": " << done << ", \"dense_flops\": " << dense
           << ", \"workspace_bytes\": " << plan->forward_workspace.device_bytes;
      if (limits.backward)
        json << ", \"bwd_ms\": " << bwd.median() << ", \"bwd_runs\": " << bwd.ms.size()
             << ", \"bwd_flops_done\": " << bstats.flops;
      for (const auto& [k, v] : result.timings) json << ", \"timing_" << k << "_s\": " << v;
      json << ", \"device\": \"" << json_escape(backend->device()) << "\"" << json_params(*p) << "}\n";
      json.flush();
    }
    if (a.write_out && !host_estimates) {
      std::vector<char> out(q_bytes);
      CHECK_CUDA(cudaMemcpy(out.data(), d.out, q_bytes, cudaMemcpyDeviceToHost));
      const std::string path = a.inputs + "/out_ours_" + name + ".bin";
      std::ofstream f(path, std::ios::binary);
      f.write(out.data(), static_cast<std::streamsize>(q_bytes));
      if (!f) {
        std::fprintf(stderr, "bench_cuda: cannot write %s\n", path.c_str());
        ++failures;
      }
    }
  }
  for (void* x : {d.q, d.k, d.v, d.out, d.dout, d.dq, d.dk, d.dv, static_cast<void*>(d.lse)})
    if (x != nullptr) cudaFree(x);
  return failures == 0 ? 0 : 1;
}
