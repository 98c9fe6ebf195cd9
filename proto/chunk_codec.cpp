#include "proto/chunk_codec.h"

#include <algorithm>
#include <cstring>

namespace plsh::wire {

namespace {

// Protobuf's wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// Reads forward over a list of slices as if they were one array.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices) left_ += s.size();
  }

  uint64_t left() const { return left_; }
  size_t slice() const { return index_; }
  size_t offset() const { return offset_; }

  bool byte(uint8_t* b) {
    if (left_ == 0) return false;
    settle();
    *b = slices_[index_].begin()[offset_++];
    --left_;
    return true;
  }

  // A base-128 varint of at most 10 bytes, as protobuf reads it.
  bool varint(uint64_t* value) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t b = 0;
      if (!byte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *value = v;
        return true;
      }
    }
    return false;  // an 11th byte: malformed
  }

  bool skip(uint64_t n) {
    if (n > left_) return false;
    left_ -= n;
    while (n > 0) {
      settle();
      const size_t here = std::min<uint64_t>(n, slices_[index_].size() - offset_);
      offset_ += here;
      n -= here;
    }
    return true;
  }

 private:
  // Moves past exhausted slices (only called with bytes left).
  void settle() {
    while (offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0, offset_ = 0;
  uint64_t left_ = 0;
};

void put_varint(uint8_t** p, uint64_t v) {
  while (v >= 0x80) {
    *(*p)++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *(*p)++ = static_cast<uint8_t>(v);
}

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

constexpr uint64_t tag(int field, int wire_type) { return static_cast<uint64_t>(field) << 3 | wire_type; }

}  // namespace

bool ChunkReader::read(const grpc::ByteBuffer& buffer) {
  clear();
  if (!buffer.Valid() || !buffer.Dump(&slices_).ok()) return false;
  Cursor in(slices_);
  // The outer message: exactly one field, the chunk, filling the buffer.
  uint64_t key = 0, length = 0;
  if (!in.varint(&key) || key != tag(kChunkField, kLengthDelimited)) return false;
  if (!in.varint(&length) || length != in.left()) return false;
  // The chunk's fields, in any order; the last of a repeated field wins,
  // as in protobuf.
  bool have_data = false;
  while (in.left() > 0) {
    if (!in.varint(&key)) return false;
    const uint64_t field = key >> 3;
    const int wire_type = static_cast<int>(key & 7);
    uint64_t value = 0;
    if (field >= 1 && field <= 3) {
      if (wire_type != kVarint || !in.varint(&value)) return false;  // a mistyped field: protobuf's to judge
      if (field == 1) tensor_ = static_cast<int32_t>(value);         // an enum: int32, as protobuf truncates it
      if (field == 2) row_start_ = static_cast<int64_t>(value);
      if (field == 3) row_count_ = static_cast<int64_t>(value);
    } else if (field == 4) {
      if (wire_type != kLengthDelimited || !in.varint(&value) || value > in.left()) return false;
      data_slice_ = in.slice();
      data_offset_ = in.offset();
      data_bytes_ = static_cast<size_t>(value);
      have_data = true;
      in.skip(value);
    } else if (field == 0) {
      return false;
    } else {
      // An unknown field: skipped, as the generated code would (it keeps it
      // aside, and the server never looks at it). Groups go to protobuf.
      bool ok = false;
      switch (wire_type) {
        case kVarint:
          ok = in.varint(&value);
          break;
        case kFixed64:
          ok = in.skip(8);
          break;
        case kFixed32:
          ok = in.skip(4);
          break;
        case kLengthDelimited:
          ok = in.varint(&value) && in.skip(value);
          break;
        default:
          break;
      }
      if (!ok) return false;
    }
  }
  if (!have_data) data_bytes_ = 0;
  return true;
}

void ChunkReader::copy_data(void* dst) const {
  auto* out = static_cast<uint8_t*>(dst);
  size_t left = data_bytes_, index = data_slice_, offset = data_offset_;
  while (left > 0) {
    const grpc::Slice& s = slices_[index];
    const size_t here = std::min(left, s.size() - offset);
    std::memcpy(out, s.begin() + offset, here);
    out += here;
    left -= here;
    ++index;
    offset = 0;
  }
}

void ChunkReader::clear() {
  slices_.clear();
  tensor_ = 0;
  row_start_ = row_count_ = 0;
  data_bytes_ = data_slice_ = data_offset_ = 0;
}

grpc::ByteBuffer encode_chunk(int tensor, int64_t row_start, int64_t row_count, const void* data, size_t bytes,
                              ReleaseFn release, void* arg) {
  // Every field is written, zeros too: protobuf's parser takes them alike.
  const uint64_t t = static_cast<uint64_t>(static_cast<int64_t>(tensor));  // negative enums: 10 bytes, as protobuf
  const size_t fields = 1 + varint_size(t) + 1 + varint_size(static_cast<uint64_t>(row_start)) + 1 +
                        varint_size(static_cast<uint64_t>(row_count)) + 1 + varint_size(bytes);
  const size_t inner = fields + bytes;
  const size_t head = 1 + varint_size(inner) + fields;
  const bool copy = bytes < kChunkCopyBelowBytes;
  grpc::Slice first(copy ? head + bytes : head);  // uninitialised, ours to fill
  auto* p = const_cast<uint8_t*>(first.begin());
  put_varint(&p, tag(kChunkField, kLengthDelimited));
  put_varint(&p, inner);
  put_varint(&p, tag(1, kVarint));
  put_varint(&p, t);
  put_varint(&p, tag(2, kVarint));
  put_varint(&p, static_cast<uint64_t>(row_start));
  put_varint(&p, tag(3, kVarint));
  put_varint(&p, static_cast<uint64_t>(row_count));
  put_varint(&p, tag(4, kLengthDelimited));
  put_varint(&p, bytes);
  if (copy) {
    if (bytes > 0) std::memcpy(p, data, bytes);
    if (release != nullptr) release(arg);
    return grpc::ByteBuffer(&first, 1);
  }
  grpc::Slice slices[2] = {std::move(first), release != nullptr
                                                 ? grpc::Slice(const_cast<void*>(data), bytes, release, arg)
                                                 : grpc::Slice(data, bytes, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace plsh::wire
