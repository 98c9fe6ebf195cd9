// libFuzzer target: bytes -> v1::AttendHeader (protobuf parse) -> what the
// server does with a header arriving first on an Attend stream (check_request,
// the planning bound against the budget, plan_request), with the server's
// default limits and a 256 MiB budget (so that no input spends seconds making
// draws). Nothing may crash or trip a sanitizer, an error must carry one of
// the codes SPEC section 7 allows at the header, planning must stay inside
// its bound, and an accepted plan must respect the limits it was checked
// against.
#include <algorithm>
#include <cstdint>

#include "fuzz_limits.h"
#include "plsh/v1/plsh.pb.h"
#include "server/request.h"

using plsh::StatusCode;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  plsh::v1::AttendHeader header;
  if (!header.ParseFromArray(data, static_cast<int>(size))) return 0;
  const plsh::server::RequestLimits limits = plsh::fuzz::server_default_limits();
  plsh::StatusOr<plsh::server::Request> plan = plsh::fuzz::plan_like_server(header, limits, int64_t{256} << 20);
  if (!plan.ok()) {
    const StatusCode code = plan.status().code();
    // UNIMPLEMENTED: a tensor in shared memory on a server without --shm-dir.
    PLSH_FUZZ_CHECK(code == StatusCode::kInvalidArgument || code == StatusCode::kResourceExhausted ||
                        code == StatusCode::kFailedPrecondition || code == StatusCode::kUnimplemented,
                    plan.status().to_string().c_str());
    PLSH_FUZZ_CHECK(!plan.status().message().empty(), "an error without a message");
    return 0;
  }
  const plsh::server::Request& p = *plan;
  const plsh::RequestShape& z = p.shape;
  PLSH_FUZZ_CHECK(p.backend != nullptr, "accepted plan without a backend");
  PLSH_FUZZ_CHECK(z.q.rows >= 1 && z.k.rows >= 1, "accepted plan with no rows");
  PLSH_FUZZ_CHECK(p.tokens() <= limits.max_tokens, "accepted plan over --max-tokens");
  PLSH_FUZZ_CHECK(p.tensor_bytes() > 0 && p.tensor_bytes() <= limits.max_request_bytes,
                  "accepted plan over --max-request-bytes");
  const int64_t payload_cap = limits.max_message_bytes - plsh::server::kMessageHeadroom;
  PLSH_FUZZ_CHECK(z.q.row_bytes <= payload_cap && z.k.row_bytes <= payload_cap && z.out.row_bytes <= payload_cap,
                  "accepted plan whose row does not fit in a message");
  PLSH_FUZZ_CHECK(p.out_chunk_bytes >= z.out.row_bytes && p.out_chunk_bytes <= std::max(payload_cap, z.out.row_bytes),
                  "out_chunk_bytes outside [one row, the payload cap]");
  PLSH_FUZZ_CHECK(p.host_charge() >= p.tensor_bytes(), "charge below the tensors' bytes");
  PLSH_FUZZ_CHECK(p.memory_layout().tensor_bytes() >= p.tensor_bytes(),
                  "a tensor in shared memory accepted without --shm-dir");
  return 0;
}
