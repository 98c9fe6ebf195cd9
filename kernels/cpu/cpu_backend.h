// The CPU backend: exact, window and lsh (per-sample reduction on the
// contiguous blocks, and the banded single pass), forward and backward on
// its own AVX2+FMA tile kernels (microkernels.h), fp32 accumulation,
// threaded over batch, heads and row tiles. It is the fallback wherever no
// GPU is present and the reference the CUDA backend is tested against.
#pragma once

#include <memory>

#include "plsh/backend.h"

namespace plsh {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace plsh
