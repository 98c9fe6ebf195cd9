// The versioned dlopen boundary (plsh/backend.h, kBackendApiVersion): a
// backend library built for another API version is not called beyond its
// version field; the registry notes why and the CPU serves. Each case runs
// the registry in a child process, since discovery happens once per process.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "plsh/backend.h"

namespace plsh {
namespace {

struct Discovery {
  std::string backends;  // names, best first, comma separated
  std::string notes;     // joined with " | "
};

// The registry's view in a fresh process with PLSH_CUDA_BACKEND = library.
Discovery discover_with(const std::string& library) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    setenv("PLSH_CUDA_BACKEND", library.c_str(), 1);
    std::string text;
    for (Backend* b : BackendRegistry::global().backends()) text += b->name() + ",";
    text += "\n";
    for (const std::string& n : BackendRegistry::global().notes()) text += n + " | ";
    [[maybe_unused]] const ssize_t n = write(fds[1], text.data(), text.size());
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child crashed: " << status;
  const size_t nl = text.find('\n');
  return {text.substr(0, nl), nl == std::string::npos ? "" : text.substr(nl + 1)};
}

TEST(PluginBoundary, AnotherApiVersionIsANoteAndTheCpuServes) {
  const Discovery d = discover_with(PLSH_FAKE_PLUGIN_NEWER);
  EXPECT_EQ(d.backends, "cpu,");
  EXPECT_NE(d.notes.find("speaks backend API version " + std::to_string(kBackendApiVersion + 1)), std::string::npos)
      << d.notes;
  EXPECT_NE(d.notes.find("this process " + std::to_string(kBackendApiVersion)), std::string::npos) << d.notes;
  // create() was never called: its refusal text would show otherwise.
  EXPECT_EQ(d.notes.find("refuses by design"), std::string::npos) << d.notes;
}

// The same version from another build (another layout of the types that
// cross): refused before create() too.
TEST(PluginBoundary, AnotherAbiFingerprintIsANoteAndTheCpuServes) {
  const Discovery d = discover_with(PLSH_FAKE_PLUGIN_SKEWED);
  EXPECT_EQ(d.backends, "cpu,");
  EXPECT_NE(d.notes.find("another C++ layout of the backend types"), std::string::npos) << d.notes;
  EXPECT_EQ(d.notes.find("refuses by design"), std::string::npos) << d.notes;
}

TEST(PluginBoundary, ALibraryWithoutTheEntryIsANote) {
  const Discovery d = discover_with(PLSH_FAKE_PLUGIN_OLD);
  EXPECT_EQ(d.backends, "cpu,");
  EXPECT_NE(d.notes.find("has no symbol plsh_backend_plugin"), std::string::npos) << d.notes;
}

TEST(PluginBoundary, TheSameVersionIsCalledAndItsReasonKept) {
  const Discovery d = discover_with(PLSH_FAKE_PLUGIN_SAME);
  EXPECT_EQ(d.backends, "cpu,");
  EXPECT_NE(d.notes.find("cuda backend unavailable: fake backend: refuses by design"), std::string::npos) << d.notes;
}

TEST(PluginBoundary, AMissingLibraryIsANote) {
  const Discovery d = discover_with("/nonexistent/libplsh_cuda.so");
  EXPECT_EQ(d.backends, "cpu,");
  EXPECT_NE(d.notes.find("cuda:"), std::string::npos) << d.notes;
}

}  // namespace
}  // namespace plsh
