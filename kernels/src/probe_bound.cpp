// The probe's upper bound on the whole output's relative error
// (ProbeEstimate::rel_err_upper). Why a margin beyond the standard error:
// the error is heavy-tailed across rows (in the calibration set the top 1%
// of rows carried 25-95% of the squared error, a single row up to half of
// it under windows on peaked inputs), so a sample of rows often misses the
// worst ones, and then its spread, and with it the standard error, is too
// small as well. The margin reads how heavy the tail is from the sample's
// largest errors (a Hill estimate of the tail index) and adds what one more
// row as bad as the worst seen, with that tail behind it, could add.
//
// With Q = sum err2 / sum ref2 over the probe rows (pooled over heads), SE
// its standard error (summarize_probe); over the rows of the heads that
// were sampled (not a census), e_(1) >= e_(2) >= ... their err2 values,
// k = max(4, floor(sqrt(rows))) and m = population / rows (the rows each
// sampled row stands for):
//   gamma = (1/k) sum_{i<=k} ln(e_(i) / e_(k+1))     (Hill; tail index 1/gamma)
//   share = e_(1) / sum_i e_i
//   g     = m^(gamma-1) sum_{i=1}^{m} i^-gamma       (Euler-Maclaurin for the sum)
//   U^2   = Q + 2 SE + 2 Q_s share g
// where Q_s is the sampled heads' part of Q. Why g: under a Pareto tail of
// index 1/gamma the population's largest rows are about e_(1) (m/i)^gamma
// (i = 1, 2, ... up to m); the sample stands for them with m e_(1), so
// their excess is share Q_s g of Q. For gamma < 1 and large m, g ->
// 1 / (1 - gamma), the expected sum beyond the sample's largest; at
// gamma >= 1 (a tail whose mean no sample pins down) g grows as ln m or
// m^(gamma-1) and the bound widens accordingly instead of failing. U is
// +inf when fewer than k + 1 sampled rows have any error (the tail cannot
// be read). A head whose probe covered all its rows has no sampling error
// and adds neither SE nor margin.
//
// The constants (2 and 2) were chosen on a calibration set and the
// coverage then measured on held-out requests through plsh compute
// (bench/pareto/calibrate.py, bench/RESULTS.md): a claim measured, not
// assumed.
#include <algorithm>
#include <cmath>
#include <functional>

#include "estimates_internal.h"

namespace plsh::estimates_detail {

double tail_growth(double gamma, double m) {
  if (!(m > 1)) return 1;
  // S = sum_{i=1}^{m} i^-gamma ~ integral_1^m x^-gamma dx + (1 + m^-gamma) / 2.
  const double integral =
      std::fabs(gamma - 1) < 1e-9 ? std::log(m) : std::expm1((1 - gamma) * std::log(m)) / (1 - gamma);
  const double sum = integral + (1 + std::pow(m, -gamma)) / 2;
  return std::pow(m, gamma - 1) * sum;
}

double probe_rel_err_upper(const std::vector<ProbeStats>& heads, double q, double se_q) {
  double sn = 0, sampled_se = 0;
  int64_t population = 0;
  std::vector<double> err2;
  for (const ProbeStats& h : heads) {
    sn += h.sn;
    if (h.rows == 0 || h.rows == h.population) continue;  // a census: no sampling error
    sampled_se += h.se;
    population += h.population;
    err2.insert(err2.end(), h.err2.begin(), h.err2.end());
  }
  if (!std::isfinite(q) || !std::isfinite(se_q)) return kInf;
  if (err2.empty()) return std::sqrt(q);  // every head a census: the rows are the whole output
  const size_t k = std::max<size_t>(4, static_cast<size_t>(std::floor(std::sqrt(static_cast<double>(err2.size())))));
  if (err2.size() < k + 1) return kInf;
  std::partial_sort(err2.begin(), err2.begin() + static_cast<std::ptrdiff_t>(k + 1), err2.end(), std::greater<>());
  if (!(err2[k] > 0)) return kInf;  // fewer than k + 1 rows with any error: the tail cannot be read
  double gamma = 0;
  for (size_t i = 0; i < k; ++i) gamma += std::log(err2[i] / err2[k]);
  gamma /= static_cast<double>(k);
  const double m = std::max(1.0, static_cast<double>(population) / static_cast<double>(err2.size()));
  const double share = sampled_se > 0 ? err2[0] / sampled_se : 0;
  const double q_sampled = sn > 0 ? sampled_se / sn : 0;
  const double u2 = q + 2 * se_q + 2 * q_sampled * share * tail_growth(gamma, m);
  return std::isnan(u2) ? kInf : std::sqrt(std::max(0.0, u2));
}

}  // namespace plsh::estimates_detail
