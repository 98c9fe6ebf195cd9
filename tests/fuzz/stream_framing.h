// The fuzz_attend_stream target's input format: a sequence of records, each
// turned into one v1::AttendRequest as a client would send it on an Attend
// stream. Debian 12 has no libprotobuf-mutator, so the records carry the
// fields a mutator should reach cheaply (tensor, row_start, row_count, and
// data of exactly the rows' size) outside protobuf's encoding; a raw record
// still lets anything protobuf can parse through.
//
//   record  = op:u8 length:u16le payload[length]   (a short last payload is cut)
//   op % 4 == 0  kRaw     payload parsed as an AttendRequest (skipped if it
//                         does not parse: gRPC would drop the call)
//   op % 4 == 1  kHeader  payload parsed as an AttendHeader
//   op % 4 == 2  kChunk   payload = tensor:u8 row_start:i64le row_count:i64le
//                         fill[...]; tensor & 0x7f is the TensorChunk's
//                         tensor; with bit 7 set the data is exactly
//                         row_count rows of the plan's tensor (fill repeated;
//                         zeros if empty) when that is at most 1 MiB,
//                         otherwise the data is fill as it stands
//   op % 4 == 3  kEnd     EndOfInput (payload ignored)
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace plsh::fuzz {

enum class RecordOp : uint8_t { kRaw = 0, kHeader = 1, kChunk = 2, kEnd = 3 };

inline constexpr uint8_t kFitRows = 0x80;  // chunk tensor byte: size the data to the rows
inline constexpr size_t kChunkFixedBytes = 1 + 8 + 8;
inline constexpr int64_t kMaxFittedBytes = 1 << 20;

struct Record {
  RecordOp op = RecordOp::kRaw;
  std::string_view payload;
};

// Reads records off the front of `input`; false at its end.
inline bool next_record(std::string_view& input, Record* record) {
  if (input.size() < 3) return false;
  record->op = static_cast<RecordOp>(static_cast<uint8_t>(input[0]) % 4);
  const size_t length = static_cast<uint8_t>(input[1]) | (size_t{static_cast<uint8_t>(input[2])} << 8);
  input.remove_prefix(3);
  record->payload = input.substr(0, length);
  input.remove_prefix(record->payload.size());
  return true;
}

inline std::string record(RecordOp op, std::string_view payload) {
  std::string out;
  out += static_cast<char>(op);
  out += static_cast<char>(payload.size() & 0xff);
  out += static_cast<char>((payload.size() >> 8) & 0xff);
  out += payload.substr(0, 0xffff);
  return out;
}

inline void put_i64(std::string* out, int64_t v) {
  for (int i = 0; i < 8; ++i) *out += static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}

inline int64_t get_i64(std::string_view bytes) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  return static_cast<int64_t>(v);
}

// A kChunk record's payload.
inline std::string chunk_payload(uint8_t tensor, int64_t row_start, int64_t row_count, std::string_view fill) {
  std::string out;
  out += static_cast<char>(tensor);
  put_i64(&out, row_start);
  put_i64(&out, row_count);
  out += fill;
  return out;
}

}  // namespace plsh::fuzz
