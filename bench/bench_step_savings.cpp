// Fewer transformer passes (issue 21): token-blocks and wall time of whole diffusion-forcing generations at DF-1.3B
// width (a few layers, random weights), uncached, with the exact savings, with exact savings + FirstBlockCache and
// with exact savings + the cache per causal block, each at several thresholds; max and mean |diff| of the final
// latents against the uncached run. "skips" counts calls FirstBlockCache skipped, or causal blocks the cache per
// block skipped.
//
//   bench_step_savings [--layers 4] [--height 64] [--width 64] [--steps 30] [--thresholds 0.05,0.1,0.2]
//                      [--block-thresholds 0.05,0.1,0.2] [--max-skips 3] [--settings async,sync,long] [--threads N]
//                      [--diffusers-src DIR]
//
// --diffusers-src: diffusers' own pipeline on the same weights, in the same run (bench/diffusers_pipeline_time.py
// with /usr/bin/python3 and Debian's python3-torch 1.13, scripts/diffusers_env.py), uncached and with its
// FirstBlockCache at the --thresholds; its uncached latents are compared with ours (same seed, same noise).
//
// Settings (the SkyReels-V2 README's, scaled down in space only): async = 97 frames (25 latent), ar_step 5,
// causal_block_size 5, one chunk; sync = the same frames with ar_step 0; long = 177 frames in chunks of 97 with
// overlap 17, async. Guidance 1 (one pass per row) so that each row is one transformer call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/random_transformer.h"
#include "model/diffusion_forcing.h"
#include "model/runtime.h"
#include "model/safetensors.h"
#include "model/transformer_skyreels_v2.h"

namespace {

using namespace skyreels::model;

struct Options {
  int64_t layers = 4, height = 64, width = 64, steps = 30;
  std::vector<double> thresholds{0.05, 0.1, 0.2}, block_thresholds{0.05, 0.1, 0.2};
  int64_t max_skips = 3;
  std::vector<std::string> settings{"async", "sync", "long"};
  int threads = 0;
  std::string diffusers_src;
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") o.layers = std::stoll(value);
    else if (flag == "--height") o.height = std::stoll(value);
    else if (flag == "--width") o.width = std::stoll(value);
    else if (flag == "--steps") o.steps = std::stoll(value);
    else if (flag == "--threads") o.threads = std::stoi(value);
    else if (flag == "--settings") o.settings = split(value);
    else if (flag == "--max-skips") o.max_skips = std::stoll(value);
    else if (flag == "--diffusers-src") o.diffusers_src = value;
    else if (flag == "--block-thresholds") {
      o.block_thresholds.clear();
      for (const auto& t : split(value)) o.block_thresholds.push_back(std::stod(t));
    }
    else if (flag == "--thresholds") {
      o.thresholds.clear();
      for (const auto& t : split(value)) o.thresholds.push_back(std::stod(t));
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return o;
}

GenerationParams setting(const std::string& name, const Options& o) {
  GenerationParams p;
  p.num_frames = name == "long" ? 177 : 97;
  p.base_num_frames = 97;
  if (name == "long") p.overlap_history = 17;
  p.height = o.height;
  p.width = o.width;
  p.num_inference_steps = o.steps;
  p.ar_step = name == "sync" ? 0 : 5;
  p.causal_block_size = 5;
  p.guidance_scale = 1.0;
  p.seed = 42;
  if (name != "async" && name != "sync" && name != "long") throw std::invalid_argument("--settings " + name);
  return p;
}

struct Result {
  at::Tensor latents;
  int64_t full = 0, computed = 0, calls = 0, skipped = 0;
  double seconds = 0;
};

Result generate_once(const SkyReelsV2Transformer& model, const GenerationParams& p, const Conditioning& c) {
  Result r;
  StepHooks hooks;
  hooks.on_call = [&r](const TransformerCallReport& call) {
    r.full += call.token_blocks_full;
    r.computed += call.token_blocks_computed;
    ++r.calls;
    if (call.blocks.empty()) {
      r.skipped += call.skipped ? 1 : 0;
    } else {
      for (const auto& b : call.blocks) r.skipped += b.skipped ? 1 : 0;
    }
  };
  auto noise = make_seeded_noise(*p.seed);
  const auto start = std::chrono::steady_clock::now();
  r.latents = generate(model, p, c, *noise, hooks);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

// diffusers' pipeline on the weights and prompt embeddings written to `dir` (see the header).
struct DiffusersRun {
  double seconds = 0;
  int64_t calls = 0, skipped = 0;
  at::Tensor latents;
};

void write_for_diffusers(const std::string& dir, const TransformerConfig& config,
                         const skyreels::checkpoint::StateDict& weights, const at::Tensor& prompt_embeds) {
  std::vector<std::pair<std::string, at::Tensor>> tensors(weights.begin(), weights.end());
  skyreels::safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tensors);
  std::ofstream(dir + "/config.json") << config.to_diffusers_json();
  skyreels::safetensors::save(dir + "/embeds.safetensors", {{"prompt_embeds", prompt_embeds}});
}

DiffusersRun run_diffusers(const Options& o, const std::string& dir, const GenerationParams& p,
                           std::optional<double> fbc_threshold) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << SKYREELS_DIFFUSERS_TIMER << " --diffusers-src '" << o.diffusers_src << "' --weights "
      << dir << " --embeds " << dir << "/embeds.safetensors --num-frames " << p.num_frames << " --base-num-frames "
      << p.base_num_frames << " --ar-step " << p.ar_step << " --causal-block-size " << *p.causal_block_size
      << " --steps " << p.num_inference_steps << " --height " << p.height << " --width " << p.width << " --seed "
      << *p.seed << " --threads " << at::get_num_threads() << " --out " << dir << "/latents.safetensors";
  if (p.overlap_history) cmd << " --overlap-history " << *p.overlap_history;
  if (fbc_threshold) cmd << " --fbc-threshold " << *fbc_threshold;
  const auto json = nlohmann::json::parse(skyreels::bench::diffusers_timer_json(cmd.str(), dir));
  DiffusersRun r;
  r.seconds = json.at("seconds").get<double>();
  r.calls = json.at("calls").get<int64_t>();
  r.skipped = json.at("skipped").get<int64_t>();
  r.latents = skyreels::safetensors::load_all(dir + "/latents.safetensors").at("latents");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  const Options o = parse(argc, argv);
  if (!o.diffusers_src.empty()) skyreels::bench::check_diffusers_timer(SKYREELS_DIFFUSERS_TIMER);
  if (o.threads > 0) skyreels::runtime::configure_threads(o.threads);
  TransformerConfig config = TransformerConfig::df_1_3b();
  config.num_layers = o.layers;
  skyreels::checkpoint::StateDict weights = skyreels::bench::random_weights(config, at::kFloat);
  at::manual_seed(1);
  Conditioning conditioning;
  conditioning.prompt_embeds = at::randn({1, 64, config.text_dim}) * 0.1;
  std::string diffusers_dir;
  if (!o.diffusers_src.empty()) {
    char pattern[] = "/tmp/bench_step_savings.XXXXXX";
    if (mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
    diffusers_dir = pattern;
    write_for_diffusers(diffusers_dir, config, weights, conditioning.prompt_embeds);
  }
  const SkyReelsV2Transformer model(config, std::move(weights), at::kCPU, at::kFloat);

  std::printf("DF-1.3B width, %lld layers, fp32, %lldx%lld pixels, %lld steps, %d threads\n\n",
              static_cast<long long>(o.layers), static_cast<long long>(o.height), static_cast<long long>(o.width),
              static_cast<long long>(o.steps), at::get_num_threads());
  std::printf("| setting | mode | calls | skips | token-blocks computed | saved | wall s | x uncached | max |diff| | "
              "mean |diff| |\n|---|---|---|---|---|---|---|---|---|---|\n");
  {  // warm-up: first allocations and kernel selection out of the timings
    GenerationParams warm = setting("async", o);
    warm.num_inference_steps = 2;
    generate_once(model, warm, conditioning);
  }
  for (const std::string& name : o.settings) {
    const GenerationParams base = setting(name, o);
    GenerationParams uncached = base;
    uncached.exact_savings = false;
    const Result reference = generate_once(model, uncached, conditioning);
    std::vector<std::pair<std::string, GenerationParams>> modes{{"uncached", uncached}, {"exact", base}};
    for (double t : o.thresholds) {
      GenerationParams cached = base;
      cached.cache.kind = StepCacheKind::kFirstBlock;
      cached.cache.threshold = t;
      char label[48];
      std::snprintf(label, sizeof(label), "exact + first-block %.3g", t);
      modes.emplace_back(label, cached);
    }
    for (double t : o.block_thresholds) {
      GenerationParams cached = base;
      cached.cache.kind = StepCacheKind::kFirstBlockPerBlock;
      cached.cache.threshold = t;
      cached.cache.max_skips = o.max_skips;
      char label[64];
      std::snprintf(label, sizeof(label), "exact + per-block %.3g (K %lld)", t, static_cast<long long>(o.max_skips));
      modes.emplace_back(label, cached);
    }
    for (const auto& [label, params] : modes) {
      const Result r = label == "uncached" ? reference : generate_once(model, params, conditioning);
      const at::Tensor diff = (r.latents - reference.latents).abs();
      std::printf("| %s | %s | %lld | %lld | %lld | %.1f %% | %.2f | %.2f | %.3g | %.3g |\n", name.c_str(),
                  label.c_str(), static_cast<long long>(r.calls), static_cast<long long>(r.skipped),
                  static_cast<long long>(r.computed), 100.0 * static_cast<double>(r.full - r.computed) / r.full,
                  r.seconds, r.seconds / reference.seconds, diff.max().item<double>(), diff.mean().item<double>());
      std::fflush(stdout);
    }
    if (diffusers_dir.empty()) continue;
    std::vector<std::optional<double>> fbc{std::nullopt};
    for (double t : o.thresholds) fbc.emplace_back(t);
    for (const auto& t : fbc) {
      const DiffusersRun d = run_diffusers(o, diffusers_dir, base, t);
      const at::Tensor diff = (d.latents.to(at::kFloat) - reference.latents).abs();
      char label[64];
      std::snprintf(label, sizeof(label), t ? "diffusers + first-block %.3g" : "diffusers uncached", t ? *t : 0.0);
      // x uncached: ours uncached over diffusers' time; |diff|: diffusers' latents against ours uncached.
      std::printf("| %s | %s | %lld | %lld | - | - | %.2f | %.2f | %.3g | %.3g |\n", name.c_str(), label,
                  static_cast<long long>(d.calls), static_cast<long long>(d.skipped), d.seconds,
                  reference.seconds / d.seconds, diff.max().item<double>(), diff.mean().item<double>());
      std::fflush(stdout);
    }
  }
  if (!diffusers_dir.empty()) std::filesystem::remove_all(diffusers_dir);
  return 0;
}
