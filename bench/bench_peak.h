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

// The best wall seconds of `repeats` runs of `f`, after one untimed warm-up run.
double best_seconds(int repeats, const std::function<void()>& f);

// Best of `repeats` timed runs after one warm-up; float32 or bfloat16.
Peaks measure_peaks(at::ScalarType dtype, int repeats = 3, int64_t matmul_n = 2048);

}  // namespace skyreels::bench
