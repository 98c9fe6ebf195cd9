// server/memory_budget.h: the two budgets by memory space, all or nothing,
// with messages that name the flag and say whether to retry.
#include <gtest/gtest.h>

#include <ostream>
#include <vector>

#include "server/memory_budget.h"
#include "server_test_util.h"

namespace plsh::server {

// Beside MemoryCharge (not in the unnamed namespace) so that gtest finds them.
inline bool operator==(const MemoryCharge& a, const MemoryCharge& b) {
  return a.host_bytes == b.host_bytes && a.device_bytes == b.device_bytes;
}
inline void PrintTo(const MemoryCharge& c, std::ostream* os) {
  *os << "{host " << c.host_bytes << ", device " << c.device_bytes << "}";
}

namespace {

using testing::has_error;
using testing::is_ok;

using testing::kExhausted;

TEST(MemoryBudget, HostBudget) {
  MemoryBudget s(MemoryCharge{100, 50});
  EXPECT_EQ(s.budget(), (MemoryCharge{100, 50}));
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 0}));
  ASSERT_TRUE(is_ok(s.reserve({60, 0})));
  EXPECT_EQ(s.reserved(), (MemoryCharge{60, 0}));
  EXPECT_TRUE(has_error(s.reserve({41, 0}), kExhausted,
                        {"41 bytes of host memory", "40 of", "--memory-budget 100", "retry later"}));
  EXPECT_EQ(s.reserved(), (MemoryCharge{60, 0}));
  ASSERT_TRUE(is_ok(s.reserve({40, 0})));  // exactly the rest
  EXPECT_EQ(s.reserved(), (MemoryCharge{100, 0}));
  EXPECT_TRUE(has_error(s.reserve({1, 0}), kExhausted, {"--memory-budget"}));
  s.release({60, 0});
  EXPECT_EQ(s.reserved(), (MemoryCharge{40, 0}));
  s.release({40, 0});
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 0}));
}

TEST(MemoryBudget, DeviceBudget) {
  MemoryBudget s(MemoryCharge{100, 50});
  ASSERT_TRUE(is_ok(s.reserve({0, 30})));
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 30}));
  const Status refused = s.reserve({0, 21});
  EXPECT_TRUE(has_error(refused, kExhausted, {"21 bytes of device memory", "20 of", "--device-memory-budget 50"}));
  EXPECT_EQ(refused.message().find("--memory-budget"), std::string::npos) << refused.message();
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 30}));
  ASSERT_TRUE(is_ok(s.reserve({0, 20})));
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 50}));
  s.release({0, 50});
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 0}));
}

// A charge that fits one space and not the other reserves neither.
TEST(MemoryBudget, AllOrNothing) {
  MemoryBudget s(MemoryCharge{100, 50});
  ASSERT_TRUE(is_ok(s.reserve({10, 10})));
  EXPECT_TRUE(has_error(s.reserve({20, 41}), kExhausted, {"--device-memory-budget"}));
  EXPECT_EQ(s.reserved(), (MemoryCharge{10, 10}));
  EXPECT_TRUE(has_error(s.reserve({91, 1}), kExhausted, {"--memory-budget"}));
  EXPECT_EQ(s.reserved(), (MemoryCharge{10, 10}));
  ASSERT_TRUE(is_ok(s.reserve({90, 40})));
  EXPECT_EQ(s.reserved(), (MemoryCharge{100, 50}));
  s.release({10, 10});
  EXPECT_EQ(s.reserved(), (MemoryCharge{90, 40}));
}

// A zero device budget (a CPU-only server) still admits CPU requests.
TEST(MemoryBudget, ZeroDeviceBudgetAdmitsHostOnlyCharges) {
  MemoryBudget s(MemoryCharge{100, 0});
  ASSERT_TRUE(is_ok(s.reserve({100, 0})));
  s.release({100, 0});
  EXPECT_TRUE(has_error(s.reserve({1, 1}), kExhausted, {"--device-memory-budget 0"}));
  EXPECT_EQ(s.reserved(), (MemoryCharge{0, 0}));
}

// The listener sees every change, in order.
TEST(MemoryBudget, ListenerSeesTheTotals) {
  MemoryBudget s(MemoryCharge{100, 50});
  std::vector<int64_t> seen;
  s.set_listener([&seen](const MemoryCharge& c) { seen.push_back(c.host_bytes * 1000 + c.device_bytes); });
  ASSERT_TRUE(is_ok(s.reserve({10, 5})));
  EXPECT_FALSE(s.reserve({100, 0}).ok());  // refused: no change to see
  s.release({10, 5});
  EXPECT_EQ(seen, (std::vector<int64_t>{10005, 0}));
}

}  // namespace
}  // namespace plsh::server
