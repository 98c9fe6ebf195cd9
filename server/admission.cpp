#include "server/admission.h"

#include <new>

#include "server/host_memory.h"

namespace plsh::server {

Admission::Admission(Options options, MemoryBudget* budget, ContextStore* contexts, const Authenticator* auth,
                     BufferPool* pool)
    : options_(options), budget_(budget), contexts_(contexts), auth_(auth), pool_(pool) {}

Status Admission::reserve(const MemoryCharge& charge) {
  return contexts_ != nullptr ? contexts_->reserve(charge) : budget_->reserve(charge);
}

Status Admission::reserve_for_client(ClientState& client, const MemoryCharge& charge) {
  return contexts_ != nullptr ? contexts_->reserve_for_client(client, charge) : client.reserve(charge);
}

Status Admission::Ticket::open(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                               const std::optional<Method>& method, const std::string& method_name) {
  Admission& a = *admission_;
  const int64_t open = a.open_calls_.fetch_add(1) + 1;
  counted_ = true;
  // Credentials first: a caller without them learns nothing else, and the
  // log and metrics name the client of every refusal after this.
  if (a.auth_ != nullptr) {
    label_ = "unauthenticated";
    if (!method) return permission_denied(method_name + " is not a method a token can allow");
    Authorization auth = a.auth_->authorize(metadata, *method);
    if (auth.client) label_ = auth.client->name();
    RETURN_IF_ERROR(auth.status);
    client_ = std::move(auth.client);
  }
  if (a.draining()) return unavailable("server is shutting down; retry on another replica");
  if (open > a.options_.max_concurrent)
    return resource_exhausted("open requests = " + std::to_string(open) +
                              ", expected <= " + std::to_string(a.options_.max_concurrent) +
                              " (the server's --max-concurrent); retry later");
  if (client_) {
    RETURN_IF_ERROR(client_->open_stream());
    client_stream_open_ = true;
  }
  return Status::Ok();
}

Status Admission::Ticket::plan(int64_t planning_bytes, const std::function<Status()>& make_plan) {
  const MemoryCharge planning{planning_bytes, 0};
  RETURN_IF_ERROR(admission_->reserve(planning));
  Status planned = make_plan();
  admission_->budget_->release(planning);
  return planned;
}

StatusOr<RequestMemory> Admission::Ticket::admit(const MemoryLayout& layout, int64_t plan_host_bytes,
                                                 int64_t device_bytes, const Backend& backend) {
  if (reserved_.host_bytes != 0 || reserved_.device_bytes != 0)
    return internal_error("a call asked the admission for its memory twice");
  const MemoryCharge charge{layout.total_bytes() + plan_host_bytes, device_bytes};
  // The client's share first: one client at its limit is told so, rather
  // than taking the server's budget from the others.
  if (client_) {
    RETURN_IF_ERROR(admission_->reserve_for_client(*client_, charge));
    client_reserved_ = charge;
  }
  RETURN_IF_ERROR(admission_->reserve(charge));
  reserved_ = charge;
  large_ = charge.host_bytes >= kLargeCallBytes;
  RequestMemory memory;
  try {
    memory = RequestMemory::allocate(layout, admission_->pool_);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of host memory for the request's " + std::to_string(layout.total_bytes()) +
                              " bytes (its tensors and workspace)");
  }
  if (device_bytes > 0) {
    ASSIGN_OR_RETURN(memory.device, backend.allocate_device(device_bytes));
    memory.workspace.device = memory.device.get();
    memory.workspace.device_bytes = device_bytes;
  }
  return memory;
}

MemoryCharge Admission::Ticket::hand_over(int64_t host_bytes) {
  reserved_.host_bytes -= host_bytes;
  if (client_) client_reserved_.host_bytes -= host_bytes;
  return MemoryCharge{host_bytes, 0};
}

void Admission::Ticket::close() {
  if (reserved_.host_bytes != 0 || reserved_.device_bytes != 0) admission_->budget_->release(reserved_);
  reserved_ = MemoryCharge{};
  if (client_) {
    client_->release(client_reserved_);
    client_reserved_ = MemoryCharge{};
    if (client_stream_open_) client_->close_stream();
    client_stream_open_ = false;
  }
  if (counted_ && admission_->open_calls_.fetch_sub(1) == 1 && large_) release_free_heap();
  counted_ = false;
  large_ = false;
}

}  // namespace plsh::server
