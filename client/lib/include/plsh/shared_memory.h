// A file in a shared-memory directory, mapped into this process: where a
// same-host client puts tensors for a plsh-server started with --shm-dir
// (the same directory, e.g. /dev/shm, or a memory-backed volume a sidecar
// shares with the server). Register a range of it with
// Client::register_shared_memory(name, file.key(), offset, bytes), name
// (region, offset) per tensor in AttendCall, and read the outputs here.
//
//   std::unique_ptr<plsh::client::SharedMemoryFile> f;
//   grpc::Status s = plsh::client::SharedMemoryFile::create("/dev/shm", "plsh-job-1", bytes, &f);
//   std::memcpy(f->data(), q, q_bytes);
//
// The server accepts a file only if it is a regular file owned by the
// server's user and not writable by others: create() makes it with mode
// 0600, so client and server must run as the same user (the deploy files'
// sidecar layout does).
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <memory>
#include <string>

namespace plsh::client {

class SharedMemoryFile {
 public:
  // Creates dir/key (it must not exist yet), of `bytes` bytes (zeros),
  // mapped for reading and writing. INVALID_ARGUMENT naming the argument
  // for a key that is not a plain file name; the system's error otherwise.
  static grpc::Status create(const std::string& dir, const std::string& key, int64_t bytes,
                             std::unique_ptr<SharedMemoryFile>* file);
  // Unmaps it and removes the file.
  ~SharedMemoryFile();
  SharedMemoryFile(const SharedMemoryFile&) = delete;
  SharedMemoryFile& operator=(const SharedMemoryFile&) = delete;

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& key() const { return key_; }  // what RegisterSharedMemory takes

 private:
  SharedMemoryFile() = default;
  std::string path_, key_;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// A key that no other process of this host is likely to pick:
// prefix-<pid>-<random hex>.
std::string unique_shared_memory_key(const std::string& prefix);

}  // namespace plsh::client
