// The Prometheus scrape endpoint: GET and HEAD /metrics in the text format,
// on a port of its own, served by libmicrohttpd (README: why this library).
// Anything else gets a short 404 or 405, malformed or oversized requests a
// 4xx from libmicrohttpd, and none of it can take the process down: this
// port listens on 0.0.0.0 in the image and the chart, where browsers and
// scanners find it.
#pragma once

#include <prometheus/collectable.h>

#include <memory>
#include <mutex>
#include <string>

#include "plsh/status.h"
#include "server/socket_deadlines.h"

struct MHD_Daemon;

namespace plsh::server {

class MetricsHttpServer {
 public:
  // Listens on addr ("host:port", host an IPv4 or [IPv6] address or a name;
  // port 0 picks a free one) and serves collectable until destroyed.
  static StatusOr<std::unique_ptr<MetricsHttpServer>> start(const std::string& addr,
                                                            std::shared_ptr<prometheus::Collectable> collectable);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // "host:port" actually bound (host as given).
  const std::string& bound_address() const { return bound_; }

  // For libmicrohttpd's C callbacks (metrics_http.cpp); not an API.
  std::string scrape() const;
  SocketDeadlines& deadlines() { return deadlines_; }
  void library_message(std::string message);

 private:
  explicit MetricsHttpServer(std::shared_ptr<prometheus::Collectable> collectable);

  std::shared_ptr<prometheus::Collectable> collectable_;
  SocketDeadlines deadlines_;
  std::mutex messages_mutex_;   // guards the two below
  bool starting_ = true;        // libmicrohttpd's messages explain a failed start
  std::string start_messages_;  // what it said while starting
  MHD_Daemon* daemon_ = nullptr;
  std::string bound_;
};

}  // namespace plsh::server
