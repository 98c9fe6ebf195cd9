#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cpu/cpu_backend.h"
#include "plsh/backend.h"

namespace plsh {

namespace {

std::mutex g_registry_mutex;

std::string self_dir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// Candidates for the CUDA backend library, first found wins:
// $PLSH_CUDA_BACKEND, then beside the executable, ../lib, then the loader's
// own search path.
std::vector<std::string> cuda_library_candidates() {
  std::vector<std::string> c;
  if (const char* env = std::getenv("PLSH_CUDA_BACKEND"); env != nullptr && *env != '\0') {
    c.emplace_back(env);
    return c;
  }
  const std::string dir = self_dir();
  c.push_back(dir + "/libplsh_cuda.so");
  c.push_back(dir + "/../lib/libplsh_cuda.so");
  c.emplace_back("libplsh_cuda.so");
  return c;
}

}  // namespace

BackendRegistry& BackendRegistry::global() {
  static BackendRegistry registry;
  return registry;
}

void BackendRegistry::discover() {
  if (discovered_) return;
  discovered_ = true;

  // CUDA, loaded at run time so that the same binary runs on machines
  // without CUDA (and says why it did not use it), and a process that never
  // uses it never maps cuBLAS.
  std::string why = "libplsh_cuda.so not found (built without CUDA)";
  for (const std::string& path : cuda_library_candidates()) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      // A library that exists but cannot load is worth reporting as is.
      if (path.find('/') != std::string::npos && access(path.c_str(), F_OK) == 0)
        why = std::string("cannot load ") + path + ": " + (err ? err : "?");
      continue;
    }
    auto entry = reinterpret_cast<BackendPluginFn>(dlsym(handle, kBackendPluginSymbol));
    if (entry == nullptr) {
      why = path + " has no symbol " + kBackendPluginSymbol + " (a library older than the versioned plugin boundary)";
      continue;
    }
    const PlshBackendPlugin* plugin = entry();
    if (plugin == nullptr || plugin->api_version != kBackendApiVersion) {
      // Nothing else of a mismatched library is called: its Backend may
      // not even have our vtable.
      why = path + " speaks backend API version " + (plugin ? std::to_string(plugin->api_version) : "?") +
            ", this process " + std::to_string(kBackendApiVersion) + ": rebuild both from one tree";
      break;
    }
    if (plugin->abi_fingerprint != backend_abi_fingerprint()) {
      // The same version from another build: the types that cross differ
      // in layout (another compiler, standard library or an unbumped edit).
      why = path + " was built with another C++ layout of the backend types (ABI fingerprint " +
            std::to_string(plugin->abi_fingerprint) + ", this process " + std::to_string(backend_abi_fingerprint()) +
            "): rebuild both from one tree with one compiler";
      break;
    }
    char why_not[512] = {0};
    Backend* backend = plugin->create(why_not, sizeof(why_not));
    if (backend == nullptr) {
      why = std::string("cuda backend unavailable: ") + why_not;
      break;
    }
    owned_.emplace_back(backend);
    list_.push_back(backend);
    why.clear();
    break;
  }
  if (!why.empty()) notes_.push_back("cuda: " + why);

  owned_.push_back(make_cpu_backend());
  list_.push_back(owned_.back().get());
}

std::vector<Backend*> BackendRegistry::backends() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  discover();
  return list_;
}

std::vector<std::string> BackendRegistry::notes() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  discover();
  return notes_;
}

void BackendRegistry::add(std::unique_ptr<Backend> backend) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  discover();
  list_.insert(list_.begin(), backend.get());
  owned_.push_back(std::move(backend));
}

Status check_backend_name(const std::string& name, const char* field) {
  for (const char* known : kBackendNames)
    if (name == known) return Status::Ok();
  std::string expected;
  for (const char* known : kBackendNames) expected += (expected.empty() ? "" : ", ") + std::string(known);
  return invalid_argument(std::string(field) + " = '" + echo_value(name) + "', expected one of " + expected);
}

StatusOr<Backend*> BackendRegistry::find(const std::string& name) {
  RETURN_IF_ERROR(check_backend_name(name));
  const std::vector<Backend*> list = backends();
  if (name == "auto") return list.front();
  for (Backend* b : list)
    if (b->name() == name) return b;
  std::string why;
  for (const std::string& n : notes())
    if (n.rfind(name + ":", 0) == 0) why = n.substr(name.size() + 2);
  return failed_precondition("backend = '" + name + "' is not available" + (why.empty() ? "" : ": " + why));
}

StatusOr<Backend*> BackendRegistry::select(const std::string& name, const AttentionParams& p, bool backward) {
  auto usable = [&](const Backend* b) {
    Status s = b->supports(p);
    if (s.ok() && backward) s = b->supports_backward(p);
    return s;
  };
  if (name != "auto") {
    ASSIGN_OR_RETURN(Backend * b, find(name));
    RETURN_IF_ERROR(usable(b));
    return b;
  }
  Status last;
  for (Backend* b : backends()) {
    Status s = usable(b);
    if (s.ok()) return b;
    last = s;
  }
  return last;
}

}  // namespace plsh
