// The metrics port as a stranger meets it: browsers asking for / and
// /favicon.ico, other methods, oversized and malformed requests, random
// bytes, silent and trickling clients, a connection flood and a seeded fuzz.
// After each, the process must still run, scrape (200 with plsh_ metrics)
// and answer gRPC health. Every test runs twice: in a process without the
// CUDA library, and in one that has loaded libplsh_cuda.so (and with it
// cuBLAS, whose static TLS once broke the metrics server's small stacks).
// Traffic goes to 127.0.0.1 only.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plsh/client.h"
#include "raw_http.h"
#include "server_process.h"

namespace plsh {
namespace {

using testing::http_exchange;
using testing::HttpReply;
using testing::ServerProcess;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The server's limits (server/metrics_http.cpp), as far as a test relies on them.
constexpr int kMaxConnections = 64;
constexpr double kIdleTimeoutSeconds = 5;
constexpr double kConnectionDeadlineSeconds = 10;

// A reply to a request the server could not or would not serve: none (it
// closed the connection) or a 4xx, or 501/505 for methods and versions it
// does not speak. Never a 500 (our handler failing), never a 2xx.
bool refused(const HttpReply& r) {
  return r.status == 0 || (r.status >= 400 && r.status < 500) || r.status == 501 || r.status == 505;
}

std::string get(const std::string& path, const std::string& method = "GET", const std::string& extra = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra + "\r\n";
}

class MetricsPort : public ::testing::TestWithParam<bool> {
 protected:
  bool cuda_loaded() const { return GetParam(); }

  void SetUp() override {
    std::vector<std::string> env;
    if (cuda_loaded()) {
      const std::string lib = PLSH_CUDA_LIBRARY;
      struct stat st {};
      if (stat(lib.c_str(), &st) != 0) GTEST_SKIP() << lib << " not built here (no CUDA toolkit): nothing to check";
      env.push_back("PLSH_CUDA_BACKEND=" + lib);
    } else {
      // Otherwise the registry would find build/lib/libplsh_cuda.so beside the binary.
      env.emplace_back("PLSH_CUDA_BACKEND=/nonexistent/libplsh_cuda.so");
    }
    server_ = std::make_unique<ServerProcess>(std::vector<std::string>{}, env);
    ASSERT_TRUE(server_->started()) << server_->log();
    const std::string log = server_->log();
    const bool loaded =
        log.find("name=cuda") != std::string::npos || log.find("cuda backend unavailable") != std::string::npos;
    ASSERT_EQ(loaded, cuda_loaded()) << "the CUDA library's factory " << (loaded ? "ran" : "did not run") << ":\n"
                                     << log;
    addr_ = server_->metrics_address();
  }

  // Alive, scraping plsh_ metrics, gRPC SERVING, and a clean SIGTERM exit.
  void expect_still_serving() {
    ASSERT_TRUE(server_->running()) << "plsh-server died:\n" << server_->log();
    const HttpReply scrape = http_exchange(addr_, get("/metrics"));
    EXPECT_EQ(scrape.status, 200) << scrape.head;
    EXPECT_NE(scrape.body.find("\nplsh_build_info{"), std::string::npos) << scrape.body.substr(0, 500);
    std::string health;
    const grpc::Status s = client::Client(server_->grpc_address()).health("", &health);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(health, "SERVING");
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
  }

  // Every method on /metrics and the paths a browser tries.
  void methods_and_paths() {
    const HttpReply ok = http_exchange(addr_, get("/metrics"));
    EXPECT_EQ(ok.status, 200) << ok.head;
    EXPECT_EQ(ok.header("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u) << ok.head;
    EXPECT_NE(ok.body.find("# TYPE plsh_queue_depth gauge"), std::string::npos) << ok.body.substr(0, 500);
    EXPECT_FALSE(testing::parse_metrics(ok.body).empty());

    const HttpReply head = http_exchange(addr_, get("/metrics", "HEAD"));
    EXPECT_EQ(head.status, 200) << head.head;
    EXPECT_EQ(head.header("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u) << head.head;
    EXPECT_GT(std::atol(head.header("Content-Length").c_str()), 0) << head.head;
    EXPECT_EQ(head.body, "");

    // The scrape the bench client and old tools send: HTTP/1.0, a query string.
    EXPECT_EQ(http_exchange(addr_, "GET /metrics HTTP/1.0\r\n\r\n").status, 200);
    EXPECT_EQ(http_exchange(addr_, get("/metrics?name[]=plsh_queue_depth")).status, 200);

    for (const char* path : {"/", "/favicon.ico", "/metrics/", "/METRICS", "/robots.txt", "/../../etc/passwd"}) {
      for (const char* method : {"GET", "HEAD", "POST"}) {
        const HttpReply r = http_exchange(addr_, get(path, method, "Content-Length: 0\r\n"));
        EXPECT_EQ(r.status, 404) << method << " " << path << "\n" << r.head;
        EXPECT_LT(r.body.size(), 200u) << method << " " << path;
        if (std::string(method) != "HEAD") {
          EXPECT_FALSE(r.body.empty()) << method << " " << path;
        }
      }
    }
    for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "PROPFIND", "BREW"}) {
      const HttpReply r = http_exchange(addr_, get("/metrics", method, "Content-Length: 5\r\n") + "hello");
      EXPECT_EQ(r.status, 405) << method << "\n" << r.head;
      EXPECT_EQ(r.header("Allow"), "GET, HEAD") << method << "\n" << r.head;
      EXPECT_FALSE(r.body.empty()) << method;
    }
  }

  // Requests too big to hold, and requests that are not HTTP.
  void oversized_and_malformed() {
    const std::string mb(1 << 20, 'a'), hundred_kb(100 << 10, 'b');
    const std::vector<std::pair<std::string, std::string>> oversized = {
        {"1 MB header", get("/metrics", "GET", "X-Big: " + mb + "\r\n")},
        {"100 KB URL", get("/metrics?" + hundred_kb)},
        {"100 KB path", get("/" + hundred_kb)},
        {"100 KB method", get("/metrics", hundred_kb)},
        {"10000 headers",
         [] {
           std::string h;
           for (int i = 0; i < 10000; ++i) h += "X-H" + std::to_string(i) + ": v\r\n";
           return get("/metrics", "GET", h);
         }()},
        {"1 MB body", get("/metrics", "POST", "Content-Length: " + std::to_string(mb.size()) + "\r\n") + mb},
        {"1 MB line, no end", mb},
    };
    for (const auto& [what, request] : oversized) {
      const HttpReply r = http_exchange(addr_, request, 10);
      EXPECT_TRUE(refused(r)) << what << ": " << r.status << "\n" << r.head.substr(0, 300);
      EXPECT_FALSE(r.timed_out) << what << ": no answer and no close in 10 s";
      ASSERT_TRUE(server_->running()) << "died on " << what << ":\n" << server_->log();
    }

    const std::vector<std::pair<std::string, std::string>> malformed = {
        {"empty lines", "\r\n\r\n\r\n\r\n"},
        {"method alone", "GET\r\n\r\n"},
        {"HTTP/0.9", "GET /metrics\r\n\r\n"},
        {"HTTP/9.9", "GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n"},
        {"HTTP/2 preface", std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")},
        {"no version", "GET /metrics HTTP/\r\nHost: x\r\n\r\n"},
        {"spaces", "GET    /metrics    HTTP/1.1   \r\nHost: x\r\n\r\n"},
        {"NUL in method", std::string("G\0T /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 34)},
        {"NUL in path", std::string("GET /met\0rics HTTP/1.1\r\nHost: x\r\n\r\n", 35)},
        {"header without colon", "GET /metrics HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n"},
        {"empty header name", "GET /metrics HTTP/1.1\r\nHost: x\r\n: v\r\n\r\n"},
        {"folded header", "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  continued\r\n\r\n"},
        {"negative length", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"},
        {"huge length", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n"},
        {"two lengths", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 5\r\n\r\nhello"},
        {"bad chunks", "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n"},
        {"absolute URL", "GET http://127.0.0.1/metrics HTTP/1.1\r\nHost: x\r\n\r\n"},
        {"percent NUL", "GET /%00%ff%zz HTTP/1.1\r\nHost: x\r\n\r\n"},
        {"CONNECT", "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n\r\n"},
        {"bare LF", "GET /nothing HTTP/1.1\nHost: x\n\n"},
        {"TLS ClientHello", std::string("\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 11) + std::string(160, '\x42')},
    };
    for (const auto& [what, request] : malformed) {
      const HttpReply r = http_exchange(addr_, request, 10, /*half_close=*/true);
      EXPECT_NE(r.status, 500) << what;
      EXPECT_FALSE(r.timed_out) << what << ": no answer and no close in 10 s";
      ASSERT_TRUE(server_->running()) << "died on " << what << ":\n" << server_->log();
    }

    std::mt19937 rng(12);
    for (int i = 0; i < 20; ++i) {
      std::string bytes(std::uniform_int_distribution<int>(1, 8192)(rng), '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      const HttpReply r = http_exchange(addr_, bytes, 10, /*half_close=*/true);
      EXPECT_TRUE(refused(r)) << "random bytes #" << i << ": " << r.status;
      ASSERT_TRUE(server_->running()) << "died on random bytes #" << i << ":\n" << server_->log();
    }
  }

  // Clients that connect and say nothing, and one that sends a byte a
  // second, run in the background while `meanwhile` runs; each must be cut
  // off, and scrapes must go on while they hang on.
  void slow_clients(const std::function<void()>& meanwhile) {
    const auto t0 = Clock::now();
    std::vector<int> silent;
    for (int i = 0; i < 3; ++i) silent.push_back(testing::connect_to(addr_, 5));
    for (int fd : silent) ASSERT_GE(fd, 0);
    std::atomic<double> dribbler_closed_after{-1};
    std::thread dribbler([&] {
      const int fd = testing::connect_to(addr_, 5);
      if (fd < 0) return;
      const std::string start = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
      if (send(fd, start.data(), start.size(), MSG_NOSIGNAL) > 0) {
        // wait_closed doubles as the second between bytes.
        while (!testing::wait_closed(fd, 1.0) && seconds_since(t0) < 30)
          if (send(fd, "a", 1, MSG_NOSIGNAL) != 1) break;
        dribbler_closed_after = seconds_since(t0);
      }
      close(fd);
    });

    meanwhile();
    // Scrapes from others go through while the slow clients hang on.
    for (int i = 0; i < 3; ++i) {
      const auto s0 = Clock::now();
      const HttpReply r = http_exchange(addr_, get("/metrics"), 5);
      EXPECT_EQ(r.status, 200) << "scrape " << i << " with slow clients open";
      EXPECT_LT(seconds_since(s0), 2.0) << "scrape " << i << " waited on the slow clients";
    }

    for (int fd : silent) {
      EXPECT_TRUE(testing::wait_closed(fd, std::max(0.5, kIdleTimeoutSeconds + 10 - seconds_since(t0))))
          << "a silent client still connected after " << seconds_since(t0) << " s";
      close(fd);
    }
    dribbler.join();
    EXPECT_GT(dribbler_closed_after, 0) << "the dribbler still connected after 30 s";
    EXPECT_LT(dribbler_closed_after, kConnectionDeadlineSeconds + 5) << "the dribbler was cut too late";
  }

  // More connections than the server takes, held open.
  void flood() {
    const int pid = server_->pid();
    const int threads_before = testing::proc_entries(pid, "task"), fds_before = testing::proc_entries(pid, "fd");
    std::vector<int> held = testing::connect_many(addr_, 300, 2);
    EXPECT_GE(held.size(), static_cast<size_t>(kMaxConnections)) << "the flood did not even fill the server";
    // The server takes them in for half a second (no event to wait on: the test is that it stays up and bounded).
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ASSERT_TRUE(server_->running()) << "died under " << held.size() << " connections:\n" << server_->log();
    EXPECT_LE(testing::proc_entries(pid, "task"), threads_before + 2) << "threads grew with connections";
    EXPECT_LE(testing::proc_entries(pid, "fd"), fds_before + kMaxConnections + 4) << "open files grew past the limit";
    // While the flood still holds its sockets, the server frees its slots
    // (idle timeout) and a scrape gets through. Each try outlasts one idle
    // round, so that it is not forever re-queued behind the flood.
    const auto t0 = Clock::now();
    HttpReply r;
    while (seconds_since(t0) < 4 * kIdleTimeoutSeconds &&
           (r = http_exchange(addr_, get("/metrics"), kIdleTimeoutSeconds + 1)).status != 200) {
    }
    EXPECT_EQ(r.status, 200) << "no scrape within " << seconds_since(t0) << " s of a flood of " << held.size();
    for (int fd : held) close(fd);
  }

  // Seeded random requests, well-formed ones with an exact expected status
  // and mangled ones that must only be refused.
  void fuzz(int count, uint32_t seed) {
    std::mt19937 rng(seed);
    auto pick = [&rng](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
    auto text = [&](int max_len, const std::string& alphabet) {
      std::string s(static_cast<size_t>(pick(max_len + 1)), ' ');
      for (char& c : s) c = alphabet[static_cast<size_t>(pick(static_cast<int>(alphabet.size())))];
      return s;
    };
    const std::vector<std::string> methods = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE"};
    const std::string token = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_";
    const std::string value = token + " ;,=/.:()\"'\t";
    const auto t0 = Clock::now();
    int answered = 0;
    for (int i = 0; i < count; ++i) {
      const std::string method = methods[static_cast<size_t>(pick(static_cast<int>(methods.size())))];
      std::string path;
      switch (pick(5)) {
        case 0:
          path = "/metrics";
          break;
        case 1:
          path = "/metrics?" + text(40, token + "=&");
          break;
        case 2:
          path = "/";
          break;
        case 3:
          path = "/favicon.ico";
          break;
        default:
          path = "/x" + text(60, "abcdefghijklmnopqrstuvwxyz0123456789/_-.");
          break;
      }
      std::string headers;
      for (int h = pick(12); h > 0; --h) headers += "X-" + text(20, token) + ": " + text(200, value) + "\r\n";
      const std::string body = text(pick(2) ? 0 : 3000, value);
      if (!body.empty()) headers += "Content-Length: " + std::to_string(body.size()) + "\r\n";
      std::string request = method + " " + path + " HTTP/1." + (pick(2) ? "1" : "0") +
                            "\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers + "\r\n" + body;
      const bool mangle = pick(3) == 0;
      const int expected = path.rfind("/metrics", 0) == 0 && (path.size() == 8 || path[8] == '?')
                               ? (method == "GET" || method == "HEAD" ? 200 : 405)
                               : 404;
      if (mangle) {
        switch (pick(4)) {
          case 0:  // flip bytes
            for (int k = pick(8) + 1; k > 0; --k)
              request[static_cast<size_t>(pick(static_cast<int>(request.size())))] = static_cast<char>(rng());
            break;
          case 1:  // cut short
            request.resize(static_cast<size_t>(pick(static_cast<int>(request.size()))));
            break;
          case 2:  // splice in garbage
            request.insert(static_cast<size_t>(pick(static_cast<int>(request.size()))),
                           text(300, std::string("\r\n:\0 %", 6) + static_cast<char>(rng())));
            break;
          default:  // claim more body than is sent
            request = method + " /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(pick(1 << 20) + 1) +
                      "\r\n\r\n" + body;
            break;
        }
      }
      // A mangled request may leave the server waiting for the rest (until
      // its idle timeout, which the slow-client test covers): give it 1 s.
      const HttpReply r = http_exchange(addr_, request, mangle ? 1 : 5, /*half_close=*/mangle);
      ASSERT_TRUE(server_->running()) << "died on fuzz request #" << i << " (seed " << seed << "):\n" << server_->log();
      if (mangle) {
        EXPECT_NE(r.status, 500) << "fuzz request #" << i;
      } else {
        EXPECT_FALSE(r.timed_out) << "fuzz request #" << i << ": no answer and no close in 5 s: "
                                  << ::testing::PrintToString(request.substr(0, 300));
        EXPECT_EQ(r.status, expected) << "fuzz request #" << i << ": " << request.substr(0, 200);
        if (expected == 405) {
          EXPECT_EQ(r.header("Allow"), "GET, HEAD");
        }
      }
      answered += r.status != 0;
    }
    EXPECT_GT(answered, count / 2) << "most requests should get an answer";
    EXPECT_LT(seconds_since(t0), 60) << count << " fuzz requests took too long";
  }

  std::unique_ptr<ServerProcess> server_;
  std::string addr_;
};

TEST_P(MetricsPort, AnswersEveryMethodAndPath) {
  methods_and_paths();
  expect_still_serving();
}

TEST_P(MetricsPort, RefusesOversizedAndMalformedRequests) {
  oversized_and_malformed();
  expect_still_serving();
}

TEST_P(MetricsPort, CutsSilentAndTricklingClientsWithoutBlockingScrapes) {
  slow_clients([] {});
  expect_still_serving();
}

TEST_P(MetricsPort, BoundsAConnectionFloodAndRecovers) {
  flood();
  expect_still_serving();
}

// All of it against one process, the slow clients hanging on throughout.
TEST_P(MetricsPort, SurvivesEverythingAndASeededFuzz) {
  slow_clients([this] {
    methods_and_paths();
    oversized_and_malformed();
    fuzz(300, 20261130);
  });
  flood();
  expect_still_serving();
}

INSTANTIATE_TEST_SUITE_P(Processes, MetricsPort, ::testing::Bool(), [](const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "CudaLibraryLoaded" : "WithoutCuda";
});

}  // namespace
}  // namespace plsh
