#include "bench/server_metrics.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

namespace plsh::bench {

namespace {

// Closes the socket on every path out.
struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) close(fd);
  }
};

// The value of label `key` in a sample key such as
// plsh_requests_total{backend="cpu",code="OK",mode="lsh"}; "" when absent.
std::string label(const std::string& sample, const std::string& key) {
  const std::string needle = key + "=\"";
  const size_t at = sample.find(needle);
  if (at == std::string::npos) return "";
  const size_t from = at + needle.size();
  const size_t to = sample.find('"', from);
  return to == std::string::npos ? "" : sample.substr(from, to - from);
}

std::string base_name(const std::string& sample) { return sample.substr(0, sample.find('{')); }

}  // namespace

StatusOr<std::string> http_get(const std::string& addr, const std::string& path, double timeout_seconds) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size())
    return invalid_argument("metrics = '" + addr + "', expected host:port");
  const std::string host = addr.substr(0, colon), port = addr.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr)
    return unavailable("metrics " + addr + ": cannot resolve " + host);
  Socket s;
  s.fd = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  const bool connected = s.fd >= 0 && connect(s.fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!connected) return unavailable("metrics " + addr + ": connect failed: " + std::strerror(errno));
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + addr + "\r\n\r\n";
  if (send(s.fd, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size()))
    return unavailable("metrics " + addr + ": send failed: " + std::strerror(errno));
  std::string response;
  char buf[16384];
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    pollfd p{s.fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0)
      return deadline_exceeded("metrics " + addr + ": no complete answer within " + std::to_string(timeout_seconds) +
                               " s");
    const ssize_t n = recv(s.fd, buf, sizeof buf, 0);
    if (n < 0) return unavailable("metrics " + addr + ": recv failed: " + std::strerror(errno));
    if (n == 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  const size_t body = response.find("\r\n\r\n");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (body == std::string::npos || status_line.find(" 200") == std::string::npos)
    return unavailable("metrics " + addr + path + ": answered '" + status_line + "', expected HTTP 200");
  return response.substr(body + 4);
}

std::map<std::string, double> parse_prometheus(const std::string& text) {
  std::map<std::string, double> samples;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    // "name{labels} value [timestamp]": label values may hold spaces, so
    // split after the closing brace when there is one.
    const size_t brace = line.rfind('}');
    const size_t space = line.find(' ', brace == std::string::npos ? 0 : brace);
    if (space == std::string::npos) continue;
    try {
      samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
      // Not a sample line this parser understands: skip it, as Prometheus would not.
    }
  }
  return samples;
}

StatusOr<ServerCounters> scrape_counters(const std::string& metrics_addr) {
  ASSIGN_OR_RETURN(const std::string text, http_get(metrics_addr, "/metrics"));
  ServerCounters c;
  for (const auto& [sample, value] : parse_prometheus(text)) {
    const std::string name = base_name(sample);
    if (name == "plsh_requests_total")
      c.requests_by_code[label(sample, "code")] += value;
    else if (name == "plsh_tokens_total")
      c.tokens += value;
    else if (name == "plsh_received_bytes_total")
      c.received_bytes += value;
    else if (name == "plsh_sent_bytes_total")
      c.sent_bytes += value;
  }
  return c;
}

ServerCounters counters_delta(const ServerCounters& before, const ServerCounters& after) {
  ServerCounters d;
  for (const auto& [code, n] : after.requests_by_code) {
    const auto b = before.requests_by_code.find(code);
    const double delta = n - (b == before.requests_by_code.end() ? 0 : b->second);
    if (delta != 0) d.requests_by_code[code] = delta;
  }
  d.tokens = after.tokens - before.tokens;
  d.received_bytes = after.received_bytes - before.received_bytes;
  d.sent_bytes = after.sent_bytes - before.sent_bytes;
  return d;
}

}  // namespace plsh::bench
