#include "cli/meta_json.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

namespace plsh::cli {

namespace {
nlohmann::ordered_json number(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}

// {name: seconds}, as both the forward's and the backward's results keep them.
nlohmann::ordered_json timings_to_json(const std::map<std::string, double>& timings) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, seconds] : timings) j[name] = number(seconds);
  return j;
}
}  // namespace

nlohmann::ordered_json probe_to_json(const ProbeEstimate& p) {
  return {{"rows", p.rows},
          {"rel_err", number(p.rel_err)},
          {"rel_err_stderr", number(p.rel_err_stderr)},
          {"max_abs_err", number(p.max_abs_err)},
          {"bound_max", number(p.bound_max)},
          {"rel_err_upper", number(p.rel_err_upper)}};  // null: the rows cannot bound it (+inf)
}

nlohmann::ordered_json head_to_json(const HeadEstimate& h) {
  nlohmann::ordered_json j = {
      {"head", h.head},
      {"slope", number(h.slope)},
      {"sigma", number(h.sigma)},
      {"window", h.window == kNoWindow ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(h.window)},
      {"max_block", h.max_block},
      {"mask_max_err", number(h.mask_max_err)},
      {"mask_rows_checked", h.mask_rows_checked},
      {"mask_rows_sampled", h.mask_rows_sampled},
      {"mask_spectral_err", number(h.mask_spectral_err)},
      {"spectral_iterations", h.spectral_iterations},
      {"probe", probe_to_json(h.probe)}};
  if (!h.draws.empty()) {
    nlohmann::ordered_json draws = nlohmann::ordered_json::array();
    for (const Draw& d : h.draws) draws.push_back({number(d.pitch), number(d.shift)});
    j["draws"] = std::move(draws);
  }
  return j;
}

nlohmann::ordered_json target_to_json(const TargetReport& t) {
  nlohmann::ordered_json attempts = nlohmann::ordered_json::array();
  for (const TargetAttempt& a : t.attempts) {
    nlohmann::ordered_json j = {{"mode", mode_name(a.mode)}};
    if (a.mode == Mode::kLsh) j["samples"] = a.samples;
    if (a.mode == Mode::kWindow) {
      j["window_scale"] = number(a.window_scale);
      j["window_eps"] = number(std::exp(-a.window_scale));
      j["window_max"] = a.window_max;
    }
    j["flops"] = number(a.flops);
    j["rel_err"] = number(a.rel_err);
    j["rel_err_upper"] = number(a.rel_err_upper);
    j["met"] = a.met;
    j["seconds"] = number(a.seconds);
    attempts.push_back(std::move(j));
  }
  return {{"target_rel_err", number(t.target_rel_err)},
          {"met", t.met},
          {"chosen", t.chosen},
          {"attempts", std::move(attempts)}};
}

nlohmann::ordered_json result_to_json(const AttentionResult& r) {
  nlohmann::ordered_json heads = nlohmann::ordered_json::array();
  for (const HeadEstimate& h : r.heads) heads.push_back(head_to_json(h));
  nlohmann::ordered_json meta = {{"format", "plsh-meta/1"},
                                 {"mode", mode_name(r.mode)},
                                 {"samples", r.samples},
                                 {"seed", r.seed},
                                 {"backend", r.backend},
                                 {"device", r.device},
                                 {"lsh_algorithm", lsh_algorithm_name(r.lsh_algorithm)},
                                 {"sampling", sampling_name(r.sampling)},
                                 {"flops", number(r.flops)},
                                 {"dense_flops", number(r.dense_flops)},
                                 {"timings", timings_to_json(r.timings)},
                                 {"summary",
                                  {{"mask_max_err", number(r.mask_max_err)},
                                   {"mask_spectral_err", number(r.mask_spectral_err)},
                                   {"probe", probe_to_json(r.probe)}}},
                                 {"heads", std::move(heads)}};
  if (r.target.target_rel_err > 0) meta["target"] = target_to_json(r.target);
  return meta;
}

nlohmann::ordered_json backward_to_json(const BackwardResult& r, DType grad_dtype) {
  return {{"backend", r.backend},
          {"device", r.device},
          {"grad_dtype", dtype_name(grad_dtype)},
          {"flops", number(r.flops)},
          {"dense_flops", number(r.dense_flops)},
          {"host_workspace_bytes", r.host_workspace_bytes},
          {"device_workspace_bytes", r.device_workspace_bytes},
          {"timings", timings_to_json(r.timings)}};
}

void add_params_json(const AttentionOptions& o, const AttentionResult& r, bool batched, nlohmann::ordered_json* meta) {
  (*meta)["shape"] = {{"batch", o.batch},
                      {"q_len", o.q_len},
                      {"kv_len", o.kv_len},
                      {"heads", o.heads},
                      {"kv_heads", resolved_kv_heads(o.heads, o.kv_heads)},
                      {"head_dim", o.head_dim},
                      {"dtype", dtype_name(o.dtype)},
                      {"out_dtype", dtype_name(o.out_dtype.value_or(o.dtype))},
                      {"batched", batched}};
  (*meta)["params"] = {{"scale", number(r.scale)},
                       {"causal", o.causal},
                       {"q_pos0", r.q_pos0},
                       {"k_pos0", r.k_pos0},
                       {"window_eps", number(o.window_eps)},
                       {"probe_rows", o.probe_rows},
                       {"mask_row_budget", o.mask_row_budget},
                       {"estimates", o.estimates}};
}

Status write_meta_file(const std::string& path, const nlohmann::ordered_json& meta) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return failed_precondition(path + ": cannot create: " + std::strerror(errno));
  out << meta.dump(2) << "\n";
  out.close();
  if (!out) return failed_precondition(path + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace plsh::cli
