// Starts the real plsh-server binary on loopback with free ports (port 0)
// and reads the bound addresses from its "serving" log line; scrapes its
// /metrics over plain HTTP.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace plsh::testing {

// Whether this build runs under AddressSanitizer: the tests and the
// plsh-server they start are built alike (GCC says so by a macro, clang by
// __has_feature).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

class ServerProcess {
 public:
  // Extra flags after --listen/--metrics-listen (which pick free ports);
  // env: extra "NAME=value" entries.
  explicit ServerProcess(std::vector<std::string> flags = {}, std::vector<std::string> env = {});
  ~ServerProcess();

  bool started() const { return !grpc_address_.empty(); }
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  pid_t pid() const { return pid_; }

  // Sends SIGTERM and waits; returns the exit status (or 128 + signal).
  int terminate(double timeout_seconds = 30);
  // Whether the process is still running.
  bool running();
  // Everything written to stderr so far.
  std::string log() const;

 private:
  void read_log(int fd);
  pid_t pid_ = -1;
  int exit_status_ = -1;
  std::string grpc_address_, metrics_address_;
  std::thread reader_;
  mutable std::mutex mutex_;
  std::string log_;
};

// GET http://addr/metrics; "" on failure.
std::string http_get(const std::string& addr, const std::string& path);

// Prometheus text -> {"name{labels}": value} for every sample line.
std::map<std::string, double> parse_metrics(const std::string& text);
// Sum of every sample of `name` whose label text contains each of `labels`
// (e.g. {"code=\"OK\"", "mode=\"lsh\""}).
double metric_sum(const std::map<std::string, double>& m, const std::string& name,
                  const std::vector<std::string>& labels = {});

}  // namespace plsh::testing
