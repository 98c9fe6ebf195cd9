// Issue 19's estimates where the work is (plsh/device_estimates.h). The
// mask errors and the probe's summary are estimates.cpp's and probe.cpp's
// own (compute_estimates, probe_rows, and the pooling of estimates_internal.h):
// only where the probe rows are computed changes.
#include "plsh/device_estimates.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "estimates_internal.h"
#include "plsh/estimates.h"
#include "plsh/numeric.h"

namespace plsh {

using namespace estimates_detail;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ProbeRows of head h's sample from the device's o*, bound ratio and max ||v||^2.
std::vector<ProbeRow> device_probe_rows(const AttentionParams& p, int64_t h, const std::vector<int64_t>& sample,
                                        const ProbeRowsOut& out) {
  const int64_t D = p.head_dim;
  std::vector<ProbeRow> rows(sample.size());
  for (size_t r = 0; r < sample.size(); ++r) {
    const int64_t b = sample[r] / p.q_len, i = sample[r] % p.q_len;
    const int64_t o_off = b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    const float* o_star = out.o_star[static_cast<size_t>(h)].data() + r * static_cast<size_t>(D);
    ProbeRow& pr = rows[r];
    for (int64_t d = 0; d < D; ++d) {
      const double diff = std::fabs(load_element(p.out, p.out_dtype, o_off + d) - static_cast<double>(o_star[d]));
      pr.err2 += diff * diff;
      pr.ref2 += static_cast<double>(o_star[d]) * o_star[d];
      pr.max_abs = std::max(pr.max_abs, std::isnan(diff) ? kInf : diff);
    }
    if (std::isnan(pr.err2)) pr.err2 = kInf;
    const double ratio = out.bound_ratio[static_cast<size_t>(h)][r];
    pr.bound =
        std::isfinite(ratio) ? 2 * std::sqrt(static_cast<double>(out.max_v2[static_cast<size_t>(h)][r])) * ratio : kInf;
  }
  return rows;
}

// Head h's sample again in float64 on the host (probe_rows, by batch item).
Status host_probe_rows(const Plan& plan, int64_t h, const std::vector<int64_t>& sample, const ExecContext& ctx,
                       std::vector<ProbeRow>* rows) {
  const AttentionParams& p = plan.params;
  const HeadMask mask = head_mask(plan, h);
  for (size_t n = 0; n < sample.size();) {
    const int64_t b = sample[n] / p.q_len;
    const size_t first = n;
    std::vector<int64_t> batch_rows;
    while (n < sample.size() && sample[n] / p.q_len == b) batch_rows.push_back(sample[n++] % p.q_len);
    const ProbeKeyStats keys = probe_key_stats(p, b, h / p.head_group);
    probe_rows(p, mask, h, b, batch_rows, rows->data() + first, &ctx, &keys);
    RETURN_IF_ERROR(ctx.check_stop());
  }
  return Status::Ok();
}

}  // namespace

Status forward_with_device_estimates(Backend& backend, const Plan& plan, const WorkspaceRef& workspace,
                                     const ExecContext& ctx, ForwardStats* stats, AttentionResult* result) {
  const AttentionParams& p = plan.params;
  const int64_t population = p.batch * p.q_len;
  const bool probe = p.estimates && p.probe_rows > 0 && p.memory == MemorySpace::kHost && p.out != nullptr;
  // The sample compute_estimates would draw, so that a result does not
  // depend on where its probe ran.
  std::vector<std::vector<int64_t>> samples(static_cast<size_t>(p.heads));
  if (probe)
    for (int64_t h = 0; h < p.heads; ++h)
      samples[static_cast<size_t>(h)] = sample_indices(population, p.probe_rows, head_seed(p.seed, h, kProbeSalt));

  // The mask errors on the host while the device computes.
  Plan masks = plan;
  masks.params.probe_rows = 0;
  AttentionResult mask_result;
  Status mask_status;
  double mask_seconds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread mask_thread([&] {
    const auto tm = std::chrono::steady_clock::now();
    mask_status = compute_estimates(masks, workspace, ctx, &mask_result);
    mask_seconds = seconds_since(tm);
  });
  ProbeRowsOut out;
  const Status forward = backend.forward_with_probe(plan, samples, workspace, ctx, stats, &out);
  result->timings["compute"] = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  mask_thread.join();
  RETURN_IF_ERROR(forward);
  RETURN_IF_ERROR(mask_status);
  result->heads = std::move(mask_result.heads);
  result->mask_max_err = mask_result.mask_max_err;
  result->mask_spectral_err = mask_result.mask_spectral_err;
  result->timings["estimates_masks"] = mask_seconds;

  if (probe) {
    const auto tp = std::chrono::steady_clock::now();
    std::vector<ProbeStats> stats_by_head(static_cast<size_t>(p.heads));
    for (int64_t h = 0; h < p.heads; ++h) {
      const std::vector<int64_t>& sample = samples[static_cast<size_t>(h)];
      std::vector<ProbeRow> rows = device_probe_rows(p, h, sample, out);
      ProbeStats st = probe_stats(rows, population);
      // float64 where float32's o* could show in the error measured.
      if (st.sn > 0 && std::sqrt(st.se / st.sn) < kDeviceProbeFloor) {
        RETURN_IF_ERROR(host_probe_rows(plan, h, sample, ctx, &rows));
        st = probe_stats(rows, population);
      }
      result->heads[static_cast<size_t>(h)].probe = summarize_probe({st});
      stats_by_head[static_cast<size_t>(h)] = std::move(st);
    }
    result->probe = summarize_probe(stats_by_head);
    result->timings["estimates_probe"] = seconds_since(tp);
  }
  result->timings["estimates"] = seconds_since(t1);
  return Status::Ok();
}

}  // namespace plsh
