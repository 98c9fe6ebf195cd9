// Credentials made at test time for the trust tests: certificates made with
// the openssl command (Debian package openssl) in a temporary directory, and
// token files with the SHA-256 digests of random tokens.
#pragma once

#include <string>
#include <vector>

#include "temp_dir.h"  // TempDir, read_file

namespace plsh::testing {

// Two CAs and what they signed, as PEM files in dir:
//   ca.crt/ca.key                 the CA the server trusts for client certificates, and that signs server.crt
//   server.crt/server.key         SAN DNS:plsh.test, IP:127.0.0.1
//   client.crt/client.key         CN=client, signed by ca
//   other-ca.crt, other-client.crt/other-client.key   another CA and a client it signed
//   encrypted.key                 server.key under a passphrase
// Empty error on success, else what failed (with openssl's output).
std::string make_pki(const std::string& dir);

// A random token: 32 bytes as 64 hex digits.
std::string random_token();
// Lowercase hex SHA-256 of text.
std::string sha256_hex(const std::string& text);

// Writes text to path through a temporary file and a rename, as an
// operator's tool (or Kubernetes' Secret volume) would.
void write_file_atomically(const std::string& path, const std::string& text);

// Runs a command through sh; returns its exit status and puts stdout and
// stderr together in *output.
int run_command(const std::string& command, std::string* output = nullptr);

}  // namespace plsh::testing
