#include "plsh/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "invalid.h"
#include "plsh/client.h"

namespace plsh::client {

namespace {

bool plain_name(const std::string& key) {
  if (key.empty() || key.size() > 255 || key[0] == '.') return false;
  for (char c : key)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
          c == '-'))
      return false;
  return true;
}

}  // namespace

grpc::Status SharedMemoryFile::create(const std::string& dir, const std::string& key, int64_t bytes,
                                      std::unique_ptr<SharedMemoryFile>* file) {
  if (!plain_name(key))
    return invalid("key = '" + key + "', expected 1-255 characters of [A-Za-z0-9_.-], not starting with '.'");
  if (bytes < 1) return invalid("bytes = " + std::to_string(bytes) + ", expected >= 1");
  std::unique_ptr<SharedMemoryFile> f(new SharedMemoryFile());
  f->path_ = dir + "/" + key;
  f->key_ = key;
  const int fd = open(f->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return grpc::Status(errno == EEXIST ? grpc::StatusCode::ALREADY_EXISTS : grpc::StatusCode::FAILED_PRECONDITION,
                        "cannot create " + f->path_ + ": " + std::strerror(errno));
  auto fail = [&](const char* what) {
    const int error = errno;
    close(fd);
    unlink(f->path_.c_str());
    return grpc::Status(
        error == ENOSPC || error == ENOMEM ? grpc::StatusCode::RESOURCE_EXHAUSTED
                                           : grpc::StatusCode::FAILED_PRECONDITION,
        std::string(what) + " " + f->path_ + " (" + std::to_string(bytes) + " bytes): " + std::strerror(error));
  };
  // posix_fallocate rather than ftruncate alone: on tmpfs the pages are
  // reserved now, so a full /dev/shm fails here, not as SIGBUS later.
  if (const int e = posix_fallocate(fd, 0, bytes); e != 0) {
    errno = e;
    return fail("cannot size");
  }
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("cannot map");
  close(fd);
  f->data_ = static_cast<uint8_t*>(p);
  f->size_ = bytes;
  *file = std::move(f);
  return grpc::Status::OK;
}

SharedMemoryFile::~SharedMemoryFile() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  if (!path_.empty()) unlink(path_.c_str());
}

std::string unique_shared_memory_key(const std::string& prefix) {
  std::random_device random;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%08x%08x", random(), random());
  return prefix + "-" + std::to_string(getpid()) + "-" + hex;
}

// The shared-memory RPCs of Client (plsh/client.h).

grpc::Status Client::register_shared_memory(const std::string& name, const std::string& key, int64_t offset,
                                            int64_t byte_size, double deadline_seconds) {
  grpc::ClientContext ctx;
  prepare(&ctx, deadline_seconds);
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  return stub_->RegisterSharedMemory(&ctx, request, &response);
}

grpc::Status Client::unregister_shared_memory(const std::string& name, double deadline_seconds) {
  grpc::ClientContext ctx;
  prepare(&ctx, deadline_seconds);
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSharedMemoryResponse response;
  return stub_->UnregisterSharedMemory(&ctx, request, &response);
}

grpc::Status Client::list_shared_memory(std::vector<v1::SharedMemoryRegion>* regions, double deadline_seconds) {
  grpc::ClientContext ctx;
  prepare(&ctx, deadline_seconds);
  v1::ListSharedMemoryResponse response;
  const grpc::Status status = stub_->ListSharedMemory(&ctx, v1::ListSharedMemoryRequest{}, &response);
  regions->assign(response.regions().begin(), response.regions().end());
  return status;
}

}  // namespace plsh::client
