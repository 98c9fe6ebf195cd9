#include "server/metrics_http.h"

#include <microhttpd.h>
#include <netdb.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>

#include "server/logging.h"

namespace plsh::server {

namespace {

// Limits: what one Prometheus server (or an HA pair, curl and a browser tab)
// needs, with everything a client can make the server hold bounded.
// Connections at once; later ones are closed at accept. 64 sockets is also
// all this port can take of the process's file descriptors.
constexpr unsigned kMaxConnections = 64;
// Connections that wait in the kernel while all of those are taken: a flood
// then waits one round (an idle timeout) rather than SOMAXCONN (4096) / 64
// rounds, and scrapers get in sooner once it stops.
constexpr unsigned kListenBacklog = 64;
// A connection that sends nothing for this long is closed.
constexpr unsigned kIdleTimeoutSeconds = 5;
// Whole-connection limit (one request each, see on_request) against clients
// that trickle bytes (socket_deadlines.h): Prometheus's default
// scrape_timeout, far above a real scrape (milliseconds).
constexpr std::chrono::seconds kConnectionDeadline{10};
// Request line plus headers, per connection (libmicrohttpd's default, stated
// here because it is a limit we rely on): longer ones get 414 or 431.
constexpr size_t kConnectionMemoryBytes = 32 * 1024;
// 8 MiB: glibc's usual default, pinned so that neither `ulimit -s` nor a
// library can shrink it (civetweb's fixed 100 KiB stacks were the old crash:
// its error page overflowed them, and libcublasLt's 92 KiB of static TLS left
// no room). Untouched stack pages cost no memory.
constexpr size_t kThreadStackBytes = size_t{8} << 20;

// What Prometheus asks for and its text parser expects.
constexpr const char* kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kNotFound = "404 not found: this port serves /metrics only\n";
constexpr std::string_view kNotAllowed = "405 method not allowed: /metrics answers GET and HEAD\n";
constexpr std::string_view kCollectFailed = "500 cannot collect metrics (see the server log)\n";

MHD_Result reply(MHD_Connection* connection, unsigned status, MHD_Response* response, const char* content_type) {
  if (response == nullptr) return MHD_NO;  // out of memory: libmicrohttpd closes the connection
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);  // the connection keeps its own reference
  return queued;
}

MHD_Result reply_static(MHD_Connection* connection, unsigned status, std::string_view body) {
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_PERSISTENT);
  return reply(connection, status, response, "text/plain; charset=utf-8");
}

// Every request, called once its headers are in. Answers at once, before any
// body: nothing here needs one, and a response queued this early makes
// libmicrohttpd close the connection rather than read the rest. So every
// connection carries one request (Prometheus reconnects per scrape, which
// costs it a loopback or LAN handshake every scrape interval).
MHD_Result on_request(void* cls, MHD_Connection* connection, const char* url, const char* method,
                      const char* /*version*/, const char* /*upload_data*/, size_t* /*upload_data_size*/,
                      void** /*request_state*/) {
  // A C callback: nothing may propagate out of it.
  try {
    const auto* self = static_cast<const MetricsHttpServer*>(cls);
    // Path first: 404 whatever the method, for paths that do not exist.
    if (std::strcmp(url, "/metrics") != 0) return reply_static(connection, MHD_HTTP_NOT_FOUND, kNotFound);
    // HEAD: libmicrohttpd sends the headers (with the body's length) and not the body.
    if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 && std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
      return reply_static(connection, MHD_HTTP_METHOD_NOT_ALLOWED, kNotAllowed);
    std::string body = self->scrape();
    MHD_Response* response = MHD_create_response_from_buffer(body.size(), body.data(), MHD_RESPMEM_MUST_COPY);
    return reply(connection, MHD_HTTP_OK, response, kMetricsContentType);
  } catch (const std::exception& e) {
    log_event(spdlog::level::err, "metrics_scrape_failed", {{"error", e.what()}});
  } catch (...) {
    log_event(spdlog::level::err, "metrics_scrape_failed", {{"error", "unknown exception"}});
  }
  try {
    return reply_static(connection, MHD_HTTP_INTERNAL_SERVER_ERROR, kCollectFailed);
  } catch (...) {
    return MHD_NO;
  }
}

void on_connection(void* cls, MHD_Connection* connection, void** /*socket_context*/,
                   MHD_ConnectionNotificationCode what) {
  auto* self = static_cast<MetricsHttpServer*>(cls);
  try {
    if (what == MHD_CONNECTION_NOTIFY_STARTED) {
      if (const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD))
        self->deadlines().track(connection, info->connect_fd);
    } else {
      // libmicrohttpd calls this before it closes the socket (MHD_cleanup_connections,
      // 0.9.75), which is what SocketDeadlines::forget asks for.
      self->deadlines().forget(connection);
    }
  } catch (...) {
    // Only allocation can fail here; the connection then lives under the idle timeout alone.
  }
}

void on_library_message(void* cls, const char* format, va_list args) {
  char buf[512];
  std::vsnprintf(buf, sizeof(buf), format, args);
  try {
    static_cast<MetricsHttpServer*>(cls)->library_message(buf);
  } catch (...) {
  }
}

struct ListenAddress {
  sockaddr_storage address{};
  bool ipv6 = false;
  std::string host;  // as given, for the "serving" log line
};

StatusOr<ListenAddress> resolve(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon + 1 == addr.size())
    return invalid_argument("metrics_listen = '" + addr +
                            "', expected host:port (e.g. 127.0.0.1:9464, [::1]:9464), or off");
  const std::string port = addr.substr(colon + 1);
  // getaddrinfo takes "99999" and the port wraps to 34463: check it here.
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    return invalid_argument("metrics_listen = '" + addr + "', expected a port from 0 to 65535 after the last ':'");
  ListenAddress out;
  out.host = addr.substr(0, colon);
  std::string host = out.host;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? "0.0.0.0" : host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return invalid_argument("metrics_listen = '" + addr + "': " + gai_strerror(rc));
  std::memcpy(&out.address, found->ai_addr, found->ai_addrlen);
  out.ipv6 = found->ai_family == AF_INET6;
  freeaddrinfo(found);
  return out;
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(std::shared_ptr<prometheus::Collectable> collectable)
    : collectable_(std::move(collectable)), deadlines_(kConnectionDeadline) {}

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const std::string& addr, std::shared_ptr<prometheus::Collectable> collectable) {
  StatusOr<ListenAddress> where = resolve(addr);
  if (!where.ok()) return where.status();
  std::unique_ptr<MetricsHttpServer> self;
  try {
    self.reset(new MetricsHttpServer(std::move(collectable)));
  } catch (const std::exception& e) {
    return unavailable(std::string("metrics_listen = '") + addr + "': cannot start (" + e.what() + ")");
  }
  // One polling thread (epoll on Linux) serves every connection: a slow or
  // silent client holds a connection slot, never a thread.
  const unsigned flags =
      MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG | (where->ipv6 ? MHD_USE_IPv6 : 0);
  self->daemon_ =
      MHD_start_daemon(flags, 0, nullptr, nullptr, &on_request, self.get(),          //
                       MHD_OPTION_EXTERNAL_LOGGER, &on_library_message, self.get(),  // first, to hear about the rest
                       MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&where->address),  //
                       MHD_OPTION_CONNECTION_LIMIT, kMaxConnections,                        //
                       MHD_OPTION_LISTEN_BACKLOG_SIZE, kListenBacklog,                      //
                       MHD_OPTION_CONNECTION_TIMEOUT, kIdleTimeoutSeconds,                  //
                       MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemoryBytes,          //
                       MHD_OPTION_THREAD_STACK_SIZE, kThreadStackBytes,                     //
                       MHD_OPTION_NOTIFY_CONNECTION, &on_connection, self.get(),            //
                       MHD_OPTION_END);
  {
    std::lock_guard<std::mutex> lock(self->messages_mutex_);
    self->starting_ = false;
    if (self->daemon_ == nullptr)
      return unavailable(
          "metrics_listen = '" + addr + "': cannot listen (" +
          (self->start_messages_.empty() ? std::string("libmicrohttpd gave no reason") : self->start_messages_) + ")");
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(self->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  self->bound_ = where->host + ":" + (info != nullptr ? std::to_string(info->port) : std::string("?"));
  return self;
}

MetricsHttpServer::~MetricsHttpServer() {
  // Closes every connection (each one forgotten by deadlines_ on the way)
  // and joins the polling thread; deadlines_ stops after, as a member.
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

std::string MetricsHttpServer::scrape() const {
  return prometheus::TextSerializer().Serialize(collectable_->Collect());
}

void MetricsHttpServer::library_message(std::string message) {
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  std::lock_guard<std::mutex> lock(messages_mutex_);
  if (starting_) {
    start_messages_ += (start_messages_.empty() ? "" : "; ") + message;
    return;
  }
  // Debug: a scanner's garbage makes libmicrohttpd talk, and must not flood the log.
  log_event(spdlog::level::debug, "metrics_http", {{"message", message}});
}

}  // namespace plsh::server
