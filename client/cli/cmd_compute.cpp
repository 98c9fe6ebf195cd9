// plsh compute: one attention request on .npy files, in this process, on
// the best local backend. The offline twin of `plsh attend` (same flags),
// and the way to produce reference outputs and metadata for a server's.
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/meta_json.h"
#include "cli/npy.h"
#include "plsh/attention.h"
#include "plsh/backend.h"

namespace plsh::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return failed_precondition(path + ": cannot create: " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) return failed_precondition(path + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

Status compute(const AttentionCliArgs& args, const OutputCliArgs& outputs) {
  const auto t_start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(check_output_paths(outputs));
  ASSIGN_OR_RETURN(AttentionInputs in, load_attention_inputs(args));
  const double load_seconds = seconds_since(t_start);

  const AttentionOptions& o = in.options;
  const DType out_dtype = o.out_dtype.value_or(o.dtype);
  std::vector<uint8_t> out(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(out_dtype));
  std::vector<float> lse;
  if (!outputs.lse_path.empty()) lse.resize(static_cast<size_t>(o.batch * o.q_len * o.heads));

  TensorRefs t;
  t.q = in.q.ptr();
  t.k = in.k.ptr();
  t.v = in.v.ptr();
  t.out = out.data();
  t.lse = lse.empty() ? nullptr : lse.data();
  ASSIGN_OR_RETURN(const AttentionParams params, make_params(o, t));
  ASSIGN_OR_RETURN(Backend * backend, BackendRegistry::global().select(args.backend, params));
  PlanLimits limits;
  limits.threads = static_cast<int>(args.threads);
  ASSIGN_OR_RETURN(AttentionResult result, run_attention(*backend, params, limits, ExecContext{}));

  const auto t_save = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(write_npy(outputs.out_path, out_dtype, output_shape(o, in.batched), out.data()));
  if (!lse.empty()) RETURN_IF_ERROR(write_npy(outputs.lse_path, DType::kF32, lse_shape(o, in.batched), lse.data()));
  result.timings["load"] = load_seconds;
  result.timings["save"] = seconds_since(t_save);  // out and lse; the metadata file itself comes after

  if (!outputs.meta_path.empty()) {
    nlohmann::ordered_json meta = result_to_json(result);
    add_params_json(o, result, in.batched, &meta);
    RETURN_IF_ERROR(write_text(outputs.meta_path, meta.dump(2) + "\n"));
  }
  return Status::Ok();
}

struct ComputeArgs {
  AttentionCliArgs attention;
  OutputCliArgs outputs;
};

RunFn setup_compute(CLI::App& app) {
  auto args = std::make_shared<ComputeArgs>();
  add_attention_flags(app, args->attention);
  add_output_flags(app, args->outputs);
  return [args] {
    const Status s = compute(args->attention, args->outputs);
    return s.ok() ? kExitOk : report_error("compute", s);
  };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(compute, "Run attention on .npy files in this process (exact, lsh or window)",
                      plsh::cli::setup_compute);
