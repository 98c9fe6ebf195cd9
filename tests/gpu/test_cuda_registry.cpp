// libplsh_cuda.so through the registry, the way the server loads it: it must
// load, and then either serve as "cuda" or leave a note saying why not (in
// CI, which has the toolkit but no GPU: "no CUDA device").
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

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

}  // namespace
}  // namespace plsh
