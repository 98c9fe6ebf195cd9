// What the integration suites share beside the server process: the names
// they all use, polling, a /metrics scrape, a fixture for a suite's one
// server, a call over tensors the test owns, and the small odd-sized GQA
// request they check end to end.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plsh/client.h"
#include "plsh/numeric.h"
#include "server_process.h"
#include "shaped.h"

namespace plsh {

using client::AttendCall;
using client::AttendReply;
using client::Client;
using testing::metric_sum;
using testing::ServerProcess;

namespace testing {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A plaintext channel to target (host:port), as the client library makes
// it for default ChannelOptions, with `args` (gRPC's defaults unless given):
// for tests that write the wire messages themselves.
inline std::shared_ptr<grpc::Channel> plaintext_channel(const std::string& target,
                                                        const grpc::ChannelArguments& args = {}) {
  std::shared_ptr<grpc::Channel> channel;
  std::string token;
  const grpc::Status s = client::make_channel(target, client::ChannelOptions{}, args, &channel, &token);
  if (!s.ok()) ADD_FAILURE() << "make_channel(" << target << "): " << s.error_message();
  return channel;
}

// gRPC's generated Attention client (its class is named Stub) on
// plaintext_channel(target), for tests that write the wire messages.
inline std::unique_ptr<v1::Attention::Stub> plaintext_attention_client(const std::string& target) {
  return v1::Attention::NewStub(plaintext_channel(target));
}

// Polls f every 20 ms for up to `seconds`.
inline bool eventually(const std::function<bool()>& f, double seconds = 10) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return f();
}

inline std::map<std::string, double> scrape(const ServerProcess& s) {
  return parse_metrics(http_get(s.metrics_address(), "/metrics"));
}

// A suite whose tests share one server: started before the first test with
// Suite::server_flags(), and required to exit 0 after the last. A template
// on the suite (CRTP), so that each suite has a server of its own.
template <class Suite>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(Suite::server_flags());
    ASSERT_TRUE(server_->started()) << server_->log();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    delete server_;
    server_ = nullptr;
  }
  static inline ServerProcess* server_ = nullptr;
};

// A call over host tensors q, k, v (float or raw bytes) that outlive it.
template <class T>
AttendCall attend_call(const AttentionOptions& o, const std::vector<T>& q, const std::vector<T>& k,
                       const std::vector<T>& v, double deadline_seconds) {
  AttendCall c;
  c.options = o;
  c.q = q.data();
  c.k = k.data();
  c.v = v.data();
  c.deadline_seconds = deadline_seconds;
  return c;
}

// B = 2, 97 queries over 130 keys, 4 heads on 2 kv heads, D = 40, 16
// samples: odd sizes and GQA in a request that takes milliseconds.
inline AttentionOptions odd_gqa_options(Mode mode, bool causal) {
  return shaped({2, 97, 130, 4, 2, 40}, {.causal = causal, .mode = mode, .samples = 16, .seed = 7});
}

// Values ~ N(0, 1) from a fixed seed, one tensor after another, stored in
// any dtype.
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : rng_(seed) {}
  std::vector<uint8_t> tensor(int64_t n, DType dtype) {
    std::vector<uint8_t> t(static_cast<size_t>(n) * dtype_bytes(dtype));
    std::vector<float> row(static_cast<size_t>(n));
    for (float& x : row) x = normal_(rng_);
    store_row(t.data(), dtype, 0, n, row.data());
    return t;
  }
  // q, k and v of o in o.dtype, drawn in that order.
  void qkv(const AttentionOptions& o, std::vector<uint8_t>* q, std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
    const int64_t kv_heads = resolved_kv_heads(o.heads, o.kv_heads);
    *q = tensor(o.batch * o.q_len * o.heads * o.head_dim, o.dtype);
    *k = tensor(o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype);
    *v = tensor(o.batch * o.kv_len * kv_heads * o.head_dim, o.dtype);
  }

 private:
  std::mt19937_64 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
};

}  // namespace testing
}  // namespace plsh
