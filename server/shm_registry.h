// Same-host shared memory (SPEC section 9), after Triton's system
// shared-memory extension and what its CVEs taught (CVE-2025-23319, -23320,
// -23334: an error message that named an internal region, a register call
// that would map any shm key the process could open, and unchecked
// offsets):
//
//   - Off unless the server runs with --shm-dir: every call is then
//     UNIMPLEMENTED.
//   - A key is a plain file name ([A-Za-z0-9_.-]{1,255}, not starting with
//     '.'; one leading '/' as shm_open writes it is allowed) inside that one
//     directory: no path, no "..", nothing outside it. The file is opened
//     relative to the directory with O_PATH | O_NOFOLLOW, checked with
//     fstat (a regular file, owned by the server's user, not writable by
//     others, large enough), and only then opened for reading and writing
//     through /proc/self/fd, so that neither a symbolic link nor a device or
//     FIFO swapped in is ever opened (no open side effects, no races).
//   - offset + byte_size are checked for overflow and against the file at
//     registration, and every tensor's (offset, byte_size) against its
//     region at each request; the file is fstat'ed again at each request.
//   - A region that a request holds cannot be unregistered
//     (FAILED_PRECONDITION): each request holds a use from its header until
//     it closes.
//   - Error messages name fields and region names, never a key or a path.
//   - A file that shrinks while mapped would make any access past its new
//     end raise SIGBUS and kill the server. A SIGBUS handler catches
//     accesses to registered mappings, maps a zero page in the faulting
//     page's place and marks the region broken: the request that touched it
//     fails with FAILED_PRECONDITION, the region refuses further use until
//     registered again, and the server keeps serving.
//
// With a token file, regions belong to the client (token file name) that
// registered them; without one, to everyone ("").
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "plsh/status.h"

namespace plsh::server {

class SharedMemoryRegistry {
 public:
  static constexpr int64_t kMaxRegions = 256;

  // dir: the directory keys are file names in; "" or "off": disabled.
  // Fails (INVALID_ARGUMENT naming --shm-dir) when the directory cannot be
  // opened. Installs the SIGBUS handler when enabled.
  static StatusOr<std::unique_ptr<SharedMemoryRegistry>> open(const std::string& dir);
  ~SharedMemoryRegistry();

  bool enabled() const { return dir_fd_ >= 0; }

  struct RegionInfo {
    std::string name, key;
    int64_t offset = 0, byte_size = 0;
    int64_t requests = 0;  // uses held now
  };

  Status register_region(const std::string& owner, const std::string& name, const std::string& key, int64_t offset,
                         int64_t byte_size);
  Status unregister_region(const std::string& owner, const std::string& name);
  StatusOr<std::vector<RegionInfo>> list(const std::string& owner) const;

  struct Region;
  // A request's hold on part of a region: the region cannot be unregistered
  // while one exists. Movable; releases on destruction.
  class Use {
   public:
    Use() = default;
    Use(Use&& other) noexcept { *this = std::move(other); }
    Use& operator=(Use&& other) noexcept;
    ~Use() { release(); }

    uint8_t* data() const { return data_; }
    // Same file and overlapping bytes (two regions may map one file).
    bool overlaps(const Use& other) const;
    // OK unless an access to the region faulted (its file shrank while in
    // use): then FAILED_PRECONDITION naming the field.
    Status check_intact(const char* field) const;

   private:
    friend class SharedMemoryRegistry;
    void release();
    SharedMemoryRegistry* registry_ = nullptr;
    std::shared_ptr<Region> region_;
    uint8_t* data_ = nullptr;
    dev_t device_ = 0;
    ino_t inode_ = 0;
    int64_t file_begin_ = 0, file_end_ = 0;
  };

  // The bytes [offset, offset + byte_size) of the caller's region `name`
  // for the tensor `field` ("q_shm"), which needs exactly `expected_bytes`
  // and a file position that is a multiple of `alignment`. NOT_FOUND for an
  // unknown region, INVALID_ARGUMENT for sizes, FAILED_PRECONDITION when its
  // file has shrunk or an earlier access faulted.
  StatusOr<Use> use(const std::string& owner, const char* field, const std::string& name, int64_t offset,
                    int64_t byte_size, int64_t expected_bytes, int64_t alignment);

 private:
  explicit SharedMemoryRegistry(int dir_fd) : dir_fd_(dir_fd) {}
  void release(Region* region);

  const int dir_fd_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Region>> regions_;  // (owner, name)
};

}  // namespace plsh::server
