// When an open-loop (--rate) run sends each request: constant spacing or a
// Poisson process, seeded, as offsets in seconds from the level's start.
// Open loop means the schedule does not wait for responses (wrk2's
// habit): a slow server makes requests queue in the client, and their
// latency is counted from the scheduled time, not from when a free slot
// let them go (no coordinated omission).
#pragma once

#include <cstdint>
#include <mutex>
#include <random>
#include <string>

#include "plsh/status.h"

namespace plsh::bench {

enum class Arrivals { kConstant, kPoisson };

const char* arrivals_name(Arrivals a);  // "constant", "poisson"
StatusOr<Arrivals> parse_arrivals(const std::string& s);

class ArrivalSchedule {
 public:
  // rate in requests per second, > 0.
  ArrivalSchedule(Arrivals kind, double rate, uint64_t seed);

  struct Arrival {
    int64_t index;  // 0, 1, 2, ... in schedule order
    double at;      // seconds from the start
  };
  // The next arrival; thread-safe, each arrival handed out once.
  Arrival next();

 private:
  Arrivals kind_;
  double rate_;
  std::mutex mutex_;
  std::mt19937_64 rng_;
  std::exponential_distribution<double> gap_;
  int64_t next_index_ = 0;
  double next_at_ = 0;
};

}  // namespace plsh::bench
