// What plsh compute shares with plsh attend, its request sent to a server:
// the flags (attend adds its own after them), the check of dout's file and
// the writing of dq, dk, dv, so that the two commands take the same files
// and refuse them with the same words. Header-only, as the other cmd_*
// helpers: only the two subcommands include it.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "cli/flags.h"
#include "cli/npy.h"

namespace plsh::cli {

struct ComputeCliArgs {
  AttentionCliArgs attention;
  OutputCliArgs outputs;
  BackwardCliArgs backward;
};

// The attention, output and backward flags, in that order (their --help order).
inline void add_compute_flags(CLI::App& app, ComputeCliArgs& args) {
  add_attention_flags(app, args.attention);
  add_output_flags(app, args.outputs);
  add_backward_flags(app, args.backward);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// dout's file against what the forward writes: out's shape and dtype.
inline Status check_dout(const NpyArray& dout, const std::string& path, const AttentionOptions& o, bool batched) {
  const std::vector<int64_t> want = output_shape(o, batched);
  if (dout.shape != want)
    return invalid_argument(path + ": dout shape " + shape_string(dout.shape) + ", expected the shape of out " +
                            shape_string(want));
  const DType out_dtype = o.out_dtype.value_or(o.dtype);
  if (dout.dtype != out_dtype)
    return invalid_argument(path + ": dout dtype " + dtype_name(dout.dtype) + ", expected the dtype of out (" +
                            dtype_name(out_dtype) + ")");
  return Status::Ok();
}

// dq (q's shape), dk and dv (k's) to --dq, --dk, --dv in grad_dtype; the
// first failure stops it.
inline Status write_gradients(const BackwardCliArgs& paths, DType grad_dtype, const AttentionOptions& o, bool batched,
                              const void* dq, const void* dk, const void* dv) {
  RETURN_IF_ERROR(write_npy(paths.dq_path, grad_dtype, output_shape(o, batched), dq));
  RETURN_IF_ERROR(write_npy(paths.dk_path, grad_dtype, kv_shape(o, batched), dk));
  return write_npy(paths.dv_path, grad_dtype, kv_shape(o, batched), dv);
}

}  // namespace plsh::cli
