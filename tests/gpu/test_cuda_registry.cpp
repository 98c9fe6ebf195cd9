// libplsh_cuda.so through the registry, the way the server loads it: it must
// load, and then either serve as "cuda" or leave a note saying why not (in
// CI, which has the toolkit but no GPU: "no CUDA device").
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "plsh/backend.h"

namespace plsh {
namespace {

TEST(CudaRegistry, LibraryLoadsAndServesOrSaysWhyNot) {
  ASSERT_EQ(setenv("PLSH_CUDA_BACKEND", PLSH_CUDA_LIBRARY, 1), 0);
  BackendRegistry& registry = BackendRegistry::global();
  const std::vector<Backend*>& backends = registry.backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends.back()->name(), "cpu");
  if (backends.front()->name() == "cuda") {
    EXPECT_FALSE(backends.front()->device().empty());
    StatusOr<Backend*> found = registry.find("cuda");
    EXPECT_TRUE(found.ok()) << found.status().to_string();
    return;
  }
  std::string note;
  for (const std::string& n : registry.notes())
    if (n.rfind("cuda:", 0) == 0) note = n;
  // Loaded (no "cannot load" or missing symbol), and refused for want of a device.
  EXPECT_NE(note.find("cuda backend unavailable: no CUDA device"), std::string::npos) << note;
  StatusOr<Backend*> found = registry.find("cuda");
  ASSERT_FALSE(found.ok());
  EXPECT_EQ(found.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(found.status().message().find("no CUDA device"), std::string::npos) << found.status().message();
  std::printf("registry note: %s\n", note.c_str());
}

// The registry keeps its backends in a static, destroyed at exit, possibly
// after the CUDA runtime has shut down: the process must still exit
// cleanly after using the CUDA backend (issue 15). In a child process, so
// that its exit is the one observed; without a device the child only loads
// the library.
void use_cuda_then_exit() {
  setenv("PLSH_CUDA_BACKEND", PLSH_CUDA_LIBRARY, 1);
  BackendRegistry& registry = BackendRegistry::global();
  Backend* cuda = registry.backends().front();
  if (cuda->name() == "cuda") {
    const AttentionOptions o{
        .q_len = 64, .kv_len = 64, .heads = 2, .head_dim = 16, .mode = Mode::kExact, .estimates = false};
    std::vector<float> q(64 * 2 * 16, 0.5f), out(q.size());
    StatusOr<AttentionParams> p =
        make_params(o, {q.data(), q.data(), q.data(), out.data(), nullptr, MemorySpace::kHost});
    if (!p.ok()) std::exit(2);
    StatusOr<Plan> plan = cuda->plan(*p, PlanLimits{});
    if (!plan.ok()) std::exit(3);
    StatusOr<HostWorkspace> workspace = HostWorkspace::allocate(plan->forward_workspace.host_bytes);
    if (!workspace.ok() || !cuda->forward(*plan, workspace->ref(), ExecContext{}, nullptr).ok()) std::exit(3);
    if (!(out[0] > 0.49f && out[0] < 0.51f)) std::exit(4);
  }
  std::exit(0);  // runs the static destructors, the registry's among them
}

TEST(CudaRegistryDeathTest, ProcessExitsCleanlyAfterUsingTheBackend) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(use_cuda_then_exit(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace plsh
