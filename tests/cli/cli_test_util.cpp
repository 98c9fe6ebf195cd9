#include "cli_test_util.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <gtest/gtest.h>

extern char** environ;

namespace plsh::cli::testing {

std::vector<std::string> command_line(const std::string& command, const ScratchDir& dir,
                                      const std::vector<std::string>& files, const std::vector<std::string>& rest) {
  std::vector<std::string> args = {command};
  for (const std::string& f : files) {
    const size_t eq = f.find('=');
    EXPECT_NE(eq, std::string::npos) << "\"" << f << "\" is not --flag=name";
    args.push_back(f.substr(0, eq));
    args.push_back(dir.file(f.substr(eq + 1)));
  }
  args.insert(args.end(), rest.begin(), rest.end());
  return args;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

bool file_exists(const std::string& path) { return std::filesystem::exists(path); }

std::vector<int64_t> npy_shape(const AttentionOptions& o, bool batched, int64_t rows, int64_t heads, bool with_dim) {
  std::vector<int64_t> s;
  if (batched) s.push_back(o.batch);
  s.push_back(rows);
  s.push_back(heads);
  if (with_dim) s.push_back(o.head_dim);
  return s;
}

Status write_qkv(const ScratchDir& dir, const AttentionOptions& o, bool batched,
                 const plsh::testing::RandomTensors& t) {
  const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
  RETURN_IF_ERROR(write_npy(dir.file("q.npy"), o.dtype, npy_shape(o, batched, o.q_len, o.heads), t.q.data()));
  RETURN_IF_ERROR(write_npy(dir.file("k.npy"), o.dtype, npy_shape(o, batched, o.kv_len, kv_heads), t.k.data()));
  return write_npy(dir.file("v.npy"), o.dtype, npy_shape(o, batched, o.kv_len, kv_heads), t.v.data());
}

NpyArray read_npy_ok(const std::string& path) {
  auto a = read_npy(path, NpyReadOptions{true});
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return a.ok() ? std::move(a).value() : NpyArray{};
}

RunResult run_plsh(const std::vector<std::string>& args, const ScratchDir& dir) {
  const std::string out_path = dir.file("stdout.txt");
  const std::string err_path = dir.file("stderr.txt");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);

  std::vector<std::string> argv_storage = {PLSH_BINARY};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  pid_t pid = 0;
  const int rc = posix_spawn(&pid, PLSH_BINARY, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  RunResult r;
  if (rc != 0) {
    r.err = "posix_spawn failed: " + std::to_string(rc);
    return r;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  return r;
}

}  // namespace plsh::cli::testing
