#include "server/host_memory.h"

#include <malloc.h>

#include <sys/sysinfo.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace plsh::server {

namespace {

// A limit file's value: a byte count, or 0 for "max" / missing / unreadable.
// v1 writes a huge number (a page-rounded INT64_MAX) for "no limit".
int64_t read_limit(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    const long long value = std::stoll(text);
    return value > 0 && value < (int64_t{1} << 60) ? value : 0;
  } catch (...) {
    return 0;
  }
}

int64_t tighter(int64_t a, int64_t b) {
  if (a == 0) return b;
  if (b == 0) return a;
  return std::min(a, b);
}

}  // namespace

int64_t cgroup_limit_bytes(const std::string& root, const std::string& self_cgroup) {
  int64_t limit = 0;
  std::istringstream lines(self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    // "hierarchy-id:controllers:path": v2 is "0::/path", v1 lists "memory".
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    const bool v2 = line.compare(0, first, "0") == 0 && controllers.empty();
    bool memory_v1 = false;
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) memory_v1 = memory_v1 || name == "memory";
    if (!v2 && !memory_v1) continue;
    const std::string base = v2 ? root : root + "/memory";
    const char* file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    // The cgroup and each parent up to the root (a namespace's root is "/").
    while (true) {
      limit = tighter(limit, read_limit(base + (path == "/" ? "" : path) + file));
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return limit;
}

int64_t HostMemory::usable_bytes() const { return tighter(physical_bytes, cgroup_bytes); }

std::string HostMemory::source() const {
  return cgroup_bytes != 0 && cgroup_bytes < physical_bytes ? "cgroup limit" : "RAM";
}

HostMemory host_memory() {
  HostMemory m;
  struct sysinfo info {};
  if (sysinfo(&info) == 0) m.physical_bytes = static_cast<int64_t>(info.totalram) * static_cast<int64_t>(info.mem_unit);
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  m.cgroup_bytes = cgroup_limit_bytes("/sys/fs/cgroup", text.str());
  return m;
}

void release_free_heap() { malloc_trim(0); }

}  // namespace plsh::server
