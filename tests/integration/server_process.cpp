#include "server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <regex>
#include <sstream>

#include "bench/server_metrics.h"

#ifndef PLSH_SERVER_BIN
#error "PLSH_SERVER_BIN must name the plsh-server binary"
#endif

namespace plsh::testing {

namespace {
std::string field(const std::string& line, const std::string& key) {
  const std::regex re(key + "=([^ ]+)");
  std::smatch m;
  return std::regex_search(line, m, re) ? m[1].str() : "";
}
}  // namespace

ServerProcess::ServerProcess(std::vector<std::string> flags, std::vector<std::string> env) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return;
  std::vector<std::string> args = {PLSH_SERVER_BIN, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"};
  args.insert(args.end(), flags.begin(), flags.end());
  pid_ = fork();
  if (pid_ == 0) {
    dup2(pipe_fds[1], STDERR_FILENO);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  reader_ = std::thread([this, fd = pipe_fds[0]] { read_log(fd); });
  // Wait up to 20 s for the serving line.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const size_t at = log_.find(" serving ");
      if (at != std::string::npos) {
        const std::string line = log_.substr(at, log_.find('\n', at) - at);
        grpc_address_ = field(line, "grpc");
        metrics_address_ = field(line, "metrics");
        return;
      }
    }
    if (!running()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && running()) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (reader_.joinable()) reader_.join();
}

void ServerProcess::read_log(int fd) {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    std::lock_guard<std::mutex> lock(mutex_);
    log_.append(buf, static_cast<size_t>(n));
  }
  close(fd);
}

bool ServerProcess::running() {
  if (pid_ <= 0 || exit_status_ >= 0) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return true;
  exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return false;
}

int ServerProcess::terminate(double timeout_seconds) {
  if (running()) kill(pid_, SIGTERM);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (running() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (running()) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    exit_status_ = 128 + SIGKILL;
  }
  if (reader_.joinable()) reader_.join();
  return exit_status_;
}

std::string ServerProcess::log() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return log_;
}

std::string http_get(const std::string& addr, const std::string& path) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))));
  inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + addr + "\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buf[8192];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos                                     ? ""
         : response.substr(0, body).find(" 200 ") == std::string::npos ? ""
                                                                       : response.substr(body + 4);
}

// The load tool's parser (client/bench): what plsh bench reads, the tests read.
std::map<std::string, double> parse_metrics(const std::string& text) { return plsh::bench::parse_prometheus(text); }

double metric_sum(const std::map<std::string, double>& m, const std::string& name,
                  const std::vector<std::string>& labels) {
  double sum = 0;
  for (const auto& [key, value] : m) {
    const std::string base = key.substr(0, key.find('{'));
    if (base != name) continue;
    bool all = true;
    for (const std::string& l : labels) all = all && key.find(l) != std::string::npos;
    if (all) sum += value;
  }
  return sum;
}

}  // namespace plsh::testing
