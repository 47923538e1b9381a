#include "model/host_syncs.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#ifdef SKYREELS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace skyreels::model {

#ifdef SKYREELS_WITH_CUDA
namespace {

class CountingHandler : public c10::WarningHandler {
 public:
  explicit CountingHandler(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("called a synchronizing CUDA operation") != std::string::npos) {
      ++count;
    } else if (next_ != nullptr) {
      next_->process(warning);
    }
  }
  int64_t count = 0;

 private:
  c10::WarningHandler* next_;
};

}  // namespace

struct HostSyncCounter::Impl {
  explicit Impl(c10::WarningHandler* previous_handler)
      : previous(previous_handler),
        handler(previous_handler),
        previous_mode(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::WarningUtils::set_warning_handler(&handler);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~Impl() {
    c10::cuda::warning_state().set_sync_debug_mode(previous_mode);
    c10::WarningUtils::set_warning_handler(previous);
  }
  c10::WarningHandler* previous;
  CountingHandler handler;
  c10::cuda::SyncDebugMode previous_mode;
};

HostSyncCounter::HostSyncCounter(bool enable) {
  if (!enable || !at::hasCUDA()) return;
  impl_ = std::make_unique<Impl>(c10::WarningUtils::get_warning_handler());
  // Positive control: one .item() must be seen as one sync, or the count would read 0 for the wrong reason (the
  // debug mode not reaching LibTorch's copy of its state); then the counter reports itself inactive.
  (void)at::zeros({1}, at::TensorOptions().device(at::kCUDA)).item<float>();
  if (impl_->handler.count != 1) {
    impl_.reset();
    return;
  }
  impl_->handler.count = 0;
}
int64_t HostSyncCounter::count() const { return impl_ ? impl_->handler.count : 0; }
#else
struct HostSyncCounter::Impl {};
HostSyncCounter::HostSyncCounter(bool) {}
int64_t HostSyncCounter::count() const { return 0; }
#endif

HostSyncCounter::~HostSyncCounter() = default;
bool HostSyncCounter::active() const { return impl_ != nullptr; }

}  // namespace skyreels::model
