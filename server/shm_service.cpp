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

grpc::ServerUnaryReactor* AttentionService::shm_call(grpc::CallbackServerContext* ctx, Method method,
                                                     const std::string* region, const ShmWork& work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string client;
  if (!authorize(ctx, method, reactor, &client)) return reactor;
  const Status status = shared_.shm == nullptr ? shm_off() : work(*shared_.shm, client);
  if (region != nullptr) log_shm_call(ctx, method, client, *region, status);
  reactor->Finish(to_grpc_status(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                                 const v1::RegisterSharedMemoryRequest* request,
                                                                 v1::RegisterSharedMemoryResponse*) {
  return shm_call(ctx, Method::kRegisterSharedMemory, &request->name(),
                  [request](SharedMemoryRegistry& shm, const std::string& client) {
                    return shm.register_region(client, request->name(), request->key(), request->offset(),
                                               request->byte_size());
                  });
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                                   const v1::UnregisterSharedMemoryRequest* request,
                                                                   v1::UnregisterSharedMemoryResponse*) {
  return shm_call(ctx, Method::kUnregisterSharedMemory, &request->name(),
                  [request](SharedMemoryRegistry& shm, const std::string& client) {
                    return shm.unregister_region(client, request->name());
                  });
}

grpc::ServerUnaryReactor* AttentionService::ListSharedMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::ListSharedMemoryRequest*,
                                                             v1::ListSharedMemoryResponse* response) {
  return shm_call(ctx, Method::kListSharedMemory, nullptr,
                  [response](SharedMemoryRegistry& shm, const std::string& client) {
                    ASSIGN_OR_RETURN(const std::vector<SharedMemoryRegistry::RegionInfo> regions, shm.list(client));
                    for (const SharedMemoryRegistry::RegionInfo& r : regions) {
                      v1::SharedMemoryRegion* out = response->add_regions();
                      out->set_name(r.name);
                      out->set_key(r.key);
                      out->set_offset(r.offset);
                      out->set_byte_size(r.byte_size);
                      out->set_requests(r.requests);
                    }
                    return Status::Ok();
                  });
}

}  // namespace plsh::server
