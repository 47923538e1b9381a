// `skyreels generate`: diffusion-forcing generation to latents (diffusers' SkyReelsV2DiffusionForcingPipeline with
// output_type="latent") from precomputed prompt embeddings, chunk by chunk as the server runs it.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <random>

#include "cli/command.h"
#include "model/diffusion_forcing.h"
#include "model/safetensors.h"
#include "model/text_encoding.h"
#include "model/transformer_loader.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;
using skyreels::cli::with_generation_flags;
namespace model = skyreels::model;

const char* kUsage =
    "usage: skyreels generate --model DIR (--inputs IN.safetensors | --text-encoder DIR --prompt TEXT)\n"
    "                         --out OUT.safetensors [flags]\n\n"
    "Diffusion-forcing generation of latents (diffusers' SkyReelsV2DiffusionForcingPipeline, output_type=latent).\n"
    "  --model      a transformer checkpoint in any layout the loader accepts\n"
    "  --inputs     safetensors with prompt_embeds [B, T, text_dim] and, when --guidance-scale > 1,\n"
    "               negative_prompt_embeds (e.g. from `skyreels encode-text`)\n"
    "  --text-encoder DIR  a UMT5 text encoder: encode --prompt / --negative-prompt (default \"\") instead of "
    "--inputs\n"
    "  --tokenizer DIR     its tokenizer (default: found next to the text encoder)\n"
    "  --max-sequence-length 512\n"
    "  --out        safetensors with `latents` fp32 [B, 16, F, H/8, W/8] and `chunkK_latents_end` per chunk K\n"
    "flags named after diffusers' arguments (defaults as diffusers):\n"
    "  --num-frames 97  --height 544  --width 960  --num-inference-steps 50  --guidance-scale 6.0\n"
    "  --flow-shift 8.0 (default: the --scheduler-config value if given, else 8.0)\n"
    "  --base-num-frames 97  --overlap-history N (long videos)  --ar-step 0  --causal-block-size N\n"
    "  --addnoise-condition 0  --fps 24\n"
    "  --seed N               latent noise as torch.Generator('cpu').manual_seed(N) draws it (default: random);\n"
    "                         addnoise_condition noise comes from a second CPU generator seeded N+1\n"
    "  --noise FILE           inject recorded noise: tensors noise_000, noise_001, ... in diffusers' draw order\n"
    "  --scheduler-config FILE  a diffusers UniPCMultistepScheduler scheduler_config.json\n"
    "  --dtype float32|bfloat16|auto (default float32)  --device cpu|cuda|cuda:N (default cpu)";

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t int_flag(const Args& args, const std::string& name, int64_t fallback) {
  if (!args.has(name)) return fallback;
  const std::string text = args.get(name);
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return value;
  } catch (const std::exception&) {
    throw UsageError("flag --" + name + " expects an integer, got '" + text + "'");
  }
}

uint64_t seed_flag(const Args& args) {
  if (!args.has("seed")) {
    const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    spdlog::info("no --seed given; using seed {}", seed);
    return seed;
  }
  const std::string text = args.get("seed");
  try {
    size_t used = 0;
    const unsigned long long value = std::stoull(text, &used);
    if (used != text.size() || text.front() == '-') throw std::invalid_argument(text);
    return value;
  } catch (const std::exception&) {
    throw UsageError("flag --seed expects a non-negative integer, got '" + text + "'");
  }
}

model::GenerationParams params_from_flags(const Args& args) {
  model::GenerationParams p;
  p.num_frames = int_flag(args, "num-frames", p.num_frames);
  p.height = int_flag(args, "height", p.height);
  p.width = int_flag(args, "width", p.width);
  p.num_inference_steps = int_flag(args, "num-inference-steps", p.num_inference_steps);
  p.guidance_scale = args.get_double("guidance-scale", p.guidance_scale);
  if (args.has("scheduler-config")) {
    p.scheduler = model::FlowUniPCConfig::from_file(args.get("scheduler-config"));
    p.flow_shift = p.scheduler.flow_shift;
  }
  p.flow_shift = args.get_double("flow-shift", p.flow_shift);
  p.base_num_frames = int_flag(args, "base-num-frames", p.base_num_frames);
  if (args.has("overlap-history")) p.overlap_history = int_flag(args, "overlap-history", 0);
  p.ar_step = int_flag(args, "ar-step", p.ar_step);
  if (args.has("causal-block-size")) p.causal_block_size = int_flag(args, "causal-block-size", 0);
  p.addnoise_condition = args.get_double("addnoise-condition", p.addnoise_condition);
  p.fps = int_flag(args, "fps", p.fps);
  return p;
}

std::unique_ptr<model::NoiseSource> noise_from_flags(const Args& args, model::GenerationParams& params) {
  if (!args.has("noise")) {
    params.seed = seed_flag(args);
    return model::make_seeded_noise(*params.seed);
  }
  if (args.has("seed")) throw UsageError("--noise and --seed are exclusive");
  const std::string path = args.get("noise");
  auto file = skyreels::safetensors::File::open(path);
  std::vector<at::Tensor> draws;
  for (size_t i = 0;; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "noise_%03zu", i);
    if (!file->contains(name)) break;
    draws.push_back(file->tensor(name).clone());
  }
  if (draws.empty()) throw std::invalid_argument(path + ": no tensor noise_000 (expected noise_000, noise_001, ...)");
  spdlog::info("{}: {} recorded noise draws", path, draws.size());
  return model::make_recorded_noise(std::move(draws));
}

// diffusers' encode_prompt: the negative prompt (default "") is encoded only when guidance is on.
model::Conditioning conditioning_from_text(const Args& args, const model::GenerationParams& params,
                                           const std::string& device) {
  const std::string prompt = args.require("prompt");
  model::TextEncoderOptions options;
  options.device = device;
  auto encoder = model::TextEncoder::load(args.require("text-encoder"), args.get("tokenizer"), options);
  const int64_t max_len = args.get_int("max-sequence-length", 512);
  model::Conditioning c;
  c.prompt_embeds = encoder->encode({prompt}, max_len).to(at::kFloat);
  if (params.guidance_scale > 1.0) {
    c.negative_prompt_embeds = encoder->encode({args.get("negative-prompt", "")}, max_len).to(at::kFloat);
  }
  return c;
}

model::Conditioning conditioning_from(const std::string& path) {
  const auto inputs = skyreels::safetensors::load_all(path);
  model::Conditioning c;
  auto it = inputs.find("prompt_embeds");
  if (it == inputs.end()) throw std::invalid_argument(path + ": missing input tensor 'prompt_embeds'");
  c.prompt_embeds = it->second;
  if (auto neg = inputs.find("negative_prompt_embeds"); neg != inputs.end()) c.negative_prompt_embeds = neg->second;
  return c;
}

int run_generate(const std::vector<std::string>& argv) {
  const Args args(argv);
  args.reject_unknown(with_generation_flags(
      {"model", "inputs", "out", "noise", "dtype", "device", "text-encoder", "tokenizer", "max-sequence-length"}));
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");
  const std::string model_path = args.require("model");
  if (args.has("inputs") == args.has("text-encoder")) {
    throw UsageError("give either --inputs (prompt embeddings) or --text-encoder with --prompt");
  }
  const std::string out_path = args.require("out");

  model::GenerationParams params = params_from_flags(args);
  const model::Conditioning conditioning = args.has("inputs")
                                               ? conditioning_from(args.get("inputs"))
                                               : conditioning_from_text(args, params, args.get("device", "cpu"));
  auto noise = noise_from_flags(args, params);

  // With an explicit block size the request can be checked before a (possibly large) model is loaded.
  std::optional<model::ChunkPlan> plan;
  if (params.causal_block_size) plan = model::plan_chunks(params, *params.causal_block_size);

  model::TransformerLoadOptions options;
  options.device = args.get("device", "cpu");
  options.dtype = args.get("dtype", "float32");
  auto start = std::chrono::steady_clock::now();
  auto loaded = model::load_transformer(model_path, options);
  const auto& transformer = *loaded.model;
  spdlog::info("loaded {} on {} as {} in {:.2f} s", model_path, transformer.device().str(),
               c10::toString(transformer.compute_dtype()), seconds_since(start));

  // The same path the server takes: an explicit plan, then run_chunk per chunk.
  if (!plan) plan = model::plan_chunks(params, transformer.config().num_frame_per_block);
  spdlog::info("{} latent frames in {} chunk(s), causal block {}", plan->total_latent_frames, plan->chunks.size(),
               plan->causal_block_size);
  model::StepHooks hooks;
  hooks.on_step = [](int64_t chunk, int64_t row, int64_t rows) {
    spdlog::info("chunk {} row {}/{}", chunk, row + 1, rows);
  };
  std::vector<std::pair<std::string, at::Tensor>> outputs;
  at::Tensor video;
  start = std::chrono::steady_clock::now();
  for (const model::ChunkSpec& chunk : plan->chunks) {
    const at::Tensor latents =
        model::run_chunk(transformer, params, *plan, chunk.index, conditioning, video, *noise, hooks);
    outputs.emplace_back("chunk" + std::to_string(chunk.index) + "_latents_end", latents.to(at::kCPU));
    video = model::accumulate(video, latents, chunk);
  }
  spdlog::info("generated in {:.2f} s", seconds_since(start));
  outputs.insert(outputs.begin(), {"latents", video.to(at::kCPU)});
  skyreels::safetensors::save(out_path, outputs);
  std::cout << out_path << ": latents " << video.sizes() << " float32, " << plan->chunks.size() << " chunk(s)\n";
  return 0;
}

}  // namespace

SKYREELS_COMMAND("generate", "diffusion-forcing generation of latents from prompt embeddings", kUsage, run_generate);
