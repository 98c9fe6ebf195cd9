// The CPU backend's backward pass (SPEC section 8), structured like
// FlashAttention's: a preprocessing pass computes D_i = rowsum(dO_i * O_i)
// ("dot_do_o") and each row's lse as the tiles need it; then the work is
// parallel over key tiles of every (batch item, kv head), so that dK and dV
// accumulate in one thread's buffers across all the query
// tiles and all the query heads of the group that see them, race-free. dQ
// gathers contributions from many key tiles: each pair adds its share to a
// float32 accumulator under a per-query-tile lock (FlashAttention's atomic
// dq_accum), and a last pass converts it to dq's dtype. The locks cost
// nothing measurable: at n = 8192 (bench_cpu_backward) the backward took
// the same CPU seconds with them as without (racy, for the measurement
// only), within the shared machine's noise; a lock is held for rows x D
// additions against the pair's five GEMMs of rows x keys x D. Per-thread
// dQ copies would cost threads x [B, Nq, H, D] floats, and a second pass
// over the pairs for dQ alone three more GEMMs per pair. The order in which
// key tiles add to dQ follows the thread schedule, so dq can differ between
// runs in the last float32 bits (dk, dv and the forward do not).
//
// P_ij = W_ij exp(s_ij - lse_i) is recomputed per pair from the forward's
// lse. W is the plan's: exact and window as the forward's AlibiBias; lsh as
// the banded form's weights c_ij / s (c_ij: hashes of the plan's draws that
// put i and j in one bin), whichever algorithm the forward ran, since
// per-sample and banded compute the same function.
//
// Precision: float32 throughout, like the forward, except for one input:
// lse arrives in float32, so a query far from every key (|lse| ~ slope x
// distance, e.g. 2400) carries |lse| x 2^-24 relative error into P and the
// gradients (1e-4 there; tests/kernels/test_backward.cpp pins it).
//
// Internal to kernels/cpu.
#pragma once

#include <cstdint>

#include "plsh/backend.h"
#include "plsh/backward.h"
#include "plsh/plan.h"

namespace plsh::cpu {

// Host bytes backward() carves from its workspace for these params on
// `threads` threads: the per-thread tiles, the float32 dQ accumulator
// [B, Nq, H, D], the per-row D and lse [B, H, Nq], the locks and, for lsh,
// the log-count table [s + 1] (the job list is computed, not stored).
int64_t backward_workspace_bytes(const AttentionParams& p, int threads);

// The backward of plan's forward, on plan.threads threads, in `workspace`
// (checked by the caller to hold backward_workspace_bytes). Checks ctx
// between pairs of tiles.
Status backward(const Plan& plan, const BackwardParams& g, const WorkspaceRef& workspace, const ExecContext& ctx,
                BackwardStats* stats);

}  // namespace plsh::cpu
