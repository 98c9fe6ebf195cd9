// What the test binaries of several folders share (tests/cli,
// tests/integration): a scratch directory that goes with everything in it,
// and reading a whole file back.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace plsh::testing {

// A fresh directory, removed with everything in it when destroyed.
class TempDir {
 public:
  // mkdtemp's pattern: a path that ends in XXXXXX.
  explicit TempDir(std::string pattern = (std::filesystem::temp_directory_path() / "plsh-test-XXXXXX").string()) {
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The file's bytes; empty when it cannot be read.
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace plsh::testing
