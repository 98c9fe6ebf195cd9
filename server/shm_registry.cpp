#include "server/shm_registry.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace plsh::server {

namespace {

// ------------------------------------------------------------ SIGBUS guard
//
// The mappings of registered regions, where the signal handler can read
// them without locks: a fixed table of address ranges (a slot per region,
// kMaxRegions of them), each set before its mapping is used and cleared
// before it is unmapped.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<int> faulted{0};
};
GuardSlot g_guard[SharedMemoryRegistry::kMaxRegions];
std::atomic<bool> g_guard_installed{false};
struct sigaction g_previous_sigbus;
long g_page_size = 4096;

extern "C" void on_sigbus(int signal_number, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : g_guard) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= slot.end.load(std::memory_order_acquire)) continue;
    // A page of a registered region whose file no longer backs it: put a
    // private zero page there and let the access run again; the request
    // fails afterwards (Use::check_intact). mmap is a plain system call.
    void* page = reinterpret_cast<void*>(address & ~static_cast<uintptr_t>(g_page_size - 1));
    if (mmap(page, static_cast<size_t>(g_page_size), PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
             -1, 0) != MAP_FAILED) {
      slot.faulted.store(1, std::memory_order_release);
      return;
    }
    break;
  }
  // Not ours (or unfixable): what would have happened without us.
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    if (g_previous_sigbus.sa_sigaction != nullptr) {
      g_previous_sigbus.sa_sigaction(signal_number, info, context);
      return;
    }
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    g_previous_sigbus.sa_handler(signal_number);
    return;
  }
  signal(SIGBUS, SIG_DFL);  // the fault repeats on return and ends the process as it would have
}

bool install_guard() {
  if (g_guard_installed.exchange(true)) return true;
  g_page_size = sysconf(_SC_PAGESIZE);
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  return sigaction(SIGBUS, &action, &g_previous_sigbus) == 0;
}

// ------------------------------------------------------------ names

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
}

bool valid_chars(const std::string& s) {
  for (char c : s)
    if (!name_char(c)) return false;
  return true;
}

Status check_region_name(const std::string& name) {
  if (name.empty() || name.size() > 64 || !valid_chars(name))
    return invalid_argument("name = '" + echo_value(name) + "', expected 1-64 characters of [A-Za-z0-9_.-]");
  return Status::Ok();
}

// The file name a key stands for: at most one leading '/' (shm_open's
// spelling), then a plain name. The key itself is never echoed: it names a
// file of the host.
StatusOr<std::string> file_name_of(const std::string& key) {
  const std::string name = !key.empty() && key[0] == '/' ? key.substr(1) : key;
  if (name.empty() || name.size() > 255 || name[0] == '.' || !valid_chars(name))
    return invalid_argument(
        "key: expected a file name of the server's shared-memory directory: 1-255 characters of [A-Za-z0-9_.-], not "
        "starting with '.', optionally after one '/' (the key is not repeated here)");
  return name;
}

bool add_overflows(int64_t a, int64_t b, int64_t* sum) { return __builtin_add_overflow(a, b, sum); }

}  // namespace

// ------------------------------------------------------------ Region

struct SharedMemoryRegistry::Region {
  std::string owner, name, key;
  int64_t offset = 0, byte_size = 0;  // in the file
  int fd = -1;                        // kept open: fstat at each use
  dev_t device = 0;
  ino_t inode = 0;
  uint8_t* map_base = nullptr;  // page-aligned mapping of [offset rounded down, offset + byte_size)
  size_t map_bytes = 0;
  uint8_t* data = nullptr;              // the region's first byte
  int slot = -1;                        // its g_guard entry
  std::map<uint64_t, int64_t> holders;  // under the registry's mutex: request -> its uses of this region

  ~Region() {
    if (slot >= 0) {  // begin last: a slot is free (begin == 0) only once all of it is cleared
      g_guard[slot].end.store(0, std::memory_order_release);
      g_guard[slot].faulted.store(0, std::memory_order_release);
      g_guard[slot].begin.store(0, std::memory_order_release);
    }
    if (map_base != nullptr) munmap(map_base, map_bytes);
    if (fd >= 0) close(fd);
  }
  bool faulted() const { return slot >= 0 && g_guard[slot].faulted.load(std::memory_order_acquire) != 0; }
};

StatusOr<std::unique_ptr<SharedMemoryRegistry>> SharedMemoryRegistry::open(
    const std::string& dir, int64_t max_mapped_bytes, std::function<void(const Totals&)> on_change) {
  if (dir.empty() || dir == "off")
    return std::unique_ptr<SharedMemoryRegistry>(new SharedMemoryRegistry(-1, 0, std::move(on_change)));
  const int fd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return invalid_argument("--shm-dir = '" + echo_value(dir) +
                            "': cannot open the directory: " + std::strerror(errno));
  if (!install_guard()) {
    close(fd);
    return internal_error("--shm-dir: cannot install the SIGBUS handler: " + std::string(std::strerror(errno)));
  }
  auto registry =
      std::unique_ptr<SharedMemoryRegistry>(new SharedMemoryRegistry(fd, max_mapped_bytes, std::move(on_change)));
  {
    std::lock_guard<std::mutex> lock(registry->mu_);
    registry->publish_locked();  // the gauges start at 0, not absent
  }
  return registry;
}

SharedMemoryRegistry::Totals SharedMemoryRegistry::totals_locked() const {
  return Totals{static_cast<int64_t>(regions_.size()), mapped_bytes_};
}

SharedMemoryRegistry::Totals SharedMemoryRegistry::totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_locked();
}

void SharedMemoryRegistry::publish_locked() const {
  if (on_change_) on_change_(totals_locked());
}

SharedMemoryRegistry::~SharedMemoryRegistry() {
  regions_.clear();
  if (dir_fd_ >= 0) close(dir_fd_);
}

namespace {

Status unimplemented_off() {
  return unimplemented("shared memory is off on this server (it runs without --shm-dir): send the tensors in chunks");
}

// errno of an open in the shared-memory directory -> a status that names no path.
Status open_error(int error) {
  switch (error) {
    case ENOENT:
      return not_found("key: no such file in the server's shared-memory directory");
    case ELOOP:
      return invalid_argument("key: a symbolic link, expected a regular file (links are not followed)");
    case EACCES:
    case EPERM:
      return permission_denied("key: the server may not open the file for reading and writing");
    case EMFILE:
    case ENFILE:
      return resource_exhausted("the server has no file descriptors left for another region");
    default:
      return invalid_argument("key: the file cannot be opened (" + std::string(std::strerror(error)) + ")");
  }
}

// The file `name` of the directory, opened for reading and writing only
// once it is known to be a regular file of the server's user, not writable
// by others, with at least `end` bytes: opened without following links and
// without opening what it is (O_PATH), checked, then reopened as the same
// inode, so that neither a symbolic link nor a device or FIFO swapped in is
// ever opened (no open side effects, no races).
StatusOr<int> open_checked(int dir_fd, const std::string& name, int64_t end) {
  const int path_fd = openat(dir_fd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (path_fd < 0) return open_error(errno);
  struct stat st {};
  if (fstat(path_fd, &st) != 0) {
    const int error = errno;
    close(path_fd);
    return open_error(error);
  }
  Status checked = Status::Ok();
  if (S_ISLNK(st.st_mode))
    checked = invalid_argument("key: a symbolic link, expected a regular file (links are not followed)");
  else if (!S_ISREG(st.st_mode))
    checked =
        invalid_argument("key: not a regular file (a directory, FIFO, socket or device), expected a regular file");
  else if (st.st_uid != geteuid())
    checked = permission_denied("key: the file belongs to another user than the server's, expected the server's own");
  else if (st.st_mode & S_IWOTH)
    checked = permission_denied("key: the file is writable by every user, expected no write permission for others");
  else if (st.st_size < end)
    checked = invalid_argument("offset + byte_size = " + std::to_string(end) + ", expected <= the file's " +
                               std::to_string(st.st_size) + " bytes");
  if (!checked.ok()) {
    close(path_fd);
    return checked;
  }
  const std::string reopen = "/proc/self/fd/" + std::to_string(path_fd);
  int fd = ::open(reopen.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY);
  if (fd < 0 && errno == ENOENT)  // no /proc: the file is known to be regular; open it by name, not following links
    fd = openat(dir_fd, name.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  const int open_errno = errno;
  close(path_fd);
  if (fd < 0) return open_error(open_errno);
  struct stat opened {};
  if (fstat(fd, &opened) != 0 || opened.st_dev != st.st_dev || opened.st_ino != st.st_ino || !S_ISREG(opened.st_mode)) {
    close(fd);
    return invalid_argument("key: the file changed while it was being opened, expected it to stay put");
  }
  return fd;
}

}  // namespace

Status SharedMemoryRegistry::register_region(const std::string& owner, const std::string& name, const std::string& key,
                                             int64_t offset, int64_t byte_size) {
  if (!enabled()) return unimplemented_off();
  RETURN_IF_ERROR(check_region_name(name));
  ASSIGN_OR_RETURN(const std::string file, file_name_of(key));
  if (offset < 0) return invalid_argument("offset = " + std::to_string(offset) + ", expected >= 0");
  if (byte_size < 1) return invalid_argument("byte_size = " + std::to_string(byte_size) + ", expected >= 1");
  int64_t end = 0;
  if (add_overflows(offset, byte_size, &end))
    return invalid_argument("offset + byte_size = " + std::to_string(offset) + " + " + std::to_string(byte_size) +
                            " overflows int64, expected a range inside the file");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count({owner, name}) != 0)
      return already_exists("region '" + name + "' is registered already; unregister it first");
    if (static_cast<int64_t>(regions_.size()) >= kMaxRegions)
      return resource_exhausted("regions = " + std::to_string(regions_.size()) + ", expected < " +
                                std::to_string(kMaxRegions) + " (the server's limit): unregister some first");
  }

  auto region = std::make_shared<Region>();
  region->owner = owner;
  region->name = name;
  region->key = key;
  region->offset = offset;
  region->byte_size = byte_size;

  ASSIGN_OR_RETURN(region->fd, open_checked(dir_fd_, file, end));
  struct stat opened {};
  fstat(region->fd, &opened);
  region->device = opened.st_dev;
  region->inode = opened.st_ino;

  // Only the registered range is mapped (from its first page), and only
  // once the bound has room for it: counted before the mapping exists, so
  // that concurrent registrations cannot pass the bound together.
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset / page * page;
  const int64_t map_bytes = end - map_offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (map_bytes > max_mapped_bytes_ - mapped_bytes_)
      return resource_exhausted("byte_size = " + std::to_string(byte_size) + ": shared memory mapped would be " +
                                std::to_string(mapped_bytes_) + " + " + std::to_string(map_bytes) +
                                " bytes, expected <= " + std::to_string(max_mapped_bytes_) +
                                " (the server's --max-shm-bytes, all regions together); unregister regions first");
    mapped_bytes_ += map_bytes;
  }
  auto unreserve = [this, map_bytes] {
    std::lock_guard<std::mutex> lock(mu_);
    mapped_bytes_ -= map_bytes;
  };
  region->map_bytes = static_cast<size_t>(map_bytes);
  void* base = mmap(nullptr, region->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, region->fd, map_offset);
  if (base == MAP_FAILED) {
    const int map_errno = errno;
    unreserve();
    return resource_exhausted("cannot map the region (" + std::string(std::strerror(map_errno)) + ")");
  }
  region->map_base = static_cast<uint8_t*>(base);
  region->data = region->map_base + (offset - map_offset);

  std::unique_lock<std::mutex> lock(mu_);
  Status room = Status::Ok();
  if (regions_.count({owner, name}) != 0)  // registered meanwhile by a concurrent call
    room = already_exists("region '" + name + "' is registered already; unregister it first");
  else if (static_cast<int64_t>(regions_.size()) >= kMaxRegions)
    room = resource_exhausted("regions = " + std::to_string(regions_.size()) + ", expected < " +
                              std::to_string(kMaxRegions) + " (the server's limit): unregister some first");
  if (!room.ok()) {
    mapped_bytes_ -= map_bytes;
    lock.unlock();
    region.reset();  // unmapped outside the lock
    return room;
  }
  for (int i = 0; i < kMaxRegions; ++i) {
    if (g_guard[i].begin.load() != 0) continue;
    g_guard[i].faulted.store(0);
    g_guard[i].end.store(reinterpret_cast<uintptr_t>(region->map_base) + region->map_bytes, std::memory_order_release);
    g_guard[i].begin.store(reinterpret_cast<uintptr_t>(region->map_base), std::memory_order_release);
    region->slot = i;
    break;
  }
  regions_.emplace(std::make_pair(owner, name), std::move(region));
  publish_locked();
  return Status::Ok();
}

Status SharedMemoryRegistry::unregister_region(const std::string& owner, const std::string& name) {
  if (!enabled()) return unimplemented_off();
  std::shared_ptr<Region> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({owner, name});
    if (it == regions_.end()) return not_found("region '" + echo_value(name) + "' is not registered");
    if (!it->second->holders.empty())
      return failed_precondition("region '" + name + "' is in use by " + std::to_string(it->second->holders.size()) +
                                 " request(s); unregister it once they have finished");
    gone = std::move(it->second);
    regions_.erase(it);
    mapped_bytes_ -= static_cast<int64_t>(gone->map_bytes);
    publish_locked();
  }
  return Status::Ok();  // unmapped as `gone` goes (no use holds it: uses == 0)
}

StatusOr<std::vector<SharedMemoryRegistry::RegionInfo>> SharedMemoryRegistry::list(const std::string& owner) const {
  if (!enabled()) return unimplemented_off();
  std::vector<RegionInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, r] : regions_)
    if (id.first == owner)
      out.push_back(RegionInfo{r->name, r->key, r->offset, r->byte_size, static_cast<int64_t>(r->holders.size())});
  return out;
}

uint64_t SharedMemoryRegistry::new_holder() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1) + 1;
}

StatusOr<SharedMemoryRegistry::Use> SharedMemoryRegistry::use(const std::string& owner, const char* field,
                                                              const std::string& name, int64_t offset,
                                                              int64_t byte_size, int64_t expected_bytes,
                                                              int64_t alignment, uint64_t holder) {
  const std::string f = field;
  if (!enabled()) return unimplemented_off();
  if (byte_size != expected_bytes)
    return invalid_argument(f + ".byte_size = " + std::to_string(byte_size) + ", expected " +
                            std::to_string(expected_bytes) + " (the tensor's bytes)");
  if (offset < 0) return invalid_argument(f + ".offset = " + std::to_string(offset) + ", expected >= 0");
  int64_t end = 0;
  if (add_overflows(offset, byte_size, &end))
    return invalid_argument(f + ".offset + byte_size = " + std::to_string(offset) + " + " + std::to_string(byte_size) +
                            " overflows int64, expected a range inside the region");
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({owner, name});
    if (it == regions_.end())
      return not_found(f + ".region = '" + echo_value(name) + "' is not registered (RegisterSharedMemory)");
    region = it->second;
    if (end > region->byte_size)
      return invalid_argument(f + ".offset + byte_size = " + std::to_string(end) +
                              ", expected <= " + std::to_string(region->byte_size) + " (region '" + name + "')");
    if ((region->offset + offset) % alignment != 0)
      return invalid_argument(f + ".offset = " + std::to_string(offset) + ": the tensor starts at byte " +
                              std::to_string(region->offset + offset) +
                              " of the region's file, expected a multiple of " + std::to_string(alignment) +
                              " (its element size)");
    if (region->faulted())
      return failed_precondition(f + ": region '" + name +
                                 "' lost its memory (its file shrank while in use); unregister and register it again");
    struct stat st {};
    if (fstat(region->fd, &st) != 0 || st.st_size < region->offset + region->byte_size)
      return failed_precondition(f + ": the file of region '" + name +
                                 "' has shrunk below the registered range; unregister and register it again");
    ++region->holders[holder];
  }
  Use use;
  use.registry_ = this;
  use.region_ = std::move(region);
  use.holder_ = holder;
  use.data_ = use.region_->data + offset;
  use.device_ = use.region_->device;
  use.inode_ = use.region_->inode;
  use.file_begin_ = use.region_->offset + offset;
  use.file_end_ = use.region_->offset + end;
  return use;
}

void SharedMemoryRegistry::release(Region* region, uint64_t holder) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = region->holders.find(holder);
  if (it != region->holders.end() && --it->second == 0) region->holders.erase(it);
}

SharedMemoryRegistry::Use& SharedMemoryRegistry::Use::operator=(Use&& other) noexcept {
  if (this != &other) {
    release();
    registry_ = std::exchange(other.registry_, nullptr);
    region_ = std::move(other.region_);
    holder_ = std::exchange(other.holder_, 0);
    data_ = std::exchange(other.data_, nullptr);
    device_ = other.device_;
    inode_ = other.inode_;
    file_begin_ = other.file_begin_;
    file_end_ = other.file_end_;
  }
  return *this;
}

void SharedMemoryRegistry::Use::release() {
  if (registry_ != nullptr && region_) registry_->release(region_.get(), holder_);
  registry_ = nullptr;
  region_.reset();
  holder_ = 0;
  data_ = nullptr;
}

bool SharedMemoryRegistry::Use::overlaps(const Use& other) const {
  return region_ && other.region_ && device_ == other.device_ && inode_ == other.inode_ &&
         file_begin_ < other.file_end_ && other.file_begin_ < file_end_;
}

Status SharedMemoryRegistry::Use::check_intact(const char* field) const {
  if (region_ && region_->faulted())
    return failed_precondition(std::string(field) + ": the file of region '" + region_->name +
                               "' shrank while the request used it; unregister and register it again");
  return Status::Ok();
}

}  // namespace plsh::server
