// Times the CUDA backend on device-resident tensors with CUDA events: median
// of repeated forward() calls after warm-up, per mode. Reads q, k, v as raw
// little-endian files written by bench/gpu/peers.py (so that both sides see
// identical inputs), writes each mode's output beside them for the error
// comparison, and appends one JSON object per mode to --json.
//
//   bench_cuda --n 131072 --inputs DIR [--heads 32 --kv-heads 32 --dim 128
//              --dtype bf16 --samples 16 --seed 0 --modes lsh,exact,window
//              --warmup 1 --repeats 5 --max-seconds 20 --json FILE --write-out]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "plsh/attention.h"
#include "plsh/params.h"

namespace {

struct Args {
  int64_t n = 8192;
  int64_t heads = 32;
  int64_t kv_heads = 32;
  int64_t dim = 128;
  std::string dtype = "bf16";
  int64_t samples = 16;
  uint64_t seed = 0;
  std::string modes = "lsh,exact,window";
  int warmup = 1;
  int repeats = 5;
  double max_seconds = 20;  // per mode: fewer repeats when one run is slow
  std::string inputs;
  std::string json;
  bool write_out = false;
  bool causal = true;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_cuda: %s\nusage: bench_cuda --n N --inputs DIR [--heads H] [--kv-heads HKV] [--dim D] "
               "[--dtype bf16|f16|f32] [--samples S] [--seed X] [--modes lsh,exact,window] [--warmup W] "
               "[--repeats R] [--max-seconds T] [--json FILE] [--write-out] [--noncausal]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + k).c_str());
      return argv[++i];
    };
    if (k == "--n") a.n = std::stoll(next());
    else if (k == "--heads") a.heads = std::stoll(next());
    else if (k == "--kv-heads") a.kv_heads = std::stoll(next());
    else if (k == "--dim") a.dim = std::stoll(next());
    else if (k == "--dtype") a.dtype = next();
    else if (k == "--samples") a.samples = std::stoll(next());
    else if (k == "--seed") a.seed = std::stoull(next());
    else if (k == "--modes") a.modes = next();
    else if (k == "--warmup") a.warmup = std::stoi(next());
    else if (k == "--repeats") a.repeats = std::stoi(next());
    else if (k == "--max-seconds") a.max_seconds = std::stod(next());
    else if (k == "--inputs") a.inputs = next();
    else if (k == "--json") a.json = next();
    else if (k == "--write-out") a.write_out = true;
    else if (k == "--noncausal") a.causal = false;
    else if (k == "--help" || k == "-h") usage("help");
    else usage(("unknown argument " + k).c_str());
  }
  if (a.inputs.empty()) usage("--inputs DIR is required (q.bin, k.bin, v.bin from peers.py prepare)");
  if (a.repeats < 1) usage("--repeats must be >= 1");
  return a;
}

#define CHECK_CUDA(expr)                                                                                  \
  do {                                                                                                    \
    const cudaError_t e_ = (expr);                                                                        \
    if (e_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                       \
    }                                                                                                     \
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
    std::fprintf(stderr, "bench_cuda: %s has %lld bytes, expected %zu\n", path.c_str(), static_cast<long long>(f.gcount()), bytes);
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
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  CHECK_CUDA(cudaMalloc(&dq, q_bytes));
  CHECK_CUDA(cudaMalloc(&dk, kv_bytes));
  CHECK_CUDA(cudaMalloc(&dv, kv_bytes));
  CHECK_CUDA(cudaMalloc(&dout, q_bytes));
  {
    const std::vector<char> q = read_file(a.inputs + "/q.bin", q_bytes);
    CHECK_CUDA(cudaMemcpy(dq, q.data(), q_bytes, cudaMemcpyHostToDevice));
  }
  {
    const std::vector<char> k = read_file(a.inputs + "/k.bin", kv_bytes);
    CHECK_CUDA(cudaMemcpy(dk, k.data(), kv_bytes, cudaMemcpyHostToDevice));
  }
  {
    const std::vector<char> v = read_file(a.inputs + "/v.bin", kv_bytes);
    CHECK_CUDA(cudaMemcpy(dv, v.data(), kv_bytes, cudaMemcpyHostToDevice));
  }
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start = nullptr, stop = nullptr;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  std::ofstream json;
  if (!a.json.empty()) {
    json.open(a.json, std::ios::app);
    if (!json) {
      std::fprintf(stderr, "bench_cuda: cannot open --json %s\n", a.json.c_str());
      return 1;
    }
  }

  std::stringstream modes(a.modes);
  std::string mode_name;
  int failures = 0;
  while (std::getline(modes, mode_name, ',')) {
    plsh::StatusOr<plsh::Mode> mode = plsh::parse_mode(mode_name);
    if (!mode.ok()) usage(mode.status().message().c_str());
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
    o.estimates = false;
    plsh::StatusOr<plsh::AttentionParams> p =
        plsh::make_params(o, {dq, dk, dv, dout, nullptr, plsh::MemorySpace::kDevice});
    if (!p.ok()) {
      std::fprintf(stderr, "bench_cuda: %s: %s\n", mode_name.c_str(), p.status().to_string().c_str());
      return 1;
    }
    // Planned once: forward alone is timed. A failed plan is reported as a
    // failed mode below.
    plsh::StatusOr<plsh::Plan> plan = backend->plan(*p, plsh::PlanLimits{});
    // The host part of the plan's workspace (the backend reserves its device
    // bytes itself, for now).
    plsh::StatusOr<plsh::HostWorkspace> workspace =
        plsh::HostWorkspace::allocate(plan.ok() ? plan->forward_workspace.host_bytes : 0);
    if (!workspace.ok()) {
      std::fprintf(stderr, "bench_cuda: %s\n", workspace.status().to_string().c_str());
      return 1;
    }
    plsh::ExecContext ctx;
    ctx.stream = stream;
    plsh::ForwardStats stats;
    std::vector<float> ms;
    int repeats = a.repeats;
    plsh::Status status = plan.status();
    for (int r = 0; r < a.warmup + repeats && status.ok(); ++r) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      status = backend->forward(*plan, workspace->ref(), ctx, &stats);
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      if (r >= a.warmup) ms.push_back(t);
      // A slow mode keeps the whole run inside its time: stop repeating.
      if (r == 0 && t * 1e-3 * (a.warmup + repeats) > a.max_seconds)
        repeats = std::max(1, static_cast<int>(a.max_seconds / (t * 1e-3)) - a.warmup);
    }
    if (!status.ok()) {
      std::fprintf(stderr, "bench_cuda: %s n=%lld: %s\n", mode_name.c_str(), static_cast<long long>(a.n),
                   status.to_string().c_str());
      // One line per mode, failed ones too, so the table says why a mode has no time.
      if (json.is_open()) {
        json << "{\"impl\": \"ours\", \"mode\": \"" << mode_name << "\", \"n\": " << a.n << ", \"error\": \""
             << json_escape(status.to_string()) << "\"" << json_params(*p) << "}\n";
        json.flush();
      }
      ++failures;
      continue;
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
    const double dense = plsh::dense_flops(*p);
    std::printf("ours %-6s n=%-7lld %10.3f ms  (min %.3f, max %.3f, %zu runs)  done %.1f TFLOP/s  exact-equivalent %.1f TFLOP/s\n",
                mode_name.c_str(), static_cast<long long>(a.n), median, ms.front(), ms.back(), ms.size(),
                stats.flops / (median * 1e-3) / 1e12, dense / (median * 1e-3) / 1e12);
    if (json.is_open()) {
      json << "{\"impl\": \"ours\", \"mode\": \"" << mode_name << "\", \"n\": " << a.n << ", \"heads\": " << a.heads
           << ", \"dim\": " << a.dim << ", \"dtype\": \"" << a.dtype << "\", \"samples\": " << a.samples
           << ", \"ms\": " << median << ", \"ms_min\": " << ms.front() << ", \"runs\": " << ms.size()
           << ", \"flops_done\": " << stats.flops << ", \"dense_flops\": " << dense
           << ", \"workspace_bytes\": " << stats.workspace.device_bytes << ", \"device\": \""
           << json_escape(backend->device()) << "\"" << json_params(*p) << "}\n";
      json.flush();
    }
    if (a.write_out) {
      std::vector<char> host(q_bytes);
      CHECK_CUDA(cudaMemcpy(host.data(), dout, q_bytes, cudaMemcpyDeviceToHost));
      const std::string path = a.inputs + "/out_ours_" + mode_name + ".bin";
      std::ofstream f(path, std::ios::binary);
      f.write(host.data(), static_cast<std::streamsize>(q_bytes));
      if (!f) {
        std::fprintf(stderr, "bench_cuda: cannot write %s\n", path.c_str());
        ++failures;
      }
    }
  }
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  return failures == 0 ? 0 : 1;
}
