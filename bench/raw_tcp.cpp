// raw_tcp: the loopback TCP baseline for plsh's streaming ingest
// (bench/ingest.sh). A forked receiver process reads N bytes into one
// pre-touched buffer, where they would have to land for a server to use
// them, and answers one byte; the sender times from connect() to that
// byte. What plsh-server's receiving phase achieves for the same bytes is
// then a fraction of this, the fraction bench/RESULTS.md reports.
//
//   raw_tcp [--bytes N] [--chunk N] [--repeat R]
//   -> raw_tcp bytes=268435456 chunk=4194304 repeat=5 best_s=... median_s=... best_mb_s=... median_mb_s=... cpu_s=...
// (cpu_s: CPU seconds of sender and receiver together per transfer)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "raw_tcp: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

long long parse_size(const char* flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || v < 1) {
    std::fprintf(stderr, "raw_tcp: %s = '%s', expected an integer >= 1\n", flag, text);
    std::exit(2);
  }
  return v;
}

// Reads exactly n bytes (the receiver) into dst.
void read_all(int fd, char* dst, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd, dst + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) die("recv");
    got += static_cast<size_t>(r);
  }
}

void write_all(int fd, const char* src, size_t n, size_t chunk) {
  size_t sent = 0;
  while (sent < n) {
    const ssize_t w = send(fd, src + sent, std::min(chunk, n - sent), 0);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) die("send");
    sent += static_cast<size_t>(w);
  }
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// Receiver: for each of `repeat` connections, read `bytes` into the same
// buffer and answer one byte; then write its CPU seconds over the
// transfers to report_fd.
void receive(int listener, size_t bytes, int repeat, int report_fd) {
  std::vector<char> buffer(bytes);
  std::memset(buffer.data(), 1, bytes);  // pre-touched: no page faults in the timed part
  const double cpu0 = cpu_seconds();
  for (int i = 0; i < repeat; ++i) {
    const int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) die("accept");
    read_all(fd, buffer.data(), bytes);
    const char ack = 'k';
    if (send(fd, &ack, 1, 0) != 1) die("send ack");
    close(fd);
  }
  const double cpu = cpu_seconds() - cpu0;
  if (write(report_fd, &cpu, sizeof cpu) != static_cast<ssize_t>(sizeof cpu)) die("write cpu");
}

}  // namespace

int main(int argc, char** argv) {
  long long bytes = 256LL << 20, chunk = 4LL << 20, repeat = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc || (flag != "--bytes" && flag != "--chunk" && flag != "--repeat")) {
      std::fprintf(stderr, "usage: raw_tcp [--bytes N] [--chunk N] [--repeat R]\n");
      return 2;
    }
    const long long v = parse_size(flag.c_str(), argv[++i]);
    (flag == "--bytes" ? bytes : flag == "--chunk" ? chunk : repeat) = v;
  }

  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) die("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("bind");
  if (listen(listener, 4) != 0) die("listen");
  socklen_t len = sizeof addr;
  if (getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) die("getsockname");

  int report[2];
  if (pipe(report) != 0) die("pipe");
  const pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    close(report[0]);
    receive(listener, static_cast<size_t>(bytes), static_cast<int>(repeat), report[1]);
    _exit(0);
  }
  close(listener);
  close(report[1]);

  std::vector<char> payload(static_cast<size_t>(bytes));
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 131 + 7);
  std::vector<double> seconds;
  const double cpu0 = cpu_seconds();
  for (long long r = 0; r < repeat; ++r) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    const auto t0 = std::chrono::steady_clock::now();
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("connect");
    write_all(fd, payload.data(), payload.size(), static_cast<size_t>(chunk));
    char ack = 0;
    if (recv(fd, &ack, 1, MSG_WAITALL) != 1) die("recv ack");
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    close(fd);
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "raw_tcp: receiver failed\n");
    return 1;
  }
  // CPU of both ends over the transfers alone, per transfer.
  const double sender_cpu = cpu_seconds() - cpu0;
  double receiver_cpu = 0;
  if (read(report[0], &receiver_cpu, sizeof receiver_cpu) != static_cast<ssize_t>(sizeof receiver_cpu)) die("read cpu");
  const double cpu_per_transfer = (sender_cpu + receiver_cpu) / static_cast<double>(repeat);
  std::sort(seconds.begin(), seconds.end());
  const double best = seconds.front(), median = seconds[seconds.size() / 2];
  std::printf(
      "raw_tcp bytes=%lld chunk=%lld repeat=%lld best_s=%.4f median_s=%.4f best_mb_s=%.1f median_mb_s=%.1f "
      "cpu_s=%.3f\n",
      bytes, chunk, repeat, best, median, 1e-6 * static_cast<double>(bytes) / best,
      1e-6 * static_cast<double>(bytes) / median, cpu_per_transfer);
  return 0;
}
