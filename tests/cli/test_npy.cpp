// .npy reading and writing: byte-exact agreement with what NumPy writes,
// round trips, and a clear INVALID_ARGUMENT (never a crash) for every kind of
// bad file.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cli/npy.h"
#include "cli_test_util.h"
#include "plsh/draws.h"
#include "plsh/numeric.h"

namespace plsh::cli {
namespace {

std::string header_v1(const std::string& dict) {
  // NumPy pads the header with spaces and a newline to a multiple of 64.
  std::string h = dict;
  const size_t total = (10 + h.size() + 1 + 63) / 64 * 64;
  h.append(total - 10 - h.size() - 1, ' ');
  h += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(h.size() & 0xFF);
  out += static_cast<char>(h.size() >> 8);
  return out + h;
}

std::string header_v2(const std::string& dict, int major) {
  std::string h = dict + "\n";
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  for (int i = 0; i < 4; ++i) out += static_cast<char>((h.size() >> (8 * i)) & 0xFF);
  return out + h;
}

std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(Npy, WritesExactlyWhatNumpyWrites) {
  // np.save(f, np.arange(6, dtype=np.float32).reshape(2, 3)) with NumPy 1.24:
  // a 128-byte header, then the data.
  const std::vector<float> data = {0, 1, 2, 3, 4, 5};
  const std::string numpy_header = std::string("\x93NUMPY\x01\x00\x76\x00", 10) +
                                   "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" +
                                   std::string(58, ' ') + "\n";
  ASSERT_EQ(numpy_header.size(), 128u);
  EXPECT_EQ(npy_bytes(DType::kF32, {2, 3}, data.data()), numpy_header + f32_bytes(data));
  // One-element tuples keep their comma: (5,).
  const std::string one_d = npy_bytes(DType::kF16, {5}, std::vector<uint16_t>(5).data());
  EXPECT_NE(one_d.find("'shape': (5,), }"), std::string::npos);
  EXPECT_EQ(one_d.size(), 128u + 10u);
}

TEST(Npy, RoundTripsEveryDtypeAndRank) {
  testing::ScratchDir dir;
  const std::vector<std::vector<int64_t>> shapes = {{}, {7}, {3, 5}, {2, 3, 4, 5}, {0, 3}, {1, 1, 1, 1}};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const auto& shape : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<uint8_t> data(static_cast<size_t>(n) * dtype_bytes(t));
      for (int64_t i = 0; i < n; ++i) store_element(data.data(), t, i, static_cast<float>(i) * 0.37f - 3.0f);
      const std::string path = dir.file("a.npy");
      ASSERT_TRUE(write_npy(path, t, shape, data.data()).ok());
      auto back = read_npy(path, NpyReadOptions{true});
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      EXPECT_EQ(back->dtype, t);
      EXPECT_EQ(back->shape, shape);
      EXPECT_EQ(back->data, data);
      EXPECT_EQ(back->elements(), n);
    }
  }
}

TEST(Npy, ReadsVersions2And3AndPython2Longs) {
  const std::vector<float> data = {1.5f, -2.0f};
  for (int major : {2, 3}) {
    auto a =
        parse_npy(header_v2("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", major) + f32_bytes(data), "v");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->shape, (std::vector<int64_t>{2}));
    float back[2];
    std::memcpy(back, a->data.data(), sizeof back);
    EXPECT_EQ(back[1], -2.0f);
  }
  // Old NumPy under Python 2 wrote "(2L,)"; double quotes and no trailing
  // comma are valid Python too.
  auto old =
      parse_npy(header_v1("{\"descr\": \"<f4\", \"shape\": (2L,), \"fortran_order\": False}") + f32_bytes(data), "old");
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_EQ(old->shape, (std::vector<int64_t>{2}));
}

TEST(Npy, Bf16NeedsTheExplicitOption) {
  const std::string file = npy_bytes(DType::kBF16, {2}, std::vector<uint16_t>{0x3F80, 0xC000}.data());
  auto refused = parse_npy(file, "b.npy");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--bf16-bits"), std::string::npos) << refused.status().message();
  auto accepted = parse_npy(file, "b.npy", NpyReadOptions{true});
  ASSERT_TRUE(accepted.ok());
  EXPECT_EQ(accepted->dtype, DType::kBF16);
  EXPECT_EQ(load_element(accepted->ptr(), DType::kBF16, 1), -2.0);
}

struct BadFile {
  const char* what;
  std::string bytes;
  const char* expected;  // in the message
};

TEST(Npy, BadFilesGiveOneLineNamingFileAndProblem) {
  const std::string ok_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const std::string data(24, '\0');
  const std::string good = header_v1(ok_dict) + data;
  const std::vector<BadFile> cases = {
      {"empty file", "", "magic"},
      {"not npy", "hello world, not an array", "magic"},
      {"magic only", std::string("\x93NUMPY", 6), "magic"},
      {"version 4", std::string("\x93NUMPY\x04\x00", 8) + good.substr(8), "version 4.0"},
      {"version 1.1", std::string("\x93NUMPY\x01\x01", 8) + good.substr(8), "version 1.1"},
      {"no header length", std::string("\x93NUMPY\x01\x00\x76", 9), "truncated .npy header"},
      {"header past the end", good.substr(0, 60), "truncated .npy header"},
      {"float64", header_v1("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }") + data + data, "'<f8'"},
      {"big-endian", header_v1("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }") + data, "'>f4'"},
      {"int32", header_v1("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }") + data, "'<i4'"},
      {"structured", header_v1("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2, 3), }") + data,
       "structured dtype"},
      {"fortran", header_v1("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }") + data, "fortran_order"},
      {"truncated data", good.substr(0, good.size() - 1), "truncated"},
      {"trailing data", good + "xyzw", "trailing data"},
      {"missing shape", header_v1("{'descr': '<f4', 'fortran_order': False, }") + data, "needs the keys"},
      {"unknown key", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}") + data,
       "unexpected header key 'x'"},
      {"duplicate key", header_v1("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}") + data,
       "appears twice"},
      {"negative dim", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }") + data,
       "non-negative integers"},
      {"float dim", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': (2.5, 3), }") + data, "shape tuple"},
      {"shape not a tuple", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': '2', }") + data,
       "not a tuple"},
      {"unterminated string", header_v1("{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3), }") + data,
       "malformed"},
      {"no brace", header_v1("'descr': '<f4'") + data, "'{'"},
      {"text after dict", header_v1(ok_dict + " junk") + data, "after the header dict"},
      {"huge shape", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 1099511627776), }"),
       "2^50"},
      {"dim overflows int64", header_v1("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }"),
       "non-negative integers"},
  };
  for (const BadFile& c : cases) {
    auto r = parse_npy(c.bytes, "bad.npy");
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.what;
    const std::string& m = r.status().message();
    EXPECT_EQ(m.rfind("bad.npy: ", 0), 0u) << c.what << ": " << m;
    EXPECT_NE(m.find(c.expected), std::string::npos) << c.what << ": " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << c.what << ": " << m;
  }
}

TEST(Npy, ReadFileErrorsNameThePath) {
  testing::ScratchDir dir;
  auto missing = read_npy(dir.file("missing.npy"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing.npy: no such file"), std::string::npos);
  auto directory = read_npy(dir.file(""));
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
  // The file on disk goes through the same checks as bytes in memory.
  const std::string good = npy_bytes(DType::kF32, {4}, std::vector<float>(4, 1.0f).data());
  testing::write_file(dir.file("short.npy"), good.substr(0, good.size() - 3));
  auto shortened = read_npy(dir.file("short.npy"));
  ASSERT_FALSE(shortened.ok());
  EXPECT_NE(shortened.status().message().find("truncated"), std::string::npos) << shortened.status().message();
}

// Every prefix of a valid file and a few thousand seeded byte mutations of
// it: each parse returns a value or an error, and a value is always
// consistent with its shape. Run under ASan/UBSan this is the crash test.
TEST(Npy, MutatedFilesNeverCrash) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::string good = npy_bytes(DType::kF32, {2, 4}, values.data());
  for (size_t len = 0; len < good.size(); ++len) EXPECT_FALSE(parse_npy(good.substr(0, len), "p").ok()) << len;
  int accepted = 0;
  for (uint64_t trial = 0; trial < 4000; ++trial) {
    std::string bytes = good;
    const uint64_t r = mix64(trial + 1);
    const int flips = 1 + static_cast<int>(r % 4);
    for (int f = 0; f < flips; ++f) {
      const uint64_t rf = mix64(r + static_cast<uint64_t>(f) + 17);
      bytes[rf % bytes.size()] = static_cast<char>((rf >> 32) & 0xFF);
    }
    auto a = parse_npy(bytes, "m");
    if (!a.ok()) continue;
    ++accepted;
    EXPECT_EQ(a->data.size(), static_cast<size_t>(a->elements()) * dtype_bytes(a->dtype));
  }
  // Mutations of the data leave a valid file, most in the header do not;
  // both must happen for the test to mean anything.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 4000);
}

}  // namespace
}  // namespace plsh::cli
