// Trust end to end (SPEC section 9, issue 12): the real plsh-server on
// loopback with TLS, client certificates and bearer tokens, certificates
// made by openssl at test time, called through the C++ client library (and
// raw stubs where a test sends metadata the library would not).
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "plsh/client.h"
#include "plsh/params.h"
#include "server_process.h"
#include "trust_files.h"

namespace plsh {
namespace {

using client::AttendCall;
using client::AttendReply;
using client::ChannelOptions;
using client::Client;
using testing::metric_sum;
using testing::ServerProcess;
using testing::TempDir;

// Polls f every 20 ms for up to `seconds`.
bool eventually(const std::function<bool()>& f, double seconds = 10) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return f();
}

// A small lsh request with Gaussian inputs.
struct Request {
  AttentionOptions options;
  std::vector<float> q, k, v;

  explicit Request(int64_t n = 64, int64_t heads = 2, Mode mode = Mode::kLsh) {
    options.batch = 1;
    options.q_len = options.kv_len = n;
    options.heads = options.kv_heads = heads;
    options.head_dim = 16;
    options.mode = mode;
    options.samples = 8;
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal;
    for (auto* t : {&q, &k, &v}) {
      t->resize(static_cast<size_t>(n * heads * 16));
      for (float& x : *t) x = normal(rng);
    }
  }
  AttendCall call() const {
    AttendCall c;
    c.options = options;
    c.q = q.data();
    c.k = k.data();
    c.v = v.data();
    c.deadline_seconds = 30;
    return c;
  }
};

grpc::Status attend(Client& c, const Request& r = Request()) {
  AttendReply reply;
  return c.attend(r.call(), &reply);
}
grpc::Status attend_unary(Client& c, const Request& r = Request()) {
  AttendReply reply;
  return c.attend_unary(r.call(), &reply);
}
grpc::Status info(Client& c) {
  v1::GetInfoResponse response;
  return c.info(&response, 10);
}
std::string health(Client& c, const std::string& service = "") {
  std::string status;
  const grpc::Status s = c.health(service, &status, 10);
  return s.ok() ? status : client::status_string(s);
}

std::string field(const std::string& log, const std::string& key) {
  std::smatch m;
  return std::regex_search(log, m, std::regex(" serving .*" + key + "=([^ \n]+)")) ? m[1].str() : "";
}

std::map<std::string, double> scrape(const ServerProcess& s) {
  return testing::parse_metrics(testing::http_get(s.metrics_address(), "/metrics"));
}

// A token file client entry.
nlohmann::json client_entry(const std::string& name, const std::vector<std::string>& tokens, nlohmann::json extra = {}) {
  nlohmann::json digests = nlohmann::json::array();
  for (const std::string& t : tokens) digests.push_back(testing::sha256_hex(t));
  nlohmann::json c = {{"name", name}, {"sha256", digests}};
  for (auto it = extra.begin(); extra.is_object() && it != extra.end(); ++it) c[it.key()] = it.value();
  return c;
}
std::string token_file_text(const std::vector<nlohmann::json>& clients) {
  return nlohmann::json{{"version", 1}, {"clients", clients}}.dump(2);
}

class Trust : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new TempDir();
    pki_error_ = testing::make_pki(pki_->path());
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(pki_error_, "") << "making the test certificates with openssl failed"; }

  static std::string pki(const std::string& name) { return pki_->file(name); }
  static std::vector<std::string> tls_flags() { return {"--tls-cert", pki("server.crt"), "--tls-key", pki("server.key")}; }

  // A client of addr with these options (files read now).
  static std::unique_ptr<Client> connect(const std::string& addr, const ChannelOptions& o) {
    std::unique_ptr<Client> c;
    const grpc::Status s = Client::connect(addr, o, &c);
    EXPECT_TRUE(s.ok()) << client::status_string(s);
    return c;
  }
  static ChannelOptions tls(const std::string& token = "") {
    ChannelOptions o;
    o.tls_ca = pki("ca.crt");
    o.token = token;
    return o;
  }
  static ChannelOptions plain(const std::string& token = "") {
    ChannelOptions o;
    o.token = token;
    return o;
  }

  static TempDir* pki_;
  static std::string pki_error_;
};

TempDir* Trust::pki_ = nullptr;
std::string Trust::pki_error_;

// ---------------------------------------------------------------- TLS

TEST_F(Trust, TlsServesTheClientLibraryAndRefusesPlaintextAndUntrustedServers) {
  ServerProcess server(tls_flags());
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_EQ(field(server.log(), "tls"), "tls");
  const std::string addr = server.grpc_address();

  std::unique_ptr<Client> c = connect(addr, tls());
  EXPECT_TRUE(info(*c).ok()) << client::status_string(info(*c));
  EXPECT_TRUE(attend(*c).ok()) << client::status_string(attend(*c));
  EXPECT_TRUE(attend_unary(*c).ok());
  EXPECT_EQ(health(*c), "SERVING");

  // A plaintext client meets a TLS listener: the handshake fails.
  Client plaintext(addr);
  EXPECT_EQ(info(plaintext).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA does not accept the server.
  ChannelOptions other = tls();
  other.tls_ca = pki("other-ca.crt");
  EXPECT_EQ(info(*connect(addr, other)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The certificate names plsh.test and 127.0.0.1: an override to its name
  // passes, to another name fails.
  ChannelOptions named = tls();
  named.tls_server_name = "plsh.test";
  EXPECT_TRUE(info(*connect(addr, named)).ok());
  named.tls_server_name = "other.test";
  EXPECT_EQ(info(*connect(addr, named)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// gRPC gives a client whose handshake the server refuses UNAVAILABLE (the
// connection closes before any call starts; there is no status from the
// server to carry another code): that is what these tests assert.
TEST_F(Trust, ClientCertificatesRequired) {
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", "require"});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_EQ(field(server.log(), "tls"), "mtls-require");
  const std::string addr = server.grpc_address();

  EXPECT_EQ(info(*connect(addr, tls())).error_code(), grpc::StatusCode::UNAVAILABLE);
  ChannelOptions mine = tls();
  mine.tls_cert = pki("client.crt");
  mine.tls_key = pki("client.key");
  std::unique_ptr<Client> c = connect(addr, mine);
  EXPECT_TRUE(info(*c).ok()) << client::status_string(info(*c));
  EXPECT_TRUE(attend(*c).ok());
  ChannelOptions foreign = tls();
  foreign.tls_cert = pki("other-client.crt");
  foreign.tls_key = pki("other-client.key");
  EXPECT_EQ(info(*connect(addr, foreign)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, ClientCertificatesOptional) {
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", "optional"});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  const std::string addr = server.grpc_address();
  EXPECT_TRUE(info(*connect(addr, tls())).ok());  // no certificate: let in
  ChannelOptions mine = tls();
  mine.tls_cert = pki("client.crt");
  mine.tls_key = pki("client.key");
  EXPECT_TRUE(info(*connect(addr, mine)).ok());
  ChannelOptions foreign = tls();
  foreign.tls_cert = pki("other-client.crt");
  foreign.tls_key = pki("other-client.key");
  EXPECT_EQ(info(*connect(addr, foreign)).error_code(), grpc::StatusCode::UNAVAILABLE);  // one sent must verify
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// ------------------------------------------------------------- tokens

TEST_F(Trust, BearerTokensOnAPlaintextListener) {
  TempDir dir;
  const std::string full = testing::random_token(), getinfo = testing::random_token(), unary = testing::random_token();
  testing::write_file_atomically(
      dir.file("tokens.json"),
      token_file_text({client_entry("full", {full}), client_entry("monitor", {getinfo}, {{"methods", {"GetInfo"}}}),
                       client_entry("unary", {unary}, {{"methods", {"AttendUnary", "GetInfo"}}})}));
  ServerProcess server({"--token-file", dir.file("tokens.json")});
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_NE(server.log().find("tokens=\"3 clients\""), std::string::npos) << server.log();
  const std::string addr = server.grpc_address();

  // Missing and wrong: UNAUTHENTICATED, every method.
  for (const std::string& token : {std::string(), testing::random_token(), full.substr(0, 63) + (full[63] == 'a' ? "b" : "a")}) {
    std::unique_ptr<Client> c = connect(addr, plain(token));
    EXPECT_EQ(info(*c).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token.size();
    EXPECT_EQ(attend(*c).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(attend_unary(*c).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(health(*c), "SERVING");  // health needs no token
    EXPECT_EQ(health(*c, "plsh.v1.Attention"), "SERVING");
  }
  // Right: OK.
  std::unique_ptr<Client> c = connect(addr, plain(full));
  EXPECT_TRUE(info(*c).ok());
  EXPECT_TRUE(attend(*c).ok()) << client::status_string(attend(*c));
  EXPECT_TRUE(attend_unary(*c).ok());
  // Known but not allowed: PERMISSION_DENIED, naming the client.
  std::unique_ptr<Client> monitor = connect(addr, plain(getinfo));
  EXPECT_TRUE(info(*monitor).ok());
  const grpc::Status denied = attend(*monitor);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(denied.error_message().find("client 'monitor' may not call Attend"), std::string::npos) << denied.error_message();
  EXPECT_EQ(attend_unary(*monitor).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  std::unique_ptr<Client> u = connect(addr, plain(unary));
  EXPECT_EQ(attend(*u).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(attend_unary(*u).ok());

  // The scheme is case-insensitive (RFC 6750); another scheme, or two
  // authorization entries, are not credentials.
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  auto call_info = [&](const std::vector<std::string>& values) {
    grpc::ClientContext ctx;
    for (const std::string& v : values) ctx.AddMetadata("authorization", v);
    v1::GetInfoResponse response;
    return stub->GetInfo(&ctx, v1::GetInfoRequest{}, &response).error_code();
  };
  EXPECT_EQ(call_info({"bearer " + full}), grpc::StatusCode::OK);
  EXPECT_EQ(call_info({"BEARER  " + full}), grpc::StatusCode::OK);
  EXPECT_EQ(call_info({"Basic " + full}), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call_info({"Bearer"}), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call_info({"Bearer " + full, "Bearer " + full}), grpc::StatusCode::UNAUTHENTICATED);

  // Per-client metrics: names from the file, "unauthenticated" for the rest.
  const auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"full\"", "method=\"Attend\"", "code=\"OK\""}), 1);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"monitor\"", "code=\"PERMISSION_DENIED\""}), 2);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"unauthenticated\"", "code=\"UNAUTHENTICATED\""}), 12);
  EXPECT_GT(metric_sum(m, "plsh_client_received_bytes_total", {"client=\"full\""}), 0);
  EXPECT_EQ(metric_sum(m, "plsh_token_file_clients"), 3);
  EXPECT_EQ(server.terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("client=monitor"), std::string::npos);
}

TEST_F(Trust, BearerTokensWithClientCertificates) {
  TempDir dir;
  const std::string token = testing::random_token();
  testing::write_file_atomically(dir.file("tokens.json"), token_file_text({client_entry("trainer", {token})}));
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", "require", "--token-file",
                             dir.file("tokens.json")});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  ChannelOptions o = tls();
  o.tls_cert = pki("client.crt");
  o.tls_key = pki("client.key");
  EXPECT_EQ(info(*connect(server.grpc_address(), o)).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(health(*connect(server.grpc_address(), o)), "SERVING");
  o.token = token;
  std::unique_ptr<Client> c = connect(server.grpc_address(), o);
  EXPECT_TRUE(info(*c).ok());
  EXPECT_TRUE(attend(*c).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, TokenFileReloadsWithoutRestart) {
  TempDir dir;
  const std::string path = dir.file("tokens.json");
  const std::string a = testing::random_token(), b = testing::random_token();
  testing::write_file_atomically(path, token_file_text({client_entry("a", {a})}));
  ServerProcess server({"--token-file", path, "--token-reload-interval", "0.2"});
  ASSERT_TRUE(server.started()) << server.log();
  std::unique_ptr<Client> ca = connect(server.grpc_address(), plain(a));
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  EXPECT_TRUE(info(*ca).ok());
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Add b.
  testing::write_file_atomically(path, token_file_text({client_entry("a", {a}), client_entry("b", {b})}));
  EXPECT_TRUE(eventually([&] { return info(*cb).ok(); })) << server.log();
  EXPECT_TRUE(info(*ca).ok());
  // Remove a.
  testing::write_file_atomically(path, token_file_text({client_entry("b", {b})}));
  EXPECT_TRUE(eventually([&] { return info(*ca).error_code() == grpc::StatusCode::UNAUTHENTICATED; })) << server.log();
  EXPECT_TRUE(attend(*cb).ok());
  // A file that no longer parses changes nothing, and says so.
  testing::write_file_atomically(path, "{\"clients\": [");
  EXPECT_TRUE(eventually([&] {
    return metric_sum(scrape(server), "plsh_token_file_reloads_total", {"result=\"error\""}) == 1;
  })) << server.log();
  EXPECT_TRUE(info(*cb).ok());
  EXPECT_EQ(info(*ca).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // In place (not renamed) works too.
  { std::ofstream(path, std::ios::trunc) << token_file_text({client_entry("a", {a})}); }
  EXPECT_TRUE(eventually([&] { return info(*ca).ok(); })) << server.log();
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  EXPECT_EQ(metric_sum(scrape(server), "plsh_token_file_reloads_total", {"result=\"ok\""}), 4);
  EXPECT_EQ(server.terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("token_file_reload_failed"), std::string::npos);
}

TEST_F(Trust, TokenFileReloadsOnSighup) {
  TempDir dir;
  const std::string path = dir.file("tokens.json");
  const std::string a = testing::random_token(), b = testing::random_token();
  testing::write_file_atomically(path, token_file_text({client_entry("a", {a})}));
  ServerProcess server({"--token-file", path, "--token-reload-interval", "0"});  // SIGHUP only
  ASSERT_TRUE(server.started()) << server.log();
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  testing::write_file_atomically(path, token_file_text({client_entry("a", {a}), client_entry("b", {b})}));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);  // no polling
  ASSERT_EQ(kill(server.pid(), SIGHUP), 0);
  EXPECT_TRUE(eventually([&] { return info(*cb).ok(); })) << server.log();
  EXPECT_TRUE(server.running());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// ------------------------------------------------- per-client limits

// An Attend stream that has sent its header and holds what the server
// reserved for it until released.
struct HeldStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream;

  bool open(v1::Attention::Stub& stub, const std::string& token, const Request& r) {
    ctx.AddMetadata("authorization", "Bearer " + token);
    stream = stub.Attend(&ctx);
    v1::AttendRequest header;
    *header.mutable_header() = client::make_header(r.call());
    v1::AttendResponse ack;
    return stream->Write(header) && stream->Read(&ack) && ack.has_ack();
  }
  void release() {
    ctx.TryCancel();
    stream->Finish();
  }
};

TEST_F(Trust, PerClientStreamLimitLeavesOtherClientsServed) {
  TempDir dir;
  const std::string a = testing::random_token(), b = testing::random_token();
  testing::write_file_atomically(dir.file("tokens.json"),
                                 token_file_text({client_entry("a", {a}, {{"max_streams", 1}}), client_entry("b", {b})}));
  ServerProcess server({"--token-file", dir.file("tokens.json"), "--workers", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(server.grpc_address(), grpc::InsecureChannelCredentials()));
  HeldStream held;
  ASSERT_TRUE(held.open(*stub, a, Request()));

  std::unique_ptr<Client> ca = connect(server.grpc_address(), plain(a));
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  for (const grpc::Status& s : {attend(*ca), attend_unary(*ca)}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(s.error_message().find("client 'a'"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("max_streams"), std::string::npos) << s.error_message();
  }
  EXPECT_TRUE(info(*ca).ok());  // GetInfo holds no stream
  EXPECT_TRUE(attend(*cb).ok());
  EXPECT_TRUE(attend(*cb).ok());
  auto m = scrape(server);
  EXPECT_EQ(metric_sum(m, "plsh_client_open_streams", {"client=\"a\""}), 1);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"a\"", "code=\"RESOURCE_EXHAUSTED\""}), 2);
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"b\"", "code=\"OK\""}), 2);

  held.release();
  EXPECT_TRUE(eventually([&] { return metric_sum(scrape(server), "plsh_client_open_streams", {"client=\"a\""}) == 0; }));
  EXPECT_TRUE(attend(*ca).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, PerClientReservedBytesLimitLeavesOtherClientsServed) {
  TempDir dir;
  const std::string path = dir.file("tokens.json");
  const std::string a = testing::random_token(), b = testing::random_token();
  testing::write_file_atomically(path, token_file_text({client_entry("a", {a}), client_entry("b", {b})}));
  ServerProcess server({"--token-file", path, "--token-reload-interval", "0.1", "--workers", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(server.grpc_address(), grpc::InsecureChannelCredentials()));
  const Request request(2048);

  // One request of a's in flight: what it holds is its charge.
  HeldStream held;
  ASSERT_TRUE(held.open(*stub, a, request));
  const double charge = metric_sum(scrape(server), "plsh_client_reserved_bytes", {"client=\"a\"", "space=\"host\""});
  ASSERT_GT(charge, 0);
  // Room for one and a half: a second one of a's does not fit, b's do.
  const auto limit = static_cast<int64_t>(charge * 1.5);
  testing::write_file_atomically(
      path, token_file_text({client_entry("a", {a}, {{"max_reserved_bytes", limit}}), client_entry("b", {b})}));
  ASSERT_TRUE(eventually([&] {
    return metric_sum(scrape(server), "plsh_token_file_reloads_total", {"result=\"ok\""}) == 2;
  })) << server.log();

  std::unique_ptr<Client> ca = connect(server.grpc_address(), plain(a));
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  const grpc::Status refused = attend(*ca, request);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("client 'a'"), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find("max_reserved_bytes"), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find(std::to_string(limit)), std::string::npos) << refused.error_message();
  EXPECT_TRUE(attend(*cb, request).ok());
  EXPECT_TRUE(attend_unary(*cb, request).ok());
  const grpc::Status small = attend(*ca, Request(16));
  EXPECT_TRUE(small.ok()) << client::status_string(small);  // what still fits its share goes through

  held.release();
  EXPECT_TRUE(eventually([&] {
    return metric_sum(scrape(server), "plsh_client_reserved_bytes", {"client=\"a\"", "space=\"host\""}) == 0;
  }));
  EXPECT_TRUE(attend(*ca, request).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// ------------------------------------------------------------ secrets

TEST_F(Trust, SecretsNeverInLogsMetricsOrMessages) {
  TempDir dir;
  const std::string token = testing::random_token(), getinfo = testing::random_token();
  const std::string near_miss = token.substr(0, 63) + (token[63] == '0' ? "1" : "0");
  testing::write_file_atomically(dir.file("tokens.json"),
                                 token_file_text({client_entry("trainer", {token}, {{"max_streams", 1}}),
                                                  client_entry("monitor", {getinfo}, {{"methods", {"GetInfo"}}})}));
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--token-file", dir.file("tokens.json"), "--log-level", "debug"});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  const std::string addr = server.grpc_address();

  std::vector<grpc::Status> statuses;
  for (const std::string& t : {token, getinfo, near_miss, std::string()}) {
    std::unique_ptr<Client> c = connect(addr, tls(t));
    statuses.push_back(info(*c));
    statuses.push_back(attend(*c));
    statuses.push_back(attend_unary(*c));
  }
  auto stub = v1::Attention::NewStub(grpc::CreateChannel(addr, grpc::SslCredentials({testing::read_file(pki("ca.crt"))})));
  for (const std::string& header : {"Basic " + token, "Bearer " + token + " extra", "Bearer " + near_miss}) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", header);
    v1::GetInfoResponse response;
    statuses.push_back(stub->GetInfo(&ctx, v1::GetInfoRequest{}, &response));
  }
  // A client over its stream limit, so that refusal's message is seen too.
  HeldStream held;
  ASSERT_TRUE(held.open(*stub, token, Request()));
  statuses.push_back(attend(*connect(addr, tls(token))));
  held.release();
  // A refused reload's message, with a raw token where a digest belongs.
  testing::write_file_atomically(dir.file("tokens.json"), "{\"clients\": [{\"name\": \"x\", \"token\": \"" + token + "\"}]}");
  ASSERT_EQ(kill(server.pid(), SIGHUP), 0);
  ASSERT_TRUE(eventually([&] { return server.log().find("token_file_reload_failed") != std::string::npos; }));

  const std::string metrics = testing::http_get(server.metrics_address(), "/metrics");
  ASSERT_NE(metrics.find("plsh_client_requests_total{client=\"trainer\""), std::string::npos) << metrics;
  EXPECT_EQ(server.terminate(), 0);
  const std::string log = server.log();

  std::vector<std::string> secrets = {token, getinfo, near_miss, testing::sha256_hex(token), testing::sha256_hex(getinfo)};
  // The private key's base64 lines.
  std::istringstream key(testing::read_file(pki("server.key")));
  for (std::string line; std::getline(key, line);)
    if (line.rfind("-----", 0) != 0 && line.size() >= 16) secrets.push_back(line);
  ASSERT_GE(secrets.size(), 6u);
  std::string messages;
  for (const grpc::Status& s : statuses) messages += s.error_message() + "\n";
  for (const std::string& secret : secrets) {
    // Half a token is as bad as all of it.
    const std::string part = secret.substr(0, secret.size() / 2);
    EXPECT_EQ(log.find(part), std::string::npos) << "a secret in the log";
    EXPECT_EQ(metrics.find(part), std::string::npos) << "a secret in /metrics";
    EXPECT_EQ(messages.find(part), std::string::npos) << "a secret in a status message";
  }
  size_t refused = 0;
  for (const grpc::Status& s : statuses) refused += s.error_code() == grpc::StatusCode::UNAUTHENTICATED;
  EXPECT_GE(refused, 8u);  // the near miss, no token, and the raw headers
}

// --------------------------------------------------- health-only port

TEST_F(Trust, HealthOnlyListenerServesProbesWithoutCredentialsAndNothingElse) {
  TempDir dir;
  const std::string token = testing::random_token();
  testing::write_file_atomically(dir.file("tokens.json"), token_file_text({client_entry("trainer", {token})}));
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", "require", "--token-file",
                             dir.file("tokens.json"), "--health-listen", "127.0.0.1:0"});
  ServerProcess server(flags);
  ASSERT_TRUE(server.started()) << server.log();
  const std::string health_addr = field(server.log(), "health");
  ASSERT_NE(health_addr, "");
  ASSERT_NE(health_addr, "off");

  Client probe(health_addr);  // plaintext, no certificate, no token
  EXPECT_EQ(health(probe), "SERVING");
  EXPECT_EQ(health(probe, "plsh.v1.Attention"), "SERVING");
  // Attend is not served there, with a token or without.
  std::unique_ptr<Client> with_token = connect(health_addr, plain(token));
  EXPECT_EQ(attend(*with_token).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(attend_unary(*with_token).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(info(*with_token).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // The main port takes neither plaintext nor a client without a certificate.
  Client plaintext(server.grpc_address());
  EXPECT_NE(health(plaintext), "SERVING");
  ChannelOptions o = tls(token);
  o.tls_cert = pki("client.crt");
  o.tls_key = pki("client.key");
  std::unique_ptr<Client> c = connect(server.grpc_address(), o);
  EXPECT_TRUE(attend(*c).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, HealthOnlyListenerTurnsNotServingWhileDraining) {
  ServerProcess server({"--health-listen", "127.0.0.1:0", "--threads", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  Client probe(field(server.log(), "health"));
  EXPECT_EQ(health(probe, "plsh.v1.Attention"), "SERVING");
  // Seconds of exact attention (~34 GFLOP) to drain.
  const Request r(8192, 8, Mode::kExact);
  grpc::Status status;
  std::thread caller([&] {
    Client c(server.grpc_address());
    status = attend(c, r);
  });
  ASSERT_TRUE(eventually([&] {
    return metric_sum(scrape(server), "plsh_received_bytes_total") >= 3.0 * r.q.size() * sizeof(float);
  }, 30));
  kill(server.pid(), SIGTERM);
  EXPECT_TRUE(eventually([&] { return health(probe) == "NOT_SERVING"; }, 5));
  EXPECT_EQ(health(probe, "plsh.v1.Attention"), "NOT_SERVING");
  caller.join();
  EXPECT_TRUE(status.ok()) << client::status_string(status);  // the request in flight still finished
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// ------------------------------------------------------------ startup

TEST_F(Trust, RefusesToStartOnBadFilesNamingTheFlag) {
  TempDir dir;
  const std::string missing = dir.file("missing.pem");
  auto token_file = [&](const std::string& name, const std::string& text) {
    testing::write_file_atomically(dir.file(name), text);
    return dir.file(name);
  };
  const std::string digest = testing::sha256_hex("x");
  const struct {
    std::vector<std::string> flags;
    std::string expected;
  } cases[] = {
      {{"--tls-cert", missing, "--tls-key", pki("server.key")}, "--tls-cert = '" + missing + "': cannot read"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", missing}, "--tls-key = '" + missing + "': cannot read"},
      {{"--tls-cert", pki("server.key"), "--tls-key", pki("server.key")}, "no PEM certificate"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("server.crt")}, "no unencrypted PEM private key"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("encrypted.key")}, "no unencrypted PEM private key"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("client.key")}, "is not the key of the first certificate"},
      {{"--tls-cert", pki("server.crt")}, "--tls-cert is set without --tls-key"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("server.key"), "--tls-client-auth", "require"},
       "--tls-client-auth = require needs --tls-client-ca"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("server.key"), "--tls-client-ca", pki("ca.crt")},
       "--tls-client-ca is set with --tls-client-auth = none"},
      {{"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", "optional"}, "needs TLS"},
      {{"--tls-cert", pki("server.crt"), "--tls-key", pki("server.key"), "--tls-client-ca", pki("server.key"),
        "--tls-client-auth", "require"},
       "--tls-client-ca = '" + pki("server.key") + "': no PEM certificate"},
      {{"--token-file", missing}, "--token-file = '" + missing + "': cannot read"},
      {{"--token-file", token_file("a.json", "{\"clients\": [")}, "not valid JSON"},
      {{"--token-file", token_file("b.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"00\"}]}")},
       "clients[0] ('a'): sha256[0] is not 64 hex digits"},
      {{"--token-file", token_file("c.json", "{\"clients\": [{\"name\": \"a b\", \"sha256\": \"" + digest + "\"}]}")},
       "clients[0]: name is missing or not 1 to 64 of [A-Za-z0-9_.-]"},
      {{"--token-file", token_file("d.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\"}, {\"name\": \"a\", \"sha256\": []}]}")},
       "clients[1] ('a'): name is used by an earlier client"},
      {{"--token-file", token_file("e.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\"}, {\"name\": \"b\", \"sha256\": \"" + digest + "\"}]}")},
       "clients[1] ('b'): sha256[0] is also a token of clients[0] ('a')"},
      {{"--token-file", token_file("f.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\", \"max_stream\": 1}]}")},
       "clients[0] ('a'): unknown field 'max_stream'"},
      {{"--token-file", token_file("g.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\", \"methods\": [\"Attnd\"]}]}")},
       R"(methods has \"Attnd\", expected Attend, AttendUnary, GetInfo or)"},
      {{"--token-file", token_file("h.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\", \"max_reserved_bytes\": -1}]}")},
       "max_reserved_bytes = -1, expected an integer >= 0"},
      {{"--token-file", token_file("i.json", "[]")}, "expected a JSON object"},
  };
  const std::string key_body = testing::read_file(pki("server.key")).substr(40, 40);
  for (const auto& c : cases) {
    ServerProcess server(c.flags);
    EXPECT_FALSE(server.started()) << c.expected;
    EXPECT_EQ(server.terminate(), 2) << c.expected << "\n" << server.log();
    EXPECT_NE(server.log().find(c.expected), std::string::npos) << "expected: " << c.expected << "\nlog: " << server.log();
    EXPECT_EQ(server.log().find(key_body), std::string::npos);
  }
}

TEST_F(Trust, DefaultIsPlaintextWithoutTokensOrTheirMetrics) {
  ServerProcess server;
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_EQ(field(server.log(), "tls"), "off");
  EXPECT_EQ(field(server.log(), "tokens"), "off");
  EXPECT_EQ(field(server.log(), "health"), "off");
  Client c(server.grpc_address());
  EXPECT_TRUE(attend(c).ok());
  EXPECT_TRUE(info(c).ok());
  const std::string metrics = testing::http_get(server.metrics_address(), "/metrics");
  EXPECT_EQ(metrics.find("plsh_client_"), std::string::npos);
  EXPECT_EQ(metrics.find("plsh_token_"), std::string::npos);
  EXPECT_EQ(server.terminate(), 0);
  EXPECT_EQ(server.log().find("client="), std::string::npos);
}

}  // namespace
}  // namespace plsh
