// What the trust tests (test_trust.cpp: TLS, client certificates, the
// health-only listener, startup; test_trust_tokens.cpp: tokens, reloads,
// per-client limits, secrets) share: a small request, call wrappers that
// return the status, token files, and the fixture that makes the test PKI
// once per suite.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "integration_util.h"
#include "plsh/params.h"
#include "trust_files.h"

namespace plsh::trust {

using client::ChannelOptions;
using testing::eventually;
using testing::scrape;
using testing::TempDir;

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
  AttendCall call() const { return testing::attend_call(options, q, k, v, 30); }
};

inline grpc::Status attend(Client& c, const Request& r = Request()) {
  AttendReply reply;
  return c.attend(r.call(), &reply);
}
inline grpc::Status attend_unary(Client& c, const Request& r = Request()) {
  AttendReply reply;
  return c.attend_unary(r.call(), &reply);
}
inline grpc::Status info(Client& c) {
  v1::GetInfoResponse response;
  return c.info(&response, 10);
}
inline std::string health(Client& c, const std::string& service = "") {
  std::string status;
  const grpc::Status s = c.health(service, &status, 10);
  return s.ok() ? status : client::status_string(s);
}

inline std::string field(const std::string& log, const std::string& key) {
  std::smatch m;
  return std::regex_search(log, m, std::regex(" serving .*" + key + "=([^ \n]+)")) ? m[1].str() : "";
}

// A token file client entry.
inline nlohmann::json client_entry(const std::string& name, const std::vector<std::string>& tokens,
                                   nlohmann::json extra = {}) {
  nlohmann::json digests = nlohmann::json::array();
  for (const std::string& t : tokens) digests.push_back(testing::sha256_hex(t));
  nlohmann::json c = {{"name", name}, {"sha256", digests}};
  for (auto it = extra.begin(); extra.is_object() && it != extra.end(); ++it) c[it.key()] = it.value();
  return c;
}
inline std::string token_file_text(const std::vector<nlohmann::json>& clients) {
  return nlohmann::json{{"version", 1}, {"clients", clients}}.dump(2);
}

// A token file in a directory of its own. write() replaces it atomically
// (a rename, as a deploy would), so a server that reloads it never reads
// half a file.
class TokenFile {
 public:
  // An initializer list, not a vector: TokenFile({one_client}) would
  // otherwise also read as a copy from a json (which converts to anything).
  explicit TokenFile(std::initializer_list<nlohmann::json> clients) { write(clients); }
  void write(const std::vector<nlohmann::json>& clients) const {
    testing::write_file_atomically(path_, token_file_text(clients));
  }
  const std::string& path() const { return path_; }

 private:
  TempDir dir_;
  std::string path_ = dir_.file("tokens.json");
};

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
  static std::vector<std::string> tls_flags() {
    return {"--tls-cert", pki("server.crt"), "--tls-key", pki("server.key")};
  }
  // tls_flags() and client certificates checked against the test CA
  // (client_auth "require" or "optional"), then `more`.
  static std::vector<std::string> mtls_flags(const std::string& client_auth,
                                             std::initializer_list<std::string> more = {}) {
    std::vector<std::string> flags = tls_flags();
    flags.insert(flags.end(), {"--tls-client-ca", pki("ca.crt"), "--tls-client-auth", client_auth});
    flags.insert(flags.end(), more);
    return flags;
  }

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
  // tls() presenting the certificate pki(name + ".crt") and its key:
  // "client" is signed by the test CA, "other-client" by another one.
  static ChannelOptions tls_as(const std::string& name, const std::string& token = "") {
    ChannelOptions o = tls(token);
    o.tls_cert = pki(name + ".crt");
    o.tls_key = pki(name + ".key");
    return o;
  }
  static ChannelOptions plain(const std::string& token = "") {
    ChannelOptions o;
    o.token = token;
    return o;
  }

  static inline TempDir* pki_ = nullptr;
  static inline std::string pki_error_;
};

// An Attend stream that has sent its header and holds what the server
// reserved for it until released.
struct HeldStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream;

  bool open(v1::Attention::Stub& rpc, const std::string& token, const Request& r) {
    ctx.AddMetadata("authorization", "Bearer " + token);
    stream = rpc.Attend(&ctx);
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

}  // namespace plsh::trust
