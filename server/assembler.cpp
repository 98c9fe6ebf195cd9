#include "server/assembler.h"

#include <cstring>
#include <iterator>
#include <string>

#include "server/buffer_pool.h"

namespace plsh::server {

namespace {
std::string rows_str(int64_t start, int64_t end) {
  return "rows [" + std::to_string(start) + ", " + std::to_string(end) + ")";
}
}  // namespace

Assembler::Assembler(std::initializer_list<AssemblyTarget> targets) {
  for (const AssemblyTarget& t : targets) {
    if (count_ == kMaxTensors) break;
    // A tensor in shared memory is there whole: no chunks of it.
    tensors_[count_++] = {t.tensor,
                          t.name,
                          t.data,
                          t.shape.rows,
                          t.shape.row_bytes,
                          t.rows_expr,
                          t.in_shm,
                          {},
                          t.in_shm ? t.shape.rows : 0};
  }
}

StatusOr<uint8_t*> Assembler::accept(int tensor, int64_t start, int64_t count, size_t data_bytes) {
  int index = -1;
  for (int i = 0; i < count_; ++i)
    if (tensors_[i].tensor == tensor) index = i;
  if (index < 0) {
    // "expected TENSOR_Q, TENSOR_K or TENSOR_V"
    std::string expected;
    for (int i = 0; i < count_; ++i)
      expected += (i == 0 ? "" : i + 1 == count_ ? " or " : ", ") + v1::Tensor_Name(tensors_[i].tensor);
    return invalid_argument("chunk.tensor = " + std::to_string(tensor) + ", expected " + expected);
  }
  TensorState& t = tensors_[index];
  const std::string who = std::string("chunk of ") + t.name + ": ";
  if (t.in_shm)
    return invalid_argument(who + "the header placed " + t.name + " in shared memory (" + t.name +
                            "_shm), expected no chunks of it");
  if (start < 0 || start >= t.rows)
    return invalid_argument(who + "row_start = " + std::to_string(start) + ", expected in [0, " +
                            std::to_string(t.rows) + ") (" + t.rows_expr + ")");
  if (count < 1 || count > t.rows - start)
    return invalid_argument(who + "row_count = " + std::to_string(count) + " from row_start = " +
                            std::to_string(start) + ", expected in [1, " + std::to_string(t.rows - start) + "] (" +
                            t.rows_expr + " = " + std::to_string(t.rows) + " rows)");
  const int64_t end = start + count;
  const int64_t expected_bytes = count * t.row_bytes;
  if (data_bytes != static_cast<size_t>(expected_bytes))
    return invalid_argument(who + "data = " + std::to_string(data_bytes) + " bytes, expected " +
                            std::to_string(expected_bytes) + " (row_count " + std::to_string(count) + " * " +
                            std::to_string(t.row_bytes) + " bytes per row)");

  // The first range starting at or after `start`, and the one before it.
  auto next = t.ranges.lower_bound(start);
  if (next != t.ranges.end() && next->first < end)
    return invalid_argument(who + rows_str(start, end) + " overlap " + rows_str(next->first, next->second) +
                            " received before, expected each row once");
  if (next != t.ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->second > start)
      return invalid_argument(who + rows_str(start, end) + " overlap " + rows_str(prev->first, prev->second) +
                              " received before, expected each row once");
  }

  t.rows_received += count;
  received_bytes_ += expected_bytes;

  // Merge with neighbours so the map stays small however many chunks arrive.
  int64_t merged_start = start, merged_end = end;
  if (next != t.ranges.end() && next->first == end) {
    merged_end = next->second;
    next = t.ranges.erase(next);
  }
  if (next != t.ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->second == start) {
      merged_start = prev->first;
      t.ranges.erase(prev);
    }
  }
  t.ranges[merged_start] = merged_end;
  // Memory follows data: the request's block is mapped but not faulted in
  // (buffer_pool.h); its pages come in here, one call per chunk.
  uint8_t* dst = t.data + start * t.row_bytes;
  BufferPool::fault_in(dst, expected_bytes);
  return dst;
}

Status Assembler::add(const v1::TensorChunk& chunk) {
  ASSIGN_OR_RETURN(uint8_t * dst, accept(chunk.tensor(), chunk.row_start(), chunk.row_count(), chunk.data().size()));
  std::memcpy(dst, chunk.data().data(), chunk.data().size());
  return Status::Ok();
}

Status Assembler::complete() const {
  for (int i = 0; i < count_; ++i) {
    const TensorState& t = tensors_[i];
    if (t.rows_received == t.rows) continue;
    // The first gap, to say which rows are missing.
    int64_t gap_start = 0, gap_end = t.rows;
    for (const auto& [s, e] : t.ranges) {
      if (s > gap_start) {
        gap_end = s;
        break;
      }
      gap_start = e;
    }
    return invalid_argument(std::string(t.name) + ": " + rows_str(gap_start, gap_end) + " missing at end of input (" +
                            std::to_string(t.rows_received) + " of " + std::to_string(t.rows) + " rows received), " +
                            "expected chunks covering every row of " + t.rows_expr);
  }
  return Status::Ok();
}

}  // namespace plsh::server
