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
  return 0;
}

}  // namespace

SKYREELS_COMMAND("version", "print versions and the CPU features that pick defaults", "usage: skyreels version",
                 run_version);
