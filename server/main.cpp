// skyreels-server: serves SkyReels-V2 diffusion-forcing video generation over gRPC.
#include <cstring>
#include <iostream>

#include "model/runtime.h"

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::cout << "usage: skyreels-server --model DIR [--vae DIR] --devices LIST --listen HOST:PORT "
                   "--metrics-listen HOST:PORT\n";
      return 0;
    }
  }
  std::cerr << "skyreels-server: not implemented yet\n";
  return 1;
}
