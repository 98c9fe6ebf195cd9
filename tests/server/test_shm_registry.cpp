// server/shm_registry.h: every misuse of the shared-memory registry that
// Triton's extension met (CVE-2025-23319/23320/23334) gets its code, and no
// message names a key or a path. Files live in a fresh directory per test.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "server/shm_registry.h"
#include "server_test_util.h"

namespace plsh::server {
namespace {

using testing::has_error;
using testing::is_ok;

class ShmRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/dev/shm/plsh-test-XXXXXX";
    if (mkdtemp(dir) == nullptr) {
      char fallback[] = "/tmp/plsh-test-XXXXXX";
      ASSERT_NE(mkdtemp(fallback), nullptr);
      dir_ = fallback;
    } else {
      dir_ = dir;
    }
    StatusOr<std::unique_ptr<SharedMemoryRegistry>> r =
        SharedMemoryRegistry::open(dir_, kMaxMapped, [this](const SharedMemoryRegistry::Totals& t) { totals_ = t; });
    ASSERT_TRUE(is_ok(r.status()));
    registry_ = std::move(r).value();
  }
  void TearDown() override {
    registry_.reset();
    ASSERT_EQ(system(("rm -rf '" + dir_ + "'").c_str()), 0);
  }

  // A file of `bytes` bytes, byte i = i % 251, mode 0600.
  std::string make_file(const std::string& name, int64_t bytes, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
    EXPECT_GE(fd, 0) << path;
    std::string content(static_cast<size_t>(bytes), '\0');
    for (int64_t i = 0; i < bytes; ++i) content[static_cast<size_t>(i)] = static_cast<char>(i % 251);
    EXPECT_EQ(write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    fchmod(fd, mode);  // past the umask
    close(fd);
    return path;
  }

  // The status, after checking that its message names neither the key nor the directory.
  Status reg(const std::string& name, const std::string& key, int64_t offset, int64_t bytes) {
    const Status s = registry_->register_region("", name, key, offset, bytes);
    if (key.size() >= 4) {
      EXPECT_EQ(s.message().find(key), std::string::npos) << s.message();
    }
    EXPECT_EQ(s.message().find(dir_), std::string::npos) << s.message();
    return s;
  }

  // A sparse file of `bytes` bytes (no disk or memory used), or "" when the
  // directory's file system cannot hold one that large.
  std::string make_sparse(const std::string& name, int64_t bytes) {
    const std::string path = dir_ + "/" + name;
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0) << path;
    const bool ok = ftruncate(fd, bytes) == 0;
    close(fd);
    return ok ? path : "";
  }

  static constexpr int64_t kMaxMapped = int64_t{64} << 20;
  std::string dir_;
  std::unique_ptr<SharedMemoryRegistry> registry_;
  SharedMemoryRegistry::Totals totals_{-1, -1};
};

// This process's virtual memory size (VmSize), in bytes.
// A holder per call: each use stands for a request of its own.
uint64_t next_holder() { return SharedMemoryRegistry::new_holder(); }

int64_t vm_size() {
  FILE* f = fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t kib = -1;
  while (fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "VmSize:", 7) == 0) kib = std::strtoll(line + 7, nullptr, 10);
  fclose(f);
  return kib * 1024;
}

TEST_F(ShmRegistryTest, RegisteredBytesAreTheFilesInPlace) {
  make_file("plsh-a", 10000);
  ASSERT_TRUE(is_ok(reg("a", "plsh-a", 100, 5000)));
  ASSERT_TRUE(is_ok(reg("b", "/plsh-a", 0, 10000)));  // shm_open's spelling
  StatusOr<std::vector<SharedMemoryRegistry::RegionInfo>> listed = registry_->list("");
  ASSERT_TRUE(is_ok(listed.status()));
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name, "a");
  EXPECT_EQ((*listed)[0].key, "plsh-a");
  EXPECT_EQ((*listed)[0].offset, 100);
  EXPECT_EQ((*listed)[0].byte_size, 5000);
  StatusOr<SharedMemoryRegistry::Use> use = registry_->use("", "q_shm", "a", 40, 400, 400, 4, next_holder());
  ASSERT_TRUE(is_ok(use.status()));
  EXPECT_EQ(use->data()[0], static_cast<uint8_t>(140 % 251));
  EXPECT_EQ(use->data()[399], static_cast<uint8_t>(539 % 251));
  use->data()[0] = 42;  // written through to the file
  StatusOr<SharedMemoryRegistry::Use> other = registry_->use("", "k_shm", "b", 140, 4, 4, 4, next_holder());
  ASSERT_TRUE(is_ok(other.status()));
  EXPECT_EQ(other->data()[0], 42);
  EXPECT_TRUE(use->overlaps(*other));  // one file, overlapping bytes, through two regions
  EXPECT_EQ(registry_->list("")->at(0).requests, 1);
}

TEST_F(ShmRegistryTest, OffWithoutADirectory) {
  StatusOr<std::unique_ptr<SharedMemoryRegistry>> off = SharedMemoryRegistry::open("off", 0);
  ASSERT_TRUE(is_ok(off.status()));
  EXPECT_FALSE((*off)->enabled());
  EXPECT_TRUE(has_error((*off)->register_region("", "a", "plsh-a", 0, 1), StatusCode::kUnimplemented, {"--shm-dir"}));
  EXPECT_TRUE(has_error((*off)->unregister_region("", "a"), StatusCode::kUnimplemented, {"--shm-dir"}));
  EXPECT_TRUE(has_error((*off)->list("").status(), StatusCode::kUnimplemented, {"--shm-dir"}));
  EXPECT_TRUE(
      has_error((*off)->use("", "q_shm", "a", 0, 1, 1, 1, 1).status(), StatusCode::kUnimplemented, {"--shm-dir"}));
  EXPECT_TRUE(has_error(SharedMemoryRegistry::open("/nonexistent/plsh-dir", kMaxMapped).status(),
                        StatusCode::kInvalidArgument, {"--shm-dir"}));
}

TEST_F(ShmRegistryTest, KeysAreFileNamesOfTheDirectoryOnly) {
  make_file("plsh-a", 4096);
  for (const std::string& key :
       std::vector<std::string>{"../plsh-a", "../../etc/passwd", "/etc/passwd", "sub/plsh-a", "//plsh-a", ".", "..",
                                ".hidden", "", std::string(256, 'a'), "a b", std::string("plsh-a\0x", 8)}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(has_error(reg("r", key, 0, 1), StatusCode::kInvalidArgument, {"key: expected a file name"}));
  }
  EXPECT_TRUE(has_error(reg("r", "plsh-none", 0, 1), StatusCode::kNotFound, {"key: no such file"}));
  for (const std::string& name : std::vector<std::string>{"", "a/b", std::string(65, 'n'), "x\n"})
    EXPECT_TRUE(has_error(reg(name, "plsh-a", 0, 1), StatusCode::kInvalidArgument, {"name = '"}));
  EXPECT_TRUE(registry_->list("")->empty());
}

TEST_F(ShmRegistryTest, OnlyRegularFilesOfTheServersUserNotFollowingLinks) {
  const std::string target = make_file("plsh-target", 4096);
  ASSERT_EQ(symlink(target.c_str(), (dir_ + "/plsh-link").c_str()), 0);
  ASSERT_EQ(symlink("/etc/passwd", (dir_ + "/plsh-outside").c_str()), 0);
  ASSERT_EQ(mkdir((dir_ + "/plsh-dir").c_str(), 0700), 0);
  ASSERT_EQ(mkfifo((dir_ + "/plsh-fifo").c_str(), 0600), 0);
  EXPECT_TRUE(has_error(reg("r", "plsh-link", 0, 1), StatusCode::kInvalidArgument, {"symbolic link"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-outside", 0, 1), StatusCode::kInvalidArgument, {"symbolic link"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-dir", 0, 1), StatusCode::kInvalidArgument, {"not a regular file"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-fifo", 0, 1), StatusCode::kInvalidArgument, {"not a regular file"}));
  make_file("plsh-everyone", 4096, 0666);
  EXPECT_TRUE(has_error(reg("r", "plsh-everyone", 0, 1), StatusCode::kPermissionDenied, {"writable by every user"}));
  EXPECT_TRUE(registry_->list("")->empty());
}

TEST_F(ShmRegistryTest, AnotherUsersFileIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user (uid 65534)";
  const std::string path = make_file("plsh-theirs", 4096);
  ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
  EXPECT_TRUE(has_error(reg("r", "plsh-theirs", 0, 1), StatusCode::kPermissionDenied, {"another user"}));
}

TEST_F(ShmRegistryTest, RangesAreCheckedForOverflowAndAgainstTheFile) {
  make_file("plsh-a", 4096);
  EXPECT_TRUE(has_error(reg("r", "plsh-a", 0, 4097), StatusCode::kInvalidArgument,
                        {"offset + byte_size = 4097", "4096 bytes"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", 4000, 100), StatusCode::kInvalidArgument, {"offset + byte_size = 4100"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", INT64_MAX, 2), StatusCode::kInvalidArgument, {"overflows"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", 2, INT64_MAX), StatusCode::kInvalidArgument, {"overflows"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", -1, 10), StatusCode::kInvalidArgument, {"offset = -1"}));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", 0, 0), StatusCode::kInvalidArgument, {"byte_size = 0"}));
  ASSERT_TRUE(is_ok(reg("r", "plsh-a", 96, 4000)));
  EXPECT_TRUE(has_error(reg("r", "plsh-a", 0, 10), StatusCode::kAlreadyExists, {"'r'"}));

  auto use = [&](int64_t offset, int64_t bytes, int64_t expected, int64_t alignment) {
    return registry_->use("", "v_shm", "r", offset, bytes, expected, alignment, next_holder()).status();
  };
  EXPECT_TRUE(is_ok(use(3904, 96, 96, 4)));
  EXPECT_TRUE(has_error(use(0, 100, 96, 4), StatusCode::kInvalidArgument, {"v_shm.byte_size = 100, expected 96"}));
  EXPECT_TRUE(
      has_error(use(3908, 96, 96, 4), StatusCode::kInvalidArgument, {"v_shm.offset + byte_size = 4004", "<= 4000"}));
  EXPECT_TRUE(has_error(use(INT64_MAX - 10, 96, 96, 4), StatusCode::kInvalidArgument, {"overflows"}));
  EXPECT_TRUE(has_error(use(-4, 96, 96, 4), StatusCode::kInvalidArgument, {"v_shm.offset = -4"}));
  EXPECT_TRUE(has_error(use(2, 96, 96, 4), StatusCode::kInvalidArgument, {"byte 98", "multiple of 4"}));
  EXPECT_TRUE(has_error(registry_->use("", "q_shm", "nope", 0, 1, 1, 1, next_holder()).status(), StatusCode::kNotFound,
                        {"q_shm.region = 'nope'"}));
}

TEST_F(ShmRegistryTest, ARegionInUseCannotBeUnregistered) {
  make_file("plsh-a", 4096);
  ASSERT_TRUE(is_ok(reg("r", "plsh-a", 0, 4096)));
  {
    StatusOr<SharedMemoryRegistry::Use> a = registry_->use("", "q_shm", "r", 0, 64, 64, 4, next_holder());
    StatusOr<SharedMemoryRegistry::Use> b = registry_->use("", "k_shm", "r", 64, 64, 64, 4, next_holder());
    ASSERT_TRUE(is_ok(a.status()));
    ASSERT_TRUE(is_ok(b.status()));
    EXPECT_TRUE(
        has_error(registry_->unregister_region("", "r"), StatusCode::kFailedPrecondition, {"in use by 2 request(s)"}));
    SharedMemoryRegistry::Use moved = std::move(a).value();  // moving a use keeps one hold
    EXPECT_EQ(registry_->list("")->at(0).requests, 2);
  }
  EXPECT_EQ(registry_->list("")->at(0).requests, 0);
  EXPECT_TRUE(is_ok(registry_->unregister_region("", "r")));
  EXPECT_TRUE(has_error(registry_->unregister_region("", "r"), StatusCode::kNotFound, {"'r'"}));
}

TEST_F(ShmRegistryTest, RegionsBelongToTheirOwner) {
  make_file("plsh-a", 4096);
  ASSERT_TRUE(is_ok(registry_->register_region("alice", "r", "plsh-a", 0, 4096)));
  EXPECT_TRUE(registry_->list("bob")->empty());
  EXPECT_TRUE(has_error(registry_->use("bob", "q_shm", "r", 0, 4, 4, 4, next_holder()).status(), StatusCode::kNotFound,
                        {"'r'"}));
  EXPECT_TRUE(has_error(registry_->unregister_region("bob", "r"), StatusCode::kNotFound, {"'r'"}));
  ASSERT_TRUE(is_ok(registry_->register_region("bob", "r", "plsh-a", 0, 16)));  // names are per owner
  EXPECT_EQ(registry_->list("alice")->size(), 1u);
}

TEST_F(ShmRegistryTest, AtMostMaxRegions) {
  make_file("plsh-a", 4096);
  for (int64_t i = 0; i < SharedMemoryRegistry::kMaxRegions; ++i) {
    std::string name = "r";  // appended: GCC 12 warns falsely on "r" + to_string (GCC bug 105329)
    name += std::to_string(i);
    ASSERT_TRUE(is_ok(reg(name, "plsh-a", 0, 4096)));
  }
  EXPECT_TRUE(has_error(reg("one-more", "plsh-a", 0, 4096), StatusCode::kResourceExhausted, {"regions = 256"}));
  ASSERT_TRUE(is_ok(registry_->unregister_region("", "r7")));
  EXPECT_TRUE(is_ok(reg("one-more", "plsh-a", 0, 4096)));
}

// The client shrinks the file under a registered region: before a request,
// the request is refused; while one uses it, the access that would have
// raised SIGBUS and killed the process reads zeros instead, and the request
// learns its data was lost. The process goes on.
TEST_F(ShmRegistryTest, AFileThatShrinksFailsTheRequestNotTheProcess) {
  const std::string path = make_file("plsh-a", 3 * 4096);
  ASSERT_TRUE(is_ok(reg("r", "plsh-a", 0, 3 * 4096)));
  StatusOr<SharedMemoryRegistry::Use> held =
      registry_->use("", "out_shm", "r", 0, 3 * 4096, 3 * 4096, 4, next_holder());
  ASSERT_TRUE(is_ok(held.status()));
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  EXPECT_TRUE(has_error(registry_->use("", "q_shm", "r", 0, 4, 4, 4, next_holder()).status(),
                        StatusCode::kFailedPrecondition, {"q_shm", "has shrunk"}));
  EXPECT_TRUE(is_ok(held->check_intact("out_shm")));
  volatile uint8_t* data = held->data();
  EXPECT_EQ(data[5], 5);             // still in the file
  EXPECT_EQ(data[2 * 4096 + 1], 0);  // past its end: SIGBUS, caught
  data[2 * 4096 + 2] = 9;            // and a write
  EXPECT_TRUE(has_error(held->check_intact("out_shm"), StatusCode::kFailedPrecondition, {"out_shm", "shrank"}));
  ASSERT_EQ(truncate(path.c_str(), 3 * 4096), 0);  // grown back: the region stays broken
  EXPECT_TRUE(has_error(registry_->use("", "q_shm", "r", 0, 4, 4, 4, next_holder()).status(),
                        StatusCode::kFailedPrecondition, {"register it again"}));
  held = Status(StatusCode::kCancelled, "released");
  ASSERT_TRUE(is_ok(registry_->unregister_region("", "r")));
  ASSERT_TRUE(is_ok(reg("r", "plsh-a", 0, 3 * 4096)));
  EXPECT_TRUE(is_ok(registry_->use("", "q_shm", "r", 0, 4, 4, 4, next_holder()).status()));
}

// D3 of issue 24: `requests` counts requests, not their tensors.
TEST_F(ShmRegistryTest, ARequestCountsOnceHoweverManyOfItsTensorsLieInTheRegion) {
  make_file("plsh-a", 4096);
  ASSERT_TRUE(is_ok(reg("r", "plsh-a", 0, 4096)));
  const uint64_t request = next_holder();
  std::vector<SharedMemoryRegistry::Use> uses;
  for (int64_t at : {0, 1024, 2048, 3072}) {
    StatusOr<SharedMemoryRegistry::Use> u = registry_->use("", "q_shm", "r", at, 1024, 1024, 4, request);
    ASSERT_TRUE(is_ok(u.status()));
    uses.push_back(std::move(u).value());
  }
  EXPECT_EQ(registry_->list("")->at(0).requests, 1);
  EXPECT_TRUE(
      has_error(registry_->unregister_region("", "r"), StatusCode::kFailedPrecondition, {"in use by 1 request(s)"}));
  StatusOr<SharedMemoryRegistry::Use> other = registry_->use("", "k_shm", "r", 0, 4, 4, 4, next_holder());
  EXPECT_EQ(registry_->list("")->at(0).requests, 2);
  uses.pop_back();  // the request still holds three
  EXPECT_EQ(registry_->list("")->at(0).requests, 2);
  uses.clear();
  EXPECT_EQ(registry_->list("")->at(0).requests, 1);
  other = Status(StatusCode::kCancelled, "released");
  EXPECT_EQ(registry_->list("")->at(0).requests, 0);
  EXPECT_TRUE(is_ok(registry_->unregister_region("", "r")));
}

// D1 of issue 24: registrations cannot map past --max-shm-bytes together,
// whatever the file's size; the refusal comes before anything is mapped.
TEST_F(ShmRegistryTest, MappedBytesStayWithinTheBound) {
  if (make_sparse("plsh-huge", int64_t{8} << 40).empty()) GTEST_SKIP() << dir_ << " cannot hold an 8 TiB sparse file";
  EXPECT_EQ(totals_.regions, 0);
  EXPECT_EQ(totals_.mapped_bytes, 0);
  const int64_t before = vm_size();
  EXPECT_TRUE(has_error(reg("all", "plsh-huge", 0, int64_t{8} << 40), StatusCode::kResourceExhausted,
                        {"--max-shm-bytes", "unregister regions first"}));
  EXPECT_LT(vm_size() - before, int64_t{1} << 20);  // nothing was mapped
  ASSERT_TRUE(is_ok(reg("a", "plsh-huge", 0, kMaxMapped / 2)));
  ASSERT_TRUE(is_ok(reg("b", "plsh-huge", int64_t{4} << 40, kMaxMapped / 4)));
  EXPECT_EQ(totals_.regions, 2);
  EXPECT_EQ(totals_.mapped_bytes, 3 * kMaxMapped / 4);
  EXPECT_TRUE(
      has_error(reg("c", "plsh-huge", 0, kMaxMapped / 4 + 4096), StatusCode::kResourceExhausted, {"--max-shm-bytes"}));
  ASSERT_TRUE(is_ok(reg("c", "plsh-huge", 0, kMaxMapped / 4)));  // exactly to the bound
  EXPECT_TRUE(has_error(reg("d", "plsh-huge", 0, 1), StatusCode::kResourceExhausted, {"--max-shm-bytes"}));
  ASSERT_TRUE(is_ok(registry_->unregister_region("", "a")));
  EXPECT_EQ(totals_.mapped_bytes, kMaxMapped / 2);
  EXPECT_EQ(registry_->totals().mapped_bytes, kMaxMapped / 2);
  EXPECT_TRUE(is_ok(reg("d", "plsh-huge", 0, kMaxMapped / 2)));
  // A refused registration leaves nothing counted.
  EXPECT_EQ(registry_->totals().regions, 3);
  EXPECT_EQ(registry_->totals().mapped_bytes, kMaxMapped);
}

// Only the registered range is mapped (from its first page), not the file.
TEST_F(ShmRegistryTest, OnlyTheRegisteredRangeIsMapped) {
  if (make_sparse("plsh-huge", int64_t{8} << 40).empty()) GTEST_SKIP() << dir_ << " cannot hold an 8 TiB sparse file";
  const int64_t before = vm_size();
  ASSERT_TRUE(is_ok(reg("r", "plsh-huge", (int64_t{8} << 40) - 3 * 4096 - 100, 2 * 4096)));
  EXPECT_LE(vm_size() - before, 3 * 4096);
  EXPECT_EQ(registry_->totals().mapped_bytes, 3 * 4096 - 100);  // from the start of the first page
  StatusOr<SharedMemoryRegistry::Use> u = registry_->use("", "q_shm", "r", 0, 2 * 4096, 2 * 4096, 4, next_holder());
  ASSERT_TRUE(is_ok(u.status()));
  EXPECT_EQ(u->data()[0], 0);  // a hole reads as zeros
}

}  // namespace
}  // namespace plsh::server
