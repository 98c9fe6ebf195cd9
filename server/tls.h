// TLS for plsh-server's main listener (SPEC section 9): the certificate and
// key of --tls-cert/--tls-key, and client certificates verified against
// --tls-client-ca (--tls-client-auth optional or require). The files are read
// and checked with OpenSSL's libcrypto at start (gRPC itself links OpenSSL,
// so this adds no library to the image), so that a wrong file stops the
// start with a message naming the flag and the path, instead of gRPC's
// generic failure to bind. Messages never contain the files' bytes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "plsh/status.h"
#include "server/config.h"

namespace plsh::server {

// Insecure credentials without --tls-cert (the default); else TLS with the
// certificate chain and key, and client certificates as configured.
// INVALID_ARGUMENT naming the flag and the file when a file cannot be read,
// holds no PEM certificate or unencrypted private key, or the key does not
// match the certificate.
StatusOr<std::shared_ptr<grpc::ServerCredentials>> listener_credentials(const ServerConfig& config);

// For the "serving" log line: off, tls, mtls-optional or mtls-require.
std::string tls_mode(const ServerConfig& config);

}  // namespace plsh::server
