#include "server/tls.h"

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "server/logging.h"

namespace plsh::server {

namespace {

// PEM files are small; anything larger is not one.
constexpr std::streamsize kMaxPemBytes = 1 << 20;

// "--tls-cert = '/path'": how every message names a file.
std::string named(const char* flag, const std::string& path) {
  return std::string(flag) + " = '" + echo_value(path, 256) + "'";
}

StatusOr<std::string> read_pem_file(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid_argument(named(flag, path) + ": cannot read: " + std::strerror(errno));
  std::string bytes;
  bytes.resize(static_cast<size_t>(kMaxPemBytes) + 1);
  in.read(bytes.data(), kMaxPemBytes + 1);
  if (in.bad()) return invalid_argument(named(flag, path) + ": cannot read: " + std::strerror(errno));
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (static_cast<std::streamsize>(bytes.size()) > kMaxPemBytes)
    return invalid_argument(named(flag, path) + ": larger than 1 MiB, expected a PEM file");
  return bytes;
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyDeleter>;

BioPtr memory_bio(const std::string& bytes) {
  return BioPtr(BIO_new_mem_buf(bytes.data(), static_cast<int>(bytes.size())));
}

// Never asks for a passphrase (OpenSSL's default callback would prompt on
// the terminal): an encrypted key is refused instead.
extern "C" int no_passphrase(char*, int, int, void*) { return 0; }

// The certificates of a PEM file, in order (at least one).
StatusOr<std::vector<X509Ptr>> parse_certificates(const char* flag, const std::string& path, const std::string& pem) {
  std::vector<X509Ptr> certs;
  BioPtr bio = memory_bio(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, no_passphrase, nullptr)) certs.emplace_back(x);
  ERR_clear_error();  // the read that ends the loop leaves "no start line"
  if (certs.empty())
    return invalid_argument(named(flag, path) + ": no PEM certificate, expected '-----BEGIN CERTIFICATE-----' blocks");
  return certs;
}

StatusOr<KeyPtr> parse_private_key(const char* flag, const std::string& path, const std::string& pem) {
  BioPtr bio = memory_bio(pem);
  KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr));
  ERR_clear_error();
  if (!key)
    return invalid_argument(named(flag, path) +
                            ": no unencrypted PEM private key, expected '-----BEGIN PRIVATE KEY-----' (or an RSA/EC "
                            "key) without a passphrase");
  return key;
}

}  // namespace

std::string tls_mode(const ServerConfig& c) {
  if (!c.tls_enabled()) return "off";
  if (c.tls_client_auth == "none") return "tls";
  return "mtls-" + c.tls_client_auth;
}

StatusOr<std::shared_ptr<grpc::ServerCredentials>> listener_credentials(const ServerConfig& c) {
  if (!c.tls_enabled()) return grpc::InsecureServerCredentials();
  ASSIGN_OR_RETURN(const std::string cert_pem, read_pem_file("--tls-cert", c.tls_cert));
  ASSIGN_OR_RETURN(std::string key_pem, read_pem_file("--tls-key", c.tls_key));
  ASSIGN_OR_RETURN(const std::vector<X509Ptr> chain, parse_certificates("--tls-cert", c.tls_cert, cert_pem));
  StatusOr<KeyPtr> key = parse_private_key("--tls-key", c.tls_key, key_pem);
  if (!key.ok()) {
    OPENSSL_cleanse(key_pem.data(), key_pem.size());
    return key.status();
  }
  const bool matches = X509_check_private_key(chain.front().get(), key->get()) == 1;
  ERR_clear_error();
  if (!matches) {
    OPENSSL_cleanse(key_pem.data(), key_pem.size());
    return invalid_argument(named("--tls-key", c.tls_key) + " is not the key of the first certificate in " +
                            named("--tls-cert", c.tls_cert));
  }
  // Served all the same (clients will refuse it, which says more than a
  // server that does not start), but said at start.
  if (X509_cmp_current_time(X509_get0_notAfter(chain.front().get())) < 0)
    log_event(spdlog::level::warn, "tls_certificate_expired", {{"file", c.tls_cert}});

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (c.tls_client_auth != "none") {
    ASSIGN_OR_RETURN(const std::string ca_pem, read_pem_file("--tls-client-ca", c.tls_client_ca));
    RETURN_IF_ERROR(parse_certificates("--tls-client-ca", c.tls_client_ca, ca_pem).status());
    options.pem_root_certs = ca_pem;
    // optional: a client may send no certificate, but one it sends must
    // chain to the CA (a handshake with another CA's certificate fails).
    options.client_certificate_request = c.tls_client_auth == "require"
                                             ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                             : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  options.pem_key_cert_pairs.push_back({key_pem, cert_pem});
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::SslServerCredentials(options);
  // gRPC keeps its own copy; ours need not stay in memory.
  OPENSSL_cleanse(key_pem.data(), key_pem.size());
  OPENSSL_cleanse(options.pem_key_cert_pairs.front().private_key.data(),
                  options.pem_key_cert_pairs.front().private_key.size());
  return credentials;
}

}  // namespace plsh::server
