#include "model/runtime.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <malloc.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace skyreels::runtime {

CpuFeatures cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("flags", 0) != 0) continue;
      std::istringstream words(line.substr(line.find(':') + 1));
      std::string w;
      while (words >> w) {
        if (w == "avx2") f.avx2 = true;
        if (w == "avx512f") f.avx512f = true;
        if (w == "avx512_bf16") f.avx512_bf16 = true;
        if (w == "amx_bf16") f.amx_bf16 = true;
      }
      break;
    }
    return f;
  }();
  return features;
}

void ensure_openblas_coretype(int argc, char** argv) {
  (void)argc;
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || std::getenv("SKYREELS_NO_REEXEC") != nullptr) return;
  const CpuFeatures f = cpu_features();
  const char* core = f.avx512f ? "SkylakeX" : (f.avx2 ? "Haswell" : nullptr);
  if (core == nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", core, 1);
  ::setenv("SKYREELS_NO_REEXEC", "1", 1);  // never loop, whatever happens below
  ::execv("/proc/self/exe", argv);
  // execv failed: carry on with OpenBLAS's own detection (slower, still correct).
}

namespace {

// CPUs granted by the cgroup v2 quota (Kubernetes CPU limits), 0 when unlimited or unknown.
int cgroup_cpu_quota() {
  std::ifstream in("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long long period = 0;
  if (!(in >> quota >> period) || quota == "max" || period <= 0) return 0;
  try {
    const long long q = std::stoll(quota);
    return q > 0 ? static_cast<int>((q + period - 1) / period) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

int available_cores() {
  int cores = affinity_cores();
  const int quota = cgroup_cpu_quota();
  if (quota > 0 && quota < cores) cores = quota;
  return cores;
}

int configure_threads(int threads) {
  if (threads <= 0) {
    // An explicit OMP_NUM_THREADS wins, as it does for OpenMP itself.
    const char* omp = std::getenv("OMP_NUM_THREADS");
    threads = omp != nullptr ? std::atoi(omp) : 0;
  }
  if (threads <= 0) threads = available_cores();
  at::set_num_threads(threads);
  return threads;
}

std::string resolve_dtype_name(const std::string& requested, const std::string& device) {
  if (requested == "float32" || requested == "fp32") return "float32";
  if (requested == "bfloat16" || requested == "bf16") return "bfloat16";
  if (requested != "auto") {
    throw std::invalid_argument("unknown dtype '" + requested + "' (expected float32, bfloat16 or auto)");
  }
  if (device.rfind("cuda", 0) == 0) return "bfloat16";
  const CpuFeatures f = cpu_features();
  return (f.amx_bf16 || f.avx512_bf16) ? "bfloat16" : "float32";
}

void tune_malloc() {
  const char* opt = std::getenv("SKYREELS_MALLOC_TUNE");
  if (opt != nullptr && std::string(opt) == "0") return;
  // Activations are large and short-lived. glibc returns them to the kernel on free and every next allocation
  // page-faults again; keeping them in the heap made a bf16 DF-1.3B forward 1.7x faster here (bench_transformer).
  // Cost: freed memory stays with the process (a serving process reuses it on the next chunk anyway).
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  ::mallopt(M_TOP_PAD, 128 << 20);
}

void release_free_heap() { ::malloc_trim(0); }

bool configure_tf32() {
  const char* env = std::getenv("SKYREELS_TF32");
  const bool tf32 = env != nullptr && std::string(env) == "1";
  at::globalContext().setAllowTF32CuBLAS(tf32);
  at::globalContext().setAllowTF32CuDNN(tf32);
  return tf32;
}

void init_process(int argc, char** argv) {
  ensure_openblas_coretype(argc, argv);
  tune_malloc();
  static bool once = [] {
    // One inter-op thread: we parallelise inside ops; must be set before any inter-op work starts.
    try {
      at::set_num_interop_threads(1);
    } catch (const std::exception&) {
    }
    return true;
  }();
  (void)once;
  configure_threads(0);
  configure_tf32();
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v");
}

}  // namespace skyreels::runtime
