#include "cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/tile_plan.h"
#include "plsh/draws.h"
#include "plsh/params.h"

namespace plsh::cuda {

namespace {

// ---- dtypes: runtime DType -> template argument, in one place ---------------

template <typename F>
auto dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF16: return f(__half{});
    case DType::kBF16: return f(__nv_bfloat16{});
    case DType::kF32: break;
  }
  return f(float{});
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF32: break;
  }
  return CUDA_R_32F;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int kThreads = 256;  // 8 warps: one query row per warp at a time
constexpr int kWarps = kThreads / 32;

// The tensors as the kernels see them (device pointers, element strides).
struct DeviceProblem {
  const char* q = nullptr;  // [B, Nq, H, D]
  const char* k = nullptr;  // [B, Nk, Hkv, D]
  const char* v = nullptr;  // [B, Nk, Hkv, D]
  int64_t q_bs = 0, q_rs = 0, q_hs = 0;
  int64_t k_bs = 0, k_rs = 0, k_hs = 0;
  int64_t v_bs = 0, v_rs = 0, v_hs = 0;
  int64_t elem_bytes = 0;
  int64_t head_group = 1;
  int64_t head_dim = 0;
  int64_t q_pos0 = 0, k_pos0 = 0;
  SpanShape shape;
};

struct DeviceOutput {
  void* out = nullptr;  // [B, Nq, H, D] out dtype
  float* lse = nullptr;  // [B, Nq, H] or null
  int64_t o_bs = 0, o_rs = 0, o_hs = 0;
  int64_t lse_bs = 0, lse_rs = 0;
  int64_t heads = 0;
};

// One round's slices of the workspace.
struct RoundBuffers {
  TileDesc* desc;
  const void** q_ptr;
  const void** k_ptr;
  const void** v_ptr;
  float** score_ptr;
  void** prob_ptr;
  float** partial_ptr;
  float* scores;   // [slot][T][Kc]
  char* probs;     // [slot][T][Kc] input dtype
  float* partial;  // [slot][T][D]
  float* row_max;  // [slot][T]
  float* row_sum;  // [slot][T]
};

struct Accumulators {
  float* acc;      // [lane][row][D]
  float* acc_max;  // [lane][row]
  float* acc_sum;  // [lane][row]
  int64_t row0 = 0;           // first query row of the chunk
  int64_t rows_per_lane = 0;  // tiles_per_chunk * T
};

// ---- kernels -----------------------------------------------------------------

// Per slot: the tile's rows and key chunk (tile_plan.h, the same code the
// host tests check) and the cuBLAS pointer arrays into the tensors.
__global__ void build_round_kernel(DeviceProblem pr, Round round, const LanePass* lanes, RoundBuffers rb) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= round.slots) return;
  const TileDesc d = describe_slot(pr.shape, round, lanes, slot);
  rb.desc[slot] = d;
  const LanePass& l = lanes[d.lane];
  const int64_t hk = l.head / pr.head_group;
  const int64_t T = pr.shape.tile_rows;
  const int64_t Kc = round.key_cols;
  rb.q_ptr[slot] = pr.q + (l.batch * pr.q_bs + d.row0 * pr.q_rs + l.head * pr.q_hs) * pr.elem_bytes;
  rb.k_ptr[slot] = pr.k + (l.batch * pr.k_bs + d.col0 * pr.k_rs + hk * pr.k_hs) * pr.elem_bytes;
  rb.v_ptr[slot] = pr.v + (l.batch * pr.v_bs + d.col0 * pr.v_rs + hk * pr.v_hs) * pr.elem_bytes;
  rb.score_ptr[slot] = rb.scores + slot * T * Kc;
  rb.prob_ptr[slot] = rb.probs + slot * T * Kc * pr.elem_bytes;
  rb.partial_ptr[slot] = rb.partial + slot * T * pr.head_dim;
}

// Row softmax of one tile's scores under the pass's rule: P = exp(s - m)
// (0 where not allowed), rounded to the input dtype for the second GEMM, with
// the row max m and the sum of the rounded P. One block per slot; the key
// bins of the chunk are computed once per block, in IEEE double.
template <typename TP>
__global__ void __launch_bounds__(kThreads) masked_softmax_kernel(DeviceProblem pr, int64_t key_cols,
                                                                  const LanePass* lanes, RoundBuffers rb) {
  __shared__ long long key_bin[kMaxKeyCols];
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const LanePass l = lanes[d.lane];
  const int64_t T = pr.shape.tile_rows;
  const int64_t Kc = key_cols;
  const bool same_bin = l.rule == SpanRule::kSameBin;
  if (same_bin) {
    for (int64_t x = threadIdx.x; x < Kc; x += kThreads) key_bin[x] = span_bin(pr.k_pos0 + d.col0 + x, l.pitch, l.shift);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  TP* probs = reinterpret_cast<TP*>(rb.probs);
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    const int64_t base = (slot * T + r) * Kc;
    if (i < d.own_begin || i >= d.own_end) {
      // Rows another tile owns: zeros keep the second GEMM's inputs defined.
      for (int64_t x = lane; x < Kc; x += 32) probs[base + x] = from_float<TP>(0.0f);
      if (lane == 0) {
        rb.row_max[slot * T + r] = -INFINITY;
        rb.row_sum[slot * T + r] = 0.0f;
      }
      continue;
    }
    const int64_t pos_i = pr.q_pos0 + i;
    const int64_t q_bin = same_bin ? span_bin(pos_i, l.pitch, l.shift) : 0;
    auto logit = [&](int64_t x, float* s) {
      const int64_t j = d.col0 + x;
      return slot_logit(l, d, pr.shape.causal, pos_i, j, pr.k_pos0 + j, q_bin, same_bin ? key_bin[x] : 0,
                        rb.scores[base + x], s);
    };
    // The row's logits stay in registers between the max and the exp pass
    // (Kc <= 512: 16 per lane, indexed by unrolled constants), so the scores
    // are read from memory once: 12 bytes per score moved instead of 16.
    constexpr int kPerLane = static_cast<int>(kMaxKeyCols / 32);
    float logits[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = lane + 32 * t;
      float s = -INFINITY;
      if (x >= Kc || !logit(x, &s)) s = -INFINITY;
      logits[t] = s;
      m = fmaxf(m, s);
    }
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t x = lane + 32 * t;
      if (x >= Kc) continue;
      // Allowed logits are finite; -inf marks the masked ones (and m = -inf
      // only when the whole row is masked).
      const float p = logits[t] == -INFINITY ? 0.0f : expf(logits[t] - m);
      const TP pv = from_float<TP>(p);
      probs[base + x] = pv;
      sum += to_float(pv);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      rb.row_max[slot * T + r] = m;
      rb.row_sum[slot * T + r] = sum;
    }
  }
}

// Folds one round's partial outputs into the running per-row accumulators
// (online log-sum-exp; SPEC section 3's merge, over samples and key chunks).
// Each row of a lane has one owner tile per round, so no two warps meet.
__global__ void __launch_bounds__(kThreads) merge_kernel(DeviceProblem pr, const LanePass* lanes, RoundBuffers rb,
                                                         Accumulators a) {
  const int64_t slot = blockIdx.x;
  const TileDesc d = rb.desc[slot];
  const int64_t acc_lane = lanes[d.lane].acc_lane;
  const int64_t T = pr.shape.tile_rows;
  const int64_t D = pr.head_dim;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t r = warp; r < T; r += kWarps) {
    const int64_t i = d.row0 + r;
    if (i < d.own_begin || i >= d.own_end) continue;
    const float l_part = rb.row_sum[slot * T + r];
    if (l_part == 0.0f) continue;  // no allowed key in this chunk
    const float m_part = rb.row_max[slot * T + r];
    const int64_t idx = acc_lane * a.rows_per_lane + (i - a.row0);
    const float l_acc = a.acc_sum[idx];
    const float m_acc = a.acc_max[idx];
    const MergeCoefficients c = merge_coefficients(m_acc, l_acc, m_part);
    float* acc = a.acc + idx * D;
    const float* part = rb.partial + (slot * T + r) * D;
    for (int64_t x = lane; x < D; x += 32) acc[x] = acc[x] * c.c_acc + part[x] * c.c_part;
    __syncwarp();
    if (lane == 0) {
      a.acc_max[idx] = c.m_new;
      a.acc_sum[idx] = l_acc * c.c_acc + l_part * c.c_part;
    }
  }
}

// out = acc / l in the output dtype; lse = m + log l - log(samples of the head).
template <typename TO>
__global__ void __launch_bounds__(kThreads) finalize_kernel(DeviceOutput o, int64_t q_len, int64_t head_dim,
                                                            int64_t lane0, const float* lse_offset, Accumulators a) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t local = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (local >= a.rows_per_lane) return;
  const int64_t i = a.row0 + local;
  if (i >= q_len) return;
  const int64_t acc_lane = blockIdx.y;
  const int64_t g = lane0 + acc_lane;
  const int64_t b = g / o.heads;
  const int64_t h = g % o.heads;
  const int64_t idx = acc_lane * a.rows_per_lane + local;
  const float l = a.acc_sum[idx];
  TO* out = static_cast<TO*>(o.out) + b * o.o_bs + i * o.o_rs + h * o.o_hs;
  const float* acc = a.acc + idx * head_dim;
  for (int64_t x = lane; x < head_dim; x += 32) out[x] = from_float<TO>(l > 0.0f ? acc[x] / l : 0.0f);
  if (lane == 0 && o.lse != nullptr)
    o.lse[b * o.lse_bs + i * o.lse_rs + h] = l > 0.0f ? a.acc_max[idx] + logf(l) - lse_offset[h] : -INFINITY;
}

__global__ void bins_kernel(const long long* pos, long long* out, int64_t n, double pitch, double shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = span_bin(pos[i], pitch, shift);
}

// ---- memory ------------------------------------------------------------------

// Stream-ordered allocations from one CUDA memory pool that keeps up to the
// budget cached between calls, and a reservation counter so that concurrent
// requests together never exceed the budget.
class DevicePool {
 public:
  Status init(int device, int64_t budget) {
    budget_ = budget;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
    uint64_t threshold = static_cast<uint64_t>(budget);
    CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    return Status::Ok();
  }
  ~DevicePool() {
    if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
  }
  int64_t budget() const { return budget_; }
  int64_t available() const { return budget_ - reserved_.load(); }

  Status reserve(int64_t bytes) {
    int64_t cur = reserved_.load();
    do {
      if (cur + bytes > budget_)
        return resource_exhausted("cuda memory budget: request needs " + std::to_string(bytes) + " bytes, " +
                                  std::to_string(cur) + " of " + std::to_string(budget_) +
                                  " bytes are held by other requests (set PLSH_CUDA_MEMORY_MB to change the budget)");
    } while (!reserved_.compare_exchange_weak(cur, cur + bytes));
    return Status::Ok();
  }
  void unreserve(int64_t bytes) { reserved_.fetch_sub(bytes); }

  Status allocate(int64_t bytes, cudaStream_t stream, void** ptr) {
    CUDA_RETURN_IF_ERROR(cudaMallocFromPoolAsync(ptr, static_cast<size_t>(std::max<int64_t>(bytes, 1)), pool_, stream));
    return Status::Ok();
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  int64_t budget_ = 0;
  std::atomic<int64_t> reserved_{0};
};

// A stream-ordered buffer from the pool, freed on the same stream.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  Status allocate(DevicePool& pool, int64_t bytes, cudaStream_t stream) {
    stream_ = stream;
    return pool.allocate(bytes, stream, &ptr_);
  }
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Holds a budget reservation for the length of one forward().
class Reservation {
 public:
  explicit Reservation(DevicePool& pool) : pool_(pool) {}
  ~Reservation() { pool_.unreserve(bytes_); }
  Status take(int64_t bytes) {
    RETURN_IF_ERROR(pool_.reserve(bytes));
    bytes_ += bytes;
    return Status::Ok();
  }

 private:
  DevicePool& pool_;
  int64_t bytes_ = 0;
};

// Carves aligned slices out of one allocation.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const int64_t at = offset_;
    offset_ += (count * static_cast<int64_t>(sizeof(T)) + kAlign - 1) / kAlign * kAlign;
    return reinterpret_cast<T*>(base_ + at);
  }
  static constexpr int64_t kAlign = 256;

 private:
  char* base_;
  int64_t offset_ = 0;
};

// Elements a tensor spans: the last element's offset + 1.
int64_t extent(int64_t batch, int64_t rows, int64_t heads, int64_t dim, int64_t bs, int64_t rs, int64_t hs) {
  return (batch - 1) * bs + (rows - 1) * rs + (heads - 1) * hs + dim;
}

// ---- the backend -------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  Status init(const CudaBackendOptions& options) {
    device_ = options.device;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    device_name_ = std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
                   std::to_string(static_cast<int64_t>(total_bytes >> 30)) + " GiB)";
    int64_t budget = options.memory_budget_bytes;
    if (budget <= 0) {
      if (const char* env = std::getenv("PLSH_CUDA_MEMORY_MB"); env != nullptr && *env != '\0') {
        char* end = nullptr;
        const long long mb = std::strtoll(env, &end, 10);
        if (end == env || *end != '\0' || mb <= 0)
          return invalid_argument(std::string("PLSH_CUDA_MEMORY_MB = '") + env + "', expected a positive integer");
        budget = static_cast<int64_t>(mb) << 20;
      } else {
        budget = static_cast<int64_t>(free_bytes / 4 * 3);
      }
    }
    return pool_.init(device_, budget);
  }

  ~CudaBackend() override {
    for (cublasHandle_t h : free_handles_) (void)cublasDestroy(h);
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  std::optional<DeviceMemory> device_memory() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so the next call starts clean
      return std::nullopt;
    }
    return DeviceMemory{static_cast<int64_t>(total_bytes - free_bytes), static_cast<int64_t>(total_bytes)};
  }

  Status supports(const AttentionParams& p) const override {
    if (p.mode == Mode::kLsh && p.lsh_algorithm == LshAlgorithm::kBanded)
      return unimplemented("lsh_algorithm = banded is not implemented on the cuda backend, expected auto or per_sample");
    const int64_t lds[] = {p.q_row_stride, p.k_row_stride, p.v_row_stride};
    for (int64_t ld : lds)
      if (ld > INT_MAX) return unimplemented("row stride " + std::to_string(ld) + " exceeds cuBLAS's int leading dimension");
    ASSIGN_OR_RETURN(const Sizing s, sizing(p, pool_.budget()));
    (void)s;
    return Status::Ok();
  }

  int64_t workspace_bytes(const AttentionParams& p) const override {
    StatusOr<Sizing> s = sizing(p, pool_.budget());
    if (!s.ok()) return std::numeric_limits<int64_t>::max();
    return s->total();
  }

  Status forward(const AttentionParams& p, const ExecContext& ctx, ForwardStats* stats) override;

 private:
  struct Sizing {
    int64_t staging = 0;  // host tensors copied to the device
    int64_t tables = 0;   // per-head lse offsets and the rounds' lane tables
    WorkspacePlan plan;
    int64_t total() const { return staging + tables + plan.bytes + 16 * Carver::kAlign; }
  };

  StatusOr<Sizing> sizing(const AttentionParams& p, int64_t budget) const;

  StatusOr<cublasHandle_t> acquire_handle() {
    {
      std::lock_guard<std::mutex> lock(handle_mutex_);
      if (!free_handles_.empty()) {
        cublasHandle_t h = free_handles_.back();
        free_handles_.pop_back();
        return h;
      }
    }
    cublasHandle_t h = nullptr;
    CUBLAS_RETURN_IF_ERROR(cublasCreate(&h));
    // fp32 inputs stay fp32 on the tensor cores' side too: no TF32.
    CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    return h;
  }
  void release_handle(cublasHandle_t h) {
    std::lock_guard<std::mutex> lock(handle_mutex_);
    free_handles_.push_back(h);
  }

  int device_ = 0;
  std::string device_name_;
  DevicePool pool_;
  std::mutex handle_mutex_;
  std::vector<cublasHandle_t> free_handles_;
};

StatusOr<CudaBackend::Sizing> CudaBackend::sizing(const AttentionParams& p, int64_t budget) const {
  Sizing s;
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  if (p.memory == MemorySpace::kHost) {
    s.staging += extent(p.batch, p.q_len, p.heads, p.head_dim, p.q_batch_stride, p.q_row_stride, p.q_head_stride) * esz;
    s.staging += extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride) * esz;
    s.staging += extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride) * esz;
    s.staging += extent(p.batch, p.q_len, p.heads, p.head_dim, p.o_batch_stride, p.o_row_stride, p.o_head_stride) *
                 static_cast<int64_t>(dtype_bytes(p.out_dtype));
    if (p.lse != nullptr) s.staging += ((p.batch - 1) * p.lse_batch_stride + (p.q_len - 1) * p.lse_row_stride + p.heads) * 4;
    s.staging += 6 * Carver::kAlign;  // five carved slices, each padded to the alignment
  }
  // Lane tables: one entry per lane, pass and key chunk, at most.
  const SpanShape shape = span_shape(p);
  int64_t entries = 0;
  for (const LaneSetup& h : head_passes(p)) {
    for (const LanePass& l : h.passes) {
      const int64_t width = max_span_width(shape, l.reach);
      entries += ceil_div(width, key_cols_for(width, shape.kv_len));
    }
  }
  s.tables = entries * p.batch * static_cast<int64_t>(sizeof(LanePass)) + p.heads * 4 + 2 * Carver::kAlign;
  WorkspaceShape ws;
  ws.lanes = p.batch * p.heads;
  ws.q_len = p.q_len;
  ws.kv_len = p.kv_len;
  ws.head_dim = p.head_dim;
  ws.elem_bytes = esz;
  const int64_t left = budget - s.staging - s.tables - 16 * Carver::kAlign;
  ASSIGN_OR_RETURN(s.plan, plan_workspace(ws, left));
  return s;
}

Status CudaBackend::forward(const AttentionParams& p, const ExecContext& ctx, ForwardStats* stats) {
  RETURN_IF_ERROR(supports(p));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream = ctx.stream != nullptr ? static_cast<cudaStream_t>(ctx.stream) : cudaStreamPerThread;

  if (p.memory == MemorySpace::kDevice) {
    // lse too when asked for: the finalize kernel writes through it, and a
    // host pointer there would be a sticky illegal-address error.
    const void* ptrs[] = {p.q, p.k, p.v, p.out, p.lse};
    const char* names[] = {"q", "k", "v", "out", "lse"};
    for (int t = 0; t < 5; ++t) {
      if (ptrs[t] == nullptr) continue;  // only lse may be null (make_params checked the rest)
      cudaPointerAttributes attr{};
      CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptrs[t]));
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return invalid_argument(std::string(names[t]) + " is not device memory, expected memory = device tensors");
      if (attr.type == cudaMemoryTypeDevice && attr.device != device_)
        return invalid_argument(std::string(names[t]) + " is on device " + std::to_string(attr.device) +
                                ", expected device " + std::to_string(device_) + " (this backend's)");
    }
  }

  // Plan against what the budget has left now, then hold it: a request that
  // cannot fit is refused before any device memory is touched.
  ASSIGN_OR_RETURN(const Sizing sz, sizing(p, pool_.available()));
  Reservation reservation(pool_);
  RETURN_IF_ERROR(reservation.take(sz.total()));

  ASSIGN_OR_RETURN(cublasHandle_t handle, acquire_handle());
  // Work still queued on an error path may use the handle's workspace: let
  // it drain before another stream can take the handle.
  struct HandleGuard {
    CudaBackend* self;
    cublasHandle_t h;
    cudaStream_t stream;
    ~HandleGuard() {
      (void)cudaStreamSynchronize(stream);
      self->release_handle(h);
    }
  } handle_guard{this, handle, stream};
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));

  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t osz = static_cast<int64_t>(dtype_bytes(p.out_dtype));
  const int64_t q_elems = extent(p.batch, p.q_len, p.heads, p.head_dim, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  const int64_t k_elems = extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  const int64_t v_elems = extent(p.batch, p.kv_len, p.kv_heads, p.head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  const int64_t o_elems = extent(p.batch, p.q_len, p.heads, p.head_dim, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  const int64_t lse_elems = (p.batch - 1) * p.lse_batch_stride + (p.q_len - 1) * p.lse_row_stride + p.heads;

  // Host tensors travel through the pool.
  DeviceBuffer staging;
  DeviceProblem pr;
  DeviceOutput out;
  pr.q = static_cast<const char*>(p.q);
  pr.k = static_cast<const char*>(p.k);
  pr.v = static_cast<const char*>(p.v);
  out.out = p.out;
  out.lse = p.lse;
  if (p.memory == MemorySpace::kHost) {
    RETURN_IF_ERROR(staging.allocate(pool_, sz.staging, stream));
    Carver c(staging.get());
    char* dq = c.take<char>(q_elems * esz);
    char* dk = c.take<char>(k_elems * esz);
    char* dv = c.take<char>(v_elems * esz);
    out.out = c.take<char>(o_elems * osz);
    out.lse = p.lse != nullptr ? c.take<float>(lse_elems) : nullptr;
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dq, p.q, static_cast<size_t>(q_elems * esz), cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dk, p.k, static_cast<size_t>(k_elems * esz), cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dv, p.v, static_cast<size_t>(v_elems * esz), cudaMemcpyHostToDevice, stream));
    pr.q = dq;
    pr.k = dk;
    pr.v = dv;
  }
  pr.q_bs = p.q_batch_stride, pr.q_rs = p.q_row_stride, pr.q_hs = p.q_head_stride;
  pr.k_bs = p.k_batch_stride, pr.k_rs = p.k_row_stride, pr.k_hs = p.k_head_stride;
  pr.v_bs = p.v_batch_stride, pr.v_rs = p.v_row_stride, pr.v_hs = p.v_head_stride;
  pr.elem_bytes = esz;
  pr.head_group = p.head_group;
  pr.head_dim = p.head_dim;
  pr.q_pos0 = p.q_pos0;
  pr.k_pos0 = p.k_pos0;
  pr.shape = span_shape(p);
  out.o_bs = p.o_batch_stride, out.o_rs = p.o_row_stride, out.o_hs = p.o_head_stride;
  out.lse_bs = p.lse_batch_stride, out.lse_rs = p.lse_row_stride;
  out.heads = p.heads;

  const WorkspacePlan& plan = sz.plan;
  const int64_t T = plan.tile_rows;
  const int64_t D = p.head_dim;
  const int64_t S = plan.slots;
  DeviceBuffer work;
  RETURN_IF_ERROR(work.allocate(pool_, plan.bytes + 16 * Carver::kAlign, stream));
  RoundBuffers rb;
  Accumulators acc;
  {
    Carver c(work.get());
    rb.scores = c.take<float>(S * T * plan.key_cols);
    rb.probs = c.take<char>(S * T * plan.key_cols * esz);
    rb.partial = c.take<float>(S * T * D);
    rb.row_max = c.take<float>(S * T);
    rb.row_sum = c.take<float>(S * T);
    acc.acc = c.take<float>(S * T * D);
    acc.acc_max = c.take<float>(S * T);
    acc.acc_sum = c.take<float>(S * T);
    rb.q_ptr = c.take<const void*>(S);
    rb.k_ptr = c.take<const void*>(S);
    rb.v_ptr = c.take<const void*>(S);
    rb.score_ptr = c.take<float*>(S);
    rb.prob_ptr = c.take<void*>(S);
    rb.partial_ptr = c.take<float*>(S);
    rb.desc = c.take<TileDesc>(S);
  }

  const std::vector<LaneSetup> heads = head_passes(p);
  DeviceBuffer tables;
  RETURN_IF_ERROR(tables.allocate(pool_, sz.tables, stream));
  float* d_lse_offset = reinterpret_cast<float*>(tables.get());
  LanePass* d_lanes = reinterpret_cast<LanePass*>(tables.get() + Carver::kAlign * ((p.heads * 4 + Carver::kAlign - 1) / Carver::kAlign));
  {
    std::vector<float> lse_offset(static_cast<size_t>(p.heads));
    for (int64_t h = 0; h < p.heads; ++h)
      lse_offset[static_cast<size_t>(h)] = cuda::lse_offset(heads[static_cast<size_t>(h)], p.samples);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_lse_offset, lse_offset.data(), lse_offset.size() * 4, cudaMemcpyHostToDevice, stream));
  }

  const cudaDataType_t in_type = cuda_type(p.dtype);
  const float alpha_qk = static_cast<float>(p.scale);
  const float one = 1.0f, zero = 0.0f;
  const int64_t lanes_total = p.batch * p.heads;
  const int64_t tiles_total = tile_count(pr.shape);
  const double chunks_total = static_cast<double>(ceil_div(lanes_total, plan.lanes_per_chunk) * ceil_div(tiles_total, plan.tiles_per_chunk));
  double chunks_done = 0;
  double flops = 0;
  std::vector<LanePass> table;

  for (int64_t lane0 = 0; lane0 < lanes_total; lane0 += plan.lanes_per_chunk) {
    const int64_t lane1 = std::min(lanes_total, lane0 + plan.lanes_per_chunk);
    const std::vector<LaneSetup> setups = chunk_lanes(heads, p.heads, lane0, lane1);
    for (int64_t t0 = 0; t0 < tiles_total; t0 += plan.tiles_per_chunk) {
      const int64_t t1 = std::min(tiles_total, t0 + plan.tiles_per_chunk);
      RETURN_IF_ERROR(ctx.check_stop());
      table.clear();
      const std::vector<Round> rounds = plan_rounds(pr.shape, setups, t0, t1, &table);
      if (static_cast<int64_t>(table.size() * sizeof(LanePass)) > sz.tables)
        return internal_error("cuda backend: lane table of " + std::to_string(table.size()) + " entries exceeds its sizing");
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_lanes, table.data(), table.size() * sizeof(LanePass), cudaMemcpyHostToDevice, stream));
      acc.row0 = t0 * T;
      acc.rows_per_lane = (t1 - t0) * T;
      const int64_t acc_rows = (lane1 - lane0) * acc.rows_per_lane;
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc, 0, static_cast<size_t>(acc_rows * D * 4), stream));
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc_max, 0, static_cast<size_t>(acc_rows * 4), stream));
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc.acc_sum, 0, static_cast<size_t>(acc_rows * 4), stream));

      for (const Round& r : rounds) {
        RETURN_IF_ERROR(ctx.check_stop());
        const int slots = static_cast<int>(r.slots);
        const int Kc = static_cast<int>(r.key_cols);
        build_round_kernel<<<static_cast<unsigned>(ceil_div(r.slots, kThreads)), kThreads, 0, stream>>>(pr, r, d_lanes, rb);
        LAUNCH_RETURN_IF_ERROR("build_round_kernel");
        // S^T (Kc x T, column-major) = K_chunk (Kc x D) . Q_tile^T: row-major S [T][Kc].
        CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, Kc, static_cast<int>(T), static_cast<int>(D), &alpha_qk, rb.k_ptr, in_type,
            static_cast<int>(p.k_row_stride), rb.q_ptr, in_type, static_cast<int>(p.q_row_stride), &zero,
            reinterpret_cast<void* const*>(rb.score_ptr), CUDA_R_32F, Kc, slots, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        dispatch_dtype(p.dtype, [&](auto tag) {
          using TP = decltype(tag);
          masked_softmax_kernel<TP><<<static_cast<unsigned>(r.slots), kThreads, 0, stream>>>(pr, r.key_cols, d_lanes, rb);
          return 0;
        });
        LAUNCH_RETURN_IF_ERROR("masked_softmax_kernel");
        // O^T (D x T) = V_chunk^T (D x Kc) . P^T (Kc x T): row-major O [T][D].
        CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
            handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(D), static_cast<int>(T), Kc, &one, rb.v_ptr, in_type,
            static_cast<int>(p.v_row_stride), rb.prob_ptr, in_type, Kc, &zero,
            reinterpret_cast<void* const*>(rb.partial_ptr), CUDA_R_32F, static_cast<int>(D), slots, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT));
        merge_kernel<<<static_cast<unsigned>(r.slots), kThreads, 0, stream>>>(pr, d_lanes, rb, acc);
        LAUNCH_RETURN_IF_ERROR("merge_kernel");
        flops += 4.0 * static_cast<double>(r.slots) * static_cast<double>(T) * static_cast<double>(Kc) * static_cast<double>(D);
      }

      const dim3 grid(static_cast<unsigned>(ceil_div(acc.rows_per_lane, kWarps)), static_cast<unsigned>(lane1 - lane0));
      dispatch_dtype(p.out_dtype, [&](auto tag) {
        using TO = decltype(tag);
        finalize_kernel<TO><<<grid, kThreads, 0, stream>>>(out, p.q_len, D, lane0, d_lse_offset, acc);
        return 0;
      });
      LAUNCH_RETURN_IF_ERROR("finalize_kernel");
      chunks_done += 1;
      if (ctx.progress) ctx.progress(chunks_done / chunks_total);
    }
  }

  if (p.memory == MemorySpace::kHost) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.out, out.out, static_cast<size_t>(o_elems * osz), cudaMemcpyDeviceToHost, stream));
    if (p.lse != nullptr)
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.lse, out.lse, static_cast<size_t>(lse_elems * 4), cudaMemcpyDeviceToHost, stream));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (stats != nullptr) {
    stats->flops = flops;
    stats->lsh_algorithm = p.mode == Mode::kLsh ? LshAlgorithm::kPerSample : LshAlgorithm::kAuto;
    stats->workspace_bytes = sz.total();
  }
  return Status::Ok();
}

Status no_device_reason(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    return failed_precondition(*why);
  }
  if (count == 0) {
    *why = "no CUDA device: cudaGetDeviceCount found 0 devices";
    return failed_precondition(*why);
  }
  return Status::Ok();
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(std::string* why_not, const CudaBackendOptions& options) {
  std::string why;
  if (!no_device_reason(&why).ok()) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  auto backend = std::make_unique<CudaBackend>();
  const Status s = backend->init(options);
  if (!s.ok()) {
    if (why_not != nullptr) *why_not = "cuda backend init: " + s.to_string();
    return nullptr;
  }
  return backend;
}

StatusOr<std::vector<int64_t>> device_bins(const Draw& draw, const std::vector<int64_t>& positions, int device) {
  std::string why;
  RETURN_IF_ERROR(no_device_reason(&why));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<int64_t> bins(positions.size());
  if (n == 0) return bins;
  long long* d_pos = nullptr;
  long long* d_out = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&d_pos, static_cast<size_t>(n) * 8));
  struct Free {
    long long** a;
    long long** b;
    ~Free() {
      (void)cudaFree(*a);
      (void)cudaFree(*b);
    }
  } guard{&d_pos, &d_out};
  CUDA_RETURN_IF_ERROR(cudaMalloc(&d_out, static_cast<size_t>(n) * 8));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(d_pos, positions.data(), static_cast<size_t>(n) * 8, cudaMemcpyHostToDevice));
  bins_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256>>>(d_pos, d_out, n, draw.pitch, draw.shift);
  LAUNCH_RETURN_IF_ERROR("bins_kernel");
  CUDA_RETURN_IF_ERROR(cudaMemcpy(bins.data(), d_out, static_cast<size_t>(n) * 8, cudaMemcpyDeviceToHost));
  return bins;
}

}  // namespace plsh::cuda

extern "C" plsh::Backend* plsh_create_cuda_backend(std::string* why_not) {
  return plsh::cuda::make_cuda_backend(why_not).release();
}
