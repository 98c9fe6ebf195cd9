#include "server/auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <poll.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "server/logging.h"

namespace plsh::server {

namespace {

constexpr std::streamsize kMaxTokenFileBytes = 1 << 20;
constexpr size_t kMaxTokenBytes = 4096;
// Failed calls are labelled with this instead of a client's name.
constexpr const char* kUnauthenticatedLabel = "unauthenticated";

std::array<uint8_t, 32> sha256(const void* data, size_t size) {
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  EVP_Digest(data, size, digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

StatusOr<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return invalid_argument("--token-file = '" + echo_value(path, 256) + "': cannot read: " + std::strerror(errno));
  std::string bytes;
  bytes.resize(static_cast<size_t>(kMaxTokenFileBytes) + 1);
  in.read(bytes.data(), kMaxTokenFileBytes + 1);
  if (in.bad())
    return invalid_argument("--token-file = '" + echo_value(path, 256) + "': cannot read: " + std::strerror(errno));
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (static_cast<std::streamsize>(bytes.size()) > kMaxTokenFileBytes)
    return invalid_argument("--token-file = '" + echo_value(path, 256) + "': larger than 1 MiB");
  return bytes;
}

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 64 || name == kUnauthenticatedLabel) return false;
  for (const char ch : name)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.' || ch == '-')) return false;
  return true;
}

bool parse_hex_digest(const std::string& hex, std::array<uint8_t, 32>* out) {
  if (hex.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    int byte = 0;
    for (size_t j = 0; j < 2; ++j) {
      const char ch = hex[2 * i + j];
      const int v = ch >= '0' && ch <= '9'   ? ch - '0'
                    : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                    : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                             : -1;
      if (v < 0) return false;
      byte = byte * 16 + v;
    }
    (*out)[i] = static_cast<uint8_t>(byte);
  }
  return true;
}

std::string methods_text(uint8_t methods) {
  std::string text;
  for (Method m : kMethods)
    if (methods & static_cast<uint8_t>(m)) text += (text.empty() ? "" : ", ") + std::string(method_name(m));
  return text.empty() ? "nothing" : text;
}

}  // namespace

const char* method_name(Method method) {
  switch (method) {
    case Method::kAttend:
      return "Attend";
    case Method::kAttendUnary:
      return "AttendUnary";
    case Method::kGetInfo:
      return "GetInfo";
    case Method::kAttendBackward:
      return "AttendBackward";
    case Method::kReleaseContext:
      return "ReleaseContext";
    case Method::kRegisterSharedMemory:
      return "RegisterSharedMemory";
    case Method::kUnregisterSharedMemory:
      return "UnregisterSharedMemory";
    case Method::kListSharedMemory:
      return "ListSharedMemory";
  }
  return "unknown";
}

bool parse_method(const std::string& name, Method* method) {
  for (Method m : kMethods)
    if (name == method_name(m)) {
      *method = m;
      return true;
    }
  return false;
}

// ------------------------------------------------------------ ClientState

ClientState::ClientState(std::string name, ClientLimits limits, Metrics* metrics)
    : name_(std::move(name)), metrics_(metrics), limits_(limits) {
  std::lock_guard<std::mutex> lock(mutex_);
  publish();
}

void ClientState::publish() const {
  if (metrics_ == nullptr) return;
  metrics_->client_open_streams(name_, static_cast<double>(open_streams_));
  metrics_->client_reserved_bytes(name_, "host", static_cast<double>(reserved_.host_bytes));
  metrics_->client_reserved_bytes(name_, "device", static_cast<double>(reserved_.device_bytes));
}

Status ClientState::open_stream() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (limits_.max_streams > 0 && open_streams_ >= limits_.max_streams)
    return resource_exhausted("client '" + name_ + "': open streams = " + std::to_string(open_streams_ + 1) +
                              ", expected <= " + std::to_string(limits_.max_streams) +
                              " (its max_streams in the token file); retry when one of its calls ends");
  ++open_streams_;
  publish();
  return Status::Ok();
}

void ClientState::close_stream() {
  std::lock_guard<std::mutex> lock(mutex_);
  --open_streams_;
  publish();
}

Status ClientState::reserve(const MemoryCharge& charge) {
  std::lock_guard<std::mutex> lock(mutex_);
  const struct {
    int64_t reserved, requested, limit;
    const char *space, *field;
  } spaces[] = {{reserved_.host_bytes, charge.host_bytes, limits_.max_reserved_bytes, "host", "max_reserved_bytes"},
                {reserved_.device_bytes, charge.device_bytes, limits_.max_reserved_device_bytes, "device",
                 "max_reserved_device_bytes"}};
  for (const auto& s : spaces)
    if (s.limit > 0 && s.requested > 0 && s.reserved + s.requested > s.limit)
      return resource_exhausted("client '" + name_ + "': reserved " + s.space +
                                " bytes = " + std::to_string(s.reserved) + " + " + std::to_string(s.requested) +
                                " for this request, expected <= " + std::to_string(s.limit) + " (its " + s.field +
                                " in the token file); retry when its requests in flight finish");
  reserved_.host_bytes += charge.host_bytes;
  reserved_.device_bytes += charge.device_bytes;
  publish();
  return Status::Ok();
}

void ClientState::release(const MemoryCharge& charge) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_.host_bytes -= charge.host_bytes;
  reserved_.device_bytes -= charge.device_bytes;
  publish();
}

void ClientState::set_limits(const ClientLimits& limits) {
  std::lock_guard<std::mutex> lock(mutex_);
  limits_ = limits;
}

MemoryCharge ClientState::reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

ClientLimits ClientState::limits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limits_;
}

// ------------------------------------------------------------- the file

StatusOr<TokenTable> parse_token_file(const std::string& text, const std::string& path) {
  const std::string where = "--token-file = '" + echo_value(path, 256) + "'";
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // Not e.what(): it quotes the bytes it last read, which may be a digest.
    return invalid_argument(where + ": not valid JSON (error at byte " + std::to_string(e.byte) + ")");
  }
  if (!doc.is_object())
    return invalid_argument(where + ": expected a JSON object {\"version\": 1, \"clients\": [...]}");
  for (auto it = doc.begin(); it != doc.end(); ++it)
    if (it.key() != "version" && it.key() != "clients")
      return invalid_argument(where + ": unknown field '" + echo_value(it.key()) + "', expected version and clients");
  if (doc.contains("version") && !(doc["version"].is_number_integer() && doc["version"].get<int64_t>() == 1))
    return invalid_argument(where + ": version = " + echo_value(doc["version"].dump()) + ", expected 1");
  if (!doc.contains("clients") || !doc["clients"].is_array())
    return invalid_argument(
        where + ": clients is missing or not an array, expected \"clients\": [{\"name\": ..., \"sha256\": ...}]");

  TokenTable table;
  std::set<std::string> names;
  std::map<std::array<uint8_t, 32>, size_t> owner;  // digest -> client index
  const nlohmann::json& clients = doc["clients"];
  for (size_t i = 0; i < clients.size(); ++i) {
    const nlohmann::json& c = clients[i];
    std::string at = where + ": clients[" + std::to_string(i) + "]";
    if (!c.is_object()) return invalid_argument(at + " is not an object");
    if (!c.contains("name") || !c["name"].is_string() || !valid_name(c["name"].get<std::string>()))
      return invalid_argument(at + ": name is missing or not 1 to 64 of [A-Za-z0-9_.-] (and not 'unauthenticated')");
    TokenTable::Client client;
    client.name = c["name"].get<std::string>();
    at += " ('" + client.name + "')";
    if (!names.insert(client.name).second)
      return invalid_argument(at +
                              ": name is used by an earlier client, expected each name once (list a client's "
                              "tokens in its sha256 array)");
    for (auto it = c.begin(); it != c.end(); ++it) {
      static const std::set<std::string> known = {
          "name", "sha256", "methods", "max_streams", "max_reserved_bytes", "max_reserved_device_bytes", "comment"};
      if (known.count(it.key()) == 0)
        return invalid_argument(at + ": unknown field '" + echo_value(it.key()) +
                                "', expected name, sha256, methods, max_streams, max_reserved_bytes, "
                                "max_reserved_device_bytes or comment");
    }
    // Tokens.
    if (!c.contains("sha256"))
      return invalid_argument(at + ": sha256 is missing, expected the hex SHA-256 of each token");
    std::vector<nlohmann::json> digests;
    if (c["sha256"].is_string()) {
      digests.push_back(c["sha256"]);
    } else if (c["sha256"].is_array() && !c["sha256"].empty()) {
      for (const nlohmann::json& d : c["sha256"]) digests.push_back(d);
    } else {
      return invalid_argument(at + ": sha256 is not a string or a non-empty array of strings");
    }
    for (size_t j = 0; j < digests.size(); ++j) {
      TokenTable::Token token;
      token.client = i;
      if (!digests[j].is_string() || !parse_hex_digest(digests[j].get<std::string>(), &token.sha256))
        return invalid_argument(at + ": sha256[" + std::to_string(j) +
                                "] is not 64 hex digits, expected the SHA-256 of a token (the token itself never goes "
                                "in this file)");
      const auto [it, added] = owner.emplace(token.sha256, i);
      if (!added)
        return invalid_argument(at + ": sha256[" + std::to_string(j) + "] is also a token of clients[" +
                                std::to_string(it->second) + "] ('" + table.clients[it->second].name +
                                "'), expected each token to name one client");
      table.tokens.push_back(token);
    }
    // Methods.
    if (c.contains("methods")) {
      if (!c["methods"].is_array() || c["methods"].empty())
        return invalid_argument(at +
                                ": methods is not a non-empty array, expected some of Attend, AttendUnary, GetInfo, "
                                "AttendBackward, ReleaseContext, the shared-memory methods (RegisterSharedMemory, "
                                "UnregisterSharedMemory, ListSharedMemory), or \"*\"");
      client.methods = 0;
      for (const nlohmann::json& m : c["methods"]) {
        Method method{};
        if (m.is_string() && m.get<std::string>() == "*") {
          client.methods = kAllMethods;
        } else if (m.is_string() && parse_method(m.get<std::string>(), &method)) {
          client.methods |= static_cast<uint8_t>(method);
        } else {
          return invalid_argument(at + ": methods has " + echo_value(m.dump()) +
                                  ", expected Attend, AttendUnary, GetInfo, AttendBackward, ReleaseContext or a "
                                  "shared-memory method (RegisterSharedMemory, UnregisterSharedMemory, "
                                  "ListSharedMemory), or \"*\"");
        }
      }
    }
    // Limits.
    const std::pair<const char*, int64_t*> limits[] = {
        {"max_streams", &client.limits.max_streams},
        {"max_reserved_bytes", &client.limits.max_reserved_bytes},
        {"max_reserved_device_bytes", &client.limits.max_reserved_device_bytes}};
    for (const auto& [field, value] : limits) {
      if (!c.contains(field)) continue;
      const nlohmann::json& v = c[field];
      if (!v.is_number_integer() ||
          (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t{INT64_MAX} : v.get<int64_t>() < 0))
        return invalid_argument(at + ": " + field + " = " + echo_value(v.dump()) +
                                ", expected an integer >= 0 (0: no limit of its own)");
      *value = v.get<int64_t>();
    }
    table.clients.push_back(std::move(client));
  }
  return table;
}

// --------------------------------------------------------- Authenticator

StatusOr<std::unique_ptr<Authenticator>> Authenticator::load(const std::string& path, Metrics* metrics) {
  ASSIGN_OR_RETURN(const std::string text, read_file(path));
  ASSIGN_OR_RETURN(TokenTable table, parse_token_file(text, path));
  std::unique_ptr<Authenticator> auth(new Authenticator(path, metrics));
  auth->install(std::move(table), sha256(text.data(), text.size()));
  if (metrics != nullptr) metrics->token_file_reload(true);
  return auth;
}

Authenticator::~Authenticator() {
  if (watcher_.joinable()) {
    const char byte = 0;
    [[maybe_unused]] const ssize_t n = write(stop_pipe_[1], &byte, 1);
    watcher_.join();
  }
  for (int fd : stop_pipe_)
    if (fd >= 0) close(fd);
}

std::shared_ptr<const Authenticator::Snapshot> Authenticator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshot_;
}

void Authenticator::install(TokenTable table, const std::array<uint8_t, 32>& file_sha256) {
  auto next = std::make_shared<Snapshot>();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const TokenTable::Client& c : table.clients) {
    std::shared_ptr<ClientState>& state = by_name_[c.name];
    if (state)
      state->set_limits(c.limits);
    else
      state = std::make_shared<ClientState>(c.name, c.limits, metrics_);
    next->states.push_back(state);
  }
  next->table = std::move(table);
  snapshot_ = std::move(next);
  file_sha256_ = file_sha256;
  if (metrics_ != nullptr) metrics_->token_file_clients(static_cast<double>(snapshot_->table.clients.size()));
}

size_t Authenticator::client_count() const { return snapshot()->table.clients.size(); }

Authorization Authenticator::authorize(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                       Method method) const {
  const auto [first, last] = metadata.equal_range("authorization");
  const auto count = std::distance(first, last);
  if (count == 0)
    return {nullptr, unauthenticated("no credentials, expected the metadata 'authorization: Bearer <token>'")};
  if (count > 1)
    return {nullptr,
            unauthenticated(std::to_string(count) + " authorization metadata entries, expected one 'Bearer <token>'")};
  // RFC 6750: the scheme is case-insensitive; the token follows one or more spaces.
  const grpc::string_ref ref = first->second;
  const std::string_view value(ref.data(), ref.size());
  constexpr size_t kScheme = 6;  // "Bearer"
  if (value.size() < kScheme + 1 || strncasecmp(value.data(), "bearer", kScheme) != 0 || value[kScheme] != ' ')
    return {nullptr, unauthenticated("the authorization metadata is not 'Bearer <token>'")};
  size_t start = kScheme;
  while (start < value.size() && value[start] == ' ') ++start;
  const size_t length = value.size() - start;
  if (length == 0) return {nullptr, unauthenticated("an empty bearer token, expected 'Bearer <token>'")};
  if (length > kMaxTokenBytes)
    return {nullptr, unauthenticated("a bearer token of " + std::to_string(length) + " bytes, expected at most " +
                                     std::to_string(kMaxTokenBytes))};

  const std::array<uint8_t, 32> digest = sha256(value.data() + start, length);
  const std::shared_ptr<const Snapshot> snap = snapshot();
  // Every digest is compared, in constant time each; a match only selects
  // the index (what took how long reveals nothing of the token's bytes).
  size_t found = SIZE_MAX;
  for (size_t i = 0; i < snap->table.tokens.size(); ++i) {
    const bool equal = CRYPTO_memcmp(digest.data(), snap->table.tokens[i].sha256.data(), digest.size()) == 0;
    found = equal ? i : found;
  }
  if (found == SIZE_MAX)
    return {nullptr,
            unauthenticated("the bearer token is not valid on this server (unknown, or removed from its token file)")};
  const size_t index = snap->table.tokens[found].client;
  const TokenTable::Client& client = snap->table.clients[index];
  if ((client.methods & static_cast<uint8_t>(method)) == 0)
    return {snap->states[index], permission_denied("client '" + client.name + "' may not call " + method_name(method) +
                                                   ": its token file entry allows " + methods_text(client.methods))};
  return {snap->states[index], Status::Ok()};
}

void Authenticator::reload() {
  StatusOr<std::string> text = read_file(path_);
  StatusOr<TokenTable> table = text.status();
  std::array<uint8_t, 32> file_sha256{};
  if (text.ok()) {
    file_sha256 = sha256(text->data(), text->size());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (file_sha256 == file_sha256_) return;  // unchanged
    }
    table = parse_token_file(*text, path_);
  }
  if (!table.ok()) {
    log_event(spdlog::level::err, "token_file_reload_failed",
              {{"error", table.status().message()}, {"kept_clients", client_count()}});
    if (metrics_ != nullptr) metrics_->token_file_reload(false);
    // Not again until the file changes once more.
    if (text.ok()) {
      std::lock_guard<std::mutex> lock(mutex_);
      file_sha256_ = file_sha256;
    }
    return;
  }
  nlohmann::json names = nlohmann::json::array();
  for (const TokenTable::Client& c : table->clients) names.push_back(c.name);
  const size_t tokens = table->tokens.size();
  install(std::move(table).value(), file_sha256);
  if (metrics_ != nullptr) metrics_->token_file_reload(true);
  log_event(spdlog::level::info, "token_file_loaded", {{"file", path_}, {"clients", names}, {"tokens", tokens}});
}

void Authenticator::watch(double interval_seconds, int wake_fd) {
  if (watcher_.joinable() || pipe(stop_pipe_) != 0) return;
  const int timeout_ms = interval_seconds > 0 ? std::max(1, static_cast<int>(interval_seconds * 1000)) : -1;
  watcher_ = std::thread([this, timeout_ms, wake_fd] {
    for (;;) {
      pollfd fds[2] = {{stop_pipe_[0], POLLIN, 0}, {wake_fd, POLLIN, 0}};
      const int ready = poll(fds, wake_fd >= 0 ? 2 : 1, timeout_ms);
      if (ready < 0 && errno == EINTR) continue;
      if (fds[0].revents != 0) return;
      if (wake_fd >= 0 && (fds[1].revents & POLLIN)) {
        char bytes[64];
        [[maybe_unused]] const ssize_t n = read(wake_fd, bytes, sizeof bytes);
      }
      reload();
    }
  });
}

}  // namespace plsh::server
