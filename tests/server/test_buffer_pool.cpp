// server/buffer_pool.h: request blocks reused across requests, within the
// memory budget.
#include <gtest/gtest.h>

#include <cstring>

#include "server/buffer_pool.h"

namespace plsh::server {
namespace {

constexpr int64_t MiB = int64_t{1} << 20;

TEST(BufferPool, SmallBuffersAreNotPooled) {
  BufferPool pool(64 * MiB);
  {
    std::shared_ptr<uint8_t> b = pool.acquire(100);
    std::memset(b.get(), 1, 100);
  }
  const BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.mapped, 0);
  EXPECT_EQ(s.idle_bytes, 0);
}

TEST(BufferPool, ABlockGivenBackServesTheNextRequestOfItsSize) {
  BufferPool pool(64 * MiB);
  uint8_t* first = nullptr;
  {
    std::shared_ptr<uint8_t> b = pool.acquire(3 * MiB);
    first = b.get();
    std::memset(b.get(), 7, 3 * MiB);  // writable, all of it
    EXPECT_EQ(pool.stats().in_use_bytes, 4 * MiB);  // rounded up to 2 MiB granules
  }
  EXPECT_EQ(pool.stats().idle_bytes, 4 * MiB);
  EXPECT_EQ(pool.stats().in_use_bytes, 0);
  std::shared_ptr<uint8_t> again = pool.acquire(3 * MiB + 5);
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(pool.stats().reused, 1);
  EXPECT_EQ(pool.stats().mapped, 1);
  // A second one while the first is held: mapped anew.
  std::shared_ptr<uint8_t> other = pool.acquire(3 * MiB);
  EXPECT_NE(other.get(), first);
  EXPECT_EQ(pool.stats().mapped, 2);
}

TEST(BufferPool, IdleBlocksMakeRoomWithinTheLimit) {
  BufferPool pool(10 * MiB);
  { std::shared_ptr<uint8_t> b = pool.acquire(8 * MiB); }
  EXPECT_EQ(pool.stats().idle_bytes, 8 * MiB);
  // 2 MiB is far smaller than the idle 8 MiB block: not handed out; 8 + 2
  // fits the limit, so the idle block stays.
  std::shared_ptr<uint8_t> small = pool.acquire(2 * MiB);
  EXPECT_EQ(pool.stats().idle_bytes, 8 * MiB);
  EXPECT_EQ(pool.stats().mapped, 2);
  // 4 MiB more does not fit beside it: the idle block is unmapped.
  std::shared_ptr<uint8_t> more = pool.acquire(4 * MiB);
  EXPECT_EQ(pool.stats().idle_bytes, 0);
  EXPECT_EQ(pool.stats().in_use_bytes, 6 * MiB);
  // Past the limit a request is still served (the Scheduler's budget, not
  // the pool, refuses requests), and its block is unmapped when given back.
  std::shared_ptr<uint8_t> big = pool.acquire(8 * MiB);
  EXPECT_EQ(pool.stats().in_use_bytes, 14 * MiB);
  big.reset();
  EXPECT_EQ(pool.stats().idle_bytes, 0);
  more.reset();  // 2 in use + 4 idle: kept
  EXPECT_EQ(pool.stats().idle_bytes, 4 * MiB);
}

TEST(BufferPool, ABlockMayOutliveThePool) {
  std::shared_ptr<uint8_t> kept;
  {
    BufferPool pool(64 * MiB);
    kept = pool.acquire(2 * MiB);
  }
  std::memset(kept.get(), 1, 2 * MiB);
  kept.reset();  // given back to the pool's state, which it held alive
}

}  // namespace
}  // namespace plsh::server
