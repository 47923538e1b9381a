// The compute limits of this machine as the benchmarks see them: the best GFLOP/s of a large matrix product and of a
// large 3-D convolution, in a dtype, measured in the benchmark's own process (same threads, same load), so a stage's
// achieved GFLOP/s can be read as a fraction of what the same process reached.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace skyreels::bench {

struct Peaks {
  double matmul_gflops = 0;  // at::mm, [n, n] x [n, n]
  double conv_gflops = 0;    // 3x3x3 convolution (oneDNN), 128 -> 128 channels, 8 frames of 48x48
};

// Peak memory allocated by LibTorch's caching allocator on a CUDA device since the process started (or the last
// reset_peak_device_memory), MiB; 0 on the CPU (see VmHWM there) and in builds without CUDA.
double peak_device_mib(const c10::Device& device);
void reset_peak_device_memory(const c10::Device& device);

// Waits for the work queued on `device` (a CUDA device; nothing to wait for on the CPU).
void sync_device(const c10::Device& device);

// The best wall seconds of `repeats` runs of `f`, after one untimed warm-up run; each run ends when `device` is idle.
double best_seconds(int repeats, const std::function<void()>& f, const c10::Device& device = c10::Device(c10::kCPU));

// Best of `repeats` timed runs after one warm-up; float32 or bfloat16; on the CPU or a CUDA device.
Peaks measure_peaks(at::ScalarType dtype, int repeats = 3, int64_t matmul_n = 2048,
                    const c10::Device& device = c10::Device(c10::kCPU));

}  // namespace skyreels::bench
