// `skyreels generate`: generation to latents (output_type="latent") as diffusers' pipelines do it: diffusion forcing
// (SkyReelsV2DiffusionForcingPipeline and its image / video variants) chunk by chunk as the server runs it, or the
// text-to-video / image-to-video pipelines (SkyReelsV2Pipeline, SkyReelsV2ImageToVideoPipeline) in one go.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <tuple>

#include "cli/command.h"
#include "cli/rank_flags.h"
#include "model/checkpoint.h"
#include "model/clip_vision.h"
#include "model/diffusion_forcing.h"
#include "model/guidance.h"
#include "model/host_syncs.h"
#include "model/image_processor.h"
#include "model/magcache_ratios.h"
#include "model/parallel_layout.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/pixel_conditioning.h"
#include "model/rank_group.h"
#include "model/safetensors.h"
#include "model/text_encoding.h"
#include "model/transformer_loader.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "server/job/generation_params.h"
#include "server/job/generation_params_model.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::frame_and_value;
using skyreels::cli::generation_request_from_flags;
using skyreels::cli::load_per_device;
using skyreels::cli::on_every_rank;
using skyreels::cli::RankModels;
using skyreels::cli::Ranks;
using skyreels::cli::ranks_from_flags;
using skyreels::cli::UsageError;
using skyreels::cli::with_generation_flags;
namespace model = skyreels::model;

const std::string kUsage =
    std::string(
        "usage: skyreels generate --model DIR (--inputs IN.safetensors | --text-encoder DIR --prompt TEXT)\n"
        "                         [--pipeline df|t2v|i2v] --out OUT.safetensors [flags]\n\n"
        "Generation of latents as diffusers' pipelines make them (output_type=latent).\n"
        "  --pipeline   df: diffusion forcing (SkyReelsV2DiffusionForcingPipeline, chunk by chunk; the image / video\n"
        "               flags below); t2v: SkyReelsV2Pipeline (one timestep for all frames); i2v:\n"
        "               SkyReelsV2ImageToVideoPipeline. Default: i2v for an image-to-video checkpoint (36 channels),\n"
        "               else df (a T2V checkpoint runs both df and t2v)\n"
        "  --model      a transformer checkpoint in any layout the loader accepts\n"
        "  --inputs     safetensors with prompt_embeds [B, T, text_dim] and, when --guidance-scale > 1,\n"
        "               negative_prompt_embeds (e.g. from `skyreels encode-text`)\n"
        "  --text-encoder DIR  a UMT5 text encoder: encode --prompt / --negative-prompt (default \"\") instead of "
        "--inputs\n"
        "  --tokenizer DIR     its tokenizer (default: found next to the text encoder)\n"
        "  --max-sequence-length 512\n"
        "  --out        safetensors with `latents` fp32 [B, 16, F, H/8, W/8] and `chunkK_latents_end` per chunk K\n"
        "  --noise FILE inject recorded noise: inject recorded noise: noise_000, noise_001, ... in diffusers' draw "
        "order\n"
        "  --dtype float32|bfloat16|auto (default float32)  --device cpu|cuda|cuda:N (default cpu)\n"
        "  --devices LIST --parallel cfg=C,ulysses=U  one video on C x U devices (e.g. --devices cpu,cpu,cpu,cpu\n"
        "               --parallel cfg=2,ulysses=2): cfg=2 runs a guided row's two passes at once on the two halves,\n"
        "               ulysses=U splits the tokens over U ranks (U divides the model's attention heads); the ranks\n"
        "               are threads joined by torch's c10d (Gloo); the output equals one device's within 1e-5\n"
        "  --lora FILE[:SCALE]  a LoRA adapter merged at load (diffusers/PEFT, original/kohya or musubi keys):\n"
        "               W + SCALE * (alpha / r) * B @ A in float32, then cast; default SCALE 1; repeatable\n"
        "  --lora-dir DIR       adapters for --adapter: every DIR/NAME.safetensors (same key formats as --lora)\n"
        "  --adapter NAME[:SCALE]  an adapter of --lora-dir applied unmerged in every transformer call, the weights\n"
        "               unchanged (SCALE default 1, |SCALE| <= 100); repeatable (at most 8), in order; combines\n"
        "               with --lora\n"
        "image-to-video and video extension (diffusers' DF ImageToVideo / VideoToVideo pipelines):\n"
        "  --vae DIR          the Wan VAE that encodes the image / video (diffusers AutoencoderKLWan folder)\n"
        "  --image PATH       first frame: PNG/JPEG, or safetensors with `image` [B, 3, H, W] float in [0, 1]\n"
        "  --last-image PATH  last frame (with --image): PNG/JPEG, or safetensors with `last_image`\n"
        "  --video PATH       video to extend: MP4, or safetensors with `video` [B, F, 3, H, W] float in [0, 1];\n"
        "                     its last --overlap-history frames are continued; --num-frames counts them too\n"
        "                     (images and videos must already be --width x --height)\n"
        "  --pin-image-prefix with --causal-block-size > 1: keep the image frame fixed (diffusers denoises it)\n"
        "  --count-host-syncs on CUDA: count the host-device synchronisations of the step loops (LibTorch's sync\n"
        "               debug mode) and print them with the number of transformer calls\n"
        "text-to-video / image-to-video (--pipeline t2v / i2v):\n"
        "  --num-videos-per-prompt N  videos per prompt (default 1); the output holds prompt b's v-th video at b*N+v\n"
        "  --image PATH       i2v: the first frame, PNG/JPEG or safetensors with `image` uint8 [H, W, C]; resized to\n"
        "                     --width x --height with Pillow LANCZOS for the VAE, as the pipeline does\n"
        "  --last-image PATH  i2v with a first-last-frame checkpoint: the last frame\n"
        "  --image-encoder DIR    i2v: the CLIP image encoder (transformers folder, a pipeline folder, or the\n"
        "                         original open-clip-xlm-roberta-large-vit-huge-14 weights)\n"
        "  --image-processor DIR  its preprocessor_config.json (default: image_processor/ beside the encoder)\n"
        "  --vae DIR          i2v: the VAE that encodes the condition video\n"
        "a prompt per chunk (each chunk takes the prompt in force at its first new frame):\n"
        "  --prompt-at FRAME:TEXT   from pixel frame FRAME on, TEXT (needs --text-encoder); repeatable\n"
        "  --inputs-at FRAME:FILE   from pixel frame FRAME on, the embeddings of FILE (like --inputs); repeatable\n"
        "  --cache-log FILE.json    every step-cache decision (the pipeline_df_cache / step_caches fixtures' "
        "decisions.json)\n"
        "  --magcache-ratios FILE   --cache magcache: the model's ratios from `skyreels calibrate-magcache`\n"
        "  --kv-cache-bytes N       memory for the kept keys/values of final frames (default 4 GiB)\n"
        "  --previews DIR           a PNG per preview: DIR/chunkK_rowR.png, the chunk's new frames side by side at\n"
        "                           latent resolution (after every --preview-every rows, default 1, and the last)\n"
        "generation parameters, named after diffusers' arguments (defaults as diffusers):\n"
        "  --scheduler-config FILE        a diffusers scheduler_config.json of --sampler's class:\n"
        "                                 UniPCMultistepScheduler (unipc) or FlowMatchEulerDiscreteScheduler\n"
        "                                 (euler: its shift and num_train_timesteps); the defaults of\n"
        "                                 --flow-shift and of the sampler's flags below\n") +
    skyreels::server::generation_flags_help();

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint64_t random_seed() {
  const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  spdlog::info("no --seed given; using seed {}", seed);
  return seed;
}

// The table's flags as the model takes them. causal_block_size stays unset unless given: plan_chunks applies the
// model's once it is loaded. The seed stays unset unless given: noise_from_flags draws one.
model::GenerationParams params_from_flags(const Args& args) {
  const skyreels::server::JobRequest request = generation_request_from_flags(args);
  model::GenerationParams p = skyreels::server::model_params(skyreels::server::resolve_generation_params(request, {}));
  p.seed = request.seed;
  p.pin_image_prefix = args.has("pin-image-prefix");
  return p;
}

std::unique_ptr<model::NoiseSource> noise_from_flags(const Args& args, model::GenerationParams& params) {
  if (!args.has("noise")) {
    if (!params.seed) params.seed = random_seed();
    return model::make_seeded_noise(*params.seed);
  }
  if (params.seed) throw UsageError("--noise and --seed are exclusive");
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
model::Conditioning conditioning_from_text(model::TextEncoder& encoder, const Args& args,
                                           const model::GenerationParams& params, const std::string& prompt) {
  const int64_t max_len = args.get_int("max-sequence-length", 512);
  model::Conditioning c;
  // Prompt and negative prompt in one call: the encoder batches them where that is faster (TextEncoder::choose_batches).
  std::vector<std::string> texts{prompt};
  const bool guidance = model::guided(params.guidance_scale);
  if (guidance) texts.push_back(args.get("negative-prompt", ""));
  const at::Tensor embeds = encoder.encode(texts, max_len).to(at::kFloat);
  c.prompt_embeds = embeds.narrow(0, 0, 1);
  if (guidance) c.negative_prompt_embeds = embeds.narrow(0, 1, 1);
  return c;
}

// What the transformer calls of a run did, for the log and --cache-log. The ranks of a replica report side by side
// (each call once, from the first sequence rank of its guidance half): add() takes a lock, and in_call_order() puts
// the step-cache log back in one device's order (a guided row's conditional call first).
struct TransformerWork {
  int64_t full = 0, computed = 0, saved_exact = 0, saved_cache = 0, transformer_calls = 0;
  std::vector<model::TransformerCallReport> calls;
  std::mutex mutex;
  void add(const model::TransformerCallReport& call) {
    const std::lock_guard<std::mutex> lock(mutex);
    full += call.token_blocks_full;
    computed += call.token_blocks_computed;
    saved_exact += call.token_blocks_saved_exact;
    saved_cache += call.token_blocks_saved_cache;
    ++transformer_calls;
    if (call.step_cache) calls.push_back(call);
  }
  void in_call_order() {
    std::stable_sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) {
      return std::make_tuple(a.chunk, a.row, a.unconditional) < std::make_tuple(b.chunk, b.row, b.unconditional);
    });
  }
  std::string summary() const {
    auto percent = [&](int64_t part) { return full > 0 ? 100.0 * static_cast<double>(part) / full : 0.0; };
    return fmt::format("{:.1f} % of token-rows saved ({:.1f} % exact, {:.1f} % by the step cache)",
                       percent(saved_exact + saved_cache), percent(saved_exact), percent(saved_cache));
  }
};

void write_cache_log(const std::string& path, const std::vector<model::TransformerCallReport>& calls) {
  std::ofstream file(path);
  file << model::step_cache_decisions_json(calls);
  if (!file) throw std::runtime_error(path + ": cannot write the cache log");
}

int64_t parse_bytes(const std::string& text) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= 0) return value;
  } catch (const std::exception&) {
  }
  throw UsageError("--kv-cache-bytes: expected a byte count >= 0, got '" + text + "'");
}

// --prompt-at and --inputs-at, sorted by frame; `encode` turns a text into [prompt, negative] embeddings.
std::vector<model::PromptChange> prompt_changes_from_flags(
    const Args& args, const std::function<model::Conditioning(const std::string&)>& encode,
    const std::function<model::Conditioning(const std::string&)>& read_file) {
  std::map<int64_t, model::PromptChange> by_frame;
  auto add = [&](const std::string& flag, const std::string& text, const auto& make) {
    const auto [frame, value] = frame_and_value(flag, text);
    if (by_frame.count(frame)) throw UsageError("two prompts take over at frame " + std::to_string(frame));
    const model::Conditioning c = make(value);
    by_frame[frame] = model::PromptChange{frame, c.prompt_embeds, c.negative_prompt_embeds};
  };
  for (const auto& text : args.all("prompt-at")) {
    if (!encode) throw UsageError("--prompt-at needs --text-encoder (or use --inputs-at FRAME:FILE)");
    add("prompt-at", text, encode);
  }
  for (const auto& text : args.all("inputs-at")) add("inputs-at", text, read_file);
  std::vector<model::PromptChange> out;
  for (auto& [frame, change] : by_frame) out.push_back(std::move(change));
  return out;
}

model::PixelConditioning pixels_from_flags(const Args& args) {
  if (args.has("image") && args.has("video")) {
    throw UsageError("--image and --video are exclusive (image-to-video or video extension)");
  }
  model::PixelConditioning pixels;
  if (args.has("image")) pixels.image = model::load_pixels(args.get("image"), "image", model::PixelKind::kImage);
  if (args.has("last-image")) {
    if (!args.has("image")) throw UsageError("--last-image needs --image");
    pixels.last_image = model::load_pixels(args.get("last-image"), "last_image", model::PixelKind::kImage);
  }
  if (args.has("video")) {
    pixels.video = model::load_pixels(args.get("video"), "video", model::PixelKind::kVideo);
  }
  return pixels;
}

// The VAE encode of the image / video into the conditioning's latents (once per video).
void encode_pixels(const Args& args, const model::PixelConditioning& pixels, const model::GenerationParams& params,
                   model::Conditioning& conditioning) {
  if (pixels.empty()) return;
  if (!args.has("vae")) throw UsageError("--image / --video need --vae DIR (the VAE that encodes them)");
  skyreels::checkpoint::PlaceOptions place;
  place.device = args.get("device", "cpu");
  auto start = std::chrono::steady_clock::now();
  const model::WanVae vae = model::WanVae::load(args.get("vae"), place);
  const model::EncodedConditioning encoded = model::encode_conditioning(vae, pixels, params);
  conditioning.prefix_latents = encoded.prefix_latents;
  conditioning.last_image_latents = encoded.last_image_latents;
  spdlog::info("encoded the conditioning into {} latent frame(s) in {:.2f} s", encoded.prefix_latents.size(2),
               seconds_since(start));
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

// Writes each preview as DIR/chunkK_rowR.png (K, R zero-padded: the files sort in order).
std::function<void(const model::ChunkPreview&)> preview_writer(const std::string& dir) {
  std::filesystem::create_directories(dir);
  return [dir](const model::ChunkPreview& p) {
    char name[64];
    std::snprintf(name, sizeof(name), "/chunk%03lld_row%04lld.png", static_cast<long long>(p.chunk),
                  static_cast<long long>(p.row));
    const std::vector<uint8_t> png = skyreels::video::encode_png(model::preview_strip(p), model::kPreviewPngCompression);
    std::ofstream out(dir + name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
    if (!out) throw std::runtime_error("--previews: cannot write " + dir + name);
  };
}

// The transformer as --device, --dtype and --lora ask, checked to run `kind`.
model::LoadedTransformer load_for(const Args& args, const std::string& model_path, model::PipelineKind kind,
                                  const std::string& device) {
  model::TransformerLoadOptions options;
  options.device = device;
  options.dtype = args.get("dtype", "float32");
  options.loras = skyreels::cli::lora_specs_from_flags(args);
  skyreels::cli::check_adapter_flags(args);
  const auto start = std::chrono::steady_clock::now();
  model::LoadedTransformer loaded = model::load_transformer(model_path, options);
  model::check_pipeline_fits(kind, loaded.model->config());
  spdlog::info("loaded {} on {} as {} in {:.2f} s; pipeline {}", model_path, loaded.model->device().str(),
               c10::toString(loaded.model->compute_dtype()), seconds_since(start), model::pipeline_kind_name(kind));
  return loaded;
}

// One noise source per rank (the first call fixes a random seed when none is given): every rank draws the same values.
std::vector<std::unique_ptr<model::NoiseSource>> rank_noises(const Args& args, model::GenerationParams& params,
                                                             const Ranks& ranks) {
  std::vector<std::unique_ptr<model::NoiseSource>> noises;
  for (int64_t r = 0; r < ranks.layout.ranks(); ++r) noises.push_back(noise_from_flags(args, params));
  return noises;
}

// The transformer once per distinct device of the ranks, as --dtype and --lora ask, checked to run `kind`.
RankModels load_for_ranks(const Args& args, const std::string& model_path, model::PipelineKind kind,
                          const Ranks& ranks) {
  return load_per_device(ranks, args, [&](const std::string& device) { return load_for(args, model_path, kind, device); });
}

// ---- text-to-video and image-to-video ----------------------------------------------------------------------------

// --pipeline, or what the checkpoint runs by default. Without the flag the checkpoint's config is peeked at (mapped,
// not loaded); a path that cannot be read is left to the diffusion-forcing path, which names the problem itself.
model::PipelineKind pipeline_from_flags(const Args& args, const std::string& model_path) {
  if (args.has("pipeline")) {
    try {
      return model::pipeline_kind_from_name(args.get("pipeline"));
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--") + e.what());
    }
  }
  if (!std::filesystem::exists(model_path)) return model::PipelineKind::kDiffusionForcing;
  try {
    const auto analysis = model::analyze_transformer_checkpoint(model_path);
    if (analysis.config) return model::default_pipeline(*analysis.config);
  } catch (const std::exception&) {
  }
  return model::PipelineKind::kDiffusionForcing;
}

// Flags that belong to diffusion forcing only: this command's own, then the generation parameters the table marks
// diffusion_forcing_only (a new such parameter is refused here without an edit).
void refuse_df_flags(const Args& args, model::PipelineKind kind) {
  std::vector<std::string> flags{"video",          "prompt-at",        "inputs-at", "pin-image-prefix",
                                 "kv-cache-bytes", "count-host-syncs", "previews"};
  for (const auto& param : skyreels::server::generation_params()) {
    if (param.diffusion_forcing_only) flags.push_back(param.flag);
  }
  for (const std::string& flag : flags) {
    if (args.has(flag)) {
      throw UsageError(std::string("--") + flag + " is a diffusion-forcing flag; --pipeline " +
                       model::pipeline_kind_name(kind) + " does not take it");
    }
  }
}

// The image tokens and the VAE condition of an I2V call, from its pixels (as the pipeline's two processors see them).
void encode_i2v_images(const Args& args, const model::GenerationParams& params, const model::TransformerConfig& config,
                       model::VideoConditioning& conditioning) {
  const at::Tensor image = model::convert_to_rgb(model::read_image(args.require("image")));
  const at::Tensor last =
      args.has("last-image") ? model::convert_to_rgb(model::read_image(args.get("last-image"))) : at::Tensor();
  const std::string encoder_dir = args.require("image-encoder");
  const std::string processor_dir =
      args.has("image-processor") ? args.get("image-processor") : model::find_image_processor_dir(encoder_dir);
  if (processor_dir.empty()) {
    throw UsageError("no preprocessor_config.json beside '" + encoder_dir + "'; pass --image-processor DIR");
  }
  auto start = std::chrono::steady_clock::now();
  const auto processor = model::ClipImageProcessorConfig::from_file(
      (std::filesystem::path(processor_dir) / "preprocessor_config.json").string());
  model::ClipVisionLoadOptions clip_options;
  clip_options.device = args.get("device", "cpu");
  const model::LoadedClipVision encoder = model::load_clip_vision_encoder(encoder_dir, clip_options);
  std::vector<at::Tensor> images{image};
  if (last.defined()) images.push_back(last);
  const at::Tensor tokens = encoder.model->forward(model::clip_preprocess(processor, images).pixel_values).penultimate;
  conditioning.image_tokens = model::prepare_image_tokens(config, tokens.narrow(0, 0, 1),
                                                          last.defined() ? tokens.narrow(0, 1, 1) : at::Tensor());
  spdlog::info("image tokens [{}, {}, {}] in {:.2f} s", tokens.size(0), tokens.size(1), tokens.size(2),
               seconds_since(start));

  start = std::chrono::steady_clock::now();
  skyreels::checkpoint::PlaceOptions place;
  place.device = args.get("device", "cpu");
  const model::WanVae vae = model::WanVae::load(args.require("vae"), place);
  auto vae_side = [&](const at::Tensor& rgb) { return model::vae_image_preprocess(rgb, params.height, params.width); };
  conditioning.condition =
      model::prepare_i2v_condition(vae, vae_side(image), last.defined() ? vae_side(last) : at::Tensor(),
                                   model::round_num_frames(params.num_frames))
          .condition;
  spdlog::info("condition video encoded in {:.2f} s", seconds_since(start));
}

// --magcache-ratios for --cache magcache: the file, checked against the model (exit 2 naming it).
void magcache_ratios_from_flags(const Args& args, const model::SkyReelsV2Transformer& transformer,
                                model::GenerationParams& params) {
  if (!args.has("magcache-ratios")) return;
  if (params.cache.kind != model::StepCacheKind::kMagCache) throw UsageError("--magcache-ratios needs --cache magcache");
  try {
    params.cache.magcache.mag_ratios =
        model::load_magcache_ratios(args.get("magcache-ratios"), model::magcache_model_signature(transformer)).cond;
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--magcache-ratios ") + e.what());
  }
}

// TaylorSeer's modules and settings, MagCache's ratios and settings, checked before the first step (exit 2 naming the
// field).
void check_step_cache_flags(const model::SkyReelsV2Transformer& transformer, const model::GenerationParams& params) {
  try {
    model::check_video_step_cache(transformer, params.cache, params.num_inference_steps);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

// The step cache of a t2v / i2v run: calibration (`calibrate-magcache`) or the flags' cache.
void video_step_cache_from_flags(const Args& args, const model::SkyReelsV2Transformer& transformer, bool calibrate,
                                 model::GenerationParams& params) {
  if (calibrate) {
    params.cache = {};
    params.cache.kind = model::StepCacheKind::kMagCache;
    params.cache.magcache.calibrate = true;
  } else {
    magcache_ratios_from_flags(args, transformer, params);
  }
  if (args.has("cache-log") && params.cache.kind == model::StepCacheKind::kNone) {
    throw UsageError("--cache-log needs a step cache (--cache taylorseer or magcache)");
  }
  check_step_cache_flags(transformer, params);
}

// The step cache of a diffusion-forcing run: TaylorSeer / MagCache as on t2v (the chunk plan checks ar_step).
void df_step_cache_from_flags(const Args& args, const model::SkyReelsV2Transformer& transformer,
                              model::GenerationParams& params) {
  magcache_ratios_from_flags(args, transformer, params);
  if (params.cache.kind == model::StepCacheKind::kTaylorSeer || params.cache.kind == model::StepCacheKind::kMagCache) {
    check_step_cache_flags(transformer, params);
  }
}

// The calibration of `calibrate-magcache`: the ratios of each guidance context, in call order.
model::MagCacheRatios calibration_of(const TransformerWork& work, const model::SkyReelsV2Transformer& transformer,
                                     const Args& args, const model::GenerationParams& params) {
  model::MagCacheRatios r;
  for (const auto& call : work.calls) {
    if (call.calibration_ratio)
      (call.unconditional ? r.uncond : r.cond).push_back(static_cast<float>(*call.calibration_ratio));
  }
  r.num_inference_steps = static_cast<int64_t>(r.cond.size());
  r.model = model::magcache_model_signature(transformer);
  r.settings =
      fmt::format("{} frames {}x{}, {} steps, flow_shift {}, guidance_scale {}, prompt from {}", params.num_frames,
                  params.width, params.height, params.num_inference_steps, params.flow_shift, params.guidance_scale,
                  args.has("inputs") ? args.get("inputs") : "--prompt");
  return r;
}

int run_video_pipeline(const Args& args, model::PipelineKind kind, const std::string& model_path,
                       const std::string& out_path, bool calibrate = false) {
  refuse_df_flags(args, kind);
  const bool i2v = kind == model::PipelineKind::kImageToVideo;
  if (!i2v) {
    for (const char* flag : {"image", "last-image", "image-encoder", "image-processor"}) {
      if (args.has(flag)) throw UsageError(std::string("--") + flag + ": the t2v pipeline takes no image");
    }
  } else {
    for (const char* flag : {"image", "image-encoder", "vae"}) {
      if (!args.has(flag)) throw UsageError(std::string("--pipeline i2v needs --") + flag);
    }
  }
  model::GenerationParams params = params_from_flags(args);
  if (i2v && !args.has("guidance-scale")) params.guidance_scale = skyreels::server::kImageToVideoGuidanceScale;
  const int videos_per_prompt = args.get_int("num-videos-per-prompt", 1);
  if (videos_per_prompt < 1) throw UsageError("--num-videos-per-prompt must be at least 1");

  std::unique_ptr<model::TextEncoder> encoder;
  model::VideoConditioning conditioning;
  {
    model::Conditioning text;
    if (args.has("inputs")) {
      text = conditioning_from(args.get("inputs"));
    } else {
      model::TextEncoderOptions options;
      options.device = args.get("device", "cpu");
      encoder = model::TextEncoder::load(args.require("text-encoder"), args.get("tokenizer"), options);
      text = conditioning_from_text(*encoder, args, params, args.require("prompt"));
      encoder.reset();
    }
    conditioning.prompt_embeds = text.prompt_embeds;
    conditioning.negative_prompt_embeds = text.negative_prompt_embeds;
  }
  const Ranks ranks = ranks_from_flags(args);
  const auto noises = rank_noises(args, params, ranks);

  const RankModels models = load_for_ranks(args, model_path, kind, ranks);
  const auto& transformer = models.of(ranks, 0);
  params.adapters = skyreels::cli::adapters_from_flags(args, transformer);
  if (i2v) encode_i2v_images(args, params, transformer.config(), conditioning);
  video_step_cache_from_flags(args, transformer, calibrate, params);

  model::VideoHooks hooks;
  hooks.on_step = [](int64_t step, int64_t steps, const at::Tensor&) { spdlog::info("step {}/{}", step + 1, steps); };
  TransformerWork work;
  auto start = std::chrono::steady_clock::now();
  at::Tensor latents;
  on_every_rank(ranks, [&](int64_t rank, const model::RankGroups& groups) {
    model::VideoHooks mine = rank == 0 ? hooks : model::VideoHooks{};
    if (groups.reports_calls()) mine.on_call = [&work](const model::TransformerCallReport& call) { work.add(call); };
    const at::Tensor out = model::generate_video(models.of(ranks, rank), kind, params, conditioning,
                                                 *noises[static_cast<size_t>(rank)], videos_per_prompt, mine, &groups);
    if (rank == 0) latents = out;
  });
  work.in_call_order();
  spdlog::info("generated in {:.2f} s; {}", seconds_since(start), work.summary());
  if (args.has("cache-log")) write_cache_log(args.get("cache-log"), work.calls);
  if (calibrate) {
    const model::MagCacheRatios ratios = calibration_of(work, transformer, args, params);
    model::save_magcache_ratios(out_path, ratios);
    std::cout << out_path << ": MagCache ratios of " << ratios.num_inference_steps << " steps\n";
    return 0;
  }
  skyreels::safetensors::save(out_path, {{"latents", latents}}, {{"pipeline", model::pipeline_kind_name(kind)}});
  std::cout << out_path << ": latents " << latents.sizes() << " float32, pipeline " << model::pipeline_kind_name(kind)
            << "\n";
  return 0;
}

int run_generate(const std::vector<std::string>& argv) {
  const Args args(argv, skyreels::cli::with_generation_switches({"pin-image-prefix", "count-host-syncs", "shard-weights"}));
  args.reject_unknown(with_generation_flags({"model",
                                             "inputs",
                                             "out",
                                             "noise",
                                             "dtype",
                                             "device",
                                             "devices",
                                             "parallel",
                                             "shard-weights",
                                             "text-encoder",
                                             "tokenizer",
                                             "max-sequence-length",
                                             "vae",
                                             "pin-image-prefix",
                                             "cache-log",
                                             "kv-cache-bytes",
                                             "lora",
                                             "lora-dir",
                                             "adapter",
                                             "count-host-syncs",
                                             "pipeline",
                                             "num-videos-per-prompt",
                                             "image-encoder",
                                             "image-processor",
                                             "magcache-ratios",
                                             "previews"}));
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");
  const std::string model_path = args.require("model");
  if (args.has("inputs") == args.has("text-encoder")) {
    throw UsageError("give either --inputs (prompt embeddings) or --text-encoder with --prompt");
  }
  const std::string out_path = args.require("out");
  const model::PipelineKind kind = pipeline_from_flags(args, model_path);
  if (kind != model::PipelineKind::kDiffusionForcing) return run_video_pipeline(args, kind, model_path, out_path);
  for (const char* flag : {"num-videos-per-prompt", "image-encoder", "image-processor"}) {
    if (args.has(flag)) throw UsageError(std::string("--") + flag + " belongs to --pipeline t2v / i2v");
  }

  model::GenerationParams params = params_from_flags(args);
  if (args.has("kv-cache-bytes")) params.kv_cache_max_bytes = parse_bytes(args.get("kv-cache-bytes"));
  if (args.has("cache-log") && params.cache.kind == model::StepCacheKind::kNone) {
    throw UsageError("--cache-log needs a step cache (--cache first-block, first-block-per-block, taylorseer, magcache)");
  }
  std::unique_ptr<model::TextEncoder> encoder;
  if (args.has("text-encoder")) {
    model::TextEncoderOptions options;
    options.device = args.get("device", "cpu");
    encoder = model::TextEncoder::load(args.require("text-encoder"), args.get("tokenizer"), options);
  }
  std::function<model::Conditioning(const std::string&)> encode_text;
  if (encoder) {
    encode_text = [&](const std::string& text) { return conditioning_from_text(*encoder, args, params, text); };
  }
  model::Conditioning conditioning =
      args.has("inputs") ? conditioning_from(args.get("inputs")) : encode_text(args.require("prompt"));
  conditioning.prompt_changes = prompt_changes_from_flags(args, encode_text, conditioning_from);
  const model::PixelConditioning pixels = pixels_from_flags(args);
  model::describe_conditioning(pixels, conditioning.prompt_embeds.size(0), params);
  const Ranks ranks = ranks_from_flags(args);
  const auto noises = rank_noises(args, params, ranks);

  // With an explicit block size the request can be checked before a (possibly large) model is loaded.
  std::optional<model::ChunkPlan> plan;
  if (params.causal_block_size) plan = model::plan_chunks(params, *params.causal_block_size);

  encode_pixels(args, pixels, params, conditioning);

  const RankModels models = load_for_ranks(args, model_path, model::PipelineKind::kDiffusionForcing, ranks);
  const auto& transformer = models.of(ranks, 0);
  params.adapters = skyreels::cli::adapters_from_flags(args, transformer);
  df_step_cache_from_flags(args, transformer, params);

  // The same path the server takes: an explicit plan, then run_chunk per chunk.
  if (!plan) plan = model::plan_chunks(params, transformer.config().num_frame_per_block);
  spdlog::info("{} latent frames in {} chunk(s), causal block {}", plan->total_latent_frames, plan->chunks.size(),
               plan->causal_block_size);
  model::StepHooks hooks;
  hooks.on_step = [](int64_t chunk, int64_t row, int64_t rows) {
    spdlog::info("chunk {} row {}/{}", chunk, row + 1, rows);
  };
  if (args.has("previews")) {
    if (params.preview_every == 0) params.preview_every = 1;
    hooks.on_preview = preview_writer(args.get("previews"));
  }
  TransformerWork work;
  std::vector<std::pair<std::string, at::Tensor>> outputs;
  at::Tensor video;
  auto start = std::chrono::steady_clock::now();
  int64_t host_syncs = 0;
  bool syncs_counted = false;
  on_every_rank(ranks, [&](int64_t rank, const model::RankGroups& groups) {
    model::StepHooks mine = rank == 0 ? hooks : model::StepHooks{};
    if (groups.reports_calls()) mine.on_call = [&work](const model::TransformerCallReport& call) { work.add(call); };
    // Stock diffusers' request-scoped step cache lives across chunks: one cache for the whole loop then.
    const auto request_cache =
        params.cache.scope == model::StepCacheScope::kRequest ? model::make_denoise_cache() : nullptr;
    const model::SkyReelsV2Transformer& rank_model = models.of(ranks, rank);
    at::Tensor rank_video;
    for (const model::ChunkSpec& chunk : plan->chunks) {
      at::Tensor latents;
      {
        // Only the step loop: the chunk's latents are copied to the host below, outside the count.
        const model::HostSyncCounter syncs(rank == 0 && args.has("count-host-syncs") && rank_model.device().is_cuda());
        latents = model::run_chunk(rank_model, params, *plan, chunk.index, conditioning, rank_video,
                                   *noises[static_cast<size_t>(rank)], mine, request_cache, &groups);
        if (rank == 0) {
          host_syncs += syncs.count();
          syncs_counted = syncs.active();
        }
      }
      if (rank == 0) outputs.emplace_back("chunk" + std::to_string(chunk.index) + "_latents_end", latents.to(at::kCPU));
      rank_video = model::accumulate(rank_video, latents, chunk);
    }
    if (rank == 0) video = rank_video;
  });
  work.in_call_order();
  const int64_t transformer_calls = work.transformer_calls;
  spdlog::info("generated in {:.2f} s; {}", seconds_since(start), work.summary());
  if (args.has("count-host-syncs")) {
    if (syncs_counted) {
      std::cout << "host_syncs: " << host_syncs << " in " << transformer_calls << " transformer calls\n";
    } else {
      std::cout << "host_syncs: not counted (no CUDA device, or LibTorch's sync debug mode missed a known sync)\n";
    }
  }
  if (args.has("cache-log")) write_cache_log(args.get("cache-log"), work.calls);
  outputs.insert(outputs.begin(), {"latents", video.to(at::kCPU)});
  skyreels::safetensors::save(out_path, outputs);
  std::cout << out_path << ": latents " << video.sizes() << " float32, " << plan->chunks.size() << " chunk(s)\n";
  return 0;
}

const std::string kCalibrateUsage =
    "usage: skyreels calibrate-magcache --model DIR (--inputs IN.safetensors | --text-encoder DIR --prompt TEXT)\n"
    "                                   --out RATIOS.json [--pipeline t2v|i2v] [generation flags]\n\n"
    "MagCache's magnitude ratios of a checkpoint, as diffusers' MagCacheConfig(calibrate=True) records them: one\n"
    "uncached run of the t2v (default) or i2v pipeline at the given size and steps (--num-inference-steps,\n"
    "--height, --width, --num-frames, --flow-shift, --guidance-scale, --seed or --noise, as `generate` takes them);\n"
    "per step and guidance context mean(|r| / |r_prev|) of the block stack's residual r. The file names the model it\n"
    "was made on; the server reads it with --magcache-ratios FILE, `generate` with --cache magcache\n"
    "--magcache-ratios FILE (another step count resamples the ratios as diffusers does). Calibrate at the steps and\n"
    "shift you serve.\n";

int run_calibrate_magcache(const std::vector<std::string>& argv) {
  const Args args(argv, skyreels::cli::with_generation_switches({}));
  args.reject_unknown(with_generation_flags({"model", "inputs", "out", "noise", "dtype", "device", "text-encoder",
                                             "tokenizer", "max-sequence-length", "vae", "lora", "lora-dir", "adapter",
                                             "pipeline", "image-encoder", "image-processor"}));
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");
  const std::string model_path = args.require("model");
  if (args.has("inputs") == args.has("text-encoder")) {
    throw UsageError("give either --inputs (prompt embeddings) or --text-encoder with --prompt");
  }
  for (const char* flag : {"cache", "magcache-threshold", "magcache-max-skip-steps", "magcache-retention-ratio"}) {
    if (args.has(flag)) throw UsageError(std::string("--") + flag + ": calibration runs without skipping");
  }
  model::PipelineKind kind = pipeline_from_flags(args, model_path);
  if (kind == model::PipelineKind::kDiffusionForcing) {
    if (args.has("pipeline")) throw UsageError("--pipeline df: MagCache runs on the t2v and i2v pipelines");
    kind = model::PipelineKind::kTextToVideo;
  }
  return run_video_pipeline(args, kind, model_path, args.require("out"), true);
}

}  // namespace

SKYREELS_COMMAND("calibrate-magcache", "MagCache's magnitude ratios of a checkpoint (diffusers' calibrate=True)",
                 kCalibrateUsage, run_calibrate_magcache);

SKYREELS_COMMAND("generate", "generation of latents (diffusion forcing, text-to-video, image-to-video)", kUsage,
                 run_generate);
