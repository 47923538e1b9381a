// `skyreels make-tiny`: writes the tiny random-weight transformer that `skyreels-server --demo` serves.
#include <iostream>

#include "cli/command.h"
#include "server/replica/demo_model.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;

const char* kUsage =
    "usage: skyreels make-tiny --out DIR [--seed N]\n\n"
    "Writes a tiny SkyReels-V2 transformer with random weights (2 heads x 12, 2 layers, text_dim 32) as a\n"
    "diffusers-layout checkpoint (config.json + diffusion_pytorch_model.safetensors). With the default seed it is\n"
    "the model `skyreels-server --demo` serves, so `skyreels generate --model DIR` reproduces the server's output.";

int run_make_tiny(const std::vector<std::string>& raw) {
  const Args args(raw);
  args.reject_unknown({"out", "seed"});
  skyreels::server::TinyModelOptions options;
  if (args.has("seed")) options.seed = static_cast<uint64_t>(std::stoull(args.get("seed")));
  const std::string dir = args.require("out");
  skyreels::server::write_tiny_model(dir, options);
  std::cout << dir << std::endl;
  return 0;
}

}  // namespace

SKYREELS_COMMAND("make-tiny", "write the tiny random-weight demo model", kUsage, run_make_tiny);
