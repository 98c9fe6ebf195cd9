// The memory this host gives the server, for the defaults that must follow
// it (--memory-budget, --max-shm-bytes): the smaller of the machine's RAM
// and the memory limit of the server's cgroup (v2 memory.max of its cgroup
// and every parent, or v1 memory.limit_in_bytes), so that a container's
// limit counts, not the node's RAM.
#pragma once

#include <cstdint>
#include <string>

namespace plsh::server {

struct HostMemory {
  int64_t physical_bytes = 0;  // RAM (sysinfo)
  int64_t cgroup_bytes = 0;    // the tightest cgroup limit; 0: none found
  int64_t usable_bytes() const;
  std::string source() const;  // "RAM" or "cgroup limit"
};

HostMemory host_memory();

// Gives the heap's free pages back to the system (glibc's malloc_trim: the
// top of every arena and the whole free pages inside them). main.cpp keeps
// freed heap mapped between requests (M_TRIM_THRESHOLD, for the ingest's
// speed under load); the admission calls this when the last open call of a
// large one closes, so that an idle server holds what --pool-keep-bytes
// says and not the gRPC buffers of its last request.
void release_free_heap();

// The cgroup limit under `cgroup_root` for the process whose /proc/self/cgroup
// text is `self_cgroup` (exposed for tests); 0 when there is none.
int64_t cgroup_limit_bytes(const std::string& cgroup_root, const std::string& self_cgroup);

}  // namespace plsh::server
