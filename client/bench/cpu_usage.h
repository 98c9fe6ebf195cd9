// How much CPU the bench client itself used during a load level, and
// whether that makes the client (not the server) the bottleneck.
//
// The rule, printed with every level that trips it (README.md, "Client
// bottleneck"):
//   1. thread:  one client worker thread was on a CPU for more than 90% of
//               the level's wall time: that thread, not the server, paced
//               its requests;
//   2. process: the client process used more than 90% of the cores it may
//               run on (sched_getaffinity);
//   3. shared:  the whole machine was more than 90% busy (/proc/stat) and
//               the client's share of that busy time was over 25%: a
//               server on the same machine was competing with its own
//               load generator.
#pragma once

#include <cstdint>
#include <string>

namespace plsh::bench {

struct CpuSnapshot {
  double wall = 0;           // steady clock, seconds
  double process_cpu = 0;    // user + system of this process, seconds (getrusage)
  double machine_busy = 0;   // /proc/stat jiffies not idle or iowait, all CPUs
  double machine_total = 0;  // /proc/stat jiffies, all CPUs; 0 when unreadable
};

CpuSnapshot cpu_snapshot();
// CPU seconds of the calling thread (CLOCK_THREAD_CPUTIME_ID).
double thread_cpu_seconds();
// CPUs this process may run on.
int usable_cores();

struct CpuUsage {
  double wall_seconds = 0;
  int cores = 0;               // usable_cores()
  double process_cores = 0;    // client CPU seconds / wall seconds
  double max_thread_core = 0;  // busiest worker thread's CPU seconds / wall seconds
  double machine_busy = -1;    // fraction of all CPUs busy; -1 when /proc/stat is unreadable
  bool client_bound = false;
  std::string reason;  // which rule tripped, with the figures; empty when none
};

// Applies the rule above to the interval [begin, end].
CpuUsage cpu_usage(const CpuSnapshot& begin, const CpuSnapshot& end, double max_thread_cpu_seconds);

}  // namespace plsh::bench
