// Stand-ins for a backend library (libplsh_cuda.so) at the dlopen boundary,
// built three ways (tests/kernels/CMakeLists.txt):
//   PLSH_FAKE_API_VERSION  the api_version the plugin struct reports
//   PLSH_FAKE_FINGERPRINT  the abi_fingerprint it reports (default: this build's)
//   PLSH_FAKE_NO_ENTRY     no plsh_backend_plugin symbol (a pre-versioning build)
// create() refuses with a reason, so a matching version shows the note a
// real library without a device leaves.
#include <cstring>

#include "plsh/backend.h"

#ifndef PLSH_FAKE_NO_ENTRY
namespace {

plsh::Backend* create(char* why_not, size_t why_not_size) {
  std::strncpy(why_not, "fake backend: refuses by design", why_not_size - 1);
  why_not[why_not_size - 1] = '\0';
  return nullptr;
}

#ifndef PLSH_FAKE_FINGERPRINT
#define PLSH_FAKE_FINGERPRINT plsh::backend_abi_fingerprint()
#endif
const plsh::PlshBackendPlugin kPlugin = {PLSH_FAKE_API_VERSION, PLSH_FAKE_FINGERPRINT, "cuda", &create};

}  // namespace

extern "C" __attribute__((visibility("default"))) const plsh::PlshBackendPlugin* plsh_backend_plugin() {
  return &kPlugin;
}
#else
extern "C" __attribute__((visibility("default"))) int plsh_fake_old_library() { return 0; }
#endif
