#include "raw_http.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>

namespace plsh::testing {

namespace {

bool parse_address(const std::string& addr, sockaddr_in* sa) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return false;
  *sa = sockaddr_in{};
  sa->sin_family = AF_INET;
  sa->sin_port = htons(static_cast<uint16_t>(std::atoi(addr.c_str() + colon + 1)));
  return inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa->sin_addr) == 1;
}

using Clock = std::chrono::steady_clock;

double seconds_left(Clock::time_point until) { return std::chrono::duration<double>(until - Clock::now()).count(); }

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

void set_timeout(int fd, int option, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

}  // namespace

std::string HttpReply::header(const std::string& name) const {
  const std::string h = lower(head), key = "\r\n" + lower(name) + ":";
  const size_t at = h.find(key);
  if (at == std::string::npos) return "";
  size_t begin = at + key.size();
  const size_t end = head.find("\r\n", begin);
  while (begin < end && head[begin] == ' ') ++begin;
  return head.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

int connect_to(const std::string& addr, double timeout_s) {
  sockaddr_in sa;
  if (!parse_address(addr, &sa)) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  // SO_SNDTIMEO bounds connect() too (a full accept queue drops SYNs).
  set_timeout(fd, SO_SNDTIMEO, timeout_s);
  set_timeout(fd, SO_RCVTIMEO, timeout_s);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

HttpReply http_exchange(const std::string& addr, const std::string& request, double timeout_s, bool half_close) {
  HttpReply reply;
  const auto until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const int fd = connect_to(addr, timeout_s);
  if (fd < 0) return reply;
  reply.connected = true;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // closed by the server (it may answer a bad request early): read what it said
    sent += static_cast<size_t>(n);
  }
  if (half_close) shutdown(fd, SHUT_WR);
  const bool head_request = request.rfind("HEAD ", 0) == 0;
  std::string in;
  char buf[16384];
  for (;;) {
    const double left = seconds_left(until);
    if (left <= 0) {
      reply.timed_out = true;
      break;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left * 1000) + 1);
    if (ready == 0) continue;
    if (ready < 0 && errno == EINTR) continue;
    const ssize_t n = ready < 0 ? -1 : recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;  // closed or reset
    in.append(buf, static_cast<size_t>(n));
    const size_t end = in.find("\r\n\r\n");
    if (end == std::string::npos) continue;
    reply.head = in.substr(0, end);
    reply.body = in.substr(end + 4);
    const std::string length = reply.header("Content-Length");
    if (!length.empty() && (head_request || reply.body.size() >= std::strtoull(length.c_str(), nullptr, 10))) break;
  }
  close(fd);
  const size_t end = in.find("\r\n\r\n");
  reply.head = in.substr(0, end);
  reply.body = end == std::string::npos ? "" : in.substr(end + 4);
  if (in.rfind("HTTP/1.", 0) == 0 && in.size() >= 12) reply.status = std::atoi(in.c_str() + 9);
  return reply;
}

std::vector<int> connect_many(const std::string& addr, int n, double timeout_s) {
  sockaddr_in sa;
  if (!parse_address(addr, &sa)) return {};
  std::vector<pollfd> pending;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) break;
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 && errno != EINPROGRESS) {
      close(fd);
      continue;
    }
    pending.push_back(pollfd{fd, POLLOUT, 0});
  }
  const auto until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::vector<int> connected;
  while (!pending.empty() && seconds_left(until) > 0) {
    if (poll(pending.data(), pending.size(), static_cast<int>(seconds_left(until) * 1000) + 1) <= 0) continue;
    for (size_t i = 0; i < pending.size();) {
      if (pending[i].revents == 0) {
        ++i;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(pending[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0)
        connected.push_back(pending[i].fd);
      else
        close(pending[i].fd);
      pending[i] = pending.back();
      pending.pop_back();
    }
  }
  for (const pollfd& p : pending) close(p.fd);
  return connected;
}

bool wait_closed(int fd, double timeout_s) {
  const auto until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  char buf[4096];
  while (seconds_left(until) > 0) {
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    const int ready = poll(&p, 1, static_cast<int>(seconds_left(until) * 1000) + 1);
    if (ready <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
  }
  return false;
}

int proc_entries(int pid, const char* dir) {
  const std::string path = "/proc/" + std::to_string(pid) + "/" + dir;
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

}  // namespace plsh::testing
