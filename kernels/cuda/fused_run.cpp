#include "cuda/fused_run.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/fused_kernels.h"
#include "cuda/step_events.h"

namespace plsh::cuda {

namespace {

// Query rows per step of the forward: about 32 MiB of q, so that a step's
// kernel (thousands of CTAs at 128k) hides the next step's uploads, and a
// cancel waits for at most a few of them.
constexpr int64_t kStepQueryBytes = int64_t{32} << 20;
// Launches the backward's key tiles are cut into (a stop acts between two).
constexpr int64_t kBackwardChunks = 16;

int64_t step_rows_for(const AttentionParams& p) {
  const int64_t row_bytes = p.heads * p.head_dim * static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t rows = std::max<int64_t>(1, kStepQueryBytes / row_bytes);
  return std::max<int64_t>(kFusedRows, rows / kFusedRows * kFusedRows);
}

// The tables to the device, and the FLOP counter zeroed.
Status upload_tables(const FusedTables& t, const FusedForwardBuffers& fb, cudaStream_t stream) {
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(fb.heads, t.heads.data(), t.heads.size() * sizeof(FusedHead), cudaMemcpyHostToDevice, stream));
  if (!t.hashes.empty())
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(fb.hashes, t.hashes.data(), t.hashes.size() * sizeof(double), cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fb.tiles_done, 0, sizeof(unsigned long long), stream));
  return Status::Ok();
}

StatusOr<unsigned long long> tiles_done(const FusedForwardBuffers& fb, cudaStream_t stream) {
  unsigned long long n = 0;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&n, fb.tiles_done, sizeof(n), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return n;
}

// Host tensors move through Transfers on a pinned set leased for the call;
// device tensors need none (tr stays empty).
Status open_transfers(bool host, const ExecContext& ctx, cudaStream_t stream, int threads, PinnedLease& lease,
                      std::optional<Transfers>* tr) {
  if (!host) return Status::Ok();
  RETURN_IF_ERROR(lease.take());
  tr->emplace(ctx, stream, lease.set(), threads);
  return (*tr)->init();
}

// p's tensors as the kernels see them: host tensors' dense device copies
// (the same strides), device tensors as they are.
AttentionParams on_device(const AttentionParams& p, const FusedForwardBuffers& fb) {
  AttentionParams d = p;
  if (p.memory == MemorySpace::kHost) {
    d.q = fb.q, d.k = fb.k, d.v = fb.v, d.out = fb.out;
    d.lse = p.lse != nullptr ? fb.lse : nullptr;
  }
  return d;
}

}  // namespace

// The probe rows after the forward's kernels (their k and v are in place):
// groups to the device, the probe's CTAs and merge, the rows back.
Status run_fused_probe(const AttentionParams& p, const FusedLayout& fused, const FusedArgs& a, char* base,
                       const std::vector<std::vector<int64_t>>& samples, Transfers* tr, cudaStream_t stream,
                       std::vector<float>* result) {
  std::vector<ProbeGroup> groups;
  std::vector<int32_t> row_index;
  fused_probe_groups(p, samples, &groups, &row_index);
  const FusedProbeLayout& l = fused.probe_layout;
  if (static_cast<int64_t>(groups.size()) > l.max_groups || static_cast<int64_t>(row_index.size()) > l.max_rows)
    return internal_error("cuda backend: " + std::to_string(row_index.size()) + " probe rows in " +
                          std::to_string(groups.size()) + " groups exceed the plan's " + std::to_string(l.max_rows) +
                          " and " + std::to_string(l.max_groups));
  if (groups.empty()) return Status::Ok();
  FusedProbeBuffers pb;
  carve_fused_probe(p, l, base, &pb);
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pb.groups, groups.data(), groups.size() * sizeof(ProbeGroup), cudaMemcpyHostToDevice, stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pb.row_index, row_index.data(), row_index.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream));
  const ProbeArgs pa{.groups = pb.groups,
                     .row_index = pb.row_index,
                     .splits = l.splits,
                     .mode = static_cast<int32_t>(p.mode),
                     .partial = pb.partial,
                     .result = pb.result,
                     .head_dim = p.head_dim};
  RETURN_IF_ERROR(launch_fused_probe(p.dtype, p.head_dim, a, pa, static_cast<int64_t>(groups.size()), stream));
  result->resize(row_index.size() * static_cast<size_t>(p.head_dim + 3));
  return tr->download(result->data(), pb.result, static_cast<int64_t>(result->size() * sizeof(float)));
}

// The merged rows in the sample's order, split by head (fused_probe_groups' order).
void probe_out_from(const AttentionParams& p, const std::vector<std::vector<int64_t>>& samples,
                    const std::vector<float>& result, ProbeRowsOut* out) {
  const size_t D = static_cast<size_t>(p.head_dim), H = samples.size();
  out->o_star.assign(H, {});
  out->bound_ratio.assign(H, {});
  out->max_v2.assign(H, {});
  size_t at = 0;
  for (size_t h = 0; h < H; ++h)
    for (size_t r = 0; r < samples[h].size(); ++r, ++at) {
      const float* row = result.data() + at * (D + 3);
      out->o_star[h].insert(out->o_star[h].end(), row, row + D);
      out->bound_ratio[h].push_back(row[D]);
      out->max_v2[h].push_back(row[D + 1]);
    }
}

Status run_fused_forward(const Plan& plan, const FusedLayout& fused, const ExecContext& ctx, DevicePool& pool,
                         PinnedPool& pinned, cudaStream_t stream, ForwardStats* stats,
                         const std::vector<std::vector<int64_t>>* probe_rows, ProbeRowsOut* probe_out) {
  if (probe_rows != nullptr && (!fused.probe || plan.params.memory != MemorySpace::kHost))
    return internal_error("cuda backend: probe rows asked of a plan made without the probe");
  const AttentionParams& p = plan.params;
  const bool host = p.memory == MemorySpace::kHost;
  DeviceBuffer buffer;
  RETURN_IF_ERROR(buffer.allocate(pool, fused.forward_bytes, stream));
  FusedForwardBuffers fb;
  carve_fused_forward(p, fused.tables, buffer.get(), &fb);
  RETURN_IF_ERROR(upload_tables(fused.tables, fb, stream));
  const AttentionParams d = on_device(p, fb);
  FusedArgs a = fused_args(d, fused.tables, fb.heads, fb.hashes);
  a.tiles_done = fb.tiles_done;

  const std::vector<ForwardStep> steps = fused_forward_steps(p, fused.tables, step_rows_for(p));
  const int64_t esz = static_cast<int64_t>(dtype_bytes(p.dtype)), osz = static_cast<int64_t>(dtype_bytes(p.out_dtype));
  const int64_t q_row = p.heads * p.head_dim, kv_row = p.kv_heads * p.head_dim;
  PinnedLease lease(pinned);
  std::optional<Transfers> tr;
  RETURN_IF_ERROR(open_transfers(host, ctx, stream, plan.threads, lease, &tr));
  PacedRounds paced(p.batch * static_cast<int64_t>(steps.size()));
  RETURN_IF_ERROR(paced.start(stream, ctx));
  int64_t chunk = 0;
  int64_t keys_uploaded = 0;  // of every batch item: the steps' key needs are the same for each
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t keys_done = 0;
    for (const ForwardStep& s : steps) {
      RETURN_IF_ERROR(ctx.check_stop());
      const int64_t r0 = s.t0 * kFusedRows, r1 = std::min(p.q_len, s.t1 * kFusedRows);
      if (host) {
        const int64_t q_at = (b * p.q_len + r0) * q_row * esz, kv_at = (b * p.kv_len + keys_done) * kv_row * esz;
        const int64_t kv_bytes = (s.keys - keys_done) * kv_row * esz;
        RETURN_IF_ERROR(tr->upload(fb.q + q_at, static_cast<const char*>(p.q) + q_at, (r1 - r0) * q_row * esz));
        RETURN_IF_ERROR(tr->upload(fb.k + kv_at, static_cast<const char*>(p.k) + kv_at, kv_bytes));
        RETURN_IF_ERROR(tr->upload(fb.v + kv_at, static_cast<const char*>(p.v) + kv_at, kv_bytes));
        keys_done = std::max(keys_done, s.keys);
        keys_uploaded = keys_done;
        RETURN_IF_ERROR(tr->compute_after_uploads());
      }
      RETURN_IF_ERROR(launch_fused_forward(p.dtype, p.head_dim, a, s.t0, s.t1, b, b + 1, stream));
      if (host) {
        const int64_t o_at = (b * p.q_len + r0) * q_row * osz;
        RETURN_IF_ERROR(tr->download(static_cast<char*>(p.out) + o_at, fb.out + o_at, (r1 - r0) * q_row * osz));
        if (p.lse != nullptr) {
          const int64_t l_at = (b * p.q_len + r0) * p.heads;
          RETURN_IF_ERROR(tr->download(p.lse + l_at, fb.lse + l_at, (r1 - r0) * p.heads * 4));
        }
      }
      // Pacing only: the step's pairs at most.
      const double flops = 4.0 * static_cast<double>((r1 - r0) * p.heads) * static_cast<double>(s.keys) *
                           static_cast<double>(p.head_dim);
      RETURN_IF_ERROR(paced.add_round(chunk++, 0, 1, flops));
    }
  }
  std::vector<float> probe_result;
  if (probe_rows != nullptr) {
    // Every key (the probe is exact): those no forward tile needed too.
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t from = (b * p.kv_len + keys_uploaded) * kv_row * esz;
      const int64_t bytes = (p.kv_len - keys_uploaded) * kv_row * esz;
      RETURN_IF_ERROR(tr->upload(fb.k + from, static_cast<const char*>(p.k) + from, bytes));
      RETURN_IF_ERROR(tr->upload(fb.v + from, static_cast<const char*>(p.v) + from, bytes));
    }
    RETURN_IF_ERROR(tr->compute_after_uploads());
    RETURN_IF_ERROR(run_fused_probe(p, fused, a, buffer.get() + carve_fused_forward(p, fused.tables, nullptr, nullptr),
                                    *probe_rows, &*tr, stream, &probe_result));
  }
  if (host) RETURN_IF_ERROR(tr->finish());
  RETURN_IF_ERROR(paced.finish(stream));
  ASSIGN_OR_RETURN(const unsigned long long done, tiles_done(fb, stream));
  if (probe_rows != nullptr) probe_out_from(p, *probe_rows, probe_result, probe_out);
  if (stats != nullptr) {
    stats->flops = static_cast<double>(done) * fused_tile_flops(p.head_dim);
    stats->lsh_algorithm = plan.lsh_algorithm;
    stats->workspace = plan.forward_workspace;
  }
  return Status::Ok();
}

Status run_fused_backward(const Plan& plan, const FusedLayout& fused, const BackwardParams& g, const ExecContext& ctx,
                          DevicePool& pool, PinnedPool& pinned, cudaStream_t stream, BackwardStats* stats) {
  const AttentionParams& p = plan.params;
  const bool host = p.memory == MemorySpace::kHost;
  const int64_t grad_bytes = static_cast<int64_t>(dtype_bytes(g.grad_dtype));
  DeviceBuffer buffer;
  RETURN_IF_ERROR(buffer.allocate(pool, fused.backward_bytes, stream));
  FusedBackwardBuffers bb;
  carve_fused_backward(p, fused.tables, grad_bytes, buffer.get(), &bb);
  RETURN_IF_ERROR(upload_tables(fused.tables, bb.fwd, stream));
  AttentionParams d = on_device(p, bb.fwd);
  d.out = host ? bb.fwd.out : const_cast<void*>(g.out);
  d.lse = host ? bb.fwd.lse : const_cast<float*>(g.lse);
  const void* dout = host ? static_cast<const void*>(bb.dout) : g.dout;
  void* dq = host ? static_cast<void*>(bb.dq) : g.dq;
  PinnedLease lease(pinned);
  std::optional<Transfers> tr;
  RETURN_IF_ERROR(open_transfers(host, ctx, stream, plan.threads, lease, &tr));
  if (host) {
    RETURN_IF_ERROR(tr->upload(bb.fwd.q, p.q, bb.fwd.q_bytes));
    RETURN_IF_ERROR(tr->upload(bb.fwd.k, p.k, bb.fwd.kv_bytes));
    RETURN_IF_ERROR(tr->upload(bb.fwd.v, p.v, bb.fwd.kv_bytes));
    RETURN_IF_ERROR(tr->upload(bb.fwd.out, g.out, bb.fwd.out_bytes));
    RETURN_IF_ERROR(tr->upload(bb.fwd.lse, g.lse, bb.fwd.lse_bytes));
    RETURN_IF_ERROR(tr->upload(bb.dout, g.dout, bb.fwd.out_bytes));
    RETURN_IF_ERROR(tr->compute_after_uploads());
  }
  FusedArgs a = fused_args(d, fused.tables, bb.fwd.heads, bb.fwd.hashes);
  a.dout = dout;
  a.do_bs = host ? p.o_batch_stride : g.do_batch_stride;
  a.do_rs = host ? p.o_row_stride : g.do_row_stride;
  a.do_hs = host ? p.o_head_stride : g.do_head_stride;
  a.row_d = bb.row_d;
  a.row_lse2_in = bb.row_lse2;
  a.dq_acc = bb.dq_acc;
  a.dk = host ? static_cast<void*>(bb.dk) : g.dk;
  a.dv = host ? static_cast<void*>(bb.dv) : g.dv;
  a.kv_heads = p.kv_heads;
  a.grad_dtype = static_cast<int32_t>(g.grad_dtype);
  a.spans = bb.spans;
  a.tiles_done = bb.fwd.tiles_done;
  FusedRowTermsArgs terms;
  terms.out = d.out;
  terms.out_dtype = static_cast<int32_t>(p.out_dtype);
  terms.o_bs = host ? p.o_batch_stride : g.o_batch_stride;
  terms.o_rs = host ? p.o_row_stride : g.o_row_stride;
  terms.o_hs = host ? p.o_head_stride : g.o_head_stride;
  terms.lse = d.lse;
  terms.lse_bs = host ? p.lse_batch_stride : g.lse_batch_stride;
  terms.lse_rs = host ? p.lse_row_stride : g.lse_row_stride;
  terms.head_dim = p.head_dim;
  terms.row_d = bb.row_d;
  terms.row_lse2 = bb.row_lse2;

  // The key tiles in up to kBackwardChunks launches, paced on the GPU: a
  // stop acts between them, progress follows them.
  const int64_t key_tiles = fused_tiles(p.kv_len, kFusedKeys);
  const int64_t chunks = std::min<int64_t>(kBackwardChunks, key_tiles);
  PacedRounds paced(chunks);
  RETURN_IF_ERROR(paced.start(stream, ctx));
  RETURN_IF_ERROR(ctx.check_stop());
  // Pacing only: every pair of every head, 5 products, spread evenly.
  const double chunk_flops = 10.0 * static_cast<double>(p.batch * p.heads) * static_cast<double>(p.q_len) *
                             static_cast<double>(p.kv_len) * static_cast<double>(p.head_dim) /
                             static_cast<double>(chunks);
  auto between = [&](int64_t chunk, int64_t) -> Status {
    RETURN_IF_ERROR(ctx.check_stop());
    return paced.add_round(chunk, 0, 1, chunk_flops);
  };
  RETURN_IF_ERROR(launch_fused_backward(p.dtype, p.head_dim, a, terms, bb.spans, dq, chunks, between, stream));
  if (host) {
    RETURN_IF_ERROR(tr->download(g.dq, bb.dq, bb.dq_elems * grad_bytes));
    RETURN_IF_ERROR(tr->download(g.dk, bb.dk, bb.dkv_elems * grad_bytes));
    RETURN_IF_ERROR(tr->download(g.dv, bb.dv, bb.dkv_elems * grad_bytes));
    RETURN_IF_ERROR(tr->finish());
  }
  RETURN_IF_ERROR(paced.finish(stream));
  ASSIGN_OR_RETURN(const unsigned long long done, tiles_done(bb.fwd, stream));
  if (stats != nullptr) {
    stats->flops = 2.5 * static_cast<double>(done) * fused_tile_flops(p.head_dim);
    stats->workspace = plan.backward_workspace;
  }
  return Status::Ok();
}

}  // namespace plsh::cuda
