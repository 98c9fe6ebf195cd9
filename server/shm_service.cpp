// AttentionService's same-host shared-memory RPCs (Register, Unregister,
// List; plsh.proto and shm_registry.h). Attend and the rest: service.cpp.
#include "server/logging.h"
#include "server/service.h"
#include "server/status_map.h"

namespace plsh::server {

void AttentionService::log_shm_call(grpc::CallbackServerContext* ctx, Method method, const std::string& client,
                                    const std::string& region, const Status& status) {
  const grpc::Status s = to_grpc_status(status);
  const std::string code = grpc_code_name(s.error_code());
  // The region's name, never its key (a file of the host).
  nlohmann::json fields = {{"method", method_name(method)}, {"peer", ctx->peer()}, {"status", code}};
  if (!region.empty()) fields["region"] = echo_value(region);
  if (shared_.auth != nullptr) {
    fields["client"] = client;
    shared_.metrics->client_request(client, method_name(method), code, 0, 0);
  }
  if (!status.ok()) fields["message"] = status.message();
  log_event(spdlog::level::info, "shared_memory", fields);
}

namespace {
Status shm_off() {
  return unimplemented("shared memory is off on this server (it runs without --shm-dir): send the tensors in chunks");
}
}  // namespace

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                                 const v1::RegisterSharedMemoryRequest* request,
                                                                 v1::RegisterSharedMemoryResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string client;
  if (!authorize(ctx, Method::kRegisterSharedMemory, reactor, &client)) return reactor;
  const Status status = shared_.shm == nullptr ? shm_off()
                                               : shared_.shm->register_region(client, request->name(), request->key(),
                                                                              request->offset(), request->byte_size());
  log_shm_call(ctx, Method::kRegisterSharedMemory, client, request->name(), status);
  reactor->Finish(to_grpc_status(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                                   const v1::UnregisterSharedMemoryRequest* request,
                                                                   v1::UnregisterSharedMemoryResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string client;
  if (!authorize(ctx, Method::kUnregisterSharedMemory, reactor, &client)) return reactor;
  const Status status =
      shared_.shm == nullptr ? shm_off() : shared_.shm->unregister_region(client, request->name());
  log_shm_call(ctx, Method::kUnregisterSharedMemory, client, request->name(), status);
  reactor->Finish(to_grpc_status(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ListSharedMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::ListSharedMemoryRequest*,
                                                             v1::ListSharedMemoryResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string client;
  if (!authorize(ctx, Method::kListSharedMemory, reactor, &client)) return reactor;
  StatusOr<std::vector<SharedMemoryRegistry::RegionInfo>> regions =
      shared_.shm == nullptr ? StatusOr<std::vector<SharedMemoryRegistry::RegionInfo>>(shm_off())
                             : shared_.shm->list(client);
  if (regions.ok()) {
    for (const SharedMemoryRegistry::RegionInfo& r : *regions) {
      v1::SharedMemoryRegion* out = response->add_regions();
      out->set_name(r.name);
      out->set_key(r.key);
      out->set_offset(r.offset);
      out->set_byte_size(r.byte_size);
      out->set_requests(r.requests);
    }
  }
  reactor->Finish(to_grpc_status(regions.status()));
  return reactor;
}

}  // namespace plsh::server
