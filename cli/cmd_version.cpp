#include <torch/cuda.h>
#include <torch/version.h>

#include <iostream>

#include "cli/command.h"
#include "model/runtime.h"

namespace {

int run_version(const std::vector<std::string>&) {
  const auto f = skyreels::runtime::cpu_features();
  std::cout << "skyreels " << SKYREELS_VERSION << "\n"
            << "libtorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "." << TORCH_VERSION_PATCH << "\n"
            << "cores " << skyreels::runtime::available_cores() << ", avx512f " << f.avx512f << ", amx_bf16 "
            << f.amx_bf16 << ", auto dtype on cpu: " << skyreels::runtime::resolve_dtype_name("auto", "cpu") << "\n";
#ifdef SKYREELS_WITH_CUDA
  std::cout << "cuda: LibTorch built with CUDA, " << torch::cuda::device_count() << " device(s) available\n";
#else
  std::cout << "cuda: LibTorch without CUDA\n";
#endif
  return 0;
}

}  // namespace

SKYREELS_COMMAND("version", "print versions and the CPU features that pick defaults", "usage: skyreels version",
                 run_version);
