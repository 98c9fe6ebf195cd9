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

// dout's file against what the forward writes (out's shape in the files'
// layout, and its dtype); in bnhd when it is.
inline Status check_dout(NpyArray* dout_array, const std::string& path, const AttentionInputs& in) {
  NpyArray& dout = *dout_array;
  const AttentionOptions& o = in.options;
  const std::vector<int64_t> want = in_layout(output_shape(o, in.batched), in.layout);
  if (dout.shape != want)
    return invalid_argument(path + ": dout shape " + shape_string(dout.shape) + ", expected the shape of out " +
                            shape_string(want));
  const DType out_dtype = o.out_dtype.value_or(o.dtype);
  if (dout.dtype != out_dtype)
    return invalid_argument(path + ": dout dtype " + dtype_name(dout.dtype) + ", expected the dtype of out (" +
                            dtype_name(out_dtype) + ")");
  if (in.layout == Layout::kBhnd) dout = swap_axes(dout, in.batched ? 1 : 0);
  return Status::Ok();
}

// dq (q's shape), dk and dv (k's), bnhd buffers, to --dq, --dk, --dv in
// grad_dtype and the files' layout; the first failure stops it.
inline Status write_gradients(const BackwardCliArgs& paths, DType grad_dtype, const AttentionInputs& in, const void* dq,
                              const void* dk, const void* dv) {
  const AttentionOptions& o = in.options;
  RETURN_IF_ERROR(write_in_layout(paths.dq_path, grad_dtype, output_shape(o, in.batched), dq, in.layout));
  RETURN_IF_ERROR(write_in_layout(paths.dk_path, grad_dtype, kv_shape(o, in.batched), dk, in.layout));
  return write_in_layout(paths.dv_path, grad_dtype, kv_shape(o, in.batched), dv, in.layout);
}

}  // namespace plsh::cli
