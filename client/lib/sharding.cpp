// ShardedClient (plsh/sharding.h): resolves the replicas, sends each shard
// of a plan on its own thread through the plain Client, retries failed
// shards on other replicas, and stitches the outputs in place.
#include "plsh/sharding.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "plsh/numeric.h"

namespace plsh::client {

namespace {

using Clock = std::chrono::steady_clock;

// A replica that answered UNAVAILABLE is passed over by new shards for this
// long (it is still tried when no other replica is left).
constexpr auto kDownFor = std::chrono::seconds(5);

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

grpc::Status to_grpc(const Status& s) {
  return s.ok() ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    items.push_back(trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

// "dns:[//authority/]host:port" -> every address of host (the system's
// resolver; the authority, a DNS server for gRPC's resolver, is not used).
grpc::Status resolve_dns(const std::string& item, std::vector<std::string>* out, std::string* host_out) {
  std::string rest = item.substr(4);
  if (rest.rfind("//", 0) == 0) {
    const size_t slash = rest.find('/', 2);
    rest = slash == std::string::npos ? "" : rest.substr(slash + 1);
  }
  std::string host, port;
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    if (close != std::string::npos && close + 1 < rest.size() && rest[close + 1] == ':') {
      host = rest.substr(1, close - 1);
      port = rest.substr(close + 2);
    }
  } else if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty() || port.empty() || port.find_first_not_of("0123456789") != std::string::npos)
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "target = '" + echo_value(item) + "', expected dns:///host:port (or dns://authority/host:port)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "target = '" + echo_value(item) + "': cannot resolve " +
                                                           echo_value(host) + ": " + gai_strerror(rc));
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof text);
      out->push_back("ipv4:" + std::string(text) + ":" + port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, text, sizeof text);
      out->push_back("ipv6:[" + std::string(text) + "]:" + port);
    }
  }
  freeaddrinfo(found);
  *host_out = host;
  return grpc::Status::OK;
}

bool retryable(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:         // down, unreachable, draining
    case grpc::StatusCode::RESOURCE_EXHAUSTED:  // its queue or budget is full; another may have room
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INTERNAL:  // a bug on that replica, or a broken stream
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::CANCELLED:          // the replica cancelled (we never do)
    case grpc::StatusCode::DEADLINE_EXCEEDED:  // the replica's own stream timeouts (the call's deadline is checked
                                               // apart)
      return true;
    default:
      return false;
  }
}

std::string make_request_id() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(r));
  return std::string("sharded-") + buf;
}

// A shard's q, k and v: pointers into the call's tensors where its slab is
// contiguous there, else gathered copies.
struct ShardInputs {
  std::vector<uint8_t> q, k, v;
  const void *q_ptr = nullptr, *k_ptr = nullptr, *v_ptr = nullptr;
};

// Copies `count` rows of `part` bytes, each `from_stride` apart from
// `from`, to consecutive rows of dst.
void gather_rows(const uint8_t* from, int64_t from_stride, int64_t count, int64_t part, uint8_t* dst) {
  for (int64_t r = 0; r < count; ++r) std::memcpy(dst + r * part, from + r * from_stride, static_cast<size_t>(part));
}

ShardInputs gather(const AttendCall& call, const AttentionParams& p, const ShardPlan& plan, const ShardSpec& s) {
  ShardInputs in;
  in.q_ptr = call.q;
  in.k_ptr = call.k;
  in.v_ptr = call.v;
  const int64_t e = static_cast<int64_t>(dtype_bytes(p.dtype));
  const int64_t q_row = p.heads * p.head_dim * e, kv_row = p.kv_heads * p.head_dim * e;
  const auto* q = static_cast<const uint8_t*>(call.q);
  const auto* k = static_cast<const uint8_t*>(call.k);
  const auto* v = static_cast<const uint8_t*>(call.v);
  if (plan.kind == ShardKind::kHeads) {
    const int64_t q_part = (s.head_end - s.head_begin) * p.head_dim * e;
    const int64_t kv_part = (s.kv_head_end - s.kv_head_begin) * p.head_dim * e;
    const int64_t q_rows = p.batch * p.q_len, kv_rows = p.batch * p.kv_len;
    in.q.resize(static_cast<size_t>(q_rows * q_part));
    in.k.resize(static_cast<size_t>(kv_rows * kv_part));
    in.v.resize(in.k.size());
    gather_rows(q + s.head_begin * p.head_dim * e, q_row, q_rows, q_part, in.q.data());
    gather_rows(k + s.kv_head_begin * p.head_dim * e, kv_row, kv_rows, kv_part, in.k.data());
    gather_rows(v + s.kv_head_begin * p.head_dim * e, kv_row, kv_rows, kv_part, in.v.data());
    in.q_ptr = in.q.data();
    in.k_ptr = in.k.data();
    in.v_ptr = in.v.data();
  } else if (plan.kind == ShardKind::kSequence) {
    const int64_t rows = s.row_end - s.row_begin, keys = s.key_end - s.key_begin;
    if (p.batch == 1) {  // one contiguous slab each: sent from where it lies
      in.q_ptr = q + s.row_begin * q_row;
      in.k_ptr = k + s.key_begin * kv_row;
      in.v_ptr = v + s.key_begin * kv_row;
    } else {
      in.q.resize(static_cast<size_t>(p.batch * rows * q_row));
      in.k.resize(static_cast<size_t>(p.batch * keys * kv_row));
      in.v.resize(in.k.size());
      for (int64_t b = 0; b < p.batch; ++b) {
        std::memcpy(in.q.data() + b * rows * q_row, q + (b * p.q_len + s.row_begin) * q_row,
                    static_cast<size_t>(rows * q_row));
        std::memcpy(in.k.data() + b * keys * kv_row, k + (b * p.kv_len + s.key_begin) * kv_row,
                    static_cast<size_t>(keys * kv_row));
        std::memcpy(in.v.data() + b * keys * kv_row, v + (b * p.kv_len + s.key_begin) * kv_row,
                    static_cast<size_t>(keys * kv_row));
      }
      in.q_ptr = in.q.data();
      in.k_ptr = in.k.data();
      in.v_ptr = in.v.data();
    }
  }
  return in;
}

// The shard's out (and lse) into their places in the request's.
void stitch(const AttentionParams& p, const ShardPlan& plan, const ShardSpec& s, const AttendReply& part,
            AttendReply* whole) {
  const int64_t e = static_cast<int64_t>(dtype_bytes(p.out_dtype));
  const int64_t heads = s.head_end - s.head_begin, rows = s.row_end - s.row_begin;
  const int64_t out_row = p.heads * p.head_dim * e, part_row = heads * p.head_dim * e;
  const bool lse = !whole->lse.empty();
  for (int64_t b = 0; b < p.batch; ++b) {
    if (plan.kind == ShardKind::kSequence || plan.kind == ShardKind::kSingle) {
      std::memcpy(whole->out.data() + (b * p.q_len + s.row_begin) * out_row, part.out.data() + b * rows * out_row,
                  static_cast<size_t>(rows * out_row));
      if (lse)
        std::memcpy(whole->lse.data() + (b * p.q_len + s.row_begin) * p.heads, part.lse.data() + b * rows * p.heads,
                    static_cast<size_t>(rows * p.heads) * sizeof(float));
      continue;
    }
    for (int64_t n = 0; n < p.q_len; ++n) {
      const int64_t r = b * p.q_len + n;
      std::memcpy(whole->out.data() + r * out_row + s.head_begin * p.head_dim * e, part.out.data() + r * part_row,
                  static_cast<size_t>(part_row));
      if (lse)
        std::memcpy(whole->lse.data() + r * p.heads + s.head_begin, part.lse.data() + r * heads,
                    static_cast<size_t>(heads) * sizeof(float));
    }
  }
}

// Per shard head: mean ||out_i||^2 over the shard's rows (the probe's weights).
std::vector<double> out_mean_square(const AttentionParams& p, int64_t heads, const AttendReply& part) {
  const int64_t rows =
      static_cast<int64_t>(part.out.size() / dtype_bytes(p.out_dtype)) / std::max<int64_t>(1, heads * p.head_dim);
  std::vector<double> sums(static_cast<size_t>(heads), 0.0);
  std::vector<float> row(static_cast<size_t>(heads * p.head_dim));
  for (int64_t r = 0; r < rows; ++r) {
    load_row(part.out.data(), p.out_dtype, r * heads * p.head_dim, heads * p.head_dim, row.data());
    for (int64_t h = 0; h < heads; ++h) {
      double s = 0;
      for (int64_t d = 0; d < p.head_dim; ++d)
        s += static_cast<double>(row[h * p.head_dim + d]) * row[h * p.head_dim + d];
      sums[static_cast<size_t>(h)] += s;
    }
  }
  for (double& s : sums) s /= static_cast<double>(std::max<int64_t>(1, rows));
  return sums;
}

}  // namespace

bool is_replica_list(const std::string& targets) {
  const std::string t = trim(targets);
  return t.find(',') != std::string::npos || t.rfind("dns:", 0) == 0;
}

grpc::Status resolve_replicas(const std::string& targets, std::vector<std::string>* replicas, std::string* tls_name) {
  replicas->clear();
  tls_name->clear();
  std::vector<std::string> all;
  const std::vector<std::string> items = split_commas(targets);
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string& item = items[i];
    if (item.empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "target = '" + echo_value(targets) + "': item " +
                                                                  std::to_string(i) + " is empty, expected host:port");
    if (item.rfind("dns:", 0) != 0) {
      all.push_back(item);
      continue;
    }
    std::string host;
    if (grpc::Status s = resolve_dns(item, &all, &host); !s.ok()) return s;
    if (tls_name->empty()) *tls_name = host;
  }
  for (const std::string& t : all)
    if (std::find(replicas->begin(), replicas->end(), t) == replicas->end()) replicas->push_back(t);
  if (replicas->empty())
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "target = '" + echo_value(targets) + "': no address");
  return grpc::Status::OK;
}

grpc::Status ShardedClient::connect(const std::string& targets, const ChannelOptions& options,
                                    std::unique_ptr<ShardedClient>* client) {
  std::vector<std::string> replicas;
  std::string tls_name;
  if (grpc::Status s = resolve_replicas(targets, &replicas, &tls_name); !s.ok()) return s;
  ChannelOptions o = options;
  // Addresses found by name: the certificate still carries the name.
  if (o.uses_tls() && o.tls_server_name.empty() && !tls_name.empty()) o.tls_server_name = tls_name;
  return connect(replicas, o, client);
}

grpc::Status ShardedClient::connect(const std::vector<std::string>& replicas, const ChannelOptions& options,
                                    std::unique_ptr<ShardedClient>* client) {
  if (replicas.empty())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "replicas: none, expected at least one");
  std::unique_ptr<ShardedClient> c(new ShardedClient());
  for (const std::string& target : replicas) {
    std::unique_ptr<Client> one;
    if (grpc::Status s = Client::connect(target, options, &one); !s.ok()) return s;
    c->clients_.push_back(std::move(one));
  }
  c->replicas_ = replicas;
  c->in_flight_.assign(replicas.size(), 0);
  c->down_until_.assign(replicas.size(), Clock::time_point{});
  *client = std::move(c);
  return grpc::Status::OK;
}

size_t ShardedClient::pick_replica(size_t preferred, const std::vector<bool>& tried) {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t n = replicas_.size();
  const Clock::time_point now = Clock::now();
  bool any_untried = false;
  for (size_t r = 0; r < n; ++r) any_untried = any_untried || !tried[r];
  size_t best = n;
  auto rank = [&](size_t r) {  // lower is better: (down, in flight)
    return std::pair<int, int>{down_until_[r] > now ? 1 : 0, in_flight_[r]};
  };
  for (size_t step = 0; step < n; ++step) {
    const size_t r = (preferred + step) % n;
    if (any_untried && tried[r]) continue;
    if (best == n || rank(r) < rank(best)) best = r;
  }
  ++in_flight_[best];
  return best;
}

void ShardedClient::mark_down(size_t replica) {
  std::lock_guard<std::mutex> lock(mutex_);
  down_until_[replica] = Clock::now() + kDownFor;
}

struct ShardedClient::Run {
  const AttendCall* call = nullptr;
  AttentionParams params;  // the whole request, resolved
  ShardPlan plan;
  std::string request_id;
  size_t first_replica = 0;
  Clock::time_point deadline = Clock::time_point::max();
  int max_attempts = 1;
  AttendReply* merged = nullptr;
  std::vector<ShardReport> reports;
  std::vector<ShardResult> results;
  std::vector<grpc::Status> status;
  std::vector<int64_t> sent, received, messages, largest;  // over every attempt
  std::atomic<bool> failed{false};
  std::atomic<int> retries{0};
};

void ShardedClient::run_shard(Run& run, size_t index) {
  const ShardSpec& spec = run.plan.shards[index];
  ShardReport& report = run.reports[index];
  report.spec = spec;
  const ShardInputs inputs = gather(*run.call, run.params, run.plan, spec);
  AttendCall call = *run.call;
  call.options = shard_options(run.call->options, run.plan, spec);
  call.q = inputs.q_ptr;
  call.k = inputs.k_ptr;
  call.v = inputs.v_ptr;
  call.out = nullptr;  // a shard's output is stitched from its reply
  call.lse = nullptr;
  // One shard is the request itself, under the caller's id (or the server's).
  const bool single = run.plan.kind == ShardKind::kSingle;
  const std::string id =
      single ? run.call->request_id
             : run.request_id + "/" + std::to_string(index + 1) + "of" + std::to_string(run.plan.shards.size());
  std::vector<bool> tried(replicas_.size(), false);
  const size_t preferred = (run.first_replica + index) % replicas_.size();
  grpc::Status last;
  for (int attempt = 1;; ++attempt) {
    if (run.failed.load()) {
      run.status[index] = grpc::Status(grpc::StatusCode::ABORTED, "not sent again: another shard failed");
      return;
    }
    const Clock::time_point start = Clock::now();
    if (run.deadline != Clock::time_point::max()) {
      if (start >= run.deadline) {
        run.status[index] = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                         "shard " + std::to_string(index + 1) + ": the call's deadline passed" +
                                             (last.ok() ? "" : " after " + status_string(last)));
        run.failed.store(true);
        return;
      }
      call.deadline_seconds = seconds_between(start, run.deadline);
    }
    call.request_id = attempt == 1 || id.empty() ? id : id + "/retry" + std::to_string(attempt - 1);
    const size_t r = pick_replica(preferred, tried);
    AttendReply reply;
    const grpc::Status s = clients_[r]->attend(call, &reply);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_[r];
    }
    const Clock::time_point end = Clock::now();
    run.sent[index] += reply.sent_bytes;
    run.received[index] += reply.received_bytes;
    run.messages[index] += reply.messages;
    run.largest[index] = std::max(run.largest[index], reply.largest_message_bytes);
    report.attempts = attempt;
    if (s.ok()) {
      const int64_t expected_out = run.params.batch * (spec.row_end - spec.row_begin) *
                                   (spec.head_end - spec.head_begin) * run.params.head_dim *
                                   static_cast<int64_t>(dtype_bytes(run.params.out_dtype));
      if (reply.out_dtype != run.params.out_dtype || static_cast<int64_t>(reply.out.size()) != expected_out) {
        run.status[index] =
            grpc::Status(grpc::StatusCode::INTERNAL, "shard " + std::to_string(index + 1) + " from " + replicas_[r] +
                                                         ": output of the wrong size or dtype");
        run.failed.store(true);
        return;
      }
      if (single) {
        run.merged->out = std::move(reply.out);
        run.merged->lse = std::move(reply.lse);
      } else {
        stitch(run.params, run.plan, spec, reply, run.merged);
      }
      report.replica = replicas_[r];
      report.request_id = reply.request_id;
      report.seconds = seconds_between(start, end);
      report.timings = reply.timings;
      report.backend = reply.result.backend;
      report.lsh_algorithm = reply.result.lsh_algorithm;
      report.sent_bytes = reply.sent_bytes;
      report.received_bytes = reply.received_bytes;
      ShardResult& result = run.results[index];
      if (!single && run.params.mode != Mode::kExact && run.params.estimates)
        result.out_mean_square = out_mean_square(run.params, spec.head_end - spec.head_begin, reply);
      result.result = std::move(reply.result);
      return;
    }
    last = s;
    report.failures.push_back({replicas_[r], status_string(s), seconds_between(start, end)});
    tried[r] = true;
    const bool out_of_time = run.deadline != Clock::time_point::max() && end >= run.deadline;
    if (!retryable(s.error_code()) || out_of_time || attempt >= run.max_attempts) {
      run.status[index] =
          grpc::Status(s.error_code(), "shard " + std::to_string(index + 1) + " of " +
                                           std::to_string(run.plan.shards.size()) + " on " + replicas_[r] +
                                           (attempt > 1 ? " (attempt " + std::to_string(attempt) + ")" : "") + ": " +
                                           s.error_message());
      run.failed.store(true);
      return;
    }
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) mark_down(r);
    ++run.retries;
    // Every replica failed this shard once: go round again after a pause.
    if (std::all_of(tried.begin(), tried.end(), [](bool t) { return t; })) {
      std::fill(tried.begin(), tried.end(), false);
      const auto pause = std::chrono::milliseconds(std::min(1000, 50 * attempt));
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, run.deadline - Clock::now()));
    }
  }
}

int64_t ShardedClient::servers_row_align() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (row_align_ > 0) return row_align_;
  }
  int64_t align = kShardRowAlign;
  for (const std::unique_ptr<Client>& c : clients_) {
    v1::GetInfoResponse info;
    if (c->info(&info, 10).ok()) {
      if (info.shard_row_align() > 0) align = info.shard_row_align();
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  row_align_ = align;
  return align;
}

grpc::Status ShardedClient::attend(const AttendCall& call, const ShardingOptions& options, ShardedReply* reply) {
  *reply = ShardedReply{};
  const Clock::time_point start = Clock::now();
  StatusOr<AttentionParams> params = resolve_params(call.options);
  if (!params.ok()) return to_grpc(params.status());
  ShardingOptions sharding = options;
  if (sharding.row_align == 0) sharding.row_align = servers_row_align();
  StatusOr<ShardPlan> plan =
      plan_shards(call.options, call.return_lse, sharding, static_cast<int64_t>(replicas_.size()));
  if (!plan.ok()) return to_grpc(plan.status());
  if (call.q == nullptr || call.k == nullptr || call.v == nullptr)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "q, k or v = null, expected host tensors");
  if (call.q_shm.set() || call.k_shm.set() || call.v_shm.set() || call.out_shm.set() || call.lse_shm.set())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "q_shm ... lse_shm with sharding: shared memory is one host's, expected host tensors");
  if (call.keep_context)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "keep_context with sharding: a context lives on one replica, expected one target");

  Run run;
  run.call = &call;
  run.params = std::move(params).value();
  run.plan = std::move(plan).value();
  run.request_id = call.request_id.empty() ? make_request_id() : call.request_id.substr(0, 100);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    run.first_replica = next_first_++ % replicas_.size();
  }
  if (call.deadline_seconds > 0)
    run.deadline =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(call.deadline_seconds));
  run.max_attempts = sharding.max_attempts > 0 ? sharding.max_attempts : static_cast<int>(replicas_.size()) + 1;
  AttendReply& merged = reply->reply;
  run.merged = &merged;
  const size_t n = run.plan.shards.size();
  run.reports.resize(n);
  run.results.resize(n);
  run.status.resize(n);
  run.sent.assign(n, 0);
  run.received.assign(n, 0);
  run.messages.assign(n, 0);
  run.largest.assign(n, 0);
  const AttentionParams& p = run.params;
  merged.out.assign(static_cast<size_t>(p.batch * p.q_len * p.heads * p.head_dim) * dtype_bytes(p.out_dtype), 0);
  if (call.return_lse) merged.lse.assign(static_cast<size_t>(p.batch * p.q_len * p.heads), 0.0f);
  merged.out_dtype = p.out_dtype;

  if (n == 1) {
    run_shard(run, 0);
  } else {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i) threads.emplace_back([this, &run, i] { run_shard(run, i); });
    for (std::thread& t : threads) t.join();
  }

  ShardingSummary& summary = reply->sharding;
  summary.kind = run.plan.kind;
  summary.reason = run.plan.reason;
  summary.replicas = replicas_;
  summary.shards = run.reports;
  summary.retries = run.retries.load();
  summary.pooling = pooling_note(run.plan.kind);
  for (size_t i = 0; i < n; ++i) {
    merged.sent_bytes += run.sent[i];
    merged.received_bytes += run.received[i];
    merged.messages += run.messages[i];
    merged.largest_message_bytes = std::max(merged.largest_message_bytes, run.largest[i]);
  }
  summary.seconds = seconds_between(start, Clock::now());
  // The first shard that failed on its own account (not one stopped because
  // another failed).
  for (size_t i = 0; i < n; ++i)
    if (!run.status[i].ok() && !(run.status[i].error_code() == grpc::StatusCode::ABORTED &&
                                 run.status[i].error_message().rfind("not sent again", 0) == 0))
      return run.status[i];

  merged.request_id = run.plan.kind == ShardKind::kSingle ? run.reports.front().request_id : run.request_id;
  merged.result = merge_results(call.options, run.plan, run.results);
  for (const ShardReport& r : run.reports) {
    merged.timings.queued = std::max(merged.timings.queued, r.timings.queued);
    merged.timings.receiving = std::max(merged.timings.receiving, r.timings.receiving);
    merged.timings.computing = std::max(merged.timings.computing, r.timings.computing);
    merged.timings.sending = std::max(merged.timings.sending, r.timings.sending);
    merged.timings.total = std::max(merged.timings.total, r.timings.total);
  }
  // Where the caller asked for them (AttendCall::out, lse), as attend() does.
  if (call.out != nullptr) {
    std::memcpy(call.out, merged.out.data(), merged.out.size());
    merged.out = {};
  }
  if (call.lse != nullptr && call.return_lse) {
    std::memcpy(call.lse, merged.lse.data(), merged.lse.size() * sizeof(float));
    merged.lse = {};
  }
  return grpc::Status::OK;
}

}  // namespace plsh::client
