// Same-host shared memory end to end (plsh.proto: RegisterSharedMemory and
// AttendHeader.*_shm; server/shm_registry.h): the real server with
// --shm-dir, called through the C++ client. Results equal the streamed
// ones bit for bit; every misuse Triton's extension met
// (CVE-2025-23319/23320/23334) gets its code, names no key or path, and
// leaves the server serving.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "plsh/shared_memory.h"
#include "shaped.h"
#include "trust_test_util.h"

namespace plsh {
namespace {

using client::SharedMemoryFile;
using plsh::testing::shaped;
using testing::TempDir;

AttentionOptions options() {
  return shaped({2, 33, 40, 4, 2, 16}, {.causal = true, .mode = Mode::kLsh, .samples = 8, .seed = 3});
}

struct Sizes {
  int64_t q, kv, out, lse;
};
Sizes sizes(const AttentionOptions& o) {
  return {o.batch * o.q_len * o.heads * o.head_dim * 4, o.batch * o.kv_len * o.kv_heads * o.head_dim * 4,
          o.batch * o.q_len * o.heads * o.head_dim * 4, o.batch * o.q_len * o.heads * 4};
}

std::vector<float> gaussian(int64_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(bytes / 4));
  for (float& x : v) x = normal(rng);
  return v;
}

// A file in the server's directory with q | k | v | out | lse, each at a
// 4 KiB boundary, registered as a region.
struct Layout {
  int64_t q = 0, k, v, out, lse, total;
  explicit Layout(const Sizes& z) {
    auto up = [](int64_t n) { return (n + 4095) / 4096 * 4096; };
    k = up(z.q);
    v = k + up(z.kv);
    out = v + up(z.kv);
    lse = out + up(z.out);
    total = lse + up(z.lse);
  }
};

std::string message_of(const grpc::Status& s) { return client::status_string(s); }

class SharedMemoryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    server_ = new ServerProcess({"--backend", "cpu", "--threads", "2", "--shm-dir", dir_->path()});
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    delete server_;
    delete dir_;
  }
  void SetUp() override { ASSERT_TRUE(server_->started()) << server_->log(); }
  // Whatever a test sent, the server still serves.
  void TearDown() override { EXPECT_TRUE(serving()); }

  // The server still answers health and a plain streamed request.
  static ::testing::AssertionResult serving() {
    Client c(server_->grpc_address());
    if (trust::health(c) != "SERVING") return ::testing::AssertionFailure() << "health: " << trust::health(c);
    const grpc::Status s = trust::attend(c);
    if (!s.ok()) return ::testing::AssertionFailure() << "attend: " << message_of(s);
    return ::testing::AssertionSuccess();
  }

  // The status has the code, and its message names neither the server's
  // directory nor any of `keys`.
  static ::testing::AssertionResult refused(const grpc::Status& s, grpc::StatusCode code, const std::string& part,
                                            const std::vector<std::string>& keys = {}) {
    if (s.error_code() != code)
      return ::testing::AssertionFailure()
             << "got " << message_of(s) << ", expected " << client::status_code_name(code);
    if (s.error_message().find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "\"" << s.error_message() << "\" lacks \"" << part << "\"";
    if (s.error_message().find(dir_->path()) != std::string::npos)
      return ::testing::AssertionFailure() << "\"" << s.error_message() << "\" names the directory";
    for (const std::string& key : keys)
      if (s.error_message().find(key) != std::string::npos)
        return ::testing::AssertionFailure() << "\"" << s.error_message() << "\" names the key " << key;
    return ::testing::AssertionSuccess();
  }

  // A file of `bytes` in the server's directory, plsh-NAME, registered whole
  // as region NAME. Call under ASSERT_NO_FATAL_FAILURE.
  static void register_file(Client& c, const std::string& name, int64_t bytes,
                            std::unique_ptr<SharedMemoryFile>* file) {
    ASSERT_TRUE(SharedMemoryFile::create(dir_->path(), "plsh-" + name, bytes, file).ok());
    ASSERT_TRUE(c.register_shared_memory(name, (*file)->key(), 0, bytes).ok());
  }

  static TempDir* dir_;
  static ServerProcess* server_;

  // Each test's client and the request its tensors are sized for (named as
  // the tests' locals).
  Client c{server_->grpc_address()};
  const AttentionOptions o = options();
  const Sizes z = sizes(o);
};
TempDir* SharedMemoryTest::dir_ = nullptr;
ServerProcess* SharedMemoryTest::server_ = nullptr;

TEST_F(SharedMemoryTest, EqualsTheStreamedResultBitForBit) {
  v1::GetInfoResponse info;
  ASSERT_TRUE(c.info(&info).ok());
  EXPECT_TRUE(info.limits().shared_memory());
  const std::vector<float> q = gaussian(z.q, 1), k = gaussian(z.kv, 2), v = gaussian(z.kv, 3);
  AttendCall call = testing::attend_call(o, q, k, v, /*deadline_seconds=*/0);  // 0: none
  call.return_lse = true;
  call.chunk_bytes = 1000;
  AttendReply streamed;
  ASSERT_TRUE(c.attend(call, &streamed).ok());

  const Layout at(z);
  std::unique_ptr<SharedMemoryFile> file;
  ASSERT_TRUE(SharedMemoryFile::create(dir_->path(), "plsh-equal", at.total, &file).ok());
  std::memcpy(file->data() + at.q, q.data(), static_cast<size_t>(z.q));
  std::memcpy(file->data() + at.k, k.data(), static_cast<size_t>(z.kv));
  std::memcpy(file->data() + at.v, v.data(), static_cast<size_t>(z.kv));
  ASSERT_TRUE(c.register_shared_memory("equal", file->key(), 0, at.total).ok());

  // Everything in the region: header and end only, on the stream.
  AttendCall shm = call;
  shm.q_shm = {"equal", at.q};
  shm.k_shm = {"equal", at.k};
  shm.v_shm = {"equal", at.v};
  shm.out_shm = {"equal", at.out};
  shm.lse_shm = {"equal", at.lse};
  AttendReply reply;
  const grpc::Status s = c.attend(shm, &reply);
  ASSERT_TRUE(s.ok()) << message_of(s);
  EXPECT_EQ(reply.sent_bytes, 0);
  EXPECT_EQ(reply.received_bytes, 0);
  EXPECT_EQ(reply.messages, 4);  // header, end; ack, summary
  EXPECT_TRUE(reply.out.empty());
  EXPECT_EQ(std::memcmp(file->data() + at.out, streamed.out.data(), static_cast<size_t>(z.out)), 0);
  EXPECT_EQ(std::memcmp(file->data() + at.lse, streamed.lse.data(), static_cast<size_t>(z.lse)), 0);
  EXPECT_EQ(reply.result.probe.rel_err, streamed.result.probe.rel_err);

  // Mixed: q from the region, k and v streamed; out streamed, lse to the region.
  std::memset(file->data() + at.lse, 0, static_cast<size_t>(z.lse));
  AttendCall mixed = call;
  mixed.q_shm = {"equal", at.q};
  mixed.lse_shm = {"equal", at.lse};
  ASSERT_TRUE(c.attend(mixed, &reply).ok());
  EXPECT_EQ(reply.out, streamed.out);
  EXPECT_TRUE(reply.lse.empty());
  EXPECT_EQ(std::memcmp(file->data() + at.lse, streamed.lse.data(), static_cast<size_t>(z.lse)), 0);
  EXPECT_EQ(reply.sent_bytes, 2 * z.kv);

  // AttendUnary too: the inputs from the region, the output in the response.
  AttendCall unary = call;
  unary.q_shm = {"equal", at.q};
  unary.k_shm = {"equal", at.k};
  unary.v_shm = {"equal", at.v};
  ASSERT_TRUE(c.attend_unary(unary, &reply).ok());
  EXPECT_EQ(reply.out, streamed.out);

  std::vector<v1::SharedMemoryRegion> regions;
  ASSERT_TRUE(c.list_shared_memory(&regions).ok());
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].name(), "equal");
  EXPECT_EQ(regions[0].key(), "plsh-equal");
  EXPECT_EQ(regions[0].byte_size(), at.total);
  EXPECT_EQ(regions[0].requests(), 0);
  EXPECT_TRUE(c.unregister_shared_memory("equal").ok());
}

// Registering what is not a plain, private, large enough file of the
// directory: the code, no key or path in the message, the server serving.
TEST_F(SharedMemoryTest, RegisteringAnythingButAPrivateFileOfTheDirectoryIsRefused) {
  const std::string d = dir_->path();
  std::unique_ptr<SharedMemoryFile> file;
  ASSERT_TRUE(SharedMemoryFile::create(d, "plsh-small", 4096, &file).ok());
  ASSERT_EQ(symlink((d + "/plsh-small").c_str(), (d + "/plsh-link").c_str()), 0);
  ASSERT_EQ(symlink("/etc/passwd", (d + "/plsh-passwd").c_str()), 0);
  ASSERT_EQ(mkdir((d + "/plsh-dir").c_str(), 0700), 0);
  ASSERT_EQ(mkfifo((d + "/plsh-fifo").c_str(), 0600), 0);
  const std::string mine = d + "/plsh-everyone";
  close(open(mine.c_str(), O_CREAT | O_RDWR, 0600));
  ASSERT_EQ(truncate(mine.c_str(), 4096), 0);
  ASSERT_EQ(chmod(mine.c_str(), 0666), 0);

  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  EXPECT_TRUE(refused(c.register_shared_memory("r", "../../etc/passwd", 0, 1), kInvalid, "key: expected a file name",
                      {"passwd"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "sub/../plsh-small", 0, 1), kInvalid, "key: expected a file name",
                      {"plsh-small"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-link", 0, 1), kInvalid, "symbolic link", {"plsh-link"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-passwd", 0, 1), kInvalid, "symbolic link", {"passwd"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-dir", 0, 1), kInvalid, "not a regular file", {"plsh-dir"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-fifo", 0, 1), kInvalid, "not a regular file", {"plsh-fifo"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-nothing", 0, 1), grpc::StatusCode::NOT_FOUND, "no such file",
                      {"plsh-nothing"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-everyone", 0, 1), grpc::StatusCode::PERMISSION_DENIED,
                      "writable by every user", {"plsh-everyone"}));
  if (geteuid() == 0) {
    const std::string theirs = d + "/plsh-theirs";
    close(open(theirs.c_str(), O_CREAT | O_RDWR, 0600));
    ASSERT_EQ(truncate(theirs.c_str(), 4096), 0);
    ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
    EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-theirs", 0, 1), grpc::StatusCode::PERMISSION_DENIED,
                        "another user", {"plsh-theirs"}));
  } else {
    std::cout << "[ SKIPPED part ] another user's file: needs root to make one (uid 65534)\n";
  }
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-small", 0, 4097), kInvalid, "4096 bytes", {"plsh-small"}));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-small", LLONG_MAX, 2), kInvalid, "overflows"));
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-small", -8, 2), kInvalid, "offset = -8"));
  EXPECT_TRUE(refused(c.register_shared_memory("bad/name", "plsh-small", 0, 2), kInvalid, "name = "));
  ASSERT_TRUE(c.register_shared_memory("r", "plsh-small", 0, 4096).ok());
  EXPECT_TRUE(refused(c.register_shared_memory("r", "plsh-small", 0, 16), grpc::StatusCode::ALREADY_EXISTS, "'r'"));
  EXPECT_TRUE(refused(c.unregister_shared_memory("nope"), grpc::StatusCode::NOT_FOUND, "'nope'"));
  EXPECT_TRUE(c.unregister_shared_memory("r").ok());
}

// A request's references that do not fit its region, overlap, or come with
// chunks: refused at the header (or the chunk), the server serving.
TEST_F(SharedMemoryTest, ReferencesThatDoNotFitTheirRegionAreRefused) {
  const Layout at(z);
  std::unique_ptr<SharedMemoryFile> file;
  ASSERT_NO_FATAL_FAILURE(register_file(c, "refs", at.total, &file));
  const std::vector<float> q = gaussian(z.q, 1), k = gaussian(z.kv, 2), v = gaussian(z.kv, 3);
  auto attend = [&](const std::function<void(AttendCall&)>& edit) {
    AttendCall call = testing::attend_call(o, q, k, v, 30);
    edit(call);
    AttendReply reply;
    return c.attend(call, &reply);
  };
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  // The region is too small for the tensor where it is placed.
  EXPECT_TRUE(refused(attend([&](AttendCall& a) {
                        a.q_shm = {"refs", at.total - z.q + 4};
                      }),
                      kInvalid, "q_shm.offset + byte_size"));
  EXPECT_TRUE(refused(attend([&](AttendCall& a) { a.k_shm = {"refs", LLONG_MAX - 8}; }), kInvalid, "overflows"));
  EXPECT_TRUE(refused(attend([&](AttendCall& a) { a.v_shm = {"refs", -4096}; }), kInvalid, "v_shm.offset = -4096"));
  EXPECT_TRUE(refused(attend([&](AttendCall& a) { a.v_shm = {"refs", 2}; }), kInvalid, "multiple of 4"));
  EXPECT_TRUE(refused(attend([&](AttendCall& a) {
                        a.q_shm = {"unknown", 0};
                      }),
                      grpc::StatusCode::NOT_FOUND, "q_shm.region = 'unknown'"));
  EXPECT_TRUE(refused(attend([&](AttendCall& a) {
                        a.q_shm = {"refs", at.q};
                        a.out_shm = {"refs", at.q + 4096};
                      }),
                      kInvalid, "out_shm overlaps q_shm"));
  // A byte size that is not the tensor's (the client library always sends
  // the right one: a raw header).
  {
    auto rpc = testing::plaintext_attention_client(server_->grpc_address());
    // A header that places q at offset 0 of the region, byte_size bytes long.
    auto q_in_refs = [&](int64_t byte_size) {
      AttendCall call;
      call.options = o;
      v1::AttendRequest header;
      *header.mutable_header() = client::make_header(call);
      header.mutable_header()->mutable_q_shm()->set_region("refs");
      header.mutable_header()->mutable_q_shm()->set_byte_size(byte_size);
      return header;
    };
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    stream->Write(q_in_refs(z.q - 4));
    // And a chunk of a tensor the header placed in shared memory.
    grpc::ClientContext ctx2;
    auto stream2 = rpc->Attend(&ctx2);
    stream2->Write(q_in_refs(z.q));
    v1::AttendRequest chunk;
    chunk.mutable_chunk()->set_tensor(v1::TENSOR_Q);
    chunk.mutable_chunk()->set_row_count(1);
    chunk.mutable_chunk()->set_data(std::string(static_cast<size_t>(o.heads * o.head_dim * 4), '\0'));
    stream2->Write(chunk);
    for (auto* s : {stream.get(), stream2.get()}) {
      s->WritesDone();
      v1::AttendResponse r;
      while (s->Read(&r)) {
      }
    }
    EXPECT_TRUE(refused(stream->Finish(), kInvalid, "q_shm.byte_size = "));
    EXPECT_TRUE(refused(stream2->Finish(), kInvalid, "placed q in shared memory"));
  }
  std::vector<v1::SharedMemoryRegion> regions;
  ASSERT_TRUE(c.list_shared_memory(&regions).ok());
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].requests(), 0);  // the refused requests hold nothing
  EXPECT_TRUE(c.unregister_shared_memory("refs").ok());
}

TEST_F(SharedMemoryTest, ARegionInUseCannotBeUnregistered) {
  std::unique_ptr<SharedMemoryFile> file;
  ASSERT_NO_FATAL_FAILURE(register_file(c, "busy", z.q, &file));
  // A request that holds it: header, ack, and then nothing.
  auto rpc = testing::plaintext_attention_client(server_->grpc_address());
  auto ctx = std::make_unique<grpc::ClientContext>();
  auto stream = rpc->Attend(ctx.get());
  AttendCall call;
  call.options = o;
  call.q_shm = {"busy", 0};
  v1::AttendRequest header;
  *header.mutable_header() = client::make_header(call);
  ASSERT_TRUE(stream->Write(header));
  v1::AttendResponse ack;
  ASSERT_TRUE(stream->Read(&ack));
  ASSERT_TRUE(ack.has_ack());
  EXPECT_TRUE(
      refused(c.unregister_shared_memory("busy"), grpc::StatusCode::FAILED_PRECONDITION, "in use by 1 request(s)"));
  std::vector<v1::SharedMemoryRegion> regions;
  ASSERT_TRUE(c.list_shared_memory(&regions).ok());
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].requests(), 1);
  // The request ends (the client goes): the region is free.
  ctx->TryCancel();
  stream->Finish();
  EXPECT_TRUE(trust::eventually([&] { return c.unregister_shared_memory("busy").ok(); }));
}

// The client shrinks the file after the header was accepted: the worker's
// accesses past the new end (which would raise SIGBUS and kill a server
// that did not expect them) fail the request; the server goes on.
TEST_F(SharedMemoryTest, AFileShrunkUnderARequestFailsItNotTheServer) {
  for (const bool input : {true, false}) {
    SCOPED_TRACE(input ? "q in the shrunk file" : "out in the shrunk file");
    std::unique_ptr<SharedMemoryFile> file;
    const std::string key = input ? "plsh-shrink-q" : "plsh-shrink-out";
    ASSERT_TRUE(SharedMemoryFile::create(dir_->path(), key, std::max(z.q, z.out), &file).ok());
    const std::vector<float> q = gaussian(z.q, 1), kv = gaussian(z.kv, 2);
    std::memcpy(file->data(), q.data(), static_cast<size_t>(z.q));
    ASSERT_TRUE(c.register_shared_memory("shrink", key, 0, std::max(z.q, z.out)).ok());
    auto rpc = testing::plaintext_attention_client(server_->grpc_address());
    grpc::ClientContext ctx;
    auto stream = rpc->Attend(&ctx);
    AttendCall call;
    call.options = o;
    (input ? call.q_shm : call.out_shm) = {"shrink", 0};
    v1::AttendRequest m;
    *m.mutable_header() = client::make_header(call);
    ASSERT_TRUE(stream->Write(m));
    v1::AttendResponse ack;
    ASSERT_TRUE(stream->Read(&ack));
    ASSERT_TRUE(ack.has_ack()) << ack.DebugString();
    ASSERT_EQ(truncate((dir_->path() + "/" + key).c_str(), 0), 0);
    const std::vector<std::pair<v1::Tensor, const float*>> chunks =
        input ? std::vector<std::pair<v1::Tensor, const float*>>{{v1::TENSOR_K, kv.data()}, {v1::TENSOR_V, kv.data()}}
              : std::vector<std::pair<v1::Tensor, const float*>>{
                    {v1::TENSOR_Q, q.data()}, {v1::TENSOR_K, kv.data()}, {v1::TENSOR_V, kv.data()}};
    for (const auto& [tensor, data] : chunks) {
      m.Clear();
      v1::TensorChunk* chunk = m.mutable_chunk();
      chunk->set_tensor(tensor);
      const int64_t rows = tensor == v1::TENSOR_Q ? o.batch * o.q_len : o.batch * o.kv_len;
      chunk->set_row_count(rows);
      chunk->set_data(data, static_cast<size_t>(tensor == v1::TENSOR_Q ? z.q : z.kv));
      ASSERT_TRUE(stream->Write(m));
    }
    m.Clear();
    m.mutable_end();
    stream->Write(m);
    stream->WritesDone();
    v1::AttendResponse r;
    while (stream->Read(&r)) {
    }
    EXPECT_TRUE(
        refused(stream->Finish(), grpc::StatusCode::FAILED_PRECONDITION, "shrank while the request used it", {key}));
    // The region is broken for good: refused at the next header, until
    // registered again.
    AttendReply reply;
    std::vector<float> q_again = gaussian(z.q, 1);
    call.q = q_again.data();
    call.k = kv.data();
    call.v = kv.data();
    EXPECT_TRUE(refused(c.attend(call, &reply), grpc::StatusCode::FAILED_PRECONDITION, "register it again"));
    EXPECT_TRUE(c.unregister_shared_memory("shrink").ok());
    EXPECT_TRUE(serving());
  }
}

TEST(SharedMemoryOff, EveryCallIsUnimplementedWithoutTheFlag) {
  ServerProcess server({"--backend", "cpu"});
  ASSERT_TRUE(server.started()) << server.log();
  Client c(server.grpc_address());
  v1::GetInfoResponse info;
  ASSERT_TRUE(c.info(&info).ok());
  EXPECT_FALSE(info.limits().shared_memory());
  EXPECT_EQ(c.register_shared_memory("r", "plsh-x", 0, 1).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(c.unregister_shared_memory("r").error_code(), grpc::StatusCode::UNIMPLEMENTED);
  std::vector<v1::SharedMemoryRegion> regions;
  EXPECT_EQ(c.list_shared_memory(&regions).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  trust::Request r;
  AttendCall call = r.call();
  call.q_shm = {"r", 0};
  AttendReply reply;
  const grpc::Status s = c.attend(call, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << message_of(s);
  EXPECT_NE(s.error_message().find("--shm-dir"), std::string::npos);
  EXPECT_TRUE(trust::attend(c).ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// With a token file, a region is its registering client's: others neither
// see nor use it, and the shared-memory calls are methods a token may lack.
TEST(SharedMemoryTokens, RegionsBelongToTheirClient) {
  TempDir dir;
  const std::string alice = testing::random_token(), bob = testing::random_token(), eve = testing::random_token();
  testing::write_file_atomically(
      dir.file("tokens.json"),
      trust::token_file_text({trust::client_entry("alice", {alice}), trust::client_entry("bob", {bob}),
                              trust::client_entry("eve", {eve}, {{"methods", {"Attend", "GetInfo"}}})}));
  ServerProcess server({"--backend", "cpu", "--token-file", dir.file("tokens.json"), "--shm-dir", dir.path()});
  ASSERT_TRUE(server.started()) << server.log();
  auto connect = [&](const std::string& token) {
    std::unique_ptr<Client> c;
    client::ChannelOptions o;
    o.token = token;
    EXPECT_TRUE(Client::connect(server.grpc_address(), o, &c).ok());
    return c;
  };
  std::unique_ptr<Client> a = connect(alice), b = connect(bob), e = connect(eve);
  trust::Request r;
  const int64_t q_bytes = static_cast<int64_t>(r.q.size() * 4);
  std::unique_ptr<SharedMemoryFile> file;
  ASSERT_TRUE(SharedMemoryFile::create(dir.path(), "plsh-alice", q_bytes, &file).ok());
  std::memcpy(file->data(), r.q.data(), static_cast<size_t>(q_bytes));
  ASSERT_TRUE(a->register_shared_memory("mine", "plsh-alice", 0, q_bytes).ok());
  EXPECT_EQ(e->register_shared_memory("eves", "plsh-alice", 0, q_bytes).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  std::vector<v1::SharedMemoryRegion> regions;
  ASSERT_TRUE(b->list_shared_memory(&regions).ok());
  EXPECT_TRUE(regions.empty());
  AttendCall call = r.call();
  call.q_shm = {"mine", 0};
  AttendReply reply;
  EXPECT_TRUE(a->attend(call, &reply).ok());
  EXPECT_EQ(b->attend(call, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(b->unregister_shared_memory("mine").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(a->unregister_shared_memory("mine").ok());
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace plsh
