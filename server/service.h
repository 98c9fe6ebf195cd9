// plsh.v1.Attention on gRPC's callback API. The service assembles requests
// from chunks (Assembler), plans and admits them (plan_request, Scheduler),
// runs them on a worker (compute_request: the backend does the maths) and
// streams the output back in chunks no larger than the message limit.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "plsh/v1/plsh.grpc.pb.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/request.h"
#include "server/scheduler.h"

namespace plsh::server {

// What every request's reactor shares.
struct ServiceContext {
  const ServerConfig* config = nullptr;
  RequestLimits limits;
  Metrics* metrics = nullptr;
  Scheduler* scheduler = nullptr;
  std::atomic<int64_t> open_streams{0};
  std::atomic<bool> draining{false};  // new requests get UNAVAILABLE
};

class AttentionService final : public v1::Attention::CallbackService {
 public:
  AttentionService(const ServerConfig& config, Metrics* metrics, Scheduler* scheduler);

  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* Attend(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* AttendUnary(grpc::CallbackServerContext* ctx, const v1::AttendUnaryRequest* request,
                                        v1::AttendUnaryResponse* response) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* request,
                                    v1::GetInfoResponse* response) override;

  // Refuses new requests with UNAVAILABLE from now on.
  void begin_drain() { shared_.draining.store(true); }
  // Attend and AttendUnary calls not yet finished.
  int64_t open_requests() const { return shared_.open_streams.load(); }

 private:
  ServiceContext shared_;
};

}  // namespace plsh::server
