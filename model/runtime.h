// Process-wide runtime defaults that matter on CPU: OpenBLAS core type, intra-op threads, the compute dtype.
// Torch-free header: include it anywhere.
#pragma once

#include <string>

namespace skyreels::runtime {

struct CpuFeatures {
  bool avx2 = false;
  bool avx512f = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
};

CpuFeatures cpu_features();  // read once from /proc/cpuinfo

// OpenBLAS 0.3.21 misdetects recent Xeons as "Prescott" and reads OPENBLAS_CORETYPE in a load-time constructor,
// so the variable must be set before the process starts. Call first thing in main(): when the variable is unset
// and the CPU has AVX-512 (SkylakeX) or AVX2 (Haswell), it sets it and re-executes the program (once).
void ensure_openblas_coretype(int argc, char** argv);

// Cores this process may run on: sched_getaffinity, capped by the cgroup v2 CPU quota (Kubernetes limits); >= 1.
int available_cores();

// Sets LibTorch intra-op threads (LibTorch 1.13 picks half the cores on x86) and one inter-op thread.
// threads <= 0 means OMP_NUM_THREADS when set, else available_cores(). Returns the number set.
int configure_threads(int threads = 0);

// "auto" resolves to bfloat16 on CUDA devices and on CPUs with AMX-BF16 or AVX512-BF16, else float32.
// Accepts "float32"/"fp32", "bfloat16"/"bf16", "auto". Throws std::invalid_argument otherwise.
std::string resolve_dtype_name(const std::string& requested, const std::string& device);

// Keeps freed activation memory in the heap instead of returning it to the kernel (page faults dominated the
// forward otherwise). SKYREELS_MALLOC_TUNE=0 turns it off.
void tune_malloc();

// Returns the heap's free pages to the kernel (malloc_trim), in every arena: what tune_malloc keeps for the next
// chunk's activations, and with it what a crowd of connections freed across their threads' arenas. The next
// activations fault their pages in again, so call it when the process has gone quiet, not per request.
void release_free_heap();

// float32 on CUDA means float32: TF32 off for cuBLAS matmuls and cuDNN convolutions (PyTorch leaves cuDNN's on),
// so fp32 results match the CPU's and diffusers' fp32 fixtures within 1e-4. SKYREELS_TF32=1 turns both on (faster
// fp32 on Ampere and later, ~1e-3 relative). No effect on bfloat16 or on the CPU. Returns whether TF32 is on.
bool configure_tf32();

// Everything a main() needs: coretype re-exec, malloc tuning, threads, TF32 off, spdlog pattern.
void init_process(int argc, char** argv);

}  // namespace skyreels::runtime
