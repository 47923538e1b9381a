// Four passes instead of sixty (issue 32): wall time and transformer passes per video of whole diffusion-forcing
// generations at DF-1.3B width (a few layers, random weights, fp32) for
//   (a) UniPC, 30 steps, guidance 6 (two passes per row: prompt and negative prompt), flow_shift 8;
//   (b) Euler, the timestep list 1000,750,500,250 (LightX2V's 4 steps), flow_shift 5, no guidance (one pass per row);
// sync and async, ours and, with --diffusers-src, diffusers' own pipeline on the same weights in the same run
// (bench/diffusers_pipeline_time.py: its UniPC, and its FlowMatchEulerDiscreteScheduler with the DF pipeline's int64
// timestep passed as a float), with max |diff| of its latents against ours (same seed, same noise).
//
//   bench_samplers [--layers 4] [--height 64] [--width 64] [--settings sync,async] [--threads N]
//                  [--diffusers-src DIR]
//
// Settings (the SkyReels-V2 README's, scaled down in space only): 97 frames (25 latent), causal_block_size 5, one
// chunk; sync = ar_step 0, async = ar_step 5. Random weights: the speed is the point, not the video.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
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
  int64_t layers = 4, height = 64, width = 64;
  std::vector<std::string> settings{"sync", "async"};
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
    else if (flag == "--threads") o.threads = std::stoi(value);
    else if (flag == "--settings") o.settings = split(value);
    else if (flag == "--diffusers-src") o.diffusers_src = value;
    else throw std::invalid_argument("unknown flag " + flag);
  }
  return o;
}

struct Mode {
  std::string label;
  SamplerKind sampler;
  int64_t steps;
  double guidance, shift;
  std::vector<int64_t> timesteps;
};

const std::vector<Mode> kModes = {
    {"UniPC 30 steps, guidance 6", SamplerKind::kUniPC, 30, 6.0, 8.0, {}},
    {"Euler 1000,750,500,250, no guidance", SamplerKind::kEuler, 4, 1.0, 5.0, {1000, 750, 500, 250}},
};

GenerationParams params_of(const std::string& setting, const Mode& m, const Options& o) {
  if (setting != "sync" && setting != "async") throw std::invalid_argument("--settings " + setting);
  GenerationParams p;
  p.num_frames = 97;
  p.base_num_frames = 97;
  p.height = o.height;
  p.width = o.width;
  p.ar_step = setting == "sync" ? 0 : 5;
  p.causal_block_size = 5;
  p.seed = 42;
  p.sampler = m.sampler;
  p.num_inference_steps = m.steps;
  p.guidance_scale = m.guidance;
  p.flow_shift = m.shift;
  p.timesteps = m.timesteps;
  return p;
}

struct Result {
  at::Tensor latents;
  int64_t calls = 0;
  double seconds = 0;
};

Result generate_once(const SkyReelsV2Transformer& model, const GenerationParams& p, const Conditioning& c) {
  Result r;
  StepHooks hooks;
  hooks.on_call = [&r](const TransformerCallReport&) { ++r.calls; };
  auto noise = make_seeded_noise(*p.seed);
  const auto start = std::chrono::steady_clock::now();
  r.latents = generate(model, p, c, *noise, hooks);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

Result run_diffusers(const Options& o, const std::string& dir, const GenerationParams& p) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << SKYREELS_DIFFUSERS_TIMER << " --diffusers-src '" << o.diffusers_src << "' --weights "
      << dir << " --embeds " << dir << "/embeds.safetensors --num-frames " << p.num_frames << " --base-num-frames "
      << p.base_num_frames << " --ar-step " << p.ar_step << " --causal-block-size " << *p.causal_block_size
      << " --steps " << p.num_inference_steps << " --height " << p.height << " --width " << p.width << " --seed "
      << *p.seed << " --threads " << at::get_num_threads() << " --guidance-scale " << p.guidance_scale
      << " --flow-shift " << p.flow_shift << " --sampler " << (p.sampler == SamplerKind::kEuler ? "euler" : "unipc")
      << " --out " << dir << "/latents.safetensors";
  for (size_t i = 0; i < p.timesteps.size(); ++i) cmd << (i == 0 ? " --timesteps " : ",") << p.timesteps[i];
  const auto json = nlohmann::json::parse(skyreels::bench::diffusers_timer_json(cmd.str(), dir));
  Result r;
  r.seconds = json.at("seconds").get<double>();
  r.calls = json.at("calls").get<int64_t>();
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
  conditioning.negative_prompt_embeds = at::randn({1, 64, config.text_dim}) * 0.1;
  std::string dir;
  if (!o.diffusers_src.empty()) {
    char pattern[] = "/tmp/bench_samplers.XXXXXX";
    if (mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir = pattern;
    std::vector<std::pair<std::string, at::Tensor>> tensors(weights.begin(), weights.end());
    skyreels::safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tensors);
    std::ofstream(dir + "/config.json") << config.to_diffusers_json();
    skyreels::safetensors::save(dir + "/embeds.safetensors",
                                {{"prompt_embeds", conditioning.prompt_embeds},
                                 {"negative_prompt_embeds", *conditioning.negative_prompt_embeds}});
  }
  const SkyReelsV2Transformer model(config, std::move(weights), at::kCPU, at::kFloat);

  std::printf("DF-1.3B width, %lld layers, fp32, %lldx%lld pixels, 97 frames (25 latent), causal_block_size 5, "
              "%d threads\n\n",
              static_cast<long long>(o.layers), static_cast<long long>(o.height), static_cast<long long>(o.width),
              at::get_num_threads());
  std::printf("| setting | sampler | who | transformer passes | wall s | x (a) | max |diff| vs ours |\n"
              "|---|---|---|---|---|---|---|\n");
  {  // warm-up: first allocations and kernel selection out of the timings
    GenerationParams warm = params_of("async", kModes[1], o);
    generate_once(model, warm, conditioning);
  }
  for (const std::string& setting : o.settings) {
    double ours_a = 0, theirs_a = 0;
    for (size_t m = 0; m < kModes.size(); ++m) {
      const GenerationParams p = params_of(setting, kModes[m], o);
      const Result ours = generate_once(model, p, conditioning);
      if (m == 0) ours_a = ours.seconds;
      std::printf("| %s | %s | ours | %lld | %.2f | %.2f | - |\n", setting.c_str(), kModes[m].label.c_str(),
                  static_cast<long long>(ours.calls), ours.seconds, ours_a / ours.seconds);
      std::fflush(stdout);
      if (dir.empty()) continue;
      const Result theirs = run_diffusers(o, dir, p);
      if (m == 0) theirs_a = theirs.seconds;
      const double diff = (theirs.latents.to(at::kFloat) - ours.latents).abs().max().item<double>();
      std::printf("| %s | %s | diffusers | %lld | %.2f | %.2f | %.3g |\n", setting.c_str(), kModes[m].label.c_str(),
                  static_cast<long long>(theirs.calls), theirs.seconds, theirs_a / theirs.seconds, diff);
      std::fflush(stdout);
    }
  }
  if (!dir.empty()) std::filesystem::remove_all(dir);
  return 0;
}
