// server/buffer_pool.h: request blocks reused across requests, within the
// memory budget; their pages resident only once data arrives, and given
// back above the high-water mark.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "server/buffer_pool.h"

namespace plsh::server {
namespace {

constexpr int64_t MiB = int64_t{1} << 20;

// Resident pages of [p, p + bytes) by mincore; -1 when the range is not
// mapped (ENOMEM).
int64_t resident_pages(const void* p, int64_t bytes) {
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> in(static_cast<size_t>((bytes + page - 1) / page));
  if (mincore(const_cast<void*>(p), static_cast<size_t>(bytes), in.data()) != 0) return errno == ENOMEM ? -1 : -2;
  int64_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n;
}

TEST(BufferPool, SmallBuffersAreNotPooled) {
  BufferPool pool(64 * MiB, 64 * MiB);
  {
    std::shared_ptr<uint8_t> b = pool.acquire(100);
    std::memset(b.get(), 1, 100);
  }
  const BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.mapped, 0);
  EXPECT_EQ(s.idle_bytes, 0);
}

TEST(BufferPool, ABlockGivenBackServesTheNextRequestOfItsSize) {
  BufferPool pool(64 * MiB, 64 * MiB);
  uint8_t* first = nullptr;
  {
    std::shared_ptr<uint8_t> b = pool.acquire(3 * MiB);
    first = b.get();
    std::memset(b.get(), 7, 3 * MiB);               // writable, all of it
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
  BufferPool pool(10 * MiB, 10 * MiB);
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
    BufferPool pool(64 * MiB, 64 * MiB);
    kept = pool.acquire(2 * MiB);
  }
  std::memset(kept.get(), 1, 2 * MiB);  // still mapped and writable
  const uint8_t* block = kept.get();
  EXPECT_EQ(resident_pages(block, 2 * MiB), 2 * MiB / sysconf(_SC_PAGESIZE));
  // Given back to the pool's state, which it held alive; the state goes
  // with it and unmaps the block (kept idle, nothing else holds it).
  kept.reset();
  EXPECT_EQ(resident_pages(block, 2 * MiB), -1);
}

// D2 of issue 24: a header's reservation costs no resident memory; the
// pages come as chunks are faulted in.
TEST(BufferPool, ABlockIsResidentOnlyWhereDataArrived) {
  BufferPool pool(64 * MiB, 64 * MiB);
  std::shared_ptr<uint8_t> b = pool.acquire(32 * MiB);
  EXPECT_EQ(resident_pages(b.get(), 32 * MiB), 0);
  const long page = sysconf(_SC_PAGESIZE);
  BufferPool::fault_in(b.get() + 4 * MiB + 100, MiB);  // spans 257 pages from an unaligned start
  EXPECT_EQ(resident_pages(b.get(), 32 * MiB), MiB / page + 1);
  EXPECT_EQ(resident_pages(b.get() + 4 * MiB, MiB + page), MiB / page + 1);
}

// Idle blocks keep at most the high-water mark resident; the rest give
// their pages back (and stay mapped for reuse).
TEST(BufferPool, IdleBlocksAboveTheMarkGiveTheirPagesBack) {
  BufferPool pool(64 * MiB, 8 * MiB);
  std::shared_ptr<uint8_t> a = pool.acquire(6 * MiB);
  std::shared_ptr<uint8_t> b = pool.acquire(6 * MiB);
  std::memset(a.get(), 1, 6 * MiB);
  std::memset(b.get(), 2, 6 * MiB);
  const uint8_t* a_block = a.get();
  const uint8_t* b_block = b.get();
  a.reset();  // 6 of 8 MiB: kept resident
  b.reset();  // 12 > 8: its pages go back
  const BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.idle_bytes, 12 * MiB);
  EXPECT_EQ(s.idle_resident_bytes, 6 * MiB);
  EXPECT_EQ(s.released, 1);
  EXPECT_EQ(resident_pages(a_block, 6 * MiB), 6 * MiB / sysconf(_SC_PAGESIZE));
  EXPECT_EQ(resident_pages(b_block, 6 * MiB), 0);
  // Reused, a released block reads as zeros (fresh pages), not as stale data.
  std::shared_ptr<uint8_t> again = pool.acquire(6 * MiB);
  std::shared_ptr<uint8_t> again2 = pool.acquire(6 * MiB);
  const uint8_t* released = again.get() == b_block ? again.get() : again2.get();
  EXPECT_EQ(released, b_block);
  EXPECT_EQ(released[12345], 0);
  EXPECT_EQ(pool.stats().idle_resident_bytes, 0);
}

}  // namespace
}  // namespace plsh::server
