// How the fused kernels' bodies (fused_forward.h, fused_backward.h) run:
// one body, two executors.
//   DeviceExec  (nvcc, device code) each thread runs the body for itself:
//               `threads`, `lanes` call their function once for the calling
//               thread; the warp collectives are the hardware's (shuffles,
//               ballot, ldmatrix, mma.sync, cp.async).
//   HostExec    (any C++ compiler) one host thread runs a whole CTA, phase
//               by phase: `threads` loops over the CTA's 128 threads,
//               `warps` over its 4 warps and `lanes` over a warp's 32 lanes,
//               and the collectives follow the PTX ISA's definitions
//               (ldmatrix's and mma.m16n8k16's fragment layouts) on all 32
//               lanes at once.
// A body keeps per-thread registers in PerThread<T> (one T on the device,
// 128 on the host) and touches them only inside `lanes` or through a
// collective's lane accessors, so that the same code is both the kernel
// and its emulation. Between phases the host needs no barrier: each phase
// runs to completion before the next starts, which is what __syncthreads
// and __syncwarp guarantee on the device (the host cannot show a missing
// barrier: compute-sanitizer's racecheck on the GPU does, bench/gpu/run.sh).
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/fused_tile.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#include <cmath>
#include <vector>

#include "plsh/numeric.h"
#endif

// Unrolls the loop that follows on the device (register arrays are indexed
// by constants only); nothing on the host.
#if defined(__CUDA_ARCH__)
#define PLSH_UNROLL _Pragma("unroll")
#else
#define PLSH_UNROLL
#endif

namespace plsh::cuda {

// ---- element types ---------------------------------------------------------------

// The three input dtypes as the fused kernels store them (raw bits for the
// 16-bit ones) and convert them; kTensorCores: mma.sync m16n8k16 with f32
// accumulation, else f32 FMAs on the CUDA cores (f32 inputs keep f32
// products: no TF32, as the cuBLAS path).
struct Bf16 {
  using Storage = uint16_t;
  static constexpr bool kTensorCores = true;
  static constexpr int kDType = 2;  // DType::kBF16
};
struct F16 {
  using Storage = uint16_t;
  static constexpr bool kTensorCores = true;
  static constexpr int kDType = 1;  // DType::kF16
};
struct F32 {
  using Storage = float;
  static constexpr bool kTensorCores = false;
  static constexpr int kDType = 0;  // DType::kF32
};

// bits <-> float, rounding to nearest even: the device's intrinsics under
// nvcc (host and device passes), plsh/numeric.h's conversions elsewhere.
#if defined(__CUDACC__)
PLSH_HD inline float bits_to_float(Bf16, uint16_t x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
PLSH_HD inline float bits_to_float(F16, uint16_t x) { return __half2float(__ushort_as_half(x)); }
PLSH_HD inline uint16_t float_to_bits(Bf16, float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
PLSH_HD inline uint16_t float_to_bits(F16, float x) { return __half_as_ushort(__float2half_rn(x)); }
#else
inline float bits_to_float(Bf16, uint16_t x) { return bf16_to_float(x); }
inline float bits_to_float(F16, uint16_t x) { return half_to_float(x); }
inline uint16_t float_to_bits(Bf16, float x) { return float_to_bf16(x); }
inline uint16_t float_to_bits(F16, float x) { return float_to_half(x); }
#endif
PLSH_HD inline float bits_to_float(F32, float x) { return x; }
PLSH_HD inline float float_to_bits(F32, float x) { return x; }

// Two 16-bit values in one register, the lower column in the lower half
// (ldmatrix's and mma's element order).
template <typename T>
PLSH_HD inline uint32_t pack2(T t, float lo, float hi) {
  return static_cast<uint32_t>(float_to_bits(t, lo)) | (static_cast<uint32_t>(float_to_bits(t, hi)) << 16);
}
template <typename T>
PLSH_HD inline float unpack_lo(T t, uint32_t r) {
  return bits_to_float(t, static_cast<uint16_t>(r & 0xFFFFu));
}
template <typename T>
PLSH_HD inline float unpack_hi(T t, uint32_t r) {
  return bits_to_float(t, static_cast<uint16_t>(r >> 16));
}

// Stores one value of the output dtype (DType as int: 0 f32, 1 f16, 2 bf16).
PLSH_HD inline void store_out(void* base, int32_t dtype, int64_t at, float x) {
  if (dtype == 0)
    static_cast<float*>(base)[at] = x;
  else if (dtype == 1)
    static_cast<uint16_t*>(base)[at] = float_to_bits(F16{}, x);
  else
    static_cast<uint16_t*>(base)[at] = float_to_bits(Bf16{}, x);
}

// ---- mma.sync m16n8k16 fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16") ----
// groupID g = lane / 4, threadID_in_group t = lane % 4.
//   A (16 x 16, row): reg i holds A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}]
//   B (16 x 8, col):  reg i holds B[2t + 8 i + {0, 1}][g]
//   C (16 x 8, f32):  c[i] is C[g + 8 (i >> 1)][2t + (i & 1)]
PLSH_HD inline int frag_row(int lane, int half) { return lane / 4 + 8 * half; }
PLSH_HD inline int frag_col(int lane, int j) { return 2 * (lane % 4) + j; }

#if defined(__CUDACC__)

// ---- the device ------------------------------------------------------------------------

struct DeviceExec {
  template <typename T>
  struct PerThread {
    T v;
    __device__ __forceinline__ T& operator()(int, int) { return v; }
  };
  __device__ __forceinline__ static int lane_id() { return static_cast<int>(threadIdx.x % 32); }
  __device__ __forceinline__ static int warp_id() { return static_cast<int>(threadIdx.x / 32); }

  template <typename F>
  __device__ __forceinline__ void threads(F&& f) {
    f(static_cast<int>(threadIdx.x));
  }
  __device__ __forceinline__ void sync() { __syncthreads(); }
  template <typename F>
  __device__ __forceinline__ void warps(F&& f) {
    f(warp_id());
  }
  template <typename F>
  __device__ __forceinline__ void lanes(F&& f) {
    f(lane_id());
  }
  __device__ __forceinline__ void syncwarp() { __syncwarp(); }

  template <typename Ref>
  __device__ __forceinline__ void quad_max(Ref&& ref) {
    float& r = ref(lane_id());
    r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, 1));
    r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, 2));
  }
  template <typename Ref>
  __device__ __forceinline__ void quad_sum(Ref&& ref) {
    float& r = ref(lane_id());
    r += __shfl_xor_sync(0xffffffffu, r, 1);
    r += __shfl_xor_sync(0xffffffffu, r, 2);
  }
  template <typename Pred>
  __device__ __forceinline__ uint32_t ballot(Pred&& pred) {
    return __ballot_sync(0xffffffffu, pred(lane_id()));
  }

  // ldmatrix .x4 (trans: .trans): lane L gives the address of row L % 8 of
  // matrix L / 8; out(lane)[m] receives its two elements of matrix m.
  template <typename Addr, typename Out>
  __device__ __forceinline__ void ldsm_x4(Addr&& addr, Out&& out, bool trans) {
    const int lane = lane_id();
    uint32_t* r = out(lane);
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(addr(lane)));
    if (trans)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(a));
    else
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(a));
  }

  // c(lane)[0..3] += A B over one m16n8k16 tile (a: 4 registers, b: 2).
  template <typename T, typename C, typename A, typename B>
  __device__ __forceinline__ void mma(T, C&& c, A&& a, B&& b) {
    const int lane = lane_id();
    float* d = c(lane);
    const uint32_t* x = a(lane);
    const uint32_t* y = b(lane);
    if constexpr (T::kDType == 2)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));
    else
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));
  }

  // 16 bytes from global to shared memory, zeros where !valid (cp.async
  // with a source size of 0); commit closes a group, wait<N> leaves at most
  // N groups in flight.
  __device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
  }
  __device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
  template <int N>
  __device__ __forceinline__ void wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
  }
  __device__ __forceinline__ void atomic_add(float* at, float x) { atomicAdd(at, x); }
  __device__ __forceinline__ void count(unsigned long long* at, unsigned long long n) { atomicAdd(at, n); }
};

#else  // !__CUDACC__

// ---- the host emulation ------------------------------------------------------------------

struct HostExec {
  template <typename T>
  struct PerThread {
    std::vector<T> v = std::vector<T>(kFusedThreads);
    T& operator()(int w, int lane) { return v[static_cast<size_t>(w * 32 + lane)]; }
  };

  template <typename F>
  void threads(F&& f) {
    for (int t = 0; t < kFusedThreads; ++t) f(t);
  }
  void sync() {}
  template <typename F>
  void warps(F&& f) {
    for (int w = 0; w < kFusedWarps; ++w) f(w);
  }
  template <typename F>
  void lanes(F&& f) {
    for (int l = 0; l < 32; ++l) f(l);
  }
  void syncwarp() {}

  template <typename Ref>
  void quad_max(Ref&& ref) {
    for (int q = 0; q < 32; q += 4) {
      float m = ref(q);
      for (int l = 1; l < 4; ++l) m = std::fmax(m, ref(q + l));
      for (int l = 0; l < 4; ++l) ref(q + l) = m;
    }
  }
  template <typename Ref>
  void quad_sum(Ref&& ref) {
    for (int q = 0; q < 32; q += 4) {
      // The butterfly's order: (r0 + r1) + (r2 + r3) for every lane.
      const float s = (ref(q) + ref(q + 1)) + (ref(q + 2) + ref(q + 3));
      for (int l = 0; l < 4; ++l) ref(q + l) = s;
    }
  }
  template <typename Pred>
  uint32_t ballot(Pred&& pred) {
    uint32_t m = 0;
    for (int l = 0; l < 32; ++l)
      if (pred(l)) m |= 1u << l;
    return m;
  }

  template <typename Addr, typename Out>
  void ldsm_x4(Addr&& addr, Out&& out, bool trans) {
    const uint16_t* rows[32];
    for (int l = 0; l < 32; ++l) rows[l] = static_cast<const uint16_t*>(addr(l));
    for (int l = 0; l < 32; ++l) {
      uint32_t* r = out(l);
      for (int m = 0; m < 4; ++m) {
        const uint16_t* const* mat = rows + 8 * m;  // row i of matrix m starts at mat[i]
        uint16_t e0, e1;
        if (!trans) {
          e0 = mat[l / 4][2 * (l % 4)];
          e1 = mat[l / 4][2 * (l % 4) + 1];
        } else {
          e0 = mat[2 * (l % 4)][l / 4];
          e1 = mat[2 * (l % 4) + 1][l / 4];
        }
        r[m] = static_cast<uint32_t>(e0) | (static_cast<uint32_t>(e1) << 16);
      }
    }
  }

  template <typename T, typename C, typename A, typename B>
  void mma(T t, C&& c, A&& a, B&& b) {
    float Am[16][16], Bm[16][8];
    for (int l = 0; l < 32; ++l) {
      const uint32_t* x = a(l);
      for (int i = 0; i < 4; ++i) {
        const int r = frag_row(l, i & 1), col = frag_col(l, 0) + 8 * (i >> 1);
        Am[r][col] = unpack_lo(t, x[i]);
        Am[r][col + 1] = unpack_hi(t, x[i]);
      }
      const uint32_t* y = b(l);
      for (int i = 0; i < 2; ++i) {
        Bm[frag_col(l, 0) + 8 * i][l / 4] = unpack_lo(t, y[i]);
        Bm[frag_col(l, 1) + 8 * i][l / 4] = unpack_hi(t, y[i]);
      }
    }
    // The products are exact in float; the sum of 16 of them, in double,
    // rounded once (the tensor cores' own accumulation is at least this good).
    for (int l = 0; l < 32; ++l) {
      float* d = c(l);
      for (int i = 0; i < 4; ++i) {
        const int r = frag_row(l, i >> 1), col = frag_col(l, i & 1);
        double s = 0;
        for (int k = 0; k < 16; ++k) s += static_cast<double>(Am[r][k]) * Bm[k][col];
        d[i] = static_cast<float>(static_cast<double>(d[i]) + s);
      }
    }
  }

  void copy16(void* dst, const void* src, bool valid) {
    if (valid)
      std::memcpy(dst, src, 16);
    else
      std::memset(dst, 0, 16);
  }
  void commit() {}
  template <int N>
  void wait() {}
  void atomic_add(float* at, float x) { *at += x; }
  void count(unsigned long long* at, unsigned long long n) { *at += n; }
};

#endif

}  // namespace plsh::cuda
