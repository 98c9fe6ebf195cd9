// The flags of every subcommand that talks to a plsh-server (attend, info,
// health, bench): TLS, client certificates and the bearer token, into the
// client library's ChannelOptions. Header-only: the subcommands link the
// client library, plsh_cli_support does not.
#pragma once

#include <CLI/CLI.hpp>

#include "plsh/client.h"

namespace plsh::cli {

// tokens: also --token and --token-file (health checks need none).
inline void add_connection_flags(CLI::App& app, client::ChannelOptions& o, bool tokens = true) {
  app.add_flag("--tls", o.tls, "connect with TLS, trusting the system's CA roots (implied by the other --tls-* flags)");
  app.add_option("--tls-ca", o.tls_ca, "PEM file of the CA(s) the server's certificate must chain to (implies --tls)");
  app.add_option("--tls-cert", o.tls_cert,
                 "PEM file of this client's certificate, for servers that ask for one (needs --tls-key)");
  app.add_option("--tls-key", o.tls_key, "PEM file of this client's private key");
  app.add_option("--tls-server-name", o.tls_server_name,
                 "name the server's certificate must carry (default: the host of --target)");
  if (!tokens) return;
  app.add_option("--token", o.token,
                 "bearer token for the server (prefer PLSH_TOKEN or --token-file: a command line is visible to other "
                 "users); never printed")
      ->envname("PLSH_TOKEN");
  app.add_option("--token-file", o.token_file, "file holding the bearer token (surrounding whitespace ignored)");
}

}  // namespace plsh::cli
