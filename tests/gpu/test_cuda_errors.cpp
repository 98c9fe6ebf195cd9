// How the CUDA backend tells recoverable CUDA errors from sticky ones, with
// the error codes injected: needs the CUDA headers and runtime library, not
// a device. What only a device can show (a stale error on a worker thread,
// a real fault) is in test_cuda_backend.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "cuda/cuda_check.h"
#include "plsh/backend.h"
#include "plsh/params.h"

namespace plsh::cuda {
namespace {

TEST(CudaErrors, StickyAreTheErrorsThatLoseTheContext) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorAssert,
                        cudaErrorIllegalInstruction, cudaErrorInvalidPc, cudaErrorHardwareStackError,
                        cudaErrorInvalidAddressSpace, cudaErrorLaunchTimeout, cudaErrorECCUncorrectable,
                        cudaErrorContained, cudaErrorTensorMemoryLeak, cudaErrorExternalDevice, cudaErrorUnknown})
    EXPECT_TRUE(is_sticky_error(e)) << cudaGetErrorName(e);
  // Recoverable: the call failed, the context is fine.
  for (cudaError_t e : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorInvalidConfiguration,
                        cudaErrorLaunchOutOfResources, cudaErrorNotReady, cudaErrorInvalidDevicePointer,
                        cudaErrorNoDevice, cudaErrorCudartUnloading})
    EXPECT_FALSE(is_sticky_error(e)) << cudaGetErrorName(e);
}

TEST(CudaErrors, StatusCodeSaysWhatToDo) {
  const Status oom = cuda_status(cudaErrorMemoryAllocation, "cudaMallocFromPoolAsync(...)", "f.cpp", 7);
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(oom.message().find("cudaErrorMemoryAllocation"), std::string::npos) << oom.message();
  EXPECT_NE(oom.message().find("f.cpp:7"), std::string::npos) << oom.message();
  const Status fault = cuda_status(cudaErrorIllegalAddress, "cudaStreamSynchronize(stream)", "f.cpp", 9);
  EXPECT_EQ(fault.code(), StatusCode::kUnavailable);
  EXPECT_NE(fault.message().find("context of this process is lost"), std::string::npos) << fault.message();
  EXPECT_EQ(cuda_status(cudaErrorInvalidValue, "x", "f.cpp", 1).code(), StatusCode::kInternal);
  EXPECT_TRUE(cuda_status(cudaSuccess, "x", "f.cpp", 1).ok());
  EXPECT_EQ(cublas_status(CUBLAS_STATUS_ALLOC_FAILED, "cublasCreate(&h)", "f.cpp", 3).code(),
            StatusCode::kResourceExhausted);
}

TEST(CudaErrors, HealthKeepsTheFirstStickyError) {
  DeviceHealth health;
  EXPECT_FALSE(health.record(cudaErrorMemoryAllocation, "in a pool allocation"));
  EXPECT_FALSE(health.record(cudaErrorInvalidValue, "in cudaPointerGetAttributes"));
  EXPECT_TRUE(health.usable().ok());
  EXPECT_TRUE(health.record(cudaErrorMisalignedAddress, "during a request"));
  EXPECT_TRUE(health.record(cudaErrorIllegalAddress, "later"));
  const Status s = health.usable();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("cudaErrorMisalignedAddress"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("cudaErrorIllegalAddress"), std::string::npos) << "the first error is the one to fix";
  EXPECT_TRUE(health.lost());
}

// A backend whose device met a sticky error, as CudaBackend reports it
// (supports() returns its DeviceHealth's status): the registry's "auto"
// goes to the CPU, and asking for it by name says why not.
class LostDevice final : public Backend {
 public:
  LostDevice() { health_.record(cudaErrorIllegalAddress, "during a request"); }
  std::string name() const override { return "cuda"; }
  std::string device() const override { return "fake"; }
  Status supports(const AttentionParams&) const override { return health_.usable(); }
  StatusOr<Plan> plan(const AttentionParams& p, const PlanLimits& limits) const override {
    RETURN_IF_ERROR(supports(p));
    return start_plan(p, name(), limits);
  }
  Status forward(const Plan&, const WorkspaceRef&, const ExecContext&, ForwardStats*) override {
    return health_.usable();
  }

 private:
  DeviceHealth health_;
};

// A device lost mid-request answers cudaErrorUnknown from then on: the
// health keeps it, so supports() is UNAVAILABLE and "auto" takes the CPU.
TEST(CudaErrors, UnknownErrorAfterADeviceLossIsSticky) {
  DeviceHealth health;
  EXPECT_TRUE(health.record(cudaErrorUnknown, "in cudaStreamSynchronize"));
  EXPECT_EQ(health.usable().code(), StatusCode::kUnavailable);
  EXPECT_NE(health.usable().message().find("cudaErrorUnknown"), std::string::npos) << health.usable().message();
  EXPECT_EQ(cuda_status(cudaErrorUnknown, "cudaStreamSynchronize(s)", "f.cpp", 2).code(), StatusCode::kUnavailable);
}

TEST(CudaErrors, AutoFallsBackToTheCpuAfterAStickyError) {
  BackendRegistry& registry = BackendRegistry::global();
  registry.add(std::make_unique<LostDevice>());
  AttentionOptions o;
  o.q_len = o.kv_len = 16;
  o.heads = 2;
  o.head_dim = 8;
  StatusOr<AttentionParams> p = resolve_params(o);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  StatusOr<Backend*> chosen = registry.select("auto", *p);
  ASSERT_TRUE(chosen.ok()) << chosen.status().to_string();
  EXPECT_EQ((*chosen)->name(), "cpu");
  StatusOr<Backend*> named = registry.select("cuda", *p);
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(named.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(named.status().message().find("cudaErrorIllegalAddress"), std::string::npos) << named.status().message();
}

}  // namespace
}  // namespace plsh::cuda
