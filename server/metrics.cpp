#include "server/metrics.h"

#include <prometheus/counter.h>

#include <cmath>

#include "server/contexts.h"

namespace plsh::server {

namespace {

using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;

// A metric family, and the one series of a family without labels.
template <class Metric>
prometheus::Family<Metric>& family(prometheus::Registry& registry, const char* name, const char* help) {
  return prometheus::detail::Builder<Metric>().Name(name).Help(help).Register(registry);
}
template <class Metric>
Metric& series(prometheus::Registry& registry, const char* name, const char* help) {
  return family<Metric>(registry, name, help).Add({});
}

// Requests run from milliseconds (small exact) to minutes (N = 10^6 exact).
Histogram::BucketBoundaries duration_buckets() {
  Histogram::BucketBoundaries b;
  for (double s = 0.0005; s < 700; s *= 2) b.push_back(s);
  return b;
}

// Relative errors from 1e-6 (rounding) to 1 (useless), a few per decade.
Histogram::BucketBoundaries error_buckets() {
  Histogram::BucketBoundaries b;
  for (int e = -6; e <= 0; ++e)
    for (double m : {1.0, 2.0, 5.0})
      if (e < 0 || m == 1.0) b.push_back(m * std::pow(10.0, e));
  return b;
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(family<Counter>(*registry_, "plsh_requests_total",
                                "Attention requests finished, by method (Attend, AttendUnary, AttendBackward), mode, "
                                "backend and gRPC status code")),
      request_duration_(family<Histogram>(*registry_, "plsh_request_duration_seconds",
                                          "Whole request as the server saw it, header to status")),
      phase_duration_(family<Histogram>(*registry_, "plsh_phase_duration_seconds",
                                        "Time per request phase: queued, receiving, computing, sending")),
      tokens_(family<Counter>(*registry_, "plsh_tokens_total", "Query tokens (B * Nq) of completed requests")),
      received_(series<Counter>(*registry_, "plsh_received_bytes_total", "Tensor payload bytes received")),
      sent_(series<Counter>(*registry_, "plsh_sent_bytes_total", "Tensor payload bytes sent")),
      inflight_(series<Gauge>(*registry_, "plsh_inflight_requests", "Attention streams open")),
      queue_(series<Gauge>(*registry_, "plsh_queue_depth", "Requests waiting for a worker")),
      busy_(series<Gauge>(*registry_, "plsh_busy_workers", "Workers computing a request now (of --workers)")),
      probe_error_(family<Histogram>(*registry_, "plsh_probe_relative_error",
                                     "Probe relative L2 error of lsh and window results (SPEC section 6)")),
      mask_error_(family<Histogram>(*registry_, "plsh_mask_max_error",
                                    "max |L* - M~| of lsh and window results (SPEC section 6)")),
      build_info_(family<Gauge>(*registry_, "plsh_build_info", "Always 1; labels say the version, backend and device")),
      device_memory_used_(family<Gauge>(*registry_, "plsh_device_memory_used_bytes",
                                        "Memory in use on the backend's device (all processes)")),
      device_memory_total_(
          family<Gauge>(*registry_, "plsh_device_memory_total_bytes", "Memory of the backend's device")),
      memory_budget_(family<Gauge>(
          *registry_, "plsh_memory_budget_bytes",
          "Budget of all in-flight requests by memory space (host: --memory-budget, device: --device-memory-budget)")),
      memory_reserved_(family<Gauge>(*registry_, "plsh_memory_reserved_bytes",
                                     "Bytes reserved by requests in flight, by memory space")),
      stream_timeouts_(family<Counter>(*registry_, "plsh_stream_timeouts_total",
                                       "Attend streams ended for waiting on their client, by reason")),
      // Families without a series print nothing: without --shm-dir these are absent.
      shm_regions_(family<Gauge>(*registry_, "plsh_shared_memory_regions", "Shared-memory regions registered")),
      shm_mapped_(family<Gauge>(*registry_, "plsh_shared_memory_mapped_bytes",
                                "Bytes the registered shared-memory regions map, all clients together")),
      shm_max_(family<Gauge>(*registry_, "plsh_shared_memory_max_bytes",
                             "The most bytes the regions may map together (--max-shm-bytes)")),
      backward_duration_(family<Histogram>(*registry_, "plsh_backward_duration_seconds",
                                           "Whole AttendBackward request as the server saw it, header to status")),
      contexts_held_(series<Gauge>(*registry_, "plsh_contexts",
                                   "Kept contexts held for AttendBackward (idle or in use by a backward)")),
      context_bytes_(series<Gauge>(*registry_, "plsh_context_bytes",
                                   "Host bytes of the kept contexts, charged to the host memory budget")),
      contexts_kept_(
          series<Counter>(*registry_, "plsh_contexts_kept_total", "Contexts kept by forwards with keep_context")),
      context_evictions_(
          family<Counter>(*registry_, "plsh_context_evictions_total",
                          "Kept contexts removed, by reason: expired (--context-ttl), evicted (for memory or "
                          "--max-contexts), released, consumed (by a backward), drained (shutdown)")),
      // Families without a series print nothing: without --token-file
      // /metrics is as before.
      client_requests_(
          family<Counter>(*registry_, "plsh_client_requests_total",
                          "Calls by client (token file name, or unauthenticated), method and gRPC status code")),
      client_received_(
          family<Counter>(*registry_, "plsh_client_received_bytes_total", "Tensor payload bytes received, by client")),
      client_sent_(family<Counter>(*registry_, "plsh_client_sent_bytes_total", "Tensor payload bytes sent, by client")),
      client_open_streams_(
          family<Gauge>(*registry_, "plsh_client_open_streams",
                        "Attend, AttendUnary and AttendBackward calls open, by client (its max_streams counts these)")),
      client_reserved_(family<Gauge>(*registry_, "plsh_client_reserved_bytes",
                                     "Bytes reserved by a client's requests in flight, by memory space (its "
                                     "max_reserved_bytes and max_reserved_device_bytes count these)")),
      token_reloads_(family<Counter>(*registry_, "plsh_token_file_reloads_total",
                                     "Loads of --token-file: ok, or error (the previous clients stay)")),
      token_clients_(family<Gauge>(*registry_, "plsh_token_file_clients", "Clients in the token file in use")) {
  for (const char* reason : {"receive_idle", "receive_slow", "send_idle", "send_slow"})
    stream_timeouts_.Add({{"reason", reason}});
  for (const char* p : {"queued", "receiving", "computing", "sending"})
    phase_duration_.Add({{"phase", p}}, duration_buckets());
  // Every reason from the start, so that rates are 0 rather than absent.
  for (ContextEnd end : kContextEnds) context_evictions_.Add({{"reason", context_end_name(end)}});
}

Status Metrics::serve(const std::string& addr) {
  StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::start(addr, registry_);
  if (!http.ok()) return http.status();
  http_ = std::move(http).value();
  return Status::Ok();
}

std::string Metrics::bound_address() const { return http_ ? http_->bound_address() : ""; }

void Metrics::set_build_info(const std::string& version, const std::string& backend, const std::string& device) {
  std::lock_guard<std::mutex> lock(mutex_);
  build_info_.Add({{"version", version}, {"backend", backend}, {"device", device}}).Set(1);
}

void Metrics::device_memory(const std::string& device, double used_bytes, double total_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_memory_used_.Add({{"device", device}}).Set(used_bytes);
  device_memory_total_.Add({{"device", device}}).Set(total_bytes);
}

void Metrics::memory_budget(const std::string& space, double bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  memory_budget_.Add({{"space", space}}).Set(bytes);
}

void Metrics::shared_memory(double regions, double mapped_bytes, double max_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  shm_regions_.Add({}).Set(regions);
  shm_mapped_.Add({}).Set(mapped_bytes);
  shm_max_.Add({}).Set(max_bytes);
}

void Metrics::memory_reserved(const std::string& space, double bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  memory_reserved_.Add({{"space", space}}).Set(bytes);
}

void Metrics::stream_timeout(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  stream_timeouts_.Add({{"reason", reason}}).Increment();
}

void Metrics::request_done(const std::string& method, const std::string& mode, const std::string& backend,
                           const std::string& code, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  requests_.Add({{"method", method}, {"mode", mode}, {"backend", backend}, {"code", code}}).Increment();
  auto& durations = method == "AttendBackward" ? backward_duration_ : request_duration_;
  durations.Add({{"mode", mode}}, duration_buckets()).Observe(seconds);
}

void Metrics::contexts(double held, double bytes) {
  contexts_held_.Set(held);
  context_bytes_.Set(bytes);
}

void Metrics::context_added() { contexts_kept_.Increment(); }

void Metrics::context_removed(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  context_evictions_.Add({{"reason", reason}}).Increment();
}

void Metrics::phase(const std::string& phase, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_duration_.Add({{"phase", phase}}, duration_buckets()).Observe(seconds);
}

void Metrics::tokens(const std::string& mode, double count) {
  std::lock_guard<std::mutex> lock(mutex_);
  tokens_.Add({{"mode", mode}}).Increment(count);
}

void Metrics::received_bytes(double bytes) { received_.Increment(bytes); }
void Metrics::sent_bytes(double bytes) { sent_.Increment(bytes); }
void Metrics::inflight_add(double delta) { inflight_.Increment(delta); }
void Metrics::queue_depth(double depth) { queue_.Set(depth); }

void Metrics::busy_workers(double workers) { busy_.Set(workers); }

void Metrics::probe_relative_error(const std::string& mode, double rel_err) {
  if (!std::isfinite(rel_err)) return;  // one NaN would turn the histogram's sum into NaN until restart
  std::lock_guard<std::mutex> lock(mutex_);
  probe_error_.Add({{"mode", mode}}, error_buckets()).Observe(rel_err);
}

void Metrics::mask_max_error(const std::string& mode, double err) {
  if (!std::isfinite(err)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  mask_error_.Add({{"mode", mode}}, error_buckets()).Observe(err);
}

}  // namespace plsh::server

namespace plsh::server {

void Metrics::client_request(const std::string& client, const std::string& method, const std::string& code,
                             double received_bytes, double sent_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  client_requests_.Add({{"client", client}, {"method", method}, {"code", code}}).Increment();
  if (received_bytes > 0) client_received_.Add({{"client", client}}).Increment(received_bytes);
  if (sent_bytes > 0) client_sent_.Add({{"client", client}}).Increment(sent_bytes);
}

void Metrics::client_open_streams(const std::string& client, double streams) {
  std::lock_guard<std::mutex> lock(mutex_);
  client_open_streams_.Add({{"client", client}}).Set(streams);
}

void Metrics::client_reserved_bytes(const std::string& client, const std::string& space, double bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  client_reserved_.Add({{"client", client}, {"space", space}}).Set(bytes);
}

void Metrics::token_file_reload(bool ok) {
  std::lock_guard<std::mutex> lock(mutex_);
  token_reloads_.Add({{"result", ok ? "ok" : "error"}}).Increment();
}

void Metrics::token_file_clients(double clients) {
  std::lock_guard<std::mutex> lock(mutex_);
  token_clients_.Add({}).Set(clients);
}

}  // namespace plsh::server
