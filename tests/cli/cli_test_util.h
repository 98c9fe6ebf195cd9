// Helpers for the CLI tests: a scratch directory per test, running the
// built plsh binary as a subprocess, and .npy files in memory.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cli/npy.h"
#include "plsh/params.h"
#include "reference.h"
#include "temp_dir.h"

namespace plsh::cli::testing {

using plsh::testing::read_file;

// A fresh directory under gtest's temp dir, removed with the object.
class ScratchDir : public plsh::testing::TempDir {
 public:
  ScratchDir() : TempDir(::testing::TempDir() + "plsh_cli_XXXXXX") {}
};

struct RunResult {
  int exit_code = -1;  // the exit status, or 128 + signal when killed by one
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs the plsh binary under test (PLSH_BINARY) with these arguments; no shell.
RunResult run_plsh(const std::vector<std::string>& args, const ScratchDir& dir);

// A plsh command line: the command, then "--flag", dir.file(name) for each
// "--flag=name" of `files` (the files it reads and writes), then `rest`.
std::vector<std::string> command_line(const std::string& command, const ScratchDir& dir,
                                      const std::vector<std::string>& files, const std::vector<std::string>& rest);

void write_file(const std::string& path, const std::string& bytes);
bool file_exists(const std::string& path);

// The .npy shape of one of o's [B, rows, heads, D] tensors: without B when
// not batched (rank 3), without D for lse.
std::vector<int64_t> npy_shape(const AttentionOptions& o, bool batched, int64_t rows, int64_t heads,
                               bool with_dim = true);
// Writes q, k and v as dir's q.npy, k.npy and v.npy in o's dtype.
Status write_qkv(const ScratchDir& dir, const AttentionOptions& o, bool batched, const plsh::testing::RandomTensors& t);
// read_npy with bfloat16 bit patterns allowed; a test failure, and an empty
// array, when it fails.
NpyArray read_npy_ok(const std::string& path);

}  // namespace plsh::cli::testing
