// plsh.v1.Attention on gRPC's callback API. Each call goes through CallBase
// (call.h): admitted and planned at its header (plan_request: limits,
// backend, the kernels' plan), charged to the host and device budgets
// (Scheduler), assembled from chunks (Assembler), computed on a worker
// (compute_request: the backend does the maths), and streamed back in chunks
// no larger than the message limit.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "plsh/v1/plsh.grpc.pb.h"
#include "server/auth.h"
#include "server/call.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/watchdog.h"

namespace plsh::server {

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // auth: the token file's clients (auth.h); null lets every call in.
  // contexts: kept contexts for AttendBackward (contexts.h); null keeps none.
  AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler, StreamWatchdog* watchdog,
                   const Authenticator* auth = nullptr, ContextStore* contexts = nullptr);

  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* Attend(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* AttendUnary(grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* request,
                                        v1::AttendUnaryResponse* response) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* request,
                                    v1::GetInfoResponse* response) override;
  // backward_call.h.
  grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* AttendBackward(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ReleaseContext(grpc::CallbackServerContext* ctx, const v1::ReleaseContextRequest* request,
                                           v1::ReleaseContextResponse* response) override;

  // Refuses new requests with UNAVAILABLE from now on, ends the streams
  // that are still receiving, and drops the kept contexts.
  void begin_drain();
  // Attend, AttendUnary and AttendBackward calls not yet finished.
  int64_t open_requests() const { return shared_.open_streams.load(); }

 private:
  ServiceContext shared_;
};

}  // namespace plsh::server
