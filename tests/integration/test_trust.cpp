// Trust end to end (SPEC section 9, issue 12), transport: the real
// plsh-server on loopback with TLS and client certificates (made by openssl
// at test time), called through the C++ client library; the plaintext
// health-only listener; refusals to start on bad files; the default
// unchanged. Tokens: test_trust_tokens.cpp.
#include <gtest/gtest.h>
#include <signal.h>

#include "trust_test_util.h"

namespace plsh::trust {
namespace {

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
  ServerProcess server(mtls_flags("require"));
  ASSERT_TRUE(server.started()) << server.log();
  EXPECT_EQ(field(server.log(), "tls"), "mtls-require");
  const std::string addr = server.grpc_address();

  EXPECT_EQ(info(*connect(addr, tls())).error_code(), grpc::StatusCode::UNAVAILABLE);
  std::unique_ptr<Client> c = connect(addr, tls_as("client"));
  EXPECT_TRUE(info(*c).ok()) << client::status_string(info(*c));
  EXPECT_TRUE(attend(*c).ok());
  EXPECT_EQ(info(*connect(addr, tls_as("other-client"))).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST_F(Trust, ClientCertificatesOptional) {
  ServerProcess server(mtls_flags("optional"));
  ASSERT_TRUE(server.started()) << server.log();
  const std::string addr = server.grpc_address();
  EXPECT_TRUE(info(*connect(addr, tls())).ok());  // no certificate: let in
  EXPECT_TRUE(info(*connect(addr, tls_as("client"))).ok());
  // One sent must verify.
  EXPECT_EQ(info(*connect(addr, tls_as("other-client"))).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// --------------------------------------------------- health-only port

TEST_F(Trust, HealthOnlyListenerServesProbesWithoutCredentialsAndNothingElse) {
  const std::string token = testing::random_token();
  const TokenFile tokens({client_entry("trainer", {token})});
  ServerProcess server(mtls_flags("require", {"--token-file", tokens.path(), "--health-listen", "127.0.0.1:0"}));
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
  std::unique_ptr<Client> c = connect(server.grpc_address(), tls_as("client", token));
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
  ASSERT_TRUE(eventually(
      [&] { return metric_sum(scrape(server), "plsh_received_bytes_total") >= 3.0 * r.q.size() * sizeof(float); }, 30));
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
      {{"--token-file",
        token_file("f.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest + "\", \"max_stream\": 1}]}")},
       "clients[0] ('a'): unknown field 'max_stream'"},
      {{"--token-file", token_file("g.json", "{\"clients\": [{\"name\": \"a\", \"sha256\": \"" + digest +
                                                 "\", \"methods\": [\"Attnd\"]}]}")},
       R"(methods has \"Attnd\", expected Attend, AttendUnary, GetInfo, AttendBackward, ReleaseContext or)"},
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
    EXPECT_NE(server.log().find(c.expected), std::string::npos)
        << "expected: " << c.expected << "\nlog: " << server.log();
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
}  // namespace plsh::trust
