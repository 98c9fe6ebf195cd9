// A backend library at the dlopen boundary (plsh/backend.h) whose forward
// never looks at its ExecContext: it sleeps PLSH_STUCK_SECONDS (default an
// hour) and then fails. It stands for a computation that does not stop (a
// BLAS call stuck retrying an allocation, a hung device) in the tests of
// what the server still bounds then: the process exit (--exit-timeout).
// Loaded in the CUDA backend's place through PLSH_CUDA_BACKEND.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "plsh/backend.h"

namespace {

class StuckBackend : public plsh::Backend {
 public:
  std::string name() const override { return "cuda"; }
  std::string device() const override { return "stuck test backend (forward ignores cancels and deadlines)"; }
  plsh::Status supports(const plsh::AttentionParams&) const override { return plsh::Status::Ok(); }
  plsh::StatusOr<plsh::Plan> plan(const plsh::AttentionParams& p, const plsh::PlanLimits& limits) const override {
    return plsh::start_plan(p, name(), limits);
  }
  plsh::Status forward(const plsh::Plan&, const plsh::WorkspaceRef&, const plsh::ExecContext&,
                       plsh::ForwardStats*) override {
    const char* env = std::getenv("PLSH_STUCK_SECONDS");
    std::this_thread::sleep_for(std::chrono::duration<double>(env != nullptr ? std::atof(env) : 3600.0));
    return plsh::internal_error("the stuck test backend woke up");
  }
};

plsh::Backend* create(char*, size_t) { return new StuckBackend(); }

const plsh::PlshBackendPlugin kPlugin = {plsh::kBackendApiVersion, plsh::backend_abi_fingerprint(), "cuda", &create};

}  // namespace

extern "C" __attribute__((visibility("default"))) const plsh::PlshBackendPlugin* plsh_backend_plugin() {
  return &kPlugin;
}
