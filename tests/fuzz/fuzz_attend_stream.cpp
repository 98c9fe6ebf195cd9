// libFuzzer target: a whole Attend stream (stream_framing.h turns the input
// into AttendRequest messages) through what the server does with each
// message, in order: the size check, the header (plan_like_server, buffers,
// Assembler), chunks (Assembler::add), the end (Assembler::complete, then
// the computation on the CPU backend and the summary). The first error ends
// the stream, as it ends the call; its code must be one SPEC section 7
// allows for a client's mistake, and INTERNAL never.
//
// The dispatch mirrors AttendReactor::handle (server/service.cpp), which is
// tied to a live gRPC call; keep the two in step. Limits are small so that
// an accepted request computes in microseconds (at most 64 tokens, 64
// samples, 256 KiB of tensors, 64 KiB messages).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_limits.h"
#include "plsh/backend.h"
#include "plsh/v1/plsh.pb.h"
#include "server/assembler.h"
#include "server/request.h"
#include "stream_framing.h"

namespace plsh::fuzz {
namespace {

server::RequestLimits stream_limits() {
  server::RequestLimits l;
  l.max_tokens = 64;
  l.max_request_bytes = 256 << 10;
  l.max_samples = 64;
  l.max_message_bytes = 64 << 10;
  l.default_backend = "cpu";
  l.threads = 1;
  return l;
}

bool allowed_client_error(StatusCode code) {
  // UNIMPLEMENTED: a tensor in shared memory on a server without --shm-dir.
  return code == StatusCode::kInvalidArgument || code == StatusCode::kResourceExhausted ||
         code == StatusCode::kFailedPrecondition || code == StatusCode::kUnimplemented;
}

// One stream's server-side state, as the reactor holds it.
class Stream {
 public:
  // OK while the stream goes on; the status the call would end with otherwise.
  Status handle(const v1::AttendRequest& request) {
    // CallBase::check_message_size: the server refuses what gRPC let through.
    if (static_cast<int64_t>(request.ByteSizeLong()) > limits_.max_message_bytes)
      return resource_exhausted("message over --max-message-bytes");
    switch (request.kind_case()) {
      case v1::AttendRequest::kHeader: {
        if (plan_) return invalid_argument("header received twice");
        ASSIGN_OR_RETURN(server::Request plan, plan_like_server(request.header(), limits_, limits_.max_request_bytes));
        plan_.emplace(std::move(plan));
        memory_ = server::RequestMemory::allocate(plan_->memory_layout(), nullptr);
        assembler_ = server::assemble_inputs(*plan_, memory_);
        return Status::Ok();
      }
      case v1::AttendRequest::kChunk: {
        if (!plan_) return invalid_argument("chunk before header");
        const int64_t before = assembler_->received_bytes();
        RETURN_IF_ERROR(assembler_->add(request.chunk()));
        PLSH_FUZZ_CHECK(assembler_->received_bytes() - before == static_cast<int64_t>(request.chunk().data().size()),
                        "received_bytes does not grow by the chunk's bytes");
        return Status::Ok();
      }
      case v1::AttendRequest::kEnd: {
        if (!plan_) return invalid_argument("end before header");
        RETURN_IF_ERROR(assembler_->complete());
        ended_ = true;
        PLSH_FUZZ_CHECK(assembler_->received_bytes() == plan_->streamed_input_bytes(),
                        "complete() with received bytes != q + k + v");
        return compute();
      }
      default:
        return invalid_argument("AttendRequest with no kind set");
    }
  }

  bool ended() const { return ended_; }
  const server::Request* plan() const { return plan_ ? &*plan_ : nullptr; }

 private:
  Status compute() {
    StatusOr<AttentionResult> result = server::compute_request(*plan_, memory_, ExecContext{});
    if (!result.ok()) {
      // Non-finite inputs are the one thing found only now (INVALID_ARGUMENT).
      PLSH_FUZZ_CHECK(result.status().code() == StatusCode::kInvalidArgument, result.status().to_string().c_str());
      return result.status();
    }
    v1::Summary summary;
    server::fill_summary(*result, *plan_, &summary);
    PLSH_FUZZ_CHECK(summary.request_id() == plan_->id, "summary names another request");
    return Status::Ok();
  }

  const server::RequestLimits limits_ = stream_limits();
  std::optional<server::Request> plan_;
  server::RequestMemory memory_;
  std::unique_ptr<server::Assembler> assembler_;
  bool ended_ = false;
};

// A kChunk record as the TensorChunk it stands for.
void fill_chunk(std::string_view payload, const server::Request* plan, v1::TensorChunk* chunk) {
  if (payload.size() < kChunkFixedBytes) {
    chunk->set_data(std::string(payload));  // too short for the fields: data alone, fields 0
    return;
  }
  const uint8_t tensor = static_cast<uint8_t>(payload[0]);
  chunk->set_tensor(static_cast<v1::Tensor>(tensor & 0x7f));
  chunk->set_row_start(get_i64(payload.substr(1)));
  chunk->set_row_count(get_i64(payload.substr(9)));
  const std::string_view fill = payload.substr(kChunkFixedBytes);
  int64_t row_bytes = 0;
  if ((tensor & kFitRows) && plan != nullptr)
    row_bytes = chunk->tensor() == v1::TENSOR_Q ? plan->shape.q.row_bytes : plan->shape.k.row_bytes;
  const int64_t rows = chunk->row_count();
  if (row_bytes > 0 && rows > 0 && rows <= kMaxFittedBytes / row_bytes) {
    std::string data(static_cast<size_t>(rows * row_bytes), '\0');
    if (!fill.empty())
      for (size_t i = 0; i < data.size(); ++i) data[i] = fill[i % fill.size()];
    chunk->set_data(std::move(data));
  } else {
    chunk->set_data(std::string(fill));
  }
}

}  // namespace
}  // namespace plsh::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace plsh;
  using namespace plsh::fuzz;
  // PLSH_FUZZ_VERBOSE=1: one line per input saying how its stream ended (to see what a corpus reaches).
  static const bool verbose = std::getenv("PLSH_FUZZ_VERBOSE") != nullptr;
  std::string_view input(reinterpret_cast<const char*>(data), size);
  Stream stream;
  Record rec;
  while (!stream.ended() && next_record(input, &rec)) {
    v1::AttendRequest request;
    switch (rec.op) {
      case RecordOp::kRaw:
        if (!request.ParseFromArray(rec.payload.data(), static_cast<int>(rec.payload.size()))) continue;
        break;
      case RecordOp::kHeader:
        if (!request.mutable_header()->ParseFromArray(rec.payload.data(), static_cast<int>(rec.payload.size())))
          continue;
        break;
      case RecordOp::kChunk:
        fill_chunk(rec.payload, stream.plan(), request.mutable_chunk());
        break;
      case RecordOp::kEnd:
        request.mutable_end();
        break;
    }
    const Status status = stream.handle(request);
    if (!status.ok()) {
      PLSH_FUZZ_CHECK(allowed_client_error(status.code()), status.to_string().c_str());
      PLSH_FUZZ_CHECK(!status.message().empty(), "an error without a message");
      if (verbose) std::fprintf(stderr, "stream: %s\n", status.to_string().c_str());
      return 0;  // the call ends with this status
    }
  }
  if (verbose) std::fprintf(stderr, "stream: %s\n", stream.ended() ? "computed" : "input ended without an end message");
  return 0;
}
