// The host side of the fused kernels (fused_forward.h, fused_backward.h):
// which requests they take, their per-head tables, the kernel arguments from
// a request's params, the device workspace they carve (forward and
// backward, in one place beside workspace_slots.h's), and the cost model by
// which the CUDA backend's `auto` picks banded (fused) or per-sample lsh
// (SPEC section 3, "CUDA: choosing the lsh algorithm"). Host code only.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/fused_probe.h"
#include "cuda/fused_tile.h"
#include "cuda/workspace_slots.h"
#include "plsh/backward.h"
#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cuda {

// The most dynamic shared memory a CTA may have on sm_90 (227 KiB).
inline constexpr int64_t kMaxCtaSharedBytes = 227 * 1024;

// OK when the fused kernels can run p (head_dim 64 or 128, at most
// kFusedMaxHashes samples, keys and rows within 32-bit key rows and the
// grid, 16-byte rows for device tensors), else UNIMPLEMENTED naming the
// reason; those requests run on the cuBLAS pipeline.
Status fused_supported(const AttentionParams& p);

// The per-head rules (FusedHead) and every hash's pitch and shift, as the
// kernels read them: lsh heads with a finite sigma take their plan's draws
// (kHashes), a slope of 0 is unbiased attention over every key (M~ = 1);
// window heads kAlibi with W_h; exact kAlibi over every key.
struct FusedTables {
  std::vector<FusedHead> heads;  // [H]
  std::vector<double> hashes;    // [sum of samples][2]
  int32_t max_samples = 0;
};
FusedTables fused_tables(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws);

// The kernels' arguments for p's tensors as they sit (host pointers in the
// emulation, device copies with p's strides on the GPU; tables given in the
// same memory), every query tile.
FusedArgs fused_args(const AttentionParams& p, const FusedTables& t, const FusedHead* head_table, const double* hashes);

// Dynamic shared memory of a forward and a backward CTA for p.
int64_t fused_forward_smem(const AttentionParams& p, int max_samples);
int64_t fused_backward_smem(const AttentionParams& p, int max_samples);

// The fused forward's device workspace, carved by one function for sizing
// (base null) and slicing: the per-head tables, the hashes, a FLOP counter
// and, for host tensors, dense device copies of q, k, v, out and lse.
struct FusedForwardBuffers {
  FusedHead* heads = nullptr;
  double* hashes = nullptr;
  unsigned long long* tiles_done = nullptr;  // (warp, key tile) products run, for ForwardStats::flops
  char* q = nullptr;
  char* k = nullptr;
  char* v = nullptr;
  char* out = nullptr;
  float* lse = nullptr;
  int64_t q_bytes = 0, kv_bytes = 0, out_bytes = 0, lse_bytes = 0;
};
int64_t carve_fused_forward(const AttentionParams& p, const FusedTables& t, char* base, FusedForwardBuffers* out);
// Its bytes before the draws exist (tables of p's sizes): what supports()
// compares with the pool.
int64_t fused_forward_bytes_for(const AttentionParams& p);

// The fused backward's: the forward's tables and staging, dout, the per-row
// terms (D_i and lse2 in base 2, [B * H][Nq]), dq's float32 accumulator
// [B, Nq, H, D], and dq, dk, dv in the gradients' dtype (grad_bytes per
// element; the plan sizes 4, the widest).
struct FusedBackwardBuffers {
  FusedForwardBuffers fwd;
  char* dout = nullptr;
  float* row_d = nullptr;
  float* row_lse2 = nullptr;
  float* dq_acc = nullptr;
  int32_t* spans = nullptr;                          // [H][query tiles][2]
  char *dq = nullptr, *dk = nullptr, *dv = nullptr;  // the gradients, in their dtype
  int64_t rows = 0, dq_elems = 0, dkv_elems = 0;
};
int64_t carve_fused_backward(const AttentionParams& p, const FusedTables& t, int64_t grad_bytes, char* base,
                             FusedBackwardBuffers* out);

// The probe rows on the device (fused_probe.h): groups of up to 64 query
// rows of one (head, batch item) from each head's sorted sample (indices
// b * Nq + i), and the buffers a probe launch carves, sized at plan time for
// p.probe_rows rows per head.
struct FusedProbeLayout {
  int64_t max_groups = 0;  // every head's sample cut by batch items and 64 rows
  int64_t max_rows = 0;
  int32_t splits = 1;  // key splits per group: about 4 CTAs per SM in all
  int64_t bytes = 0;   // carve_fused_probe
};
FusedProbeLayout plan_fused_probe(const AttentionParams& p, int sm_count);
struct FusedProbeBuffers {
  ProbeGroup* groups = nullptr;
  int32_t* row_index = nullptr;
  float* partial = nullptr;
  float* result = nullptr;  // [rows][D + 3] (fused_probe_merge)
};
int64_t carve_fused_probe(const AttentionParams& p, const FusedProbeLayout& l, char* base, FusedProbeBuffers* out);
// The groups and their rows' query indices for samples[h] (sorted b * Nq + i).
void fused_probe_groups(const AttentionParams& p, const std::vector<std::vector<int64_t>>& samples,
                        std::vector<ProbeGroup>* groups, std::vector<int32_t>* row_index);

// The fused path's plan: its tables, and what forward (and backward, when
// planned) carve from the pool, exactly.
struct FusedLayout {
  FusedTables tables;
  int64_t forward_bytes = 0;   // carve_fused_forward (and the probe's, when planned)
  int64_t backward_bytes = 0;  // carve_fused_backward with 4-byte gradients; 0 unless planned
  bool probe = false;          // the forward can compute the estimates' probe rows (lsh, window; host tensors)
  FusedProbeLayout probe_layout;
};
FusedLayout plan_fused_layout(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws, bool backward,
                              int sm_count);

// INTERNAL unless forward (backward: with grad_bytes per gradient element)
// carving for the bound params p stays inside what the layout sized.
Status check_fused_fits(const FusedLayout& f, const AttentionParams& p);
Status check_fused_backward_fits(const FusedLayout& f, const AttentionParams& p, int64_t grad_bytes);

// The cost model of SPEC's "CUDA: choosing the lsh algorithm": seconds the
// fused banded kernel and the cuBLAS per-sample pipeline are expected to
// take for p with these draws, and the choice of `auto` (banded where the
// fused kernel runs p and costs less).
struct LshCosts {
  double banded_s = 0;  // +inf where fused_supported refuses p
  double per_sample_s = 0;
};
LshCosts cuda_lsh_costs(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws);
LshAlgorithm cuda_lsh_algorithm(const AttentionParams& p, const std::vector<std::vector<Draw>>& draws);

// The query tiles of one step of the forward, [t0, t1), and the key rows
// [0, keys) they need: the next tiles (at least `min_tiles`, more while the
// step's query rows stay under `step_rows`) of batch item b whose keys are
// among the first `keys`. For host tensors the step's uploads precede it;
// key needs grow with the tiles, so the keys go up in order.
struct ForwardStep {
  int64_t t0, t1;
  int64_t keys;
};
std::vector<ForwardStep> fused_forward_steps(const AttentionParams& p, const FusedTables& t, int64_t step_rows);

// FLOPs of one (warp, key tile) product of the forward (Q K^T and P V:
// 2 * 2 * 16 * 64 * D) and of the backward (five products).
inline double fused_tile_flops(int64_t head_dim) { return 4.0 * 16 * kFusedKeys * static_cast<double>(head_dim); }

}  // namespace plsh::cuda
