// proto/chunk_codec.h: chunk messages read from and written to gRPC's
// slices. The reader must mean what protobuf's parser means: every message
// it accepts parses (with the generated code) to the same fields and data,
// however the bytes are cut into slices; everything else it leaves to
// protobuf. The writer's output must parse as the message it stands for,
// and give the tensor memory back exactly once.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <random>
#include <string>
#include <vector>

#include "plsh/v1/plsh.pb.h"
#include "proto/chunk_codec.h"

namespace plsh::wire {
namespace {

// The bytes as a ByteBuffer cut at the given offsets.
grpc::ByteBuffer cut(const std::string& bytes, std::vector<size_t> cuts) {
  cuts.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    if (c < at) continue;
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string payload(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7 + 1) & 0xff);
  return s;
}

v1::AttendRequest chunk_request(int tensor, int64_t start, int64_t count, const std::string& data) {
  v1::AttendRequest r;
  v1::TensorChunk* c = r.mutable_chunk();
  c->set_tensor(static_cast<v1::Tensor>(tensor));
  c->set_row_start(start);
  c->set_row_count(count);
  c->set_data(data);
  return r;
}

// The reader's view of `bytes` agrees with protobuf's: when it accepts, the
// message parses to the same chunk; when protobuf finds a chunk-only message
// the reader may still decline (it then falls back), never disagree.
::testing::AssertionResult agrees_with_protobuf(const std::string& bytes, const std::vector<size_t>& cuts) {
  ChunkReader reader;
  const bool read = reader.read(cut(bytes, cuts));
  v1::AttendRequest parsed;
  const bool parses = parsed.ParseFromString(bytes);
  if (!read) return ::testing::AssertionSuccess();
  if (!parses) return ::testing::AssertionFailure() << "the reader accepted what protobuf refuses";
  if (!parsed.has_chunk()) return ::testing::AssertionFailure() << "the reader accepted a message without a chunk";
  const v1::TensorChunk& c = parsed.chunk();
  std::string data(reader.data_bytes(), '\0');
  if (!data.empty()) reader.copy_data(data.data());
  if (reader.tensor() != c.tensor() || reader.row_start() != c.row_start() || reader.row_count() != c.row_count() ||
      data != c.data())
    return ::testing::AssertionFailure() << "fields differ: reader (" << reader.tensor() << ", " << reader.row_start()
                                         << ", " << reader.row_count() << ", " << data.size() << " bytes) vs protobuf ("
                                         << c.tensor() << ", " << c.row_start() << ", " << c.row_count() << ", "
                                         << c.data().size() << " bytes)";
  return ::testing::AssertionSuccess();
}

TEST(ChunkReader, ReadsWhatProtobufWritesCutAnywhere) {
  const std::string data = payload(300, 1);
  const std::string bytes = chunk_request(v1::TENSOR_K, 12345, 7, data).SerializeAsString();
  // Every single cut, and every cut into 1-byte slices.
  for (size_t at = 0; at <= bytes.size(); ++at) {
    ChunkReader reader;
    ASSERT_TRUE(reader.read(cut(bytes, {at}))) << "cut at " << at;
    EXPECT_EQ(reader.tensor(), v1::TENSOR_K);
    EXPECT_EQ(reader.row_start(), 12345);
    EXPECT_EQ(reader.row_count(), 7);
    ASSERT_EQ(reader.data_bytes(), data.size());
    std::string got(data.size(), '\0');
    reader.copy_data(got.data());
    EXPECT_EQ(got, data) << "cut at " << at;
  }
  std::vector<size_t> every;
  for (size_t i = 1; i < bytes.size(); ++i) every.push_back(i);
  EXPECT_TRUE(agrees_with_protobuf(bytes, every));
}

TEST(ChunkReader, DefaultsOrderRepeatsAndUnknownFieldsAsProtobuf) {
  // Zero fields are left out by protobuf; the reader reads them as zero.
  EXPECT_TRUE(agrees_with_protobuf(chunk_request(0, 0, 0, "").SerializeAsString(), {}));
  EXPECT_TRUE(agrees_with_protobuf(chunk_request(v1::TENSOR_Q, 0, 3, "abc").SerializeAsString(), {2}));
  // Fields out of order, a field twice (the last wins), unknown fields of
  // every wire type but groups; all in one chunk, read as protobuf does.
  const std::string data = payload(40, 2);
  std::string inner;
  inner += std::string("\x22\x03xyz", 5);                                   // data "xyz" (replaced below)
  inner += std::string("\x18\x05", 2);                                      // row_count 5
  inner += std::string("\x10\x09", 2);                                      // row_start 9
  inner += std::string("\x28\x96\x01", 3);                                  // field 5, varint: unknown
  inner += std::string("\x31", 1) + std::string(8, '\x01');                 // field 6, fixed64
  inner += std::string("\x3d", 1) + std::string(4, '\x02');                 // field 7, fixed32
  inner += std::string("\x42\x02zz", 4);                                    // field 8, bytes
  inner += std::string("\x10\x0b", 2);                                      // row_start 11: wins
  inner += std::string("\x08\x02", 2);                                      // tensor K
  inner += std::string("\x22", 1) + static_cast<char>(data.size()) + data;  // data: wins
  const std::string bytes = std::string("\x12", 1) + static_cast<char>(inner.size()) + inner;
  ChunkReader reader;
  ASSERT_TRUE(reader.read(cut(bytes, {1, 7, 20})));
  EXPECT_EQ(reader.row_start(), 11);
  EXPECT_EQ(reader.row_count(), 5);
  EXPECT_TRUE(agrees_with_protobuf(bytes, {3, 30}));
}

TEST(ChunkReader, LeavesEverythingElseToProtobuf) {
  v1::AttendRequest header;
  header.mutable_header()->set_q_len(5);
  v1::AttendRequest end;
  end.mutable_end();
  v1::AttendResponse ack;
  ack.mutable_ack()->set_request_id("r1");
  const std::string chunk = chunk_request(v1::TENSOR_Q, 1, 1, "abcd").SerializeAsString();
  const std::vector<std::string> others = {
      header.SerializeAsString(),
      end.SerializeAsString(),
      ack.SerializeAsString(),
      "",
      chunk + chunk,                                                            // the oneof twice: protobuf merges
      chunk.substr(0, chunk.size() - 1),                                        // truncated
      std::string("\x12\x02\x08", 3),                                           // inner length beyond the buffer
      std::string("\x12\x02\x0a\x00", 4),                                       // tensor as bytes: mistyped
      std::string("\x12\x02\x0b\x0c", 4),                                       // a group
      std::string("\x12\x0b\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 13),  // an 11-byte varint
  };
  for (const std::string& m : others) {
    ChunkReader reader;
    EXPECT_FALSE(reader.read(cut(m, {1}))) << "message of " << m.size() << " bytes";
  }
}

TEST(ChunkReader, RandomDamageNeverDisagreesWithProtobuf) {
  std::mt19937 rng(5);
  const std::string base = chunk_request(v1::TENSOR_V, 77, 3, payload(48, 3)).SerializeAsString();
  for (int trial = 0; trial < 20000; ++trial) {
    std::string bytes = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 3) {
        case 0:
          bytes[rng() % bytes.size()] = static_cast<char>(rng());
          break;
        case 1:
          bytes.insert(bytes.begin() + static_cast<long>(rng() % (bytes.size() + 1)), static_cast<char>(rng()));
          break;
        default:
          if (bytes.size() > 1) bytes.erase(bytes.begin() + static_cast<long>(rng() % bytes.size()));
      }
    }
    ASSERT_TRUE(agrees_with_protobuf(bytes, {rng() % (bytes.size() + 1)})) << "trial " << trial;
  }
}

struct Released {
  int count = 0;
  static void release(void* arg) { ++static_cast<Released*>(arg)->count; }
};

TEST(EncodeChunk, ParsesAsTheMessageAndReleasesOnceWhenGrpcLetsGo) {
  for (size_t n : {size_t{0}, size_t{1}, kChunkCopyBelowBytes - 1, kChunkCopyBelowBytes, size_t{1} << 20}) {
    SCOPED_TRACE(n);
    const std::string data = payload(n, 4);
    Released released;
    {
      grpc::ByteBuffer buffer =
          encode_chunk(v1::TENSOR_OUT, 1 << 20, 300, data.data(), n, Released::release, &released);
      const bool copied = n < kChunkCopyBelowBytes;
      EXPECT_EQ(released.count, copied ? 1 : 0);  // a copy gives the memory back at once
      v1::AttendResponse parsed;
      ASSERT_TRUE(parsed.ParseFromString(flatten(buffer)));
      ASSERT_TRUE(parsed.has_out_chunk());
      EXPECT_EQ(parsed.out_chunk().tensor(), v1::TENSOR_OUT);
      EXPECT_EQ(parsed.out_chunk().row_start(), 1 << 20);
      EXPECT_EQ(parsed.out_chunk().row_count(), 300);
      EXPECT_EQ(parsed.out_chunk().data(), data);
      ChunkReader reader;  // and the reader reads it back, holding it meanwhile
      ASSERT_TRUE(reader.read(buffer));
      EXPECT_EQ(reader.data_bytes(), n);
      grpc::ByteBuffer copy = buffer;  // a reference, as gRPC keeps one
      buffer.Clear();
      reader.clear();
      EXPECT_EQ(released.count, copied ? 1 : 0);
    }
    EXPECT_EQ(released.count, 1);
  }
}

}  // namespace
}  // namespace plsh::wire
