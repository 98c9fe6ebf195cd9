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
//   - Only the registered range is mapped (from its page down), never the
//     whole file, and the bytes mapped by all regions together are bounded
//     (--max-shm-bytes, by default the host's memory): a registration that
//     would pass the bound is RESOURCE_EXHAUSTED before anything is mapped,
//     so that sparse files of any size cannot exhaust the address space
//     (a process out of it hangs in OpenBLAS's buffer allocation, which
//     retries forever).
//   - A region that a request holds cannot be unregistered
//     (FAILED_PRECONDITION): each request holds a use from its header until
//     it closes. A request counts once per region, however many of its
//     tensors lie there.
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
#include <functional>
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

  // Regions and mapped bytes now, all clients together (for the gauges).
  struct Totals {
    int64_t regions = 0;
    int64_t mapped_bytes = 0;
  };

  // dir: the directory keys are file names in; "" or "off": disabled.
  // max_mapped_bytes: the most bytes all regions may map together.
  // on_change (may be empty): called with the new totals, under the
  // registry's lock, whenever a region comes or goes.
  // Fails (INVALID_ARGUMENT naming --shm-dir) when the directory cannot be
  // opened. Installs the SIGBUS handler when enabled.
  static StatusOr<std::unique_ptr<SharedMemoryRegistry>> open(const std::string& dir, int64_t max_mapped_bytes,
                                                              std::function<void(const Totals&)> on_change = {});
  ~SharedMemoryRegistry();

  bool enabled() const { return dir_fd_ >= 0; }
  int64_t max_mapped_bytes() const { return max_mapped_bytes_; }
  Totals totals() const;

  struct RegionInfo {
    std::string name, key;
    int64_t offset = 0, byte_size = 0;
    int64_t requests = 0;  // requests holding it now (each once, however many of its tensors lie there)
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
    uint64_t holder_ = 0;
    uint8_t* data_ = nullptr;
    dev_t device_ = 0;
    ino_t inode_ = 0;
    int64_t file_begin_ = 0, file_end_ = 0;
  };

  // The bytes [offset, offset + byte_size) of the caller's region `name`
  // for the tensor `field` ("q_shm"), which needs exactly `expected_bytes`
  // and a file position that is a multiple of `alignment`, held by
  // `holder` (the request, by new_holder(): its uses of one region count as
  // one). NOT_FOUND
  // for an unknown region, INVALID_ARGUMENT for sizes, FAILED_PRECONDITION
  // when its file has shrunk or an earlier access faulted.
  static uint64_t new_holder();
  StatusOr<Use> use(const std::string& owner, const char* field, const std::string& name, int64_t offset,
                    int64_t byte_size, int64_t expected_bytes, int64_t alignment, uint64_t holder);

 private:
  SharedMemoryRegistry(int dir_fd, int64_t max_mapped_bytes, std::function<void(const Totals&)> on_change)
      : dir_fd_(dir_fd), max_mapped_bytes_(max_mapped_bytes), on_change_(std::move(on_change)) {}
  void release(Region* region, uint64_t holder);
  Totals totals_locked() const;
  void publish_locked() const;

  const int dir_fd_;
  const int64_t max_mapped_bytes_;
  const std::function<void(const Totals&)> on_change_;
  int64_t mapped_bytes_ = 0;  // under mu_: mapped, or being mapped, by registrations
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Region>> regions_;  // (owner, name)
};

}  // namespace plsh::server
