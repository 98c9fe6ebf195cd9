#include "bench/cpu_usage.h"

#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace plsh::bench {

namespace {

constexpr double kBusy = 0.9;          // "saturated": rules 1-3
constexpr double kClientShare = 0.25;  // rule 3

double timeval_seconds(const timeval& t) {
  return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
}

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f%%", 100 * fraction);
  return buf;
}

}  // namespace

CpuSnapshot cpu_snapshot() {
  CpuSnapshot s;
  s.wall = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0)
    s.process_cpu = timeval_seconds(usage.ru_utime) + timeval_seconds(usage.ru_stime);
  // First line: "cpu  user nice system idle iowait irq softirq steal guest guest_nice".
  std::ifstream stat("/proc/stat");
  std::string line;
  if (stat && std::getline(stat, line) && line.rfind("cpu ", 0) == 0) {
    std::istringstream fields(line.substr(4));
    double v[10] = {};
    int n = 0;
    while (n < 10 && fields >> v[n]) ++n;
    if (n >= 5) {
      // guest and guest_nice are already counted in user and nice.
      const int counted = n > 8 ? 8 : n;
      for (int i = 0; i < counted; ++i) s.machine_total += v[i];
      s.machine_busy = s.machine_total - v[3] - v[4];
    }
  }
  return s;
}

double thread_cpu_seconds() {
  timespec t{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) return 0;
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

CpuUsage cpu_usage(const CpuSnapshot& begin, const CpuSnapshot& end, double max_thread_cpu_seconds) {
  CpuUsage u;
  u.wall_seconds = end.wall - begin.wall;
  u.cores = usable_cores();
  if (u.wall_seconds <= 0) return u;
  u.process_cores = (end.process_cpu - begin.process_cpu) / u.wall_seconds;
  u.max_thread_core = max_thread_cpu_seconds / u.wall_seconds;
  const double total = end.machine_total - begin.machine_total;
  double client_share = 0;
  if (begin.machine_total > 0 && total > 0) {
    const double busy = end.machine_busy - begin.machine_busy;
    u.machine_busy = busy / total;
    // Jiffies over all CPUs -> the machine's busy core-seconds, to compare
    // with the client's CPU seconds.
    const int machine_cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
    const double busy_core_seconds = u.machine_busy * u.wall_seconds * (machine_cores > 0 ? machine_cores : u.cores);
    if (busy_core_seconds > 0) client_share = (end.process_cpu - begin.process_cpu) / busy_core_seconds;
  }
  if (u.max_thread_core > kBusy) {
    u.client_bound = true;
    u.reason = "a client worker thread was busy " + percent(u.max_thread_core) + " of the time";
  } else if (u.process_cores > kBusy * u.cores) {
    u.client_bound = true;
    u.reason =
        "the client used " + percent(u.process_cores / u.cores) + " of its " + std::to_string(u.cores) + " cores";
  } else if (u.machine_busy > kBusy && client_share > kClientShare) {
    u.client_bound = true;
    u.reason = "the machine was " + percent(u.machine_busy) + " busy and the client took " + percent(client_share) +
               " of that (server and client share the CPUs)";
  }
  return u;
}

}  // namespace plsh::bench
