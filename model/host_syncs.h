// Counts the host-device synchronisations a thread makes (cudaStreamSynchronize, .item(), device-to-host copies,
// nonzero, ...) through LibTorch's CUDA sync debug mode (what torch.cuda.set_sync_debug_mode("warn") turns on) and a
// warning handler that counts its "called a synchronizing CUDA operation" warnings instead of printing them.
// Torch-free header. Without CUDA (a CPU LibTorch, or a CUDA one with no GPU) it counts nothing and says so.
#pragma once

#include <cstdint>
#include <memory>

namespace skyreels::model {

class HostSyncCounter {
 public:
  // Counts from construction to destruction on this thread when `enable` and CUDA is available.
  explicit HostSyncCounter(bool enable);
  ~HostSyncCounter();
  HostSyncCounter(const HostSyncCounter&) = delete;
  HostSyncCounter& operator=(const HostSyncCounter&) = delete;

  bool active() const;    // counting: a CUDA build with a GPU, enabled, and a known .item() sync was seen
  int64_t count() const;  // synchronisations seen so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skyreels::model
