// libFuzzer target: bytes -> the .npy reader of plsh compute
// (client/cli/npy.h), with and without u2_as_bf16. An error must be
// INVALID_ARGUMENT naming the file; an array that parses must hold exactly
// its shape's bytes and survive a write/read round trip unchanged.
#include <cstdint>
#include <string>
#include <string_view>

#include "cli/npy.h"
#include "fuzz_check.h"

namespace {

void parse_one(std::string_view bytes, bool u2_as_bf16) {
  using namespace plsh;
  cli::NpyReadOptions options;
  options.u2_as_bf16 = u2_as_bf16;
  StatusOr<cli::NpyArray> array = cli::parse_npy(bytes, "fuzz.npy", options);
  if (!array.ok()) {
    PLSH_FUZZ_CHECK(array.status().code() == StatusCode::kInvalidArgument, array.status().to_string().c_str());
    PLSH_FUZZ_CHECK(array.status().message().rfind("fuzz.npy", 0) == 0, "an error that does not name the file");
    return;
  }
  const cli::NpyArray& a = *array;
  for (int64_t d : a.shape) PLSH_FUZZ_CHECK(d >= 0, "negative dimension accepted");
  PLSH_FUZZ_CHECK(static_cast<int64_t>(a.data.size()) == a.elements() * static_cast<int64_t>(dtype_bytes(a.dtype)),
                  "data size != elements * dtype bytes");
  PLSH_FUZZ_CHECK(a.data.size() <= bytes.size(), "more data than input");
  // What plsh writes, plsh reads back the same.
  const std::string again = cli::npy_bytes(a.dtype, a.shape, a.ptr());
  StatusOr<cli::NpyArray> back = cli::parse_npy(again, "again.npy", options);
  PLSH_FUZZ_CHECK(back.ok(), back.status().to_string().c_str());
  PLSH_FUZZ_CHECK(back->dtype == a.dtype && back->shape == a.shape && back->data == a.data,
                  "round trip changed the array");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  parse_one(bytes, false);
  parse_one(bytes, true);
  return 0;
}
