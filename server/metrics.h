// Prometheus metrics (names fixed by the service contract, shared with the
// deploy rules and dashboards), kept in a prometheus-cpp registry and served
// on their own port at /metrics by MetricsHttpServer (metrics_http.h).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <mutex>
#include <string>

#include "plsh/status.h"
#include "server/metrics_http.h"

namespace plsh::server {

class Metrics {
 public:
  Metrics();

  // Serves /metrics on addr ("host:port"; port 0 picks a free one) until
  // destroyed. Callable before or after the CUDA backend is loaded.
  Status serve(const std::string& addr);
  // "host:port" actually bound, or "" when not serving.
  std::string bound_address() const;

  void set_build_info(const std::string& version, const std::string& backend, const std::string& device);

  // One finished Attend/AttendUnary/AttendBackward request. method labels
  // plsh_requests_total; the duration goes to plsh_request_duration_seconds
  // for the forward methods and to plsh_backward_duration_seconds for
  // AttendBackward, so that the latency rules keep meaning the forward.
  void request_done(const std::string& method, const std::string& mode, const std::string& backend,
                    const std::string& code, double seconds);
  // phase: queued|receiving|computing|sending
  void phase(const std::string& phase, double seconds);
  void tokens(const std::string& mode, double count);
  void received_bytes(double bytes);
  void sent_bytes(double bytes);
  void inflight_add(double delta);
  void queue_depth(double depth);
  void busy_workers(double workers);
  void probe_relative_error(const std::string& mode, double rel_err);
  void mask_max_error(const std::string& mode, double err);
  void device_memory(const std::string& device, double used_bytes, double total_bytes);
  // space: host|device. Budgets once at start, reservations as they change.
  void memory_budget(const std::string& space, double bytes);
  void memory_reserved(const std::string& space, double bytes);
  // Same-host shared memory (shm_registry.h): regions registered and the
  // bytes they map, all clients together, and the bound (--max-shm-bytes).
  void shared_memory(double regions, double mapped_bytes, double max_bytes);
  // A stream ended for waiting on its client (watchdog.h): receive_idle,
  // receive_slow, send_idle, send_slow.
  void stream_timeout(const std::string& reason);

  // Kept contexts (contexts.h): held now and their host bytes; one kept;
  // one removed, by reason (expired, evicted, released, consumed,
  // cancelled, drained).
  void contexts(double held, double bytes);
  void context_added();
  void context_removed(const std::string& reason);

  // Per client, with a token file only (auth.h). client is a name from the
  // token file, or "unauthenticated" for calls without a valid token: never
  // a token, so the label's values are as few as the file's clients.
  // method: Attend|AttendUnary|GetInfo.
  void client_request(const std::string& client, const std::string& method, const std::string& code,
                      double received_bytes, double sent_bytes);
  void client_open_streams(const std::string& client, double streams);
  // space: host|device.
  void client_reserved_bytes(const std::string& client, const std::string& space, double bytes);
  // A load of the token file: at start, and each change (ok) or refused change (error).
  void token_file_reload(bool ok);
  void token_file_clients(double clients);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::mutex mutex_;  // guards Family::Add, which is not meant for concurrent first use of a label set

  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Family<prometheus::Histogram>& phase_duration_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Counter& received_;
  prometheus::Counter& sent_;
  prometheus::Gauge& inflight_;
  prometheus::Gauge& queue_;
  prometheus::Gauge& busy_;
  prometheus::Family<prometheus::Histogram>& probe_error_;
  prometheus::Family<prometheus::Histogram>& mask_error_;
  prometheus::Family<prometheus::Gauge>& build_info_;
  prometheus::Family<prometheus::Gauge>& device_memory_used_;
  prometheus::Family<prometheus::Gauge>& device_memory_total_;
  prometheus::Family<prometheus::Gauge>& memory_budget_;
  prometheus::Family<prometheus::Gauge>& memory_reserved_;
  prometheus::Family<prometheus::Counter>& stream_timeouts_;
  prometheus::Family<prometheus::Gauge>& shm_regions_;
  prometheus::Family<prometheus::Gauge>& shm_mapped_;
  prometheus::Family<prometheus::Gauge>& shm_max_;
  prometheus::Family<prometheus::Histogram>& backward_duration_;
  prometheus::Gauge& contexts_held_;
  prometheus::Gauge& context_bytes_;
  prometheus::Counter& contexts_kept_;
  prometheus::Family<prometheus::Counter>& context_evictions_;
  prometheus::Family<prometheus::Counter>& client_requests_;
  prometheus::Family<prometheus::Counter>& client_received_;
  prometheus::Family<prometheus::Counter>& client_sent_;
  prometheus::Family<prometheus::Gauge>& client_open_streams_;
  prometheus::Family<prometheus::Gauge>& client_reserved_;
  prometheus::Family<prometheus::Counter>& token_reloads_;
  prometheus::Family<prometheus::Gauge>& token_clients_;
};

}  // namespace plsh::server
