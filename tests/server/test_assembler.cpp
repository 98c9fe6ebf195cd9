// server/assembler.h: chunks back into q, k and v. The plan is built by hand
// with q and k/v of different row counts and row widths, so that a chunk
// checked against (or copied into) the wrong tensor shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "server/assembler.h"
#include "server/request.h"
#include "server_test_util.h"

namespace plsh::server {
namespace {

using testing::has_error;
using testing::is_ok;

using testing::kInvalid;

// The byte a test writes at (tensor, row, byte); `salt` makes a second
// writer's bytes differ from the first's.
uint8_t pattern(v1::Tensor tensor, int64_t row, int64_t byte, int salt = 0) {
  return static_cast<uint8_t>(static_cast<int>(tensor) * 89 + row * 31 + byte * 7 + salt * 53 + 1);
}

class AssemblerTest : public ::testing::Test {
 protected:
  void make(int64_t q_rows, int64_t kv_rows) {
    q_ = {q_rows, 12};   // e.g. H = 3, D = 1, f32
    kv_ = {kv_rows, 8};  // Hkv = 1, D = 2, f32
    memory_ = RequestMemory::allocate({.q = q_.bytes(), .k = kv_.bytes(), .v = kv_.bytes()}, nullptr);
    assembler_.emplace(std::initializer_list<AssemblyTarget>{{v1::TENSOR_Q, "q", memory_.q, q_, "batch * q_len"},
                                                             {v1::TENSOR_K, "k", memory_.k, kv_, "batch * kv_len"},
                                                             {v1::TENSOR_V, "v", memory_.v, kv_, "batch * kv_len"}});
  }
  void SetUp() override { make(10, 7); }

  int64_t row_bytes(v1::Tensor t) const { return t == v1::TENSOR_Q ? q_.row_bytes : kv_.row_bytes; }
  int64_t rows(v1::Tensor t) const { return t == v1::TENSOR_Q ? q_.rows : kv_.rows; }
  const uint8_t* buffer(v1::Tensor t) const {
    return t == v1::TENSOR_Q ? memory_.q : t == v1::TENSOR_K ? memory_.k : memory_.v;
  }

  // A chunk of rows [start, start + count) carrying exactly their bytes.
  v1::TensorChunk chunk(v1::Tensor t, int64_t start, int64_t count, int salt = 0) const {
    v1::TensorChunk c;
    c.set_tensor(t);
    c.set_row_start(start);
    c.set_row_count(count);
    std::string data(static_cast<size_t>(count * row_bytes(t)), '\0');
    for (int64_t r = 0; r < count; ++r)
      for (int64_t b = 0; b < row_bytes(t); ++b)
        data[static_cast<size_t>(r * row_bytes(t) + b)] = static_cast<char>(pattern(t, start + r, b, salt));
    c.set_data(std::move(data));
    return c;
  }
  Status add(v1::Tensor t, int64_t start, int64_t count, int salt = 0) {
    return assembler_->add(chunk(t, start, count, salt));
  }
  Status add_all(v1::Tensor t) { return add(t, 0, rows(t)); }

  // Rows [start, end) of t hold what chunk(t, ..., salt) wrote there.
  ::testing::AssertionResult rows_hold(v1::Tensor t, int64_t start, int64_t end, int salt = 0) const {
    for (int64_t r = start; r < end; ++r)
      for (int64_t b = 0; b < row_bytes(t); ++b)
        if (buffer(t)[r * row_bytes(t) + b] != pattern(t, r, b, salt))
          return ::testing::AssertionFailure()
                 << v1::Tensor_Name(t) << " row " << r << " byte " << b << " is "
                 << int{buffer(t)[r * row_bytes(t) + b]} << ", expected " << int{pattern(t, r, b, salt)};
    return ::testing::AssertionSuccess();
  }

  TensorShape q_, kv_;
  RequestMemory memory_;
  std::optional<Assembler> assembler_;
};

TEST_F(AssemblerTest, ChunksInOrderLandInPlaceAndComplete) {
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 0, 3)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 3, 7)));
  ASSERT_TRUE(is_ok(add_all(v1::TENSOR_K)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 0, 1)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 1, 5)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 6, 1)));
  EXPECT_TRUE(is_ok(assembler_->complete()));
  EXPECT_TRUE(rows_hold(v1::TENSOR_Q, 0, 10));
  EXPECT_TRUE(rows_hold(v1::TENSOR_K, 0, 7));
  EXPECT_TRUE(rows_hold(v1::TENSOR_V, 0, 7));
  EXPECT_EQ(assembler_->received_bytes(), 10 * 12 + 2 * 7 * 8);
}

TEST_F(AssemblerTest, ReceivedBytesCountsOnlyAcceptedChunks) {
  EXPECT_EQ(assembler_->received_bytes(), 0);
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 2, 3)));
  EXPECT_EQ(assembler_->received_bytes(), 3 * 12);
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, 6, 1)));
  EXPECT_EQ(assembler_->received_bytes(), 3 * 12 + 8);
  EXPECT_FALSE(add(v1::TENSOR_Q, 4, 2).ok());  // overlap
  EXPECT_FALSE(add(v1::TENSOR_K, 7, 1).ok());  // out of range
  v1::TensorChunk short_chunk = chunk(v1::TENSOR_V, 0, 2);
  short_chunk.mutable_data()->pop_back();
  EXPECT_FALSE(assembler_->add(short_chunk).ok());
  EXPECT_EQ(assembler_->received_bytes(), 3 * 12 + 8);
}

// Many one-row chunks, shuffled and interleaved across the three tensors with
// a fixed seed: each is accepted, complete() fails until the very last row
// arrives, and every byte ends up in place. After that every row is taken,
// so one more row anywhere overlaps.
TEST_F(AssemblerTest, ShuffledOneRowChunksCoverEveryTensor) {
  make(300, 211);
  std::vector<std::pair<v1::Tensor, int64_t>> rows_to_send;
  for (v1::Tensor t : {v1::TENSOR_Q, v1::TENSOR_K, v1::TENSOR_V})
    for (int64_t r = 0; r < rows(t); ++r) rows_to_send.emplace_back(t, r);
  std::mt19937_64 rng(20240917);
  std::shuffle(rows_to_send.begin(), rows_to_send.end(), rng);

  for (size_t i = 0; i < rows_to_send.size(); ++i) {
    const auto [t, r] = rows_to_send[i];
    ASSERT_TRUE(is_ok(add(t, r, 1))) << "chunk " << i;
    if (i + 1 < rows_to_send.size()) {
      ASSERT_EQ(assembler_->complete().code(), kInvalid) << "after chunk " << i;
    }
  }
  EXPECT_TRUE(is_ok(assembler_->complete()));
  EXPECT_EQ(assembler_->received_bytes(), 300 * 12 + 2 * 211 * 8);
  EXPECT_TRUE(rows_hold(v1::TENSOR_Q, 0, 300));
  EXPECT_TRUE(rows_hold(v1::TENSOR_K, 0, 211));
  EXPECT_TRUE(rows_hold(v1::TENSOR_V, 0, 211));
  for (int64_t r : {int64_t{0}, int64_t{150}, int64_t{299}})
    EXPECT_TRUE(has_error(add(v1::TENSOR_Q, r, 1), kInvalid, {"overlap"})) << "row " << r;
  EXPECT_TRUE(has_error(add(v1::TENSOR_V, 210, 1), kInvalid, {"overlap"}));
}

// [0, 2) and [4, 6), then [2, 4) joins them: the error for a later overlap
// names the merged range.
TEST_F(AssemblerTest, AdjacentChunksMerge) {
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 0, 2)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 4, 2)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 2, 2)));
  EXPECT_TRUE(has_error(add(v1::TENSOR_Q, 5, 3), kInvalid, {"rows [5, 8)", "overlap rows [0, 6)"}));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 6, 4)));
  EXPECT_TRUE(has_error(add(v1::TENSOR_Q, 9, 1), kInvalid, {"overlap rows [0, 10)"}));
}

struct OverlapCase {
  const char* name;
  int64_t first_start, first_count, second_start, second_count;
};

class AssemblerOverlapTest : public AssemblerTest, public ::testing::WithParamInterface<OverlapCase> {};

// The second chunk is refused, and neither the buffer nor the byte count
// changes: its bytes (written with another salt) must not land.
TEST_P(AssemblerOverlapTest, RefusedWithoutTouchingTheBuffer) {
  const OverlapCase& c = GetParam();
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, c.first_start, c.first_count)));
  const std::string first =
      "rows [" + std::to_string(c.first_start) + ", " + std::to_string(c.first_start + c.first_count) + ")";
  EXPECT_TRUE(has_error(add(v1::TENSOR_K, c.second_start, c.second_count, /*salt=*/1), kInvalid,
                        {"chunk of k", "overlap", first.c_str(), "received before"}));
  EXPECT_EQ(assembler_->received_bytes(), c.first_count * 8);
  EXPECT_TRUE(rows_hold(v1::TENSOR_K, c.first_start, c.first_start + c.first_count));
}

INSTANTIATE_TEST_SUITE_P(Overlaps, AssemblerOverlapTest,
                         ::testing::Values(OverlapCase{"Exact", 2, 3, 2, 3}, OverlapCase{"TailOfEarlier", 2, 3, 4, 2},
                                           OverlapCase{"HeadOfEarlier", 3, 3, 1, 3},
                                           OverlapCase{"Contains", 3, 2, 1, 5}, OverlapCase{"Inside", 1, 5, 3, 1},
                                           OverlapCase{"SameStartLonger", 2, 2, 2, 4},
                                           OverlapCase{"SameEndShorter", 1, 5, 5, 1}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_F(AssemblerTest, RowStartOutOfRange) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  const int64_t min = std::numeric_limits<int64_t>::min();
  for (int64_t start : {int64_t{-1}, min, int64_t{7}, int64_t{8}, max}) {
    v1::TensorChunk c = chunk(v1::TENSOR_V, 0, 1);
    c.set_row_start(start);
    EXPECT_TRUE(has_error(assembler_->add(c), kInvalid,
                          {"chunk of v", ("row_start = " + std::to_string(start)).c_str(), "[0, 7)", "batch * kv_len"}))
        << "row_start " << start;
  }
  // q's range is q's own.
  EXPECT_TRUE(is_ok(add(v1::TENSOR_Q, 9, 1)));
  EXPECT_TRUE(
      has_error(add(v1::TENSOR_Q, 10, 1), kInvalid, {"chunk of q", "row_start = 10", "[0, 10)", "batch * q_len"}));
  EXPECT_EQ(assembler_->received_bytes(), 12);
}

TEST_F(AssemblerTest, RowCountOutOfRange) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  const int64_t min = std::numeric_limits<int64_t>::min();
  struct Case {
    int64_t start, count;
  };
  // Zero and negative counts, one past the end, and counts whose
  // start + count overflows int64 (a naive end check would wrap and pass).
  for (Case c :
       {Case{0, 0}, Case{3, -1}, Case{3, min}, Case{0, 8}, Case{6, 2}, Case{5, max}, Case{2, max - 1}, Case{6, max}}) {
    v1::TensorChunk ch = chunk(v1::TENSOR_K, c.start, 1);
    ch.set_row_count(c.count);
    EXPECT_TRUE(has_error(assembler_->add(ch), kInvalid,
                          {"chunk of k", ("row_count = " + std::to_string(c.count)).c_str(),
                           ("[1, " + std::to_string(7 - c.start) + "]").c_str()}))
        << "row_start " << c.start << ", row_count " << c.count;
  }
  EXPECT_EQ(assembler_->received_bytes(), 0);
  EXPECT_TRUE(is_ok(add(v1::TENSOR_K, 6, 1)));  // the last row alone is fine
}

TEST_F(AssemblerTest, DataMustBeExactlyTheRowsBytes) {
  for (int delta : {-1, +1, -24}) {
    v1::TensorChunk c = chunk(v1::TENSOR_Q, 4, 2);
    c.mutable_data()->resize(static_cast<size_t>(24 + delta));
    EXPECT_TRUE(has_error(
        assembler_->add(c), kInvalid,
        {"chunk of q", ("data = " + std::to_string(24 + delta) + " bytes").c_str(), "expected 24", "12 bytes per row"}))
        << "delta " << delta;
  }
  // k's rows are 8 bytes: q's 12 is wrong there.
  v1::TensorChunk k = chunk(v1::TENSOR_K, 0, 1);
  k.set_data(std::string(12, 'x'));
  EXPECT_TRUE(has_error(assembler_->add(k), kInvalid, {"chunk of k", "data = 12 bytes", "expected 8"}));
  EXPECT_EQ(assembler_->received_bytes(), 0);
}

TEST_F(AssemblerTest, OnlyInputTensorsAccepted) {
  for (int t : {int{v1::TENSOR_UNSPECIFIED}, int{v1::TENSOR_OUT}, int{v1::TENSOR_LSE}, 99, -1}) {
    v1::TensorChunk c = chunk(v1::TENSOR_Q, 0, 1);
    c.set_tensor(static_cast<v1::Tensor>(t));
    EXPECT_TRUE(has_error(assembler_->add(c), kInvalid,
                          {("chunk.tensor = " + std::to_string(t)).c_str(), "TENSOR_Q, TENSOR_K or TENSOR_V"}))
        << "tensor " << t;
  }
  EXPECT_EQ(assembler_->received_bytes(), 0);
}

TEST_F(AssemblerTest, CompleteNamesTheFirstMissingRows) {
  EXPECT_TRUE(
      has_error(assembler_->complete(), kInvalid, {"q: rows [0, 10) missing", "0 of 10 rows", "batch * q_len"}));

  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 2, 8)));
  EXPECT_TRUE(has_error(assembler_->complete(), kInvalid, {"q: rows [0, 2) missing", "8 of 10 rows"}));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_Q, 0, 2)));

  // q done: k is next, with a gap in the middle and one at the end.
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, 0, 2)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, 4, 2)));
  EXPECT_TRUE(has_error(assembler_->complete(), kInvalid, {"k: rows [2, 4) missing", "4 of 7 rows", "batch * kv_len"}));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, 2, 2)));
  EXPECT_TRUE(has_error(assembler_->complete(), kInvalid, {"k: rows [6, 7) missing", "6 of 7 rows"}));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_K, 6, 1)));

  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 0, 3)));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 5, 2)));
  EXPECT_TRUE(has_error(assembler_->complete(), kInvalid, {"v: rows [3, 5) missing", "5 of 7 rows"}));
  ASSERT_TRUE(is_ok(add(v1::TENSOR_V, 3, 2)));
  EXPECT_TRUE(is_ok(assembler_->complete()));
}

}  // namespace
}  // namespace plsh::server
