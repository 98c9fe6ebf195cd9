// Chunk messages at the level of gRPC's slices, so that tensor bytes are
// copied once at most between the socket and the tensor (SPEC section 9).
//
// The idea is TensorFlow's grpc_tensor_coding: hand-encode the few small
// fields of a message and let the big `bytes` field be a slice that points
// at the tensor's own memory (released when gRPC lets go of it); on the
// receiving side, read the small fields from the received slices and copy
// the data from those slices straight to where it belongs, instead of
// parsing it into a std::string first (protobuf's parse is one more copy
// and one more allocation of the whole payload per message).
//
// Both directions use one shape, which plsh.proto keeps on purpose:
//   AttendRequest  { chunk     = 2: TensorChunk { tensor = 1; row_start = 2; row_count = 3; bytes data = 4; } }
//   AttendResponse { out_chunk = 2: OutputChunk { tensor = 1; row_start = 2; row_count = 3; bytes data = 4; } }
// The encoding here is what protobuf would write (fields in order); the
// reader takes any valid encoding of a message that holds only the chunk
// field (fields in any order, repeated scalars, unknown fields) and leaves
// everything else to protobuf's parser (read() returns false), so a
// message means the same to this reader as to the generated code.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace plsh::wire {

// The oneof field of AttendRequest.chunk and AttendResponse.out_chunk.
inline constexpr int kChunkField = 2;

// Data below this many bytes is copied into the message's one slice: a
// slice of its own (and a release callback) costs more than copying it.
inline constexpr size_t kChunkCopyBelowBytes = 16 << 10;

class ChunkReader {
 public:
  // Reads `buffer` as a message whose only field is the chunk field, once,
  // holding a well-formed chunk: true and the fields set. False for any
  // other message (a header, an end, an ack, a summary, several oneof
  // fields, groups, a malformed encoding): parse it with protobuf then.
  // Holds references to the buffer's slices (no copy) until clear() or the
  // next read().
  bool read(const grpc::ByteBuffer& buffer);

  int tensor() const { return tensor_; }
  int64_t row_start() const { return row_start_; }
  int64_t row_count() const { return row_count_; }
  size_t data_bytes() const { return data_bytes_; }

  // Copies the data field's bytes (data_bytes()) to dst, slice by slice.
  void copy_data(void* dst) const;
  // Gives the slices back to gRPC.
  void clear();

 private:
  std::vector<grpc::Slice> slices_;
  int tensor_ = 0;
  int64_t row_start_ = 0, row_count_ = 0;
  size_t data_bytes_ = 0;
  size_t data_slice_ = 0, data_offset_ = 0;  // where the data begins
};

// Called once gRPC has let go of a chunk's data (on any thread).
using ReleaseFn = void (*)(void* arg);

// The chunk message as a ByteBuffer whose data is not copied: its last slice
// points at data[0, bytes) and release(arg) runs when gRPC no longer needs
// it. Below kChunkCopyBelowBytes the data is copied and release(arg) runs
// before this returns. release may be null (memory that outlives the call).
grpc::ByteBuffer encode_chunk(int tensor, int64_t row_start, int64_t row_count, const void* data, size_t bytes,
                              ReleaseFn release, void* arg);

}  // namespace plsh::wire
