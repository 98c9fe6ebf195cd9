// Puts a streamed request back together: every TensorChunk must name q, k or
// v (or, for AttendBackward, the tensors its form expects; never one the
// header placed in shared memory), lie inside the tensor's rows, not overlap
// a chunk already received, and carry exactly its rows' bytes; at the end of
// input every row must have arrived. Errors name the chunk's fields and the
// rows involved.
//
// accept() checks a chunk from its fields alone and says where its bytes
// go, with the pages there faulted in (buffer_pool.h: memory follows data),
// so that the service copies them there straight from the slices gRPC
// received (proto/chunk_codec.h); add() does both for a parsed message.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>

#include "plsh/shape.h"
#include "plsh/status.h"
#include "plsh/v1/plsh.pb.h"

namespace plsh::server {

// One tensor an Assembler expects, and where its rows go.
struct AssemblyTarget {
  v1::Tensor tensor = v1::TENSOR_UNSPECIFIED;
  const char* name = "";       // "q", "dout": what messages call it
  uint8_t* data = nullptr;     // shape.bytes()
  TensorShape shape;           // its rows and row bytes (plsh/shape.h)
  const char* rows_expr = "";  // "batch * q_len"
  bool in_shm = false;         // in shared memory: there whole, no chunks
};

class Assembler {
 public:
  // Any set of tensors (Attend's q, k, v; AttendBackward's), at most kMaxTensors.
  explicit Assembler(std::initializer_list<AssemblyTarget> targets);
  static constexpr int kMaxTensors = 6;

  // Checks a chunk of `data_bytes` bytes and records its rows as received:
  // where its data_bytes go (the caller copies them there).
  StatusOr<uint8_t*> accept(int tensor, int64_t row_start, int64_t row_count, size_t data_bytes);
  // accept, then copies the chunk's bytes into place.
  Status add(const v1::TensorChunk& chunk);
  // OK when every row of every expected tensor has arrived.
  Status complete() const;
  int64_t received_bytes() const { return received_bytes_; }

 private:
  struct TensorState {
    v1::Tensor tensor = v1::TENSOR_UNSPECIFIED;
    const char* name = "";
    uint8_t* data = nullptr;
    int64_t rows = 0;
    int64_t row_bytes = 0;
    const char* rows_expr = "";         // "batch * q_len"
    bool in_shm = false;                // in shared memory: no chunks
    std::map<int64_t, int64_t> ranges;  // start -> end (exclusive), disjoint, merged when adjacent
    int64_t rows_received = 0;
  };
  TensorState tensors_[kMaxTensors];
  int count_ = 0;
  int64_t received_bytes_ = 0;
};

}  // namespace plsh::server
