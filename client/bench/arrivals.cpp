#include "bench/arrivals.h"

namespace plsh::bench {

const char* arrivals_name(Arrivals a) { return a == Arrivals::kPoisson ? "poisson" : "constant"; }

StatusOr<Arrivals> parse_arrivals(const std::string& s) {
  if (s == "constant") return Arrivals::kConstant;
  if (s == "poisson") return Arrivals::kPoisson;
  return invalid_argument("arrivals = '" + s + "', expected constant or poisson");
}

ArrivalSchedule::ArrivalSchedule(Arrivals kind, double rate, uint64_t seed)
    : kind_(kind), rate_(rate), rng_(seed), gap_(rate) {
  // A Poisson process's first arrival is one exponential gap after the
  // start, like every other; constant spacing starts at 0.
  if (kind_ == Arrivals::kPoisson) next_at_ = gap_(rng_);
}

ArrivalSchedule::Arrival ArrivalSchedule::next() {
  std::lock_guard<std::mutex> lock(mutex_);
  Arrival a{next_index_, next_at_};
  ++next_index_;
  // Constant: index / rate rather than a running sum, so that rounding
  // does not drift over millions of arrivals.
  next_at_ = kind_ == Arrivals::kConstant ? static_cast<double>(next_index_) / rate_ : next_at_ + gap_(rng_);
  return a;
}

}  // namespace plsh::bench
