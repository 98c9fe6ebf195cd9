// NumPy .npy files (format versions 1.0, 2.0 and 3.0), the arrays that plsh
// compute reads and writes. Only what attention needs: little-endian
// float32 ('<f4') and float16 ('<f2') in C order, plus, when the caller asks
// for it, uint16 ('<u2') holding bfloat16 bit patterns (NumPy itself has no
// bfloat16). Everything else -- Fortran order, other dtypes, a malformed
// header, a file shorter or longer than its shape -- is an INVALID_ARGUMENT
// naming the file and what was found.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "plsh/params.h"
#include "plsh/status.h"

namespace plsh::cli {

struct NpyArray {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // C order; empty for a scalar
  std::vector<uint8_t> data;   // little-endian elements, elements() * dtype_bytes(dtype) bytes

  int64_t elements() const;
  const void* ptr() const { return data.data(); }
};

struct NpyReadOptions {
  bool u2_as_bf16 = false;  // read '<u2' as bfloat16 bit patterns
};

// `name` is what error messages call the array (e.g. the file path).
StatusOr<NpyArray> parse_npy(std::string_view bytes, const std::string& name, const NpyReadOptions& options = {});
StatusOr<NpyArray> read_npy(const std::string& path, const NpyReadOptions& options = {});

// The header alone (magic, version, length, dict): version 1.0 (2.0 when
// the dict would not fit in 64 KiB), padded so the data starts on a 64-byte
// boundary as NumPy does. bfloat16 is written as '<u2' bit patterns.
std::string npy_header(DType dtype, const std::vector<int64_t>& shape);
// The whole file: header and data.
std::string npy_bytes(DType dtype, const std::vector<int64_t>& shape, const void* data);
// Errors are FAILED_PRECONDITION (the disk, not the request, is at fault).
Status write_npy(const std::string& path, DType dtype, const std::vector<int64_t>& shape, const void* data);

// The elements of a C-order array of `shape` with axes `axis` and `axis + 1`
// swapped (so [B, N, H, D] <-> [B, H, N, D] for axis 1): a new buffer.
std::vector<uint8_t> swap_axes(const void* data, size_t element_bytes, const std::vector<int64_t>& shape, size_t axis);
// The same for an array, shape included.
NpyArray swap_axes(const NpyArray& a, size_t axis);

// "[2, 16, 8, 64]", for messages.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace plsh::cli
