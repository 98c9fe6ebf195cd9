// Who may call what (SPEC section 9): bearer tokens from a token file that
// names each client, the methods it may call and its share of the server.
//
// The token file (--token-file), JSON:
//
//   {
//     "version": 1,
//     "clients": [
//       {"name": "trainer",                       // [A-Za-z0-9_.-]{1,64}: logs and metrics say it
//        "sha256": ["9f86d081...", "60303ae2..."], // hex SHA-256 of each of its tokens (several: rotation)
//        "methods": ["Attend", "AttendUnary", "GetInfo"],  // optional; default all ("*"); also
//                                                  // AttendBackward, ReleaseContext, RegisterSharedMemory,
//                                                  // UnregisterSharedMemory, ListSharedMemory
//        "max_streams": 4,                        // optional; Attend/AttendUnary/AttendBackward calls open at once
//        "max_reserved_bytes": 8589934592,        // optional; host bytes its requests in flight hold
//        "max_reserved_device_bytes": 0},         // optional; device bytes likewise; 0 or absent: no own limit
//       {"name": "dashboard", "sha256": "2c26b46b...", "methods": ["GetInfo"]}
//     ]
//   }
//
// Digests, not tokens: whoever reads the file (a backup, a copy of the
// Secret, a debug dump) cannot call the server with what it holds, and the
// server never keeps a raw token beyond the call that presents it. Tokens
// are random (`openssl rand -hex 32`), so an unsalted fast hash is enough;
// a password hash would only slow every call. Make one with
// `printf %s "$TOKEN" | sha256sum`.
//
// A presented token is hashed and compared with every digest by
// CRYPTO_memcmp, without stopping at a match: the time taken depends on the
// token's length and the number of digests, not on how much of a digest
// matched. Each call's metadata is checked in the service (CallBase::open,
// GetInfo) rather than in a gRPC AuthMetadataProcessor, which runs only on
// secure listeners: tokens work the same over TLS and on a plaintext
// loopback listener. grpc.health.v1 and reflection stay open (they carry
// no data).
//
// The file is re-read every --token-reload-interval seconds and on SIGHUP;
// a change takes effect for new calls (calls in flight keep their client).
// A file that no longer parses is refused and the previous clients stay,
// with an error in the log and plsh_token_file_reloads_total{result="error"}:
// a bad edit neither locks everyone out nor lets anyone in.
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plsh/status.h"
#include "server/memory_budget.h"
#include "server/metrics.h"

namespace plsh::server {

// The calls a token may be allowed, as bits.
enum class Method : uint8_t {
  kAttend = 1 << 0,
  kAttendUnary = 1 << 1,
  kGetInfo = 1 << 2,
  kRegisterSharedMemory = 1 << 3,
  kUnregisterSharedMemory = 1 << 4,
  kListSharedMemory = 1 << 5,
  kAttendBackward = 1 << 6,
  kReleaseContext = 1 << 7,
};
constexpr uint8_t kAllMethods = 255;
inline constexpr Method kMethods[] = {Method::kAttend,
                                      Method::kAttendUnary,
                                      Method::kGetInfo,
                                      Method::kAttendBackward,
                                      Method::kReleaseContext,
                                      Method::kRegisterSharedMemory,
                                      Method::kUnregisterSharedMemory,
                                      Method::kListSharedMemory};
const char* method_name(Method method);
// "Attend" -> kAttend; false for any other name.
bool parse_method(const std::string& name, Method* method);

// A client's own limits; 0: none beyond the server's.
struct ClientLimits {
  int64_t max_streams = 0;                // Attend/AttendUnary/AttendBackward calls open at once
  int64_t max_reserved_bytes = 0;         // host bytes (tensors + host workspace) of its requests in flight
  int64_t max_reserved_device_bytes = 0;  // device bytes of its requests in flight
};

// One client's share of the server: its open streams and reserved bytes,
// shared by every token of the client and kept across reloads (a call holds
// it until it closes, so counts stay right when the file changes).
class ClientState {
 public:
  ClientState(std::string name, ClientLimits limits, Metrics* metrics);

  const std::string& name() const { return name_; }
  // RESOURCE_EXHAUSTED naming the client and its limit when it has
  // max_streams open already.
  Status open_stream();
  void close_stream();
  // Both spaces against the client's limits, all or nothing.
  Status reserve(const MemoryCharge& charge);
  void release(const MemoryCharge& charge);
  void set_limits(const ClientLimits& limits);
  // What it holds now, and its limits (kept contexts: contexts.h).
  MemoryCharge reserved() const;
  ClientLimits limits() const;

 private:
  void publish() const;  // the gauges, with mutex_ held

  const std::string name_;
  Metrics* metrics_;
  mutable std::mutex mutex_;
  ClientLimits limits_;
  int64_t open_streams_ = 0;
  MemoryCharge reserved_;
};

// A token file, parsed.
struct TokenTable {
  struct Client {
    std::string name;
    uint8_t methods = kAllMethods;
    ClientLimits limits;
  };
  struct Token {
    std::array<uint8_t, 32> sha256{};
    size_t client = 0;  // index into clients
  };
  std::vector<Client> clients;
  std::vector<Token> tokens;
};

// The text of a token file -> its table, or INVALID_ARGUMENT naming the
// path, the client (by index and name) and the field. Unknown fields are
// refused (a misspelt limit must not silently mean "none"). A digest's
// value is never echoed.
StatusOr<TokenTable> parse_token_file(const std::string& text, const std::string& path);

// What a call's credentials allow: the client, when its token is known
// (also when the call is refused for its method), and the status to refuse
// it with (OK: go on).
struct Authorization {
  std::shared_ptr<ClientState> client;
  Status status;
};

class Authenticator {
 public:
  // Reads and parses the file; any error fails the start.
  static StatusOr<std::unique_ptr<Authenticator>> load(const std::string& path, Metrics* metrics);
  ~Authenticator();

  // The client whose token is in the call's `authorization: Bearer <token>`
  // metadata, if it may call `method`: UNAUTHENTICATED without one valid
  // token, PERMISSION_DENIED when its entry does not allow the method.
  Authorization authorize(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, Method method) const;

  // Re-reads the file; a change of its bytes replaces the table, a file
  // that does not parse keeps the old one. Logs and counts either.
  void reload();
  // Reloads every interval_seconds (0: never by itself) and whenever a byte
  // arrives on wake_fd (SIGHUP's pipe; -1: none), on a thread of its own
  // until destroyed.
  void watch(double interval_seconds, int wake_fd);

  size_t client_count() const;

 private:
  Authenticator(std::string path, Metrics* metrics) : path_(std::move(path)), metrics_(metrics) {}
  // What a call reads, swapped whole on a reload.
  struct Snapshot {
    TokenTable table;
    std::vector<std::shared_ptr<ClientState>> states;  // parallel to table.clients
  };
  // Swaps in a parsed table; keeps the ClientStates of names still there.
  void install(TokenTable table, const std::array<uint8_t, 32>& file_sha256);
  std::shared_ptr<const Snapshot> snapshot() const;

  const std::string path_;
  Metrics* metrics_;
  mutable std::mutex mutex_;
  std::shared_ptr<const Snapshot> snapshot_;
  std::map<std::string, std::shared_ptr<ClientState>> by_name_;  // every client ever loaded (reload only)
  std::array<uint8_t, 32> file_sha256_{};
  int stop_pipe_[2] = {-1, -1};
  std::thread watcher_;
};

}  // namespace plsh::server
