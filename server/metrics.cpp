#include "server/metrics.h"

#include <prometheus/counter.h>

#include <cmath>

#include "server/contexts.h"

namespace plsh::server {

namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

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
      requests_(BuildCounter()
                    .Name("plsh_requests_total")
                    .Help("Attention requests finished, by method (Attend, AttendUnary, AttendBackward), mode, backend "
                          "and gRPC status code")
                    .Register(*registry_)),
      request_duration_(BuildHistogram()
                            .Name("plsh_request_duration_seconds")
                            .Help("Whole request as the server saw it, header to status")
                            .Register(*registry_)),
      phase_duration_(BuildHistogram()
                          .Name("plsh_phase_duration_seconds")
                          .Help("Time per request phase: queued, receiving, computing, sending")
                          .Register(*registry_)),
      tokens_(BuildCounter().Name("plsh_tokens_total").Help("Query tokens (B * Nq) of completed requests").Register(*registry_)),
      received_(BuildCounter()
                    .Name("plsh_received_bytes_total")
                    .Help("Tensor payload bytes received")
                    .Register(*registry_)
                    .Add({})),
      sent_(BuildCounter().Name("plsh_sent_bytes_total").Help("Tensor payload bytes sent").Register(*registry_).Add({})),
      inflight_(BuildGauge().Name("plsh_inflight_requests").Help("Attention streams open").Register(*registry_).Add({})),
      queue_(BuildGauge().Name("plsh_queue_depth").Help("Requests waiting for a worker").Register(*registry_).Add({})),
      probe_error_(BuildHistogram()
                       .Name("plsh_probe_relative_error")
                       .Help("Probe relative L2 error of lsh and window results (SPEC section 6)")
                       .Register(*registry_)),
      mask_error_(BuildHistogram()
                      .Name("plsh_mask_max_error")
                      .Help("max |L* - M~| of lsh and window results (SPEC section 6)")
                      .Register(*registry_)),
      build_info_(BuildGauge()
                      .Name("plsh_build_info")
                      .Help("Always 1; labels say the version, backend and device")
                      .Register(*registry_)),
      device_memory_used_(BuildGauge()
                              .Name("plsh_device_memory_used_bytes")
                              .Help("Memory in use on the backend's device (all processes)")
                              .Register(*registry_)),
      device_memory_total_(BuildGauge()
                               .Name("plsh_device_memory_total_bytes")
                               .Help("Memory of the backend's device")
                               .Register(*registry_)),
      memory_budget_(BuildGauge()
                         .Name("plsh_memory_budget_bytes")
                         .Help("Budget of all in-flight requests by memory space (host: --memory-budget, device: "
                               "--device-memory-budget)")
                         .Register(*registry_)),
      memory_reserved_(BuildGauge()
                           .Name("plsh_memory_reserved_bytes")
                           .Help("Bytes reserved by requests in flight, by memory space")
                           .Register(*registry_)),
      stream_timeouts_(BuildCounter()
                           .Name("plsh_stream_timeouts_total")
                           .Help("Attend streams ended for waiting on their client, by reason")
                           .Register(*registry_)),
      backward_duration_(BuildHistogram()
                             .Name("plsh_backward_duration_seconds")
                             .Help("Whole AttendBackward request as the server saw it, header to status")
                             .Register(*registry_)),
      contexts_held_(BuildGauge()
                         .Name("plsh_contexts")
                         .Help("Kept contexts held for AttendBackward (idle or in use by a backward)")
                         .Register(*registry_)
                         .Add({})),
      context_bytes_(BuildGauge()
                         .Name("plsh_context_bytes")
                         .Help("Host bytes of the kept contexts, charged to the host memory budget")
                         .Register(*registry_)
                         .Add({})),
      contexts_kept_(BuildCounter()
                         .Name("plsh_contexts_kept_total")
                         .Help("Contexts kept by forwards with keep_context")
                         .Register(*registry_)
                         .Add({})),
      context_evictions_(BuildCounter()
                             .Name("plsh_context_evictions_total")
                             .Help("Kept contexts removed, by reason: expired (--context-ttl), evicted (for memory or "
                                   "--max-contexts), released, consumed (by a backward), drained (shutdown)")
                             .Register(*registry_)),
      // Families without a series print nothing: without --token-file
      // /metrics is as before.
      client_requests_(BuildCounter()
                           .Name("plsh_client_requests_total")
                           .Help("Calls by client (token file name, or unauthenticated), method and gRPC status code")
                           .Register(*registry_)),
      client_received_(BuildCounter()
                           .Name("plsh_client_received_bytes_total")
                           .Help("Tensor payload bytes received, by client")
                           .Register(*registry_)),
      client_sent_(BuildCounter()
                       .Name("plsh_client_sent_bytes_total")
                       .Help("Tensor payload bytes sent, by client")
                       .Register(*registry_)),
      client_open_streams_(BuildGauge()
                               .Name("plsh_client_open_streams")
                               .Help("Attend, AttendUnary and AttendBackward calls open, by client (its max_streams counts these)")
                               .Register(*registry_)),
      client_reserved_(BuildGauge()
                           .Name("plsh_client_reserved_bytes")
                           .Help("Bytes reserved by a client's requests in flight, by memory space (its "
                                 "max_reserved_bytes and max_reserved_device_bytes count these)")
                           .Register(*registry_)),
      token_reloads_(BuildCounter()
                         .Name("plsh_token_file_reloads_total")
                         .Help("Loads of --token-file: ok, or error (the previous clients stay)")
                         .Register(*registry_)),
      token_clients_(BuildGauge()
                         .Name("plsh_token_file_clients")
                         .Help("Clients in the token file in use")
                         .Register(*registry_)) {
  for (const char* reason : {"receive_idle", "receive_slow", "send_idle", "send_slow"})
    stream_timeouts_.Add({{"reason", reason}});
  for (const char* p : {"queued", "receiving", "computing", "sending"}) phase_duration_.Add({{"phase", p}}, duration_buckets());
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
