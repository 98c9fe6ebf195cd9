// The caller owns the memory (plsh/workspace.h): a step given exactly the
// workspace its plan sized runs, in any contents, writes nothing past it and
// allocates nothing on the heap; a step given one byte less is refused
// before it writes anything.
//
// This binary replaces the global operator new to count allocations while a
// test asks (AllocationCounter): each test runs in its own process (ctest),
// and counting is off everywhere else.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/tiles.h"
#include "plsh/attention.h"
#include "plsh/estimates.h"
#include "plsh/workspace.h"
#include "problem.h"
#include "reference.h"
#include "shaped.h"

namespace {
using plsh::testing::shaped;

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_allocated_bytes{0};

void* counted_malloc(size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    g_allocated_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  }
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

// Every form that pairs with the deletes below, the nothrow ones included
// (std::stable_sort's buffer): one left to the runtime's new would be freed
// here, which AddressSanitizer reports as a mismatch.
void* operator new(size_t n) { return counted_malloc(n); }
void* operator new[](size_t n) { return counted_malloc(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_malloc(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t& tag) noexcept { return operator new(n, tag); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace plsh {
namespace {

using testing::make_problem;
using testing::Problem;

// Counts the operator-new calls of every thread between its construction
// and allocations().
class AllocationCounter {
 public:
  AllocationCounter() {
    g_allocations = 0;
    g_allocated_bytes = 0;
    g_counting = true;
  }
  ~AllocationCounter() { g_counting = false; }
  int64_t allocations() {
    g_counting = false;
    return g_allocations.load();
  }
  int64_t bytes() const { return g_allocated_bytes.load(); }
};

// A workspace of `planned` bytes and a canary behind it, its planned part
// filled with 0xFF (NaN as floats, -1 as integers): a step that reads what
// it did not write shows in its output, one that writes past its figure in
// the canary.
class PoisonedWorkspace {
 public:
  static constexpr int64_t kCanary = 4096;
  explicit PoisonedWorkspace(int64_t planned) : planned_(planned) {
    StatusOr<HostWorkspace> w = HostWorkspace::allocate(planned + kCanary);
    EXPECT_TRUE(w.ok()) << w.status().to_string();
    memory_ = std::move(*w);
    std::memset(memory_.ref().host, 0xFF, static_cast<size_t>(planned));
    std::memset(static_cast<char*>(memory_.ref().host) + planned, 0x5A, kCanary);
  }
  WorkspaceRef exact() const { return {memory_.ref().host, planned_, nullptr, 0}; }
  WorkspaceRef short_by_one() const { return {memory_.ref().host, planned_ - 1, nullptr, 0}; }
  bool canary_intact() const {
    const unsigned char* c = static_cast<const unsigned char*>(memory_.ref().host) + planned_;
    for (int64_t i = 0; i < kCanary; ++i)
      if (c[i] != 0x5A) return false;
    return true;
  }

 private:
  int64_t planned_;
  HostWorkspace memory_;
};

struct WorkspaceCase {
  const char* name;
  Mode mode;
  LshAlgorithm algorithm;
  DType dtype;
  int threads;
};

const WorkspaceCase kCases[] = {
    {"exact_f32_2threads", Mode::kExact, LshAlgorithm::kAuto, DType::kF32, 2},
    {"window_bf16", Mode::kWindow, LshAlgorithm::kAuto, DType::kBF16, 1},
    {"lsh_banded_f16_3threads", Mode::kLsh, LshAlgorithm::kBanded, DType::kF16, 3},
    {"lsh_per_sample_f32", Mode::kLsh, LshAlgorithm::kPerSample, DType::kF32, 2},
};

AttentionOptions options_of(const WorkspaceCase& c) {
  return shaped({2, 197, 261, 4, 2, 24}, {.dtype = c.dtype,
                                          .causal = true,
                                          .mode = c.mode,
                                          .samples = 8,
                                          .seed = 3,
                                          .lsh_algorithm = c.algorithm,
                                          .probe_rows = 24});
}

TEST(Workspace, ForwardRunsInExactlyThePlannedBytesAndRefusesFewer) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (const WorkspaceCase& c : kCases) {
    SCOPED_TRACE(c.name);
    Problem a = make_problem(options_of(c), 7), b = make_problem(options_of(c), 7);
    PlanLimits limits;
    limits.threads = c.threads;
    StatusOr<Plan> plan = cpu->plan(a.params, limits);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const int64_t planned = plan->forward_workspace.host_bytes;
    // Each thread holds at least its [kKeyTile, rows] logits (64 rows of
    // float at the least): the figure is not a token.
    EXPECT_GE(planned, c.threads * cpu::kKeyTile * cpu::logits_stride(64) * 4);
    EXPECT_EQ(plan->forward_workspace.device_bytes, 0);

    PoisonedWorkspace w(planned);
    const Status refused = cpu->forward(*plan, w.short_by_one(), ExecContext{}, nullptr);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("workspace.host_bytes = " + std::to_string(planned - 1)), std::string::npos)
        << refused.message();
    EXPECT_NE(refused.message().find(std::to_string(planned)), std::string::npos) << refused.message();
    EXPECT_TRUE(w.canary_intact());

    ForwardStats stats;
    AllocationCounter counter;
    const Status ran = cpu->forward(*plan, w.exact(), ExecContext{}, &stats);
    EXPECT_EQ(counter.allocations(), 0) << "the forward allocated " << counter.bytes() << " bytes";
    ASSERT_TRUE(ran.ok()) << ran.to_string();
    EXPECT_TRUE(w.canary_intact());
    EXPECT_EQ(stats.workspace.host_bytes, planned);

    // The same output as a forward in a fresh, roomier workspace.
    StatusOr<Plan> again = cpu->plan(b.params, limits);
    ASSERT_TRUE(again.ok());
    StatusOr<HostWorkspace> roomy = HostWorkspace::allocate(2 * planned);
    ASSERT_TRUE(roomy.ok());
    ASSERT_TRUE(cpu->forward(*again, roomy->ref(), ExecContext{}, nullptr).ok());
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0);
  }
}

TEST(Workspace, BackwardRunsInExactlyThePlannedBytesAndRefusesFewer) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (const WorkspaceCase& c : kCases) {
    SCOPED_TRACE(c.name);
    const AttentionOptions o = options_of(c);
    Problem pr = make_problem(o, 9);
    PlanLimits limits;
    limits.threads = c.threads;
    limits.backward = true;
    StatusOr<Plan> plan = cpu->plan(pr.params, limits);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    ASSERT_TRUE(testing::run_forward(*cpu, *plan).ok());
    testing::GradTensors first = testing::grad_tensors(o, o.dtype, 5), second = testing::grad_tensors(o, o.dtype, 5);
    StatusOr<BackwardParams> g1 = make_backward_params(plan->params, first.refs());
    StatusOr<BackwardParams> g2 = make_backward_params(plan->params, second.refs());
    ASSERT_TRUE(g1.ok() && g2.ok()) << g1.status().to_string();
    const int64_t planned = plan->backward_workspace.host_bytes;
    // The float32 dQ accumulator alone is [B, Nq, H, D].
    EXPECT_GE(planned, o.batch * o.q_len * o.heads * o.head_dim * 4);

    PoisonedWorkspace w(planned);
    const Status refused = cpu->backward(*plan, *g1, w.short_by_one(), ExecContext{}, nullptr);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("workspace.host_bytes"), std::string::npos) << refused.message();
    EXPECT_EQ(first.dq, second.dq) << "a refused backward wrote dq";

    BackwardStats stats;
    AllocationCounter counter;
    const Status ran = cpu->backward(*plan, *g1, w.exact(), ExecContext{}, &stats);
    EXPECT_EQ(counter.allocations(), 0) << "the backward allocated " << counter.bytes() << " bytes";
    ASSERT_TRUE(ran.ok()) << ran.to_string();
    EXPECT_TRUE(w.canary_intact());
    EXPECT_EQ(stats.workspace.host_bytes, planned);

    StatusOr<HostWorkspace> roomy = HostWorkspace::allocate(2 * planned);
    ASSERT_TRUE(roomy.ok());
    ASSERT_TRUE(cpu->backward(*plan, *g2, roomy->ref(), ExecContext{}, nullptr).ok());
    // dq sums key tiles in schedule order (cpu_backward.h); dk, dv are exact.
    EXPECT_EQ(first.dk, second.dk);
    EXPECT_EQ(first.dv, second.dv);
    EXPECT_LE(testing::compare(first.dq.data(), o.dtype, second.values(second.dq)).max_rel, 1e-5);
  }
}

TEST(Workspace, RefusesANullOrMisalignedBase) {
  Workspace needed{1024, 0};
  EXPECT_EQ(check_workspace({nullptr, 4096, nullptr, 0}, needed, "step").code(), StatusCode::kInvalidArgument);
  alignas(64) static char buffer[2048];
  const Status misaligned = check_workspace({buffer + 8, 2000, nullptr, 0}, needed, "step");
  EXPECT_EQ(misaligned.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(misaligned.message().find("aligned"), std::string::npos) << misaligned.message();
  EXPECT_TRUE(check_workspace({buffer, 1024, nullptr, 0}, needed, "step").ok());
  // Device bytes are checked in their own space.
  const Status device = check_workspace({buffer, 1024, nullptr, 0}, Workspace{0, 64}, "step");
  EXPECT_NE(device.message().find("workspace.device_bytes = 0"), std::string::npos) << device.message();
}

TEST(Workspace, CarverCountsWhatItSlices) {
  Carver counting;
  counting.take<float>(3);
  counting.take<double>(0);
  counting.take<char>(65);
  EXPECT_EQ(counting.used(), 64 + 128);
  alignas(64) static char buffer[192];
  Carver real(buffer, sizeof buffer);
  EXPECT_EQ(real.take<float>(3), reinterpret_cast<float*>(buffer));
  EXPECT_EQ(real.take<double>(0), nullptr);
  EXPECT_EQ(real.take<char>(65), buffer + 64);
  EXPECT_FALSE(real.overflowed());
  EXPECT_EQ(real.take<char>(1), nullptr);
  EXPECT_TRUE(real.overflowed());
}

}  // namespace
}  // namespace plsh
