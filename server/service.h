// plsh.v1.Attention on gRPC's callback API. Each call goes through CallBase
// (call.h): opened and, at its header, checked, planned (plan_request: the
// backend and its plsh::Plan) and granted its memory by the admission
// (admission.h: tokens, limits, both budgets, kept contexts), assembled
// from chunks (Assembler) or read in place from shared memory
// (SharedMemoryRegistry), computed on a worker (the Scheduler; the backend
// does the maths), and streamed back in chunks no larger than the message
// limit (or written to shared memory).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include <atomic>
#include <cstdint>
#include <string>

#include "plsh/v1/plsh.grpc.pb.h"
#include "server/admission.h"
#include "server/auth.h"
#include "server/call.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/shm_registry.h"
#include "server/watchdog.h"

namespace plsh::server {

// Attend and AttendBackward are raw methods (grpc::ByteBuffer each way):
// their chunks are read from and written to gRPC's slices directly
// (proto/chunk_codec.h), so a tensor byte is copied once between the socket
// buffers and the tensor.
using AttentionServiceBase = v1::Attention::WithRawCallbackMethod_Attend<v1::Attention::WithCallbackMethod_AttendUnary<
    v1::Attention::WithCallbackMethod_GetInfo<v1::Attention::WithRawCallbackMethod_AttendBackward<
        v1::Attention::WithCallbackMethod_ReleaseContext<v1::Attention::WithCallbackMethod_RegisterSharedMemory<
            v1::Attention::WithCallbackMethod_UnregisterSharedMemory<
                v1::Attention::WithCallbackMethod_ListSharedMemory<v1::Attention::Service>>>>>>>>;

class AttentionService final : public AttentionServiceBase {
 public:
  // admission: who runs with what memory (its tokens, budgets, pool and
  // contexts are the service's). auth: the token file's clients (auth.h),
  // for the calls outside the admission; null lets every call in. shm: the
  // shared-memory regions (null or disabled: the RPCs are UNIMPLEMENTED).
  AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler, Admission* admission,
                   StreamWatchdog* watchdog, const Authenticator* auth = nullptr, SharedMemoryRegistry* shm = nullptr);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Attend(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* AttendUnary(grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* request,
                                        v1::AttendUnaryResponse* response) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* request,
                                    v1::GetInfoResponse* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterSharedMemoryRequest* request,
                                                 v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                   const v1::UnregisterSharedMemoryRequest* request,
                                                   v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* ListSharedMemory(grpc::CallbackServerContext* ctx,
                                             const v1::ListSharedMemoryRequest* request,
                                             v1::ListSharedMemoryResponse* response) override;
  // backward_call.h.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendBackward(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ReleaseContext(grpc::CallbackServerContext* ctx, const v1::ReleaseContextRequest* request,
                                           v1::ReleaseContextResponse* response) override;

  // Refuses new requests with UNAVAILABLE from now on, ends the streams
  // that are still receiving, and drops the kept contexts.
  void begin_drain();
  // Attend, AttendUnary and AttendBackward calls not yet finished.
  int64_t open_requests() const { return shared_.admission->open_calls(); }

 private:
  // A unary call outside CallBase (GetInfo, the shared-memory calls): the
  // token check. False when refused (logged, and the reactor finished);
  // *client is the token file's name for the caller ("" without one).
  bool authorize(grpc::CallbackServerContext* ctx, Method method, grpc::ServerUnaryReactor* reactor,
                 std::string* client);
  // The shared-memory calls' log line and per-client count.
  void log_shm_call(grpc::CallbackServerContext* ctx, Method method, const std::string& client,
                    const std::string& region, const Status& status);
  // The shared-memory calls' one path: the token check, UNIMPLEMENTED on a
  // server without --shm-dir, work(registry, client), the log line (when
  // `region` is given: Register and Unregister) and the finish.
  using ShmWork = std::function<Status(SharedMemoryRegistry& registry, const std::string& client)>;
  grpc::ServerUnaryReactor* shm_call(grpc::CallbackServerContext* ctx, Method method, const std::string* region,
                                     const ShmWork& work);

  ServiceContext shared_;
};

}  // namespace plsh::server
