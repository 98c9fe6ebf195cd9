// The kept-context store (server/contexts.h) on its own: ids, ownership,
// checkout, the budget's charge moving with a context, least-recently-used
// eviction for room, --max-contexts, the TTL sweeper and a drain. No
// network: contexts here carry a Request of one small request and
// nothing else (the store never reads their tensors).
#include <gtest/gtest.h>

#include <regex>
#include <set>

#include "server/contexts.h"
#include "server_test_util.h"

namespace plsh::server {
namespace {

using testing::eventually;
using testing::has_error;
using testing::is_ok;

struct Fixture {
  explicit Fixture(int64_t budget_host = 1000, ContextStoreOptions options = {})
      : budget(MemoryCharge{budget_host, 0}), store(options, &budget, nullptr) {}

  // A forward that keeps a context of `bytes`: reserved as the forward's
  // charge, then moved to the store as CallBase::close does.
  std::string keep(int64_t bytes, const std::string& owner = "") {
    EXPECT_TRUE(is_ok(budget.reserve({bytes, 0})));
    StatusOr<std::string> id = store.reserve_id(owner);
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    store.put(*id, std::make_shared<KeptContext>(Request{}, RequestMemory{}, MemoryCharge{bytes, 0}, &budget, nullptr));
    return *id;
  }

  MemoryBudget budget;
  ContextStore store;
};

TEST(ContextStore, IdsAreRandomAndWellFormed) {
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) ids.insert(new_context_id());
  EXPECT_EQ(ids.size(), 1000u);
  for (const std::string& id : ids) EXPECT_TRUE(std::regex_match(id, std::regex("ctx-[0-9a-f]{32}"))) << id;
}

TEST(ContextStore, ChargeMovesWithTheContextAndReturnsWhenConsumed) {
  Fixture f;
  const std::string id = f.keep(300);
  EXPECT_EQ(f.store.held().contexts, 1);
  EXPECT_EQ(f.store.held().bytes, 300);
  EXPECT_EQ(f.budget.reserved().host_bytes, 300);
  StatusOr<std::shared_ptr<KeptContext>> out = f.store.check_out(id, "", "r1");
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_TRUE(has_error(f.store.check_out(id, "", "r2").status(), StatusCode::kFailedPrecondition,
                        {"in use by backward request r1"}));
  EXPECT_TRUE(has_error(f.store.release(id, "").status(), StatusCode::kFailedPrecondition, {"in use"}));
  f.store.check_in(id, /*consume=*/true, "r1");
  EXPECT_EQ(f.store.held().contexts, 0);
  // The backward still holds it: the charge goes with the last reference.
  EXPECT_EQ(f.budget.reserved().host_bytes, 300);
  out = Status::Ok();
  EXPECT_EQ(f.budget.reserved().host_bytes, 0);
  EXPECT_TRUE(has_error(f.store.check_out(id, "", "r3").status(), StatusCode::kFailedPrecondition,
                        {"consumed", "by backward request r1"}));
}

TEST(ContextStore, ACheckInWithoutConsumingKeepsIt) {
  Fixture f;
  const std::string id = f.keep(100);
  ASSERT_TRUE(f.store.check_out(id, "", "r1").ok());
  f.store.check_in(id, /*consume=*/false, "r1");
  EXPECT_EQ(f.store.held().contexts, 1);
  ASSERT_TRUE(f.store.check_out(id, "", "r2").ok());
  f.store.check_in(id, false, "r2");
  StatusOr<int64_t> released = f.store.release(id, "");
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 100);
  EXPECT_EQ(f.budget.reserved().host_bytes, 0);
  EXPECT_TRUE(has_error(f.store.release(id, "").status(), StatusCode::kNotFound, {"released"}));
}

TEST(ContextStore, ContextsBelongToTheirOwner) {
  Fixture f;
  const std::string id = f.keep(100, "alice");
  EXPECT_TRUE(has_error(f.store.check_out(id, "bob", "r1").status(), StatusCode::kNotFound,
                        {"no such context for this client"}));
  EXPECT_TRUE(has_error(f.store.release(id, "bob").status(), StatusCode::kNotFound, {"no such context"}));
  EXPECT_EQ(f.store.check_out(id, "bob", "r1").status().message().find("alice"), std::string::npos);
  ASSERT_TRUE(f.store.release(id, "alice").ok());
  // Gone: its owner is told why, others only that it is not theirs.
  EXPECT_TRUE(has_error(f.store.check_out(id, "alice", "r2").status(), StatusCode::kFailedPrecondition, {"released"}));
  EXPECT_TRUE(has_error(f.store.check_out(id, "bob", "r2").status(), StatusCode::kNotFound, {"no such context"}));
  EXPECT_TRUE(has_error(f.store.check_out("ctx-unknown", "alice", "r3").status(), StatusCode::kNotFound,
                        {"no such context for this client"}));
}

// D4 of issue 24: an id that is not the caller's says nothing more, whether
// it never existed or is another client's, live or gone, through check_out
// (AttendBackward) and release (ReleaseContext) alike.
TEST(ContextStore, AnotherClientsContextLooksLikeOneThatNeverExisted) {
  Fixture f;
  const std::string live = f.keep(100, "alice");
  const std::string gone = f.keep(100, "alice");
  ASSERT_TRUE(f.store.release(gone, "alice").ok());
  const std::string unknown = "ctx-" + std::string(32, '0');
  auto seen = [](const Status& s, const std::string& id) {
    std::string text = s.message();
    for (size_t at = text.find(id); at != std::string::npos; at = text.find(id)) text.replace(at, id.size(), "ID");
    return std::to_string(static_cast<int>(s.code())) + " " + text;
  };
  const std::string expected = seen(f.store.check_out(unknown, "bob", "r1").status(), unknown);
  EXPECT_NE(expected.find("no such context for this client"), std::string::npos) << expected;
  EXPECT_EQ(seen(f.store.check_out(live, "bob", "r1").status(), live), expected);
  EXPECT_EQ(seen(f.store.check_out(gone, "bob", "r1").status(), gone), expected);
  const std::string released = seen(f.store.release(unknown, "bob").status(), unknown);
  EXPECT_EQ(seen(f.store.release(live, "bob").status(), live), released);
  EXPECT_EQ(seen(f.store.release(gone, "bob").status(), gone), released);
  EXPECT_EQ(released, expected);
}

TEST(ContextStore, APendingIdIsNotUsableAndAnAbandonedOneIsRemembered) {
  Fixture f;
  StatusOr<std::string> id = f.store.reserve_id("");
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(
      has_error(f.store.check_out(*id, "", "r1").status(), StatusCode::kFailedPrecondition, {"has not finished yet"}));
  f.store.abandon(*id);
  EXPECT_EQ(f.store.held().contexts, 0);
  EXPECT_TRUE(has_error(f.store.check_out(*id, "", "r1").status(), StatusCode::kFailedPrecondition,
                        {"cancelled", "did not finish OK"}));
}

TEST(ContextStore, RoomIsMadeLeastRecentlyUsedFirstAndOnlyWhenItHelps) {
  Fixture f(1000);
  const std::string a = f.keep(300), b = f.keep(300), c = f.keep(300);
  // a is used again: b is now the least recently used.
  ASSERT_TRUE(f.store.check_out(a, "", "r1").ok());
  f.store.check_in(a, false, "r1");
  EXPECT_TRUE(is_ok(f.store.reserve({350, 0})));  // 900 + 350 > 1000: one must go
  EXPECT_EQ(f.store.held().contexts, 2);
  EXPECT_TRUE(has_error(f.store.check_out(b, "", "r2").status(), StatusCode::kFailedPrecondition,
                        {"evicted", "--memory-budget"}));
  // More than the budget could ever give: refused, nothing evicted.
  EXPECT_TRUE(has_error(f.store.reserve({2000, 0}), StatusCode::kResourceExhausted, {}));
  EXPECT_EQ(f.store.held().contexts, 2);
  // A checked-out context is never evicted.
  ASSERT_TRUE(f.store.check_out(c, "", "r3").ok());
  f.budget.release({350, 0});
  EXPECT_TRUE(is_ok(f.store.reserve({650, 0})));  // evicts a, not c
  EXPECT_TRUE(has_error(f.store.check_out(a, "", "r4").status(), StatusCode::kFailedPrecondition, {"evicted"}));
  f.store.check_in(c, true, "r3");
  f.budget.release({650, 0});
  EXPECT_EQ(f.budget.reserved().host_bytes, 0);
}

TEST(ContextStore, OverMaxContextsTheLeastRecentlyUsedGoes) {
  ContextStoreOptions o;
  o.max_contexts = 2;
  Fixture f(1000, o);
  const std::string a = f.keep(10), b = f.keep(10), c = f.keep(10);
  EXPECT_EQ(f.store.held().contexts, 2);
  EXPECT_TRUE(has_error(f.store.check_out(a, "", "r").status(), StatusCode::kFailedPrecondition,
                        {"evicted", "--max-contexts = 2"}));
  EXPECT_TRUE(f.store.check_out(b, "", "r").ok());
  EXPECT_TRUE(f.store.check_out(c, "", "r2").ok());
}

TEST(ContextStore, TheSweeperExpiresIdleContexts) {
  ContextStoreOptions o;
  o.ttl_seconds = 0.1;
  Fixture f(1000, o);
  const std::string a = f.keep(100), b = f.keep(100);
  ASSERT_TRUE(f.store.check_out(b, "", "r1").ok());  // checked out: never expires meanwhile
  // The sweeper drops the context, then gives its bytes back outside the
  // store's lock: wait for both.
  EXPECT_TRUE(eventually([&] { return f.store.held().contexts == 1 && f.budget.reserved().host_bytes == 100; }))
      << f.store.held().contexts << " held, " << f.budget.reserved().host_bytes << " bytes reserved";
  EXPECT_TRUE(has_error(f.store.check_out(a, "", "r2").status(), StatusCode::kFailedPrecondition,
                        {"expired", "--context-ttl = 0.1 s"}));
  f.store.check_in(b, false, "r1");  // back in: its TTL restarts
  EXPECT_TRUE(eventually([&] { return f.store.held().contexts == 0 && f.budget.reserved().host_bytes == 0; }))
      << f.store.held().contexts << " held, " << f.budget.reserved().host_bytes << " bytes reserved";
}

TEST(ContextStore, ADrainDropsIdleContextsNowAndCheckedOutOnesAtCheckIn) {
  Fixture f;
  const std::string a = f.keep(100), b = f.keep(100);
  StatusOr<std::string> pending = f.store.reserve_id("");
  ASSERT_TRUE(pending.ok());
  ASSERT_TRUE(f.store.check_out(b, "", "r1").ok());
  f.store.close();
  EXPECT_EQ(f.store.held().contexts, 1);
  EXPECT_TRUE(has_error(f.store.check_out(a, "", "r2").status(), StatusCode::kFailedPrecondition, {"drained"}));
  EXPECT_TRUE(has_error(f.store.reserve_id("").status(), StatusCode::kUnavailable, {"shutting down"}));
  f.store.check_in(b, /*consume=*/false, "r1");
  EXPECT_EQ(f.store.held().contexts, 0);
  // The forward that was still running: its context is dropped on arrival.
  ASSERT_TRUE(is_ok(f.budget.reserve({50, 0})));
  f.store.put(*pending,
              std::make_shared<KeptContext>(Request{}, RequestMemory{}, MemoryCharge{50, 0}, &f.budget, nullptr));
  EXPECT_EQ(f.store.held().contexts, 0);
  EXPECT_EQ(f.budget.reserved().host_bytes, 0);
}

}  // namespace
}  // namespace plsh::server
