#include "bench/bench_peak.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>

#ifdef SKYREELS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace skyreels::bench {

double peak_device_mib(const c10::Device& device) {
#ifdef SKYREELS_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    // Index 0 is StatType::AGGREGATE (all pools), whichever namespace this LibTorch declares StatType in.
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);
  }
#endif
  (void)device;
  return 0.0;
}

void reset_peak_device_memory(const c10::Device& device) {
#ifdef SKYREELS_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
#endif
  (void)device;
}

void sync_device(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.has_index() ? device.index() : -1);
}

double best_seconds(int repeats, const std::function<void()>& f, const c10::Device& device) {
  f();  // warm-up: first-touch pages, oneDNN primitive creation, cuBLAS handles
  sync_device(device);
  double best = 1e30;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    sync_device(device);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

Peaks measure_peaks(at::ScalarType dtype, int repeats, int64_t matmul_n, const c10::Device& device) {
  at::manual_seed(0);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  Peaks p;
  const at::Tensor a = at::randn({matmul_n, matmul_n}, opts), b = at::randn({matmul_n, matmul_n}, opts);
  const double mm_flops = 2.0 * static_cast<double>(matmul_n * matmul_n * matmul_n);
  p.matmul_gflops = mm_flops / best_seconds(repeats, [&] { at::mm(a, b); }, device) / 1e9;

  const int64_t c = 128, t = 8, h = 48, w = 48;
  const at::Tensor x = at::randn({1, c, t + 2, h + 2, w + 2}, opts);
  const at::Tensor weight = at::randn({c, c, 3, 3, 3}, opts) * 0.01, bias = at::zeros({c}, opts);
  const double conv_flops = 2.0 * static_cast<double>(c * c * 27 * t * h * w);
  p.conv_gflops = conv_flops /
                  best_seconds(repeats,
                               [&] {
                                 if (dtype == at::kFloat && device.is_cpu()) {
                                   at::mkldnn_convolution(x, weight, bias, {0, 0, 0}, {1, 1, 1}, {1, 1, 1}, 1);
                                 } else {
                                   at::conv3d(x, weight, bias);
                                 }
                               },
                               device) /
                  1e9;
  return p;
}

}  // namespace skyreels::bench
