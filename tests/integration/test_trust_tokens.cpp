// Trust end to end (SPEC section 9, issue 12), bearer tokens: the real
// plsh-server on loopback with a token file, over plaintext and TLS;
// missing, wrong and not-allowed tokens; reloads without a restart;
// per-client limits on streams and reserved bytes while other clients are
// served; secrets kept out of logs, metrics and messages.
#include <gtest/gtest.h>
#include <signal.h>

#include "trust_test_util.h"

namespace plsh::trust {
namespace {

// ------------------------------------------------------------- tokens

TEST_F(Trust, BearerTokensOnAPlaintextListener) {
  const std::string full = testing::random_token(), getinfo = testing::random_token(), unary = testing::random_token();
  const TokenFile tokens({client_entry("full", {full}), client_entry("monitor", {getinfo}, {{"methods", {"GetInfo"}}}),
                          client_entry("unary", {unary}, {{"methods", {"AttendUnary", "GetInfo"}}})});
  ServerProcess server({"--token-file", tokens.path()});
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_NE(server.log().find("tokens=\"3 clients\""), std::string::npos) << server.log();
  const std::string addr = server.grpc_address();

  // Missing and wrong: UNAUTHENTICATED, every method.
  for (const std::string& token :
       {std::string(), testing::random_token(), full.substr(0, 63) + (full[63] == 'a' ? "b" : "a")}) {
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
  EXPECT_NE(denied.error_message().find("client 'monitor' may not call Attend"), std::string::npos)
      << denied.error_message();
  EXPECT_EQ(attend_unary(*monitor).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  std::unique_ptr<Client> u = connect(addr, plain(unary));
  EXPECT_EQ(attend(*u).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(attend_unary(*u).ok());

  // The scheme is case-insensitive (RFC 6750); another scheme, or two
  // authorization entries, are not credentials.
  auto rpc = testing::plaintext_attention_client(addr);
  auto call_info = [&](const std::vector<std::string>& values) {
    grpc::ClientContext ctx;
    for (const std::string& v : values) ctx.AddMetadata("authorization", v);
    v1::GetInfoResponse response;
    return rpc->GetInfo(&ctx, v1::GetInfoRequest{}, &response).error_code();
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
  EXPECT_EQ(metric_sum(m, "plsh_client_requests_total", {"client=\"unauthenticated\"", "code=\"UNAUTHENTICATED\""}),
            12);
  EXPECT_GT(metric_sum(m, "plsh_client_received_bytes_total", {"client=\"full\""}), 0);
  EXPECT_EQ(metric_sum(m, "plsh_token_file_clients"), 3);
  EXPECT_EQ(server.terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("client=monitor"), std::string::npos);
}

TEST_F(Trust, BearerTokensWithClientCertificates) {
  const std::string token = testing::random_token();
  const TokenFile tokens({client_entry("trainer", {token})});
  ServerProcess server(mtls_flags("require", {"--token-file", tokens.path()}));
  ASSERT_TRUE(server.started()) << server.log();
  ChannelOptions o = tls_as("client");
  EXPECT_EQ(info(*connect(server.grpc_address(), o)).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(health(*connect(server.grpc_address(), o)), "SERVING");
  o.token = token;
  std::unique_ptr<Client> c = connect(server.grpc_address(), o);
  EXPECT_TRUE(info(*c).ok());
  EXPECT_TRUE(attend(*c).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, TokenFileReloadsWithoutRestart) {
  const std::string a = testing::random_token(), b = testing::random_token();
  const TokenFile tokens({client_entry("a", {a})});
  ServerProcess server({"--token-file", tokens.path(), "--token-reload-interval", "0.2"});
  ASSERT_TRUE(server.started()) << server.log();
  std::unique_ptr<Client> ca = connect(server.grpc_address(), plain(a));
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  EXPECT_TRUE(info(*ca).ok());
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Add b.
  tokens.write({client_entry("a", {a}), client_entry("b", {b})});
  EXPECT_TRUE(eventually([&] { return info(*cb).ok(); })) << server.log();
  EXPECT_TRUE(info(*ca).ok());
  // Remove a.
  tokens.write({client_entry("b", {b})});
  EXPECT_TRUE(eventually([&] { return info(*ca).error_code() == grpc::StatusCode::UNAUTHENTICATED; })) << server.log();
  EXPECT_TRUE(attend(*cb).ok());
  // A file that no longer parses changes nothing, and says so.
  testing::write_file_atomically(tokens.path(), "{\"clients\": [");
  EXPECT_TRUE(eventually([&] {
    return metric_sum(scrape(server), "plsh_token_file_reloads_total", {"result=\"error\""}) == 1;
  })) << server.log();
  EXPECT_TRUE(info(*cb).ok());
  EXPECT_EQ(info(*ca).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // In place (not renamed) works too.
  { std::ofstream(tokens.path(), std::ios::trunc) << token_file_text({client_entry("a", {a})}); }
  EXPECT_TRUE(eventually([&] { return info(*ca).ok(); })) << server.log();
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  EXPECT_EQ(metric_sum(scrape(server), "plsh_token_file_reloads_total", {"result=\"ok\""}), 4);
  EXPECT_EQ(server.terminate(), 0) << server.log();
  EXPECT_NE(server.log().find("token_file_reload_failed"), std::string::npos);
}

TEST_F(Trust, TokenFileReloadsOnSighup) {
  const std::string a = testing::random_token(), b = testing::random_token();
  const TokenFile tokens({client_entry("a", {a})});
  ServerProcess server({"--token-file", tokens.path(), "--token-reload-interval", "0"});  // SIGHUP only
  ASSERT_TRUE(server.started()) << server.log();
  std::unique_ptr<Client> cb = connect(server.grpc_address(), plain(b));
  tokens.write({client_entry("a", {a}), client_entry("b", {b})});
  // Half a second in which nothing may happen (no event to wait on: the test is that the file is not polled).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(info(*cb).error_code(), grpc::StatusCode::UNAUTHENTICATED);  // no polling
  ASSERT_EQ(kill(server.pid(), SIGHUP), 0);
  EXPECT_TRUE(eventually([&] { return info(*cb).ok(); })) << server.log();
  EXPECT_TRUE(server.running());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// ------------------------------------------------- per-client limits

TEST_F(Trust, PerClientStreamLimitLeavesOtherClientsServed) {
  const std::string a = testing::random_token(), b = testing::random_token();
  const TokenFile tokens({client_entry("a", {a}, {{"max_streams", 1}}), client_entry("b", {b})});
  ServerProcess server({"--token-file", tokens.path(), "--workers", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  HeldStream held;
  ASSERT_TRUE(held.open(*rpc, a, Request()));

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
  EXPECT_TRUE(
      eventually([&] { return metric_sum(scrape(server), "plsh_client_open_streams", {"client=\"a\""}) == 0; }));
  EXPECT_TRUE(attend(*ca).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, PerClientReservedBytesLimitLeavesOtherClientsServed) {
  const std::string a = testing::random_token(), b = testing::random_token();
  const TokenFile tokens({client_entry("a", {a}), client_entry("b", {b})});
  ServerProcess server({"--token-file", tokens.path(), "--token-reload-interval", "0.1", "--workers", "2"});
  ASSERT_TRUE(server.started()) << server.log();
  auto rpc = testing::plaintext_attention_client(server.grpc_address());
  const Request request(2048);

  // One request of a's in flight: what it holds is its charge.
  HeldStream held;
  ASSERT_TRUE(held.open(*rpc, a, request));
  const double charge = metric_sum(scrape(server), "plsh_client_reserved_bytes", {"client=\"a\"", "space=\"host\""});
  ASSERT_GT(charge, 0);
  // Room for one and a half: a second one of a's does not fit, b's do.
  const auto limit = static_cast<int64_t>(charge * 1.5);
  tokens.write({client_entry("a", {a}, {{"max_reserved_bytes", limit}}), client_entry("b", {b})});
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
  const std::string token = testing::random_token(), getinfo = testing::random_token();
  const std::string near_miss = token.substr(0, 63) + (token[63] == '0' ? "1" : "0");
  const TokenFile tokens({client_entry("trainer", {token}, {{"max_streams", 1}}),
                          client_entry("monitor", {getinfo}, {{"methods", {"GetInfo"}}})});
  std::vector<std::string> flags = tls_flags();
  flags.insert(flags.end(), {"--token-file", tokens.path(), "--log-level", "debug"});
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
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = testing::read_file(pki("ca.crt"));
  auto rpc = v1::Attention::NewStub(grpc::CreateChannel(addr, grpc::SslCredentials(ssl)));
  for (const std::string& header : {"Basic " + token, "Bearer " + token + " extra", "Bearer " + near_miss}) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", header);
    v1::GetInfoResponse response;
    statuses.push_back(rpc->GetInfo(&ctx, v1::GetInfoRequest{}, &response));
  }
  // A client over its stream limit, so that refusal's message is seen too.
  HeldStream held;
  ASSERT_TRUE(held.open(*rpc, token, Request()));
  statuses.push_back(attend(*connect(addr, tls(token))));
  held.release();
  // A refused reload's message, with a raw token where a digest belongs.
  testing::write_file_atomically(tokens.path(), "{\"clients\": [{\"name\": \"x\", \"token\": \"" + token + "\"}]}");
  ASSERT_EQ(kill(server.pid(), SIGHUP), 0);
  ASSERT_TRUE(eventually([&] { return server.log().find("token_file_reload_failed") != std::string::npos; }));

  const std::string metrics = testing::http_get(server.metrics_address(), "/metrics");
  ASSERT_NE(metrics.find("plsh_client_requests_total{client=\"trainer\""), std::string::npos) << metrics;
  EXPECT_EQ(server.terminate(), 0);
  const std::string log = server.log();

  std::vector<std::string> secrets = {token, getinfo, near_miss, testing::sha256_hex(token),
                                      testing::sha256_hex(getinfo)};
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

}  // namespace
}  // namespace plsh::trust
