// Conversions between the library's types (plsh/params.h, plsh/result.h)
// and the plsh.v1 messages, both ways, in one place: the server writes
// what the clients read, so the two directions sit side by side.
#pragma once

#include <optional>

#include <cstdint>

#include "plsh/params.h"
#include "plsh/result.h"
#include "plsh/status.h"
#include "plsh/v1/plsh.pb.h"

namespace plsh::wire {

// Bytes per message kept free for the message's own fields, so that a
// chunk's payload plus framing never exceeds the max message size (a
// chunk's fields take < 40 bytes). The server tells clients the payload cap
// (Ack and GetInfo: max_chunk_payload_bytes), so clients need not know it.
inline constexpr int64_t kMessageHeadroom = 1024;
// The largest tensor payload of one chunk under a max message size.
inline constexpr int64_t max_chunk_payload_bytes(int64_t max_message_bytes) {
  return max_message_bytes - kMessageHeadroom;
}

v1::DType to_wire(DType t);
v1::Mode to_wire(Mode m);
v1::LshAlgorithm to_wire(LshAlgorithm a);
v1::Sampling to_wire(Sampling s);

// INVALID_ARGUMENT naming `field` for values outside the enum;
// DTYPE_UNSPECIFIED gives `if_unspecified`, or an error without one.
StatusOr<DType> dtype_from_wire(const char* field, int value, std::optional<DType> if_unspecified);
// MODE_UNSPECIFIED is lsh (SPEC section 4's default).
StatusOr<Mode> mode_from_wire(int value);
StatusOr<LshAlgorithm> lsh_algorithm_from_wire(int value);
StatusOr<Sampling> sampling_from_wire(int value);
// "exact", "lsh", "window", "unknown": a metrics label for any wire value.
const char* mode_label(v1::Mode m);

// A header's attention options (shape, dtypes, positions, mode and its
// settings, estimates): what the client sends and the server reads. Not the
// request id, tensors in shared memory, lse, chunk size, backend or
// keep_context, which belong to the call. Unset fields read as the
// library's defaults (out_dtype: the dtype, so it is always set);
// INVALID_ARGUMENT for enum values outside plsh.v1 and
// for a target_rel_err that is set but not > 0 (its range and the rest:
// plsh::validate_options).
void options_to_header(const AttentionOptions& options, v1::AttendHeader* header);
StatusOr<AttentionOptions> options_from_header(const v1::AttendHeader& header);

// The result's estimates, FLOPs and backend timings (not the request id or
// the output dtype, which belong to the request).
void result_to_summary(const AttentionResult& result, v1::Summary* summary);
// The inverse; INVALID_ARGUMENT for enum values outside plsh.v1.
StatusOr<AttentionResult> result_from_summary(const v1::Summary& summary);

// A backward's result: backend, device, FLOPs, workspace and the backend
// timings (not the ids, dtypes or wire timings, which belong to the call).
void backward_result_to_summary(const BackwardResult& result, v1::BackwardSummary* summary);
BackwardResult backward_result_from_summary(const v1::BackwardSummary& summary);

}  // namespace plsh::wire
