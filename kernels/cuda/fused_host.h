// The fused kernels run on the host (HostExec, fused_exec.h): every CTA of a
// launch in turn, each with its own shared memory, poisoned beforehand so
// that a read of a value no phase wrote shows as NaN. The same bodies as
// the device (fused_forward.h, fused_backward.h), the same dispatch
// (fused_dispatch.h) and the same steps (fused_backward_steps); what the
// tests (tests/gpu/test_cuda_host_fused*.cpp) compare with the float64
// reference and the CPU backend. Host code only, for tests: one CTA at a
// time, no threads.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/fused_backward.h"
#include "cuda/fused_dispatch.h"
#include "cuda/fused_forward.h"
#include "cuda/fused_probe.h"
#include "cuda/fused_steps.h"

namespace plsh::cuda {

// Every CTA (x, y, z) of the grid [0, nz) x [0, ny) x [x0, x1) in turn, each
// in freshly poisoned shared memory of smem_bytes.
template <typename Cta>
void run_grid_on_host(int64_t smem_bytes, int64_t nz, int64_t ny, int64_t x0, int64_t x1, Cta&& cta) {
  std::vector<unsigned char> smem(static_cast<size_t>(smem_bytes));
  for (int64_t z = 0; z < nz; ++z)
    for (int64_t y = 0; y < ny; ++y)
      for (int64_t t = x0; t < x1; ++t) {
        std::memset(smem.data(), 0xFF, smem.size());
        HostExec x;
        cta(t, y, z, smem.data(), x);
      }
}

// The tiles [t0, t1) of every (head, batch item): the forward's query
// tiles, or with Backward the backward's key tiles of every (kv head,
// batch item).
template <bool Backward>
bool fused_tiles_on_host(DType dtype, int64_t head_dim, const FusedArgs& a, int64_t t0, int64_t t1) {
  return dispatch_fused(dtype, head_dim, false, [&](auto cfg) {
    using Cfg = decltype(cfg);
    const int64_t smem_bytes =
        Backward ? fused_backward_smem_bytes<Cfg>(a.max_samples) : fused_forward_smem_bytes<Cfg>(a.max_samples);
    run_grid_on_host(smem_bytes, a.batch, Backward ? a.kv_heads : a.heads, t0, t1,
                     [&](int64_t t, int64_t h, int64_t b, unsigned char* smem, HostExec& x) {
                       if constexpr (Backward)
                         fused_backward_cta<Cfg>(a, t, h, b, smem, x);
                       else
                         fused_forward_cta<Cfg>(a, t, h, b, smem, x);
                     });
    return true;
  });
}

inline bool fused_forward_on_host(DType dtype, int64_t head_dim, const FusedArgs& a, int64_t tile_begin,
                                  int64_t tile_end) {
  return fused_tiles_on_host<false>(dtype, head_dim, a, tile_begin, tile_end);
}

// The probe's CTAs and merge on the host.
inline bool fused_probe_on_host(DType dtype, int64_t head_dim, const FusedArgs& a, const ProbeArgs& pa,
                                int64_t groups) {
  const bool ran = dispatch_fused(dtype, head_dim, false, [&](auto cfg) {
    using Cfg = decltype(cfg);
    run_grid_on_host(fused_probe_smem_bytes<Cfg>(a.max_samples), 1, groups, 0, pa.splits,
                     [&](int64_t c, int64_t g, int64_t, unsigned char* smem, HostExec& x) {
                       fused_probe_cta<Cfg>(a, pa, g, c, smem, x);
                     });
    return true;
  });
  for (int64_t g = 0; ran && g < groups; ++g)
    for (int64_t r = 0; r < pa.groups[g].rows; ++r) fused_probe_merge(pa, g, r);
  return ran;
}

// The backward's steps on the host (FusedBackwardSteps' hooks).
struct HostBackwardSteps {
  DType dtype;
  int64_t head_dim;
  const FusedArgs& a;
  const FusedRowTermsArgs& terms;

  bool spans(int32_t* spans) const {
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t t = 0; t < fused_tiles(a.q_len, kFusedRows); ++t) fused_span(a, h, t, spans);
    return true;
  }
  bool row_terms() const {
    for (int64_t g = 0; g < a.batch * a.heads; ++g)
      for (int64_t i = 0; i < a.q_len; ++i) {
        terms.row_d[g * a.q_len + i] = fused_row_dot(a, terms, g, i, 0, 1);
        terms.row_lse2[g * a.q_len + i] = fused_row_lse2(a, terms, g, i);
      }
    return true;
  }
  bool zero_dq() const {
    std::memset(a.dq_acc, 0, static_cast<size_t>(a.batch * a.q_len * a.heads * head_dim) * sizeof(float));
    return true;
  }
  bool stats(const FusedArgs& s, const TileSpan& tiles) const {
    return fused_forward_on_host(dtype, head_dim, s, tiles.begin, tiles.end);
  }
  bool between(int64_t, int64_t) const { return true; }
  bool main(int64_t kt0, int64_t kt1) const { return fused_tiles_on_host<true>(dtype, head_dim, a, kt0, kt1); }
  void* dq;  // dense [B, Nq, H, D] in a.grad_dtype
  bool dq_out() const {
    const int64_t n = a.batch * a.q_len * a.heads * head_dim;
    for (int64_t e = 0; e < n; ++e) store_out(dq, a.grad_dtype, e, a.dq_acc[e]);
    return true;
  }
};

}  // namespace plsh::cuda
