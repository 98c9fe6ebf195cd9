// Plan once, run many (CUTLASS's can_implement -> get_workspace_size ->
// initialize -> run; ggml's graph_plan_create): a Plan is made once per
// request, before any tensor byte arrives, and holds everything that depends
// on the request's shape and options but not on its data:
//   - the resolved params (tensors bound later, by bind_tensors),
//   - the lsh draws of every head (SPEC section 5), made exactly once and
//     read by the forward pass, the estimates and the backward,
//   - the lsh algorithm the backend chose,
//   - the workspace of each step, split by memory space, so that a server can
//     charge host bytes and device bytes to separate budgets, refuse what
//     cannot fit before it allocates anything, and hand the memory to the
//     step (plsh/workspace.h: the caller owns it),
//   - the backend's own layout (on CUDA the tile/lane layout that both the
//     sizing and the slicing of the workspace read).
// Backend::plan makes one; Backend::forward, compute_estimates and
// Backend::backward read it, each in a workspace of at least its figure. The backward's workspace is sized only when
// asked (PlanLimits::backward), so that a server charges it to the requests
// that will run one, and a backward refuses a plan made without it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plsh/draws.h"
#include "plsh/params.h"
#include "plsh/status.h"
#include "plsh/workspace.h"

namespace plsh {

// What a caller fixes before planning.
struct PlanLimits {
  int threads = 0;           // CPU threads forward and the estimates use; 0: all cores
  int64_t device_bytes = 0;  // most device workspace one request may take; 0: the backend's default share
  bool backward = false;     // plan the backward pass too (supports_backward, backward_workspace)
};

// A backend's private part of a plan (CUDA: its tile layout). Backends
// derive from it; nothing else looks inside.
struct BackendLayout {
  virtual ~BackendLayout() = default;
};

struct Plan {
  AttentionParams params;  // resolved; q, k, v, out, lse bound by bind_tensors before forward
  std::string backend;     // name() of the backend that made it; forward refuses others' plans
  int threads = 1;         // CPU threads the host workspace was sized for (>= 1)
  LshAlgorithm lsh_algorithm = LshAlgorithm::kAuto;  // lsh: the algorithm forward runs; kAuto otherwise
  std::vector<std::vector<Draw>> draws;              // lsh: [H][samples], SPEC section 5; empty otherwise
  int64_t own_host_bytes = 0;     // host memory the plan itself holds: its draws and its attempts' (draw_bytes)
  Workspace forward_workspace;    // what forward needs, beyond the plan
  Workspace estimates_workspace;  // what compute_estimates needs (host only)
  bool backward = false;          // planned with PlanLimits::backward: backward may run on it
  Workspace backward_workspace;   // what backward needs; zero unless planned for it
  std::shared_ptr<const BackendLayout> layout;
  // Error-targeted requests (params.target_rel_err > 0, plsh/targeted.h):
  // one plan per configuration to try, cheapest first, made with this one;
  // the workspaces above are the largest attempt's, own_host_bytes counts
  // every attempt's draws. Empty otherwise.
  std::vector<Plan> attempts;
  double target_window_scale = 0;  // an attempt's window: c in W_h = ceil(c sigma_h)

  // Peak workspace of the request: forward, the estimates and the backward
  // run one after the other in one workspace, so the largest per memory
  // space. A server reserves this plus own_host_bytes.
  Workspace workspace() const {
    return {
        std::max({forward_workspace.host_bytes, estimates_workspace.host_bytes, backward_workspace.host_bytes}),
        std::max({forward_workspace.device_bytes, estimates_workspace.device_bytes, backward_workspace.device_bytes})};
  }
};

// The draws of every head (head_draws) for lsh and fixed_blocks params,
// nothing otherwise: what a request's plan holds.
std::vector<std::vector<Draw>> plan_draws(const AttentionParams& p);

// Host bytes of plan_draws(p): the one count of a request's draws, which
// its plan holds (Plan::own_host_bytes) and no workspace counts again.
int64_t draw_bytes(const AttentionParams& p);

// What every backend's plan starts from: the params, the backend's name,
// the threads, the draws and own_host_bytes (RESOURCE_EXHAUSTED when the
// draws cannot be allocated). The backend then adds its algorithm,
// workspace and layout.
StatusOr<Plan> start_plan(const AttentionParams& p, const std::string& backend, const PlanLimits& limits);

// Threads a plan uses for PlanLimits::threads (0: all cores).
int plan_threads(int requested);

}  // namespace plsh
