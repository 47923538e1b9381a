// `skyreels forward`: one transformer forward pass on tensors from a safetensors file, for parity checks against
// diffusers (e.g. the golden transformer_forward cases) and for timing a checkpoint.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <iostream>

#include "cli/command.h"
#include "cli/rank_flags.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;

const char* kUsage =
    "usage: skyreels forward --model DIR --inputs IN.safetensors --out OUT.safetensors\n"
    "                        [--dtype float32|bfloat16|auto] [--device cpu|cuda|cuda:N]\n"
    "                        [--devices LIST --parallel cfg=C,ulysses=U]\n"
    "                        [--num-frame-per-block N] [--lora FILE[:SCALE]]...\n"
    "                        [--lora-dir DIR --adapter NAME[:SCALE]...]\n\n"
    "Runs SkyReelsV2Transformer3DModel.forward once.\n"
    "  --model    a transformer checkpoint in any layout the loader accepts (see `skyreels inspect`)\n"
    "  --inputs   safetensors with hidden_states [B, C, F, H, W], timestep int64 [B] or [B, F] (per-frame,\n"
    "             diffusion forcing), encoder_hidden_states [B, T, text_dim] and, for models with the fps\n"
    "             embedding, fps int64 [B] (0 for 16 fps, else 1)\n"
    "  --out      safetensors with `sample` [B, out_channels, F, H, W] in the compute dtype\n"
    "  --dtype    compute dtype (default float32); fp32 islands stay fp32 either way\n"
    "  --device   default cpu\n"
    "  --devices LIST --parallel cfg=1,ulysses=U  the pass with its tokens split over U ranks (threads joined by\n"
    "             torch's c10d, one per device of LIST; U divides the attention heads): the same sample within 1e-5\n"
    "  --lora     a LoRA adapter merged at load (diffusers/PEFT, original/kohya or musubi keys): W + SCALE *\n"
    "             (alpha / r) * B @ A in float32, then cast; SCALE default 1; repeatable, applied in order\n"
    "  --lora-dir DIR  adapters for --adapter: every DIR/NAME.safetensors (same key formats as --lora)\n"
    "  --adapter  NAME[:SCALE] an adapter of --lora-dir applied unmerged, the weights unchanged: each linear layer\n"
    "             adds SCALE * (alpha / r) * B (A x); SCALE default 1, |SCALE| <= 100; repeatable (at most 8),\n"
    "             in order; combines with --lora\n"
    "  --num-frame-per-block  block size of the block-causal self-attention mask (default: the config's value;\n"
    "             1 = no mask)";

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

const at::Tensor& required_input(const std::map<std::string, at::Tensor>& inputs, const std::string& name,
                                 const std::string& path) {
  auto it = inputs.find(name);
  if (it == inputs.end()) throw std::invalid_argument(path + ": missing input tensor '" + name + "'");
  return it->second;
}

int run_forward(const std::vector<std::string>& argv) {
  const Args args(argv, {"shard-weights"});
  args.reject_unknown({"model", "inputs", "out", "dtype", "device", "devices", "parallel", "shard-weights",
                       "num-frame-per-block", "lora", "lora-dir", "adapter"});
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");
  const std::string model_path = args.require("model");
  const std::string inputs_path = args.require("inputs");
  const std::string out_path = args.require("out");

  const skyreels::cli::Ranks ranks = skyreels::cli::ranks_from_flags(args);
  if (ranks.layout.cfg > 1) throw UsageError("--parallel: a forward is one pass (no guidance): use cfg=1,ulysses=U");
  skyreels::model::TransformerLoadOptions options;
  options.dtype = args.get("dtype", "float32");
  options.loras = skyreels::cli::lora_specs_from_flags(args);
  skyreels::cli::check_adapter_flags(args);

  const skyreels::cli::RankModels models =
      skyreels::cli::load_per_device(ranks, args, [&](const std::string& device) {
        skyreels::model::TransformerLoadOptions on_device = options;
        on_device.device = device;
        return skyreels::model::load_transformer(model_path, on_device);  // logs what it found and did
      });
  const auto& loaded = models.by_device.at(ranks.devices.front());
  const auto& model = *loaded.model;
  // The loader refuses a model with any tensor off the device; this line says what it checked (scripts/gpu-check.sh).
  std::cout << "placement: " << loaded.report.placed_tensors << " tensors on " << loaded.report.placed_device << " ("
            << loaded.report.placed_fp32 << " float32), none on meta or another device\n";

  const auto inputs = skyreels::safetensors::load_all(inputs_path);
  skyreels::model::TransformerForwardArgs forward_args;
  forward_args.hidden_states = required_input(inputs, "hidden_states", inputs_path);
  forward_args.timestep = required_input(inputs, "timestep", inputs_path);
  forward_args.encoder_hidden_states = required_input(inputs, "encoder_hidden_states", inputs_path);
  if (auto it = inputs.find("fps"); it != inputs.end()) forward_args.fps = it->second;
  const int nfpb = args.get_int("num-frame-per-block", static_cast<int>(model.config().num_frame_per_block));
  if (nfpb < 1) throw UsageError("flag --num-frame-per-block must be >= 1, got " + std::to_string(nfpb));
  forward_args.num_frame_per_block = nfpb;
  forward_args.adapters = skyreels::cli::adapters_from_flags(args, model);

  const auto start = std::chrono::steady_clock::now();
  at::Tensor sample;
  skyreels::cli::on_every_rank(ranks, [&](int64_t rank, const skyreels::model::RankGroups& groups) {
    skyreels::model::TransformerForwardArgs mine = forward_args;
    mine.sequence_parallel = groups.ulysses;
    mine.weight_ranks = groups.all;
    const at::Tensor out = models.of(ranks, rank).forward(mine).to(at::kCPU);  // waits: the time is the whole pass
    if (rank == 0) sample = out;
  });
  spdlog::info("forward {} -> {} in {:.3f} s", c10::str(forward_args.hidden_states.sizes()), c10::str(sample.sizes()),
               seconds_since(start));

  skyreels::safetensors::save(out_path, {{"sample", sample}});
  std::cout << out_path << ": sample " << sample.sizes() << " " << c10::toString(sample.scalar_type()) << "\n";
  return 0;
}

}  // namespace

SKYREELS_COMMAND("forward", "run the transformer once on tensors from a safetensors file", kUsage, run_forward);
