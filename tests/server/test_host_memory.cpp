// server/host_memory.h: the defaults that follow the host read the tighter
// of its RAM and its cgroup's limit (a container's), v2 and v1 alike.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "server/config.h"
#include "server/host_memory.h"

namespace plsh::server {
namespace {

namespace fs = std::filesystem;
constexpr int64_t GiB = int64_t{1} << 30;

class CgroupTree {
 public:
  CgroupTree() {
    root_ = fs::temp_directory_path() / ("plsh-cgroup-" + std::to_string(::getpid()) + "-" + std::to_string(next_++));
    fs::create_directories(root_);
  }
  ~CgroupTree() { fs::remove_all(root_); }
  void write(const std::string& relative, const std::string& text) const {
    fs::create_directories((root_ / relative).parent_path());
    std::ofstream(root_ / relative) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  static inline int next_ = 0;
  fs::path root_;
};

TEST(HostMemory, CgroupV2TakesTheTightestLimitUpTheTree) {
  CgroupTree t;
  t.write("memory.max", "max\n");
  t.write("kubepods/memory.max", std::to_string(8 * GiB) + "\n");
  t.write("kubepods/pod1/memory.max", std::to_string(6 * GiB) + "\n");
  t.write("kubepods/pod1/plsh/memory.max", "max\n");
  EXPECT_EQ(cgroup_limit_bytes(t.root(), "0::/kubepods/pod1/plsh\n"), 6 * GiB);
  EXPECT_EQ(cgroup_limit_bytes(t.root(), "0::/\n"), 0);  // "max" at the namespace's root: none
  EXPECT_EQ(cgroup_limit_bytes(t.root(), "0::/elsewhere\n"), 0);
}

TEST(HostMemory, CgroupV1ReadsTheMemoryController) {
  CgroupTree t;
  t.write("memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  t.write("memory/docker/abc/memory.limit_in_bytes", std::to_string(3 * GiB) + "\n");
  EXPECT_EQ(cgroup_limit_bytes(t.root(), "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"), 3 * GiB);
  EXPECT_EQ(cgroup_limit_bytes(t.root(), "4:memory:/\n"), 0);
}

TEST(HostMemory, DefaultsFollowTheUsableMemory) {
  HostMemory host{.physical_bytes = 64 * GiB, .cgroup_bytes = 20 * GiB};
  EXPECT_EQ(host.usable_bytes(), 20 * GiB);
  EXPECT_EQ(host.source(), "cgroup limit");
  ServerConfig c;
  resolve_host_defaults(&c, host);
  EXPECT_EQ(c.memory_budget, 10 * GiB);
  EXPECT_EQ(c.pool_keep_bytes, 10 * GiB / 8);
  EXPECT_EQ(c.max_shm_bytes, 20 * GiB);
  // What was set stays.
  ServerConfig set;
  set.memory_budget = 4 * GiB;
  set.max_shm_bytes = GiB;
  resolve_host_defaults(&set, HostMemory{.physical_bytes = 64 * GiB});
  EXPECT_EQ(set.memory_budget, 4 * GiB);
  EXPECT_EQ(set.pool_keep_bytes, GiB / 2);
  EXPECT_EQ(set.max_shm_bytes, GiB);
  EXPECT_EQ(HostMemory{.physical_bytes = 64 * GiB}.source(), "RAM");
}

}  // namespace
}  // namespace plsh::server
