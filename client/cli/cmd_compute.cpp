// plsh compute: one attention request on .npy files, in this process, on
// the best local backend. The offline twin of `plsh attend` (same flags),
// and the way to produce reference outputs and metadata for a server's.
// With --dout --dq --dk --dv it also runs the backward pass (SPEC section
// 8) on the same plan: the gradients of the forward it just computed.
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "cli/cmd_compute.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/meta_json.h"
#include "cli/npy.h"
#include "plsh/attention.h"
#include "plsh/backend.h"
#include "plsh/backward.h"

namespace plsh::cli {
namespace {

Status compute(const AttentionCliArgs& args, const OutputCliArgs& outputs, const BackwardCliArgs& backward) {
  const auto t_start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(check_output_paths(outputs));
  ASSIGN_OR_RETURN(const std::optional<DType> grad_dtype_flag, check_backward_args(backward, args.bf16_bits));
  ASSIGN_OR_RETURN(AttentionInputs in, load_attention_inputs(args));
  NpyArray dout;
  if (backward.requested()) {
    ASSIGN_OR_RETURN(dout, read_npy(backward.dout_path, NpyReadOptions{args.bf16_bits}));
    RETURN_IF_ERROR(check_dout(&dout, backward.dout_path, in));
  }
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
  ASSIGN_OR_RETURN(Backend * backend, BackendRegistry::global().select(args.backend, params, backward.requested()));
  PlanLimits limits;
  limits.threads = static_cast<int>(args.threads);

  // The backward's buffers: dq like q, dk and dv like k, in the gradients' dtype.
  const DType grad_dtype = grad_dtype_flag.value_or(o.dtype);
  std::vector<uint8_t> dq, dk, dv;
  AttentionResult result;
  std::optional<BackwardResult> backward_result;
  if (backward.requested()) {
    const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
    dq.resize(static_cast<size_t>(o.batch * o.q_len * o.heads * o.head_dim) * dtype_bytes(grad_dtype));
    dk.resize(static_cast<size_t>(o.batch * o.kv_len * kv_heads * o.head_dim) * dtype_bytes(grad_dtype));
    dv.resize(dk.size());
    GradientRefs grads;
    grads.dout = dout.ptr();
    grads.dq = dq.data();
    grads.dk = dk.data();
    grads.dv = dv.data();
    grads.grad_dtype = grad_dtype;
    ASSIGN_OR_RETURN(ForwardBackwardResult both, run_forward_backward(*backend, params, limits, grads, ExecContext{}));
    result = std::move(both.forward);
    backward_result = std::move(both.backward);
  } else {
    ASSIGN_OR_RETURN(result, run_attention(*backend, params, limits, ExecContext{}));
  }

  const auto t_save = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(write_in_layout(outputs.out_path, out_dtype, output_shape(o, in.batched), out.data(), in.layout));
  if (!lse.empty())
    RETURN_IF_ERROR(
        write_in_layout(outputs.lse_path, DType::kF32, lse_shape(o, in.batched), lse.data(), in.layout, false));
  result.timings["load"] = load_seconds;
  result.timings["save"] = seconds_since(t_save);  // out and lse; the metadata file itself comes after
  if (backward_result) {
    const auto t_grads = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(write_gradients(backward, grad_dtype, in, dq.data(), dk.data(), dv.data()));
    backward_result->timings["save"] = seconds_since(t_grads);
  }

  if (!outputs.meta_path.empty()) {
    nlohmann::ordered_json meta = result_to_json(result);
    add_params_json(o, result, in.batched, &meta);
    meta["shape"]["layout"] = name_of(kLayoutNames, in.layout);
    if (backward_result) meta["backward"] = backward_to_json(*backward_result, grad_dtype);
    RETURN_IF_ERROR(write_meta_file(outputs.meta_path, meta));
  }
  return Status::Ok();
}

RunFn setup_compute(CLI::App& app) {
  auto args = std::make_shared<ComputeCliArgs>();
  add_compute_flags(app, *args);
  return [args] {
    const Status s = compute(args->attention, args->outputs, args->backward);
    return s.ok() ? kExitOk : report_error("compute", s);
  };
}

}  // namespace
}  // namespace plsh::cli

PLSH_REGISTER_COMMAND(compute, "Run attention (and with --dout its backward) on .npy files in this process",
                      plsh::cli::setup_compute);
