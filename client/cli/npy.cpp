#include "cli/npy.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

namespace plsh::cli {

int64_t NpyArray::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<uint8_t> swap_axes(const void* data, size_t element_bytes, const std::vector<int64_t>& shape, size_t axis) {
  int64_t outer = 1, inner = static_cast<int64_t>(element_bytes);
  for (size_t i = 0; i < axis; ++i) outer *= shape[i];
  for (size_t i = axis + 2; i < shape.size(); ++i) inner *= shape[i];
  const int64_t a = shape[axis], b = shape[axis + 1];
  std::vector<uint8_t> out(static_cast<size_t>(outer * a * b * inner));
  const auto* in = static_cast<const uint8_t*>(data);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < a; ++i)
      for (int64_t j = 0; j < b; ++j)
        std::memcpy(out.data() + ((o * b + j) * a + i) * inner, in + ((o * a + i) * b + j) * inner,
                    static_cast<size_t>(inner));
  return out;
}

NpyArray swap_axes(const NpyArray& a, size_t axis) {
  NpyArray out;
  out.dtype = a.dtype;
  out.shape = a.shape;
  std::swap(out.shape[axis], out.shape[axis + 1]);
  out.data = swap_axes(a.ptr(), dtype_bytes(a.dtype), a.shape, axis);
  return out;
}

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// No attention tensor comes near this; it keeps products far from overflow.
constexpr int64_t kMaxElements = int64_t{1} << 50;

Status bad(const std::string& name, const std::string& what) { return invalid_argument(name + ": " + what); }

// The header is a Python dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// A small recursive-descent reader of exactly that subset: strings, True,
// False, and tuples of integers. A list value (a structured dtype) is
// recognised only to name it in the error.
struct HeaderValue {
  enum Kind { kString, kBool, kTuple, kList } kind = kString;
  std::string text;
  bool flag = false;
  std::vector<int64_t> ints;
};

class HeaderReader {
 public:
  explicit HeaderReader(std::string_view s) : s_(s) {}

  // Fills the three keys NumPy writes; the message says what is wrong.
  bool read(std::optional<HeaderValue>* descr, std::optional<HeaderValue>* fortran, std::optional<HeaderValue>* shape,
            std::string* error) {
    if (!expect('{')) return fail(error, "expected '{' at the start of the header");
    while (true) {
      skip_space();
      if (peek() == '}') {
        ++pos_;
        break;
      }
      std::string key;
      if (!read_string(&key)) return fail(error, "expected a quoted key in the header dict");
      std::optional<HeaderValue>* slot = nullptr;
      if (key == "descr")
        slot = descr;
      else if (key == "fortran_order")
        slot = fortran;
      else if (key == "shape")
        slot = shape;
      else
        return fail(error, "unexpected header key '" + key + "' (expected descr, fortran_order, shape)");
      if (slot->has_value()) return fail(error, "header key '" + key + "' appears twice");
      if (!expect(':')) return fail(error, "expected ':' after key '" + key + "'");
      HeaderValue value;
      if (!read_value(&value, error)) return false;
      *slot = std::move(value);
      skip_space();
      if (peek() == ',') {
        ++pos_;
      } else if (peek() != '}') {
        return fail(error, "expected ',' or '}' after the value of '" + key + "'");
      }
    }
    skip_space();
    if (pos_ != s_.size()) return fail(error, "unexpected text after the header dict");
    return true;
  }

 private:
  static bool fail(std::string* error, std::string what) {
    *error = std::move(what);
    return false;
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool expect(char c) {
    skip_space();
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  bool read_string(std::string* out) {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"') return false;
    const size_t end = s_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) return false;
    *out = std::string(s_.substr(pos_ + 1, end - pos_ - 1));
    if (out->find('\\') != std::string::npos) return false;  // no escapes in any valid descr
    pos_ = end + 1;
    return true;
  }
  bool read_word(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  bool read_int(int64_t* out) {
    skip_space();
    const size_t start = pos_;
    int64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) return false;
      v = v * 10 + (s_[pos_] - '0');
      ++pos_;
    }
    if (pos_ == start) return false;
    if (peek() == 'L') ++pos_;  // Python 2 longs, in files from old NumPy
    *out = v;
    return true;
  }
  bool read_value(HeaderValue* v, std::string* error) {
    skip_space();
    const char c = peek();
    if (c == '\'' || c == '"') {
      v->kind = HeaderValue::kString;
      if (!read_string(&v->text)) return fail(error, "unterminated or escaped string in the header");
      return true;
    }
    if (read_word("True")) {
      v->kind = HeaderValue::kBool;
      v->flag = true;
      return true;
    }
    if (read_word("False")) {
      v->kind = HeaderValue::kBool;
      v->flag = false;
      return true;
    }
    if (c == '[') {
      v->kind = HeaderValue::kList;
      // Skip to the matching bracket; the caller only reports it.
      int depth = 0;
      for (; pos_ < s_.size(); ++pos_) {
        if (s_[pos_] == '[') ++depth;
        if (s_[pos_] == ']' && --depth == 0) {
          ++pos_;
          return true;
        }
      }
      return fail(error, "unterminated list in the header");
    }
    if (c == '(') {
      ++pos_;
      v->kind = HeaderValue::kTuple;
      while (true) {
        skip_space();
        if (peek() == ')') {
          ++pos_;
          return true;
        }
        int64_t d = 0;
        if (!read_int(&d)) return fail(error, "shape must be a tuple of non-negative integers");
        v->ints.push_back(d);
        skip_space();
        if (peek() == ',') {
          ++pos_;
        } else if (peek() != ')') {
          return fail(error, "expected ',' or ')' in the shape tuple");
        }
      }
    }
    return fail(error, "unreadable value in the header at offset " + std::to_string(pos_));
  }

  std::string_view s_;
  size_t pos_ = 0;
};

uint32_t read_le(std::string_view bytes, size_t offset, size_t n) {
  uint32_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
  return v;
}

// The .npy descr of each dtype, the one list that the reader and the writer
// read: bfloat16, which numpy lacks, travels as its bit patterns, '<u2'.
constexpr EnumName<DType> kNpyDescrs[] = {{DType::kF32, "<f4"}, {DType::kF16, "<f2"}, {DType::kBF16, "<u2"}};

}  // namespace

namespace {

// Header bytes before the dict: magic, version, and the dict's length.
struct Preamble {
  size_t header_offset = 0;  // where the dict starts
  size_t data_offset = 0;    // where the data starts
};

StatusOr<Preamble> parse_preamble(std::string_view bytes, size_t file_size, const std::string& name) {
  if (bytes.size() < kMagicLen + 2 || bytes.substr(0, kMagicLen) != std::string_view(kMagic, kMagicLen))
    return bad(name, "not a .npy file (no \\x93NUMPY magic)");
  const int major = static_cast<uint8_t>(bytes[6]);
  const int minor = static_cast<uint8_t>(bytes[7]);
  if (major < 1 || major > 3 || minor != 0)
    return bad(name, ".npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                         ", expected 1.0, 2.0 or 3.0");
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (bytes.size() < kMagicLen + 2 + len_bytes) return bad(name, "truncated .npy header");
  Preamble p;
  p.header_offset = kMagicLen + 2 + len_bytes;
  const size_t header_len = read_le(bytes, kMagicLen + 2, len_bytes);
  p.data_offset = p.header_offset + header_len;
  if (p.data_offset > file_size)
    return bad(name, "truncated .npy header (declares " + std::to_string(header_len) + " bytes, file has " +
                         std::to_string(file_size - p.header_offset) + ")");
  return p;
}

// Reads the dict into `a` (dtype, shape; data left empty) and returns the
// number of data bytes the shape needs.
StatusOr<size_t> parse_header(std::string_view dict, const std::string& name, const NpyReadOptions& options,
                              NpyArray* a, std::string* descr_text) {
  std::optional<HeaderValue> descr, fortran, shape;
  std::string error;
  HeaderReader reader(dict);
  if (!reader.read(&descr, &fortran, &shape, &error)) return bad(name, "malformed .npy header: " + error);
  if (!descr || !fortran || !shape)
    return bad(name, "malformed .npy header: needs the keys descr, fortran_order and shape");
  if (descr->kind == HeaderValue::kList) return bad(name, "structured dtype, expected '<f4' or '<f2'");
  if (descr->kind != HeaderValue::kString) return bad(name, "malformed .npy header: descr is not a string");
  if (fortran->kind != HeaderValue::kBool) return bad(name, "malformed .npy header: fortran_order is not True/False");
  if (shape->kind != HeaderValue::kTuple) return bad(name, "malformed .npy header: shape is not a tuple");

  const std::optional<DType> dtype = value_named(kNpyDescrs, descr->text);
  if (!dtype)
    return bad(name, "dtype '" + descr->text + "', expected '<f4' (float32) or '<f2' (float16), little-endian");
  if (*dtype == DType::kBF16 && !options.u2_as_bf16)
    return bad(name, "dtype '<u2', expected '<f4' or '<f2' (pass --bf16-bits to read uint16 as bfloat16 bit patterns)");
  a->dtype = *dtype;
  if (fortran->flag) return bad(name, "fortran_order = True, expected C order (use numpy.ascontiguousarray)");

  a->shape = shape->ints;
  int64_t elements = 1;
  for (int64_t d : a->shape) {
    if (d != 0 && elements > kMaxElements / d)
      return bad(name, "shape " + shape_string(a->shape) + " has more than 2^50 elements");
    elements *= d;
  }
  *descr_text = descr->text;
  return static_cast<size_t>(elements) * dtype_bytes(a->dtype);
}

Status check_data_size(size_t have, size_t want, const NpyArray& a, const std::string& descr, const std::string& name) {
  if (have < want)
    return bad(name, "truncated: shape " + shape_string(a.shape) + " of '" + descr + "' needs " + std::to_string(want) +
                         " data bytes, file has " + std::to_string(have));
  if (have > want)
    return bad(name, std::to_string(have) + " data bytes, expected " + std::to_string(want) + " for shape " +
                         shape_string(a.shape) + " of '" + descr + "' (trailing data)");
  return Status::Ok();
}

}  // namespace

StatusOr<NpyArray> parse_npy(std::string_view bytes, const std::string& name, const NpyReadOptions& options) {
  ASSIGN_OR_RETURN(const Preamble pre, parse_preamble(bytes, bytes.size(), name));
  NpyArray a;
  std::string descr;
  ASSIGN_OR_RETURN(const size_t want, parse_header(bytes.substr(pre.header_offset, pre.data_offset - pre.header_offset),
                                                   name, options, &a, &descr));
  RETURN_IF_ERROR(check_data_size(bytes.size() - pre.data_offset, want, a, descr, name));
  a.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(pre.data_offset), bytes.end());
  return a;
}

StatusOr<NpyArray> read_npy(const std::string& path, const NpyReadOptions& options) {
  // Header first, then the data straight into the array: a file's size is
  // checked against its shape before anything of that size is allocated.
  std::error_code ec;
  const auto kind = std::filesystem::status(path, ec).type();
  if (kind == std::filesystem::file_type::not_found) return invalid_argument(path + ": no such file");
  if (kind == std::filesystem::file_type::directory)
    return invalid_argument(path + ": is a directory, expected a .npy file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return invalid_argument(path + ": cannot open: " + std::strerror(errno));
  const std::streamoff end = in.tellg();
  if (end < 0) return invalid_argument(path + ": cannot read (not a regular file?)");
  const size_t file_size = static_cast<size_t>(end);
  in.seekg(0);

  std::string head(std::min<size_t>(file_size, kMagicLen + 2 + 4), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  if (!in) return invalid_argument(path + ": read error");
  ASSIGN_OR_RETURN(const Preamble pre, parse_preamble(head, file_size, path));

  std::string dict(pre.data_offset - pre.header_offset, '\0');
  in.seekg(static_cast<std::streamoff>(pre.header_offset));
  in.read(dict.data(), static_cast<std::streamsize>(dict.size()));
  if (!in) return invalid_argument(path + ": read error in the header");
  NpyArray a;
  std::string descr;
  ASSIGN_OR_RETURN(const size_t want, parse_header(dict, path, options, &a, &descr));
  RETURN_IF_ERROR(check_data_size(file_size - pre.data_offset, want, a, descr, path));

  a.data.resize(want);
  in.read(reinterpret_cast<char*>(a.data.data()), static_cast<std::streamsize>(want));
  if (!in) return invalid_argument(path + ": read error in the data (file changed while reading?)");
  return a;
}

std::string npy_header(DType dtype, const std::vector<int64_t>& shape) {
  std::string dict = std::string("{'descr': '") + name_of(kNpyDescrs, dtype) + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dict += ",";
  dict += "), }";

  // Pad with spaces and a final newline so the data starts on a 64-byte
  // boundary (NumPy >= 1.21 does the same; mmap and SIMD readers like it).
  int major = 1;
  size_t prefix = kMagicLen + 2 + 2;
  size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  if (total - prefix > 65535) {
    major = 2;
    prefix = kMagicLen + 2 + 4;
    total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  }
  const size_t header_len = total - prefix;
  dict.append(header_len - dict.size() - 1, ' ');
  dict += '\n';

  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < (major == 1 ? 2u : 4u); ++i) out += static_cast<char>((header_len >> (8 * i)) & 0xFF);
  return out + dict;
}

namespace {
size_t data_bytes(DType dtype, const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  return static_cast<size_t>(elements) * dtype_bytes(dtype);
}
}  // namespace

std::string npy_bytes(DType dtype, const std::vector<int64_t>& shape, const void* data) {
  std::string out = npy_header(dtype, shape);
  const size_t n = data_bytes(dtype, shape);
  if (n > 0) out.append(static_cast<const char*>(data), n);
  return out;
}

Status write_npy(const std::string& path, DType dtype, const std::vector<int64_t>& shape, const void* data) {
  // Header, then the data straight from the caller's buffer (no copy of it).
  const std::string header = npy_header(dtype, shape);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return failed_precondition(path + ": cannot create: " + std::strerror(errno));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  const size_t n = data_bytes(dtype, shape);
  if (n > 0) out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  out.close();
  if (!out) return failed_precondition(path + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace plsh::cli
