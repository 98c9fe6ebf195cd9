// libFuzzer target: bytes sent to the /metrics HTTP port. One
// MetricsHttpServer per process on 127.0.0.1:0 (the server's own class, on
// libmicrohttpd); each input is written to a new connection, which is then
// half-closed (after a 1 ms pause) and read until the server closes it or
// 100 ms pass, then reset. (The pause: when the last bytes of an incomplete
// request and the FIN arrive together, libmicrohttpd 0.9.75, edge-triggered
// epoll, misses the FIN and keeps the connection to its 5 s idle timeout;
// a separate FIN makes it close at once. Either way the port's limits hold,
// but one input per 5 s would make a useless fuzzer.) The port must keep answering GET /metrics with
// 200 and the registry's samples, within its 10 s connection deadline:
// checked every 16 inputs and after any input it did not answer.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "fuzz_limits.h"
#include "server/metrics_http.h"

namespace {

std::unique_ptr<plsh::server::MetricsHttpServer> g_server;
uint16_t g_port = 0;
uint64_t g_inputs = 0;

// Closes with a reset (SO_LINGER 0), as a scanner that gives up does, and
// so that no input leaves a TIME_WAIT socket behind: at ~1000 inputs per
// second, half-closing first (the active close) would hold tens of
// thousands of local ports.
void reset(int fd) {
  linger l{};
  l.l_onoff = 1;
  l.l_linger = 0;
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

// A connected socket to the port, or -1 (errno says why) after 12 s: past
// the port's 10 s connection deadline, so a port whose slots are all held
// must have freed one by then. A connect interrupted by a signal (libFuzzer's
// timeout alarm) is tried again.
int connect_port() {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(12);
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    timeval timeout{};
    timeout.tv_sec = 12;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(g_port);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) return fd;
    const int error = errno;
    reset(fd);
    errno = error;
    if (error != EINTR || std::chrono::steady_clock::now() > give_up) return -1;
  }
}

enum class ReadEnd { kClosed, kTimedOut };

void set_read_timeout(int fd, long microseconds) {
  timeval timeout{};
  timeout.tv_sec = microseconds / 1000000;
  timeout.tv_usec = microseconds % 1000000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
}

// Sends `bytes` (as much as the server takes), half-closes, reads to the end
// or the read timeout.
ReadEnd exchange(int fd, std::string_view bytes, std::string* response) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server answered early and closed: fine
    sent += static_cast<size_t>(n);
  }
  pollfd p{fd, POLLIN, 0};
  poll(&p, 1, 1);  // the reply, or 1 ms: see the file comment
  shutdown(fd, SHUT_WR);
  char buf[16384];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      if (response->size() < (1 << 20)) response->append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ReadEnd::kTimedOut;
    return ReadEnd::kClosed;  // EOF or a reset
  }
}

std::string refused() { return std::string("the metrics port refuses connections: ") + std::strerror(errno); }

void check_scrape() {
  const int fd = connect_port();
  PLSH_FUZZ_CHECK(fd >= 0, refused().c_str());
  std::string response;
  const ReadEnd end = exchange(fd, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", &response);
  reset(fd);
  PLSH_FUZZ_CHECK(end == ReadEnd::kClosed, "a scrape was not answered and closed");
  PLSH_FUZZ_CHECK(response.rfind("HTTP/1.1 200 ", 0) == 0, response.substr(0, 200).c_str());
  PLSH_FUZZ_CHECK(response.find("plsh_fuzz_inputs_total") != std::string::npos,
                  "the scrape lacks the registry's samples");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("plsh_fuzz_inputs_total").Help("Inputs sent").Register(*registry).Add({}).Increment();
  auto server = plsh::server::MetricsHttpServer::start("127.0.0.1:0", registry);
  PLSH_FUZZ_CHECK(server.ok(), server.status().to_string().c_str());
  g_server = std::move(server).value();
  const std::string& bound = g_server->bound_address();
  g_port = static_cast<uint16_t>(std::stoi(bound.substr(bound.rfind(':') + 1)));
  check_scrape();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = connect_port();
  PLSH_FUZZ_CHECK(fd >= 0, refused().c_str());
  set_read_timeout(fd, 100 * 1000);
  std::string response;
  exchange(fd, std::string_view(reinterpret_cast<const char*>(data), size), &response);
  reset(fd);
  if (++g_inputs % 16 == 0 || response.empty()) check_scrape();
  return 0;
}
