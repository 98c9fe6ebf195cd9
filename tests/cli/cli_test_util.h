// Helpers for the CLI tests: a scratch directory per test, running the
// built plsh binary as a subprocess, and .npy files in memory.
#pragma once

#include <string>
#include <vector>

namespace plsh::cli::testing {

// A fresh directory under the test temp dir, removed with the object.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
};

struct RunResult {
  int exit_code = -1;  // the exit status, or 128 + signal when killed by one
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs the plsh binary under test (PLSH_BINARY) with these arguments; no shell.
RunResult run_plsh(const std::vector<std::string>& args, const ScratchDir& dir);

std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& bytes);
bool file_exists(const std::string& path);

}  // namespace plsh::cli::testing
