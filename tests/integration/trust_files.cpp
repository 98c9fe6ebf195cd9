#include "trust_files.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace plsh::testing {

namespace {

// Lowercase hex, two digits a byte.
std::string hex(const unsigned char* bytes, size_t n) {
  static const char* const kHex = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < n; ++i) {
    text += kHex[bytes[i] >> 4];
    text += kHex[bytes[i] & 15];
  }
  return text;
}

}  // namespace

int run_command(const std::string& command, std::string* output) {
  FILE* pipe = popen(("(" + command + ") 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string text;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) text.append(buf, n);
  const int status = pclose(pipe);
  if (output != nullptr) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string make_pki(const std::string& dir) {
  // P-256 keys: quick to make. -days 2: valid through the test run.
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  auto ca = [&](const std::string& name) {
    return "openssl req -x509 " + ec + " -keyout " + name + ".key -out " + name + ".crt -days 2 -subj /CN=" + name;
  };
  auto leaf = [&](const std::string& name, const std::string& issuer, const std::string& cn, const std::string& ext) {
    return "openssl req " + ec + " -keyout " + name + ".key -out " + name + ".csr -subj /CN=" + cn +
           " && openssl x509 -req -in " + name + ".csr -CA " + issuer + ".crt -CAkey " + issuer +
           ".key -CAcreateserial" + " -out " + name + ".crt -days 2" + (ext.empty() ? "" : " -extfile " + ext);
  };
  const std::vector<std::string> steps = {
      "printf 'subjectAltName=DNS:plsh.test,IP:127.0.0.1\\n' > server.ext",
      ca("ca"),
      leaf("server", "ca", "plsh.test", "server.ext"),
      leaf("client", "ca", "client", ""),
      ca("other-ca"),
      leaf("other-client", "other-ca", "other-client", ""),
      "openssl pkey -in server.key -aes128 -passout pass:secret -out encrypted.key",
  };
  for (const std::string& step : steps) {
    std::string output;
    if (run_command("cd '" + dir + "' && " + step, &output) != 0) return step + ":\n" + output;
  }
  return "";
}

std::string random_token() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof bytes) != 1) throw std::runtime_error("RAND_bytes failed");
  return hex(bytes, sizeof bytes);
}

std::string sha256_hex(const std::string& text) {
  unsigned char digest[32];
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr);
  return hex(digest, sizeof digest);
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    out << text;
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace plsh::testing
