// AttentionResult -> JSON: the metadata file of plsh compute (and, through
// the client library, of plsh attend). Layout, every number in SI units
// (seconds, FLOPs):
//
//   {"format": "plsh-meta/1", "mode", "samples", "seed", "backend", "device",
//    "lsh_algorithm", "sampling", "flops", "dense_flops", "timings": {name: seconds},
//    "summary": {"mask_max_err", "mask_spectral_err", "probe": {...}},
//    "heads": [{"head", "slope", "sigma", "window", "max_block",
//               "mask_max_err", "mask_rows_checked", "mask_rows_sampled",
//               "mask_spectral_err", "spectral_iterations",
//               "probe": {"rows", "rel_err", "rel_err_stderr", "max_abs_err", "bound_max",
//                         "rel_err_upper"},
//               "draws": [[pitch, shift], ...]}],          (draws: only when asked for)
//    "target": {"target_rel_err", "met", "chosen",           (error-targeted requests only)
//               "attempts": [{"mode", "samples" | "window_scale", "window_eps", "window_max",
//                             "flops", "rel_err", "rel_err_upper", "met", "seconds"}]},
//    "shape": {...}, "params": {...},                       (from add_params_json)
//    "backward": {"backend", "device", "grad_dtype", "flops", "dense_flops",
//                 "host_workspace_bytes", "device_workspace_bytes",
//                 "timings": {name: seconds}}}                (plsh compute --dout: backward_to_json)
//
// JSON has no infinity: sigma of a head with slope 0 (+inf), its pitch, and
// a window of kNoWindow ("every key") and an infinite rel_err_upper ("the
// probe's rows cannot bound the error") are written as null; any other
// non-finite number (none is expected) is null too. Seeds are uint64 and
// written as exact integers; doubles are written with 17 significant
// digits, so they read back bit for bit.
#pragma once

#include <nlohmann/json.hpp>

#include "plsh/params.h"
#include "plsh/result.h"

namespace plsh::cli {

nlohmann::ordered_json probe_to_json(const ProbeEstimate& p);
nlohmann::ordered_json head_to_json(const HeadEstimate& h);
nlohmann::ordered_json result_to_json(const AttentionResult& r);  // with "target" for error-targeted results
nlohmann::ordered_json target_to_json(const TargetReport& t);
// The backward's part of the metadata: FLOPs done (the five GEMMs of SPEC
// section 8) and those of the dense equivalent, the workspace, the timings
// ("backward": the pass itself; "save": writing dq, dk, dv).
nlohmann::ordered_json backward_to_json(const BackwardResult& r, DType grad_dtype);

// "shape": {"batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim",
// "dtype", "out_dtype", "batched"} and "params": {"scale", "causal",
// "q_pos0", "k_pos0", "window_eps", "probe_rows", "mask_row_budget",
// "estimates"}, merged into `meta`. What the caller asked for comes from
// `options` (kv_heads and out_dtype resolved by their plsh/params.h rules);
// the defaults that the library resolves (scale, q_pos0, k_pos0) come from
// `result`, as computed in this process (plsh compute) or as the server
// resolved them (plsh attend), so that neither command re-derives them.
// `batched`: the arrays had a batch axis.
void add_params_json(const AttentionOptions& options, const AttentionResult& result, bool batched,
                     nlohmann::ordered_json* meta);

// Writes meta to path (replacing the file): two-space indent, a final newline.
Status write_meta_file(const std::string& path, const nlohmann::ordered_json& meta);

}  // namespace plsh::cli
