#include "tests/pipeline_case.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "model/checkpoint.h"
#include "model/pixel_conditioning.h"
#include "model/transformer_loader.h"
#include "tests/test_util.h"

namespace skyreels::test {

using Json = nlohmann::json;

namespace {

model::GenerationParams call_params(const Json& case_json, const std::string& dir) {
  Json kwargs = case_json.at("call_defaults_in_effect");
  for (const auto& item : case_json.at("call_kwargs").items()) kwargs[item.key()] = item.value();
  const auto given = [&](const char* key) { return kwargs.contains(key) && !kwargs.at(key).is_null(); };
  model::GenerationParams p;
  p.num_frames = kwargs.at("num_frames").get<int64_t>();
  p.height = kwargs.at("height").get<int64_t>();
  p.width = kwargs.at("width").get<int64_t>();
  p.num_inference_steps = kwargs.at("num_inference_steps").get<int64_t>();
  p.guidance_scale = kwargs.at("guidance_scale").get<double>();
  p.fps = kwargs.at("fps").get<int64_t>();
  if (given("base_num_frames")) p.base_num_frames = kwargs.at("base_num_frames").get<int64_t>();
  if (given("ar_step")) p.ar_step = kwargs.at("ar_step").get<int64_t>();
  if (given("addnoise_condition")) p.addnoise_condition = kwargs.at("addnoise_condition").get<double>();
  if (given("overlap_history")) p.overlap_history = kwargs.at("overlap_history").get<int64_t>();
  if (given("causal_block_size")) p.causal_block_size = kwargs.at("causal_block_size").get<int64_t>();
  const std::string generator = kwargs.at("generator").get<std::string>();  // "torch.Generator().manual_seed(N)"
  p.seed = std::stoull(generator.substr(generator.find("manual_seed(") + 12));
  if (case_json.contains("sampler")) {  // tests/data/euler: diffusers' FlowMatchEulerDiscreteScheduler
    const Json& sampler = case_json.at("sampler");
    if (sampler.at("type").get<std::string>() != "euler") throw std::runtime_error("unknown sampler in case");
    p.sampler = model::SamplerKind::kEuler;
    p.flow_shift = sampler.at("shift").get<double>();
    p.scheduler.num_train_timesteps = sampler.at("num_train_timesteps").get<int64_t>();
    if (!sampler.at("timesteps").is_null()) p.timesteps = sampler.at("timesteps").get<std::vector<int64_t>>();
  } else {
    p.scheduler = model::FlowUniPCConfig::from_file(dir + "/scheduler/scheduler_config.json");
    p.flow_shift = p.scheduler.flow_shift;
  }
  if (case_json.contains("cache")) {  // pipeline_df_cache: diffusers' FirstBlockCache was on
    const Json& cache = case_json.at("cache");
    if (cache.at("kind").get<std::string>() != "first_block") throw std::runtime_error("unknown cache kind in case");
    p.cache.kind = model::StepCacheKind::kFirstBlock;
    p.cache.threshold = cache.at("threshold").get<double>();
    p.cache.scope =
        cache.at("scope").get<std::string>() == "request" ? model::StepCacheScope::kRequest : model::StepCacheScope::kChunk;
  }
  return p;
}

}  // namespace

PipelineCase load_pipeline_case(const std::string& name, const std::string& dir) {
  PipelineCase c;
  c.name = name;
  c.dir = dir;
  c.json = Json::parse(std::ifstream(dir + "/case.json"));
  c.base_dir = c.json.contains("base") ? dir + "/" + c.json.at("base").get<std::string>() : dir;
  c.params = call_params(c.json, dir);
  c.model_block = c.json.at("transformer_config_before_call").at("num_frame_per_block").get<int64_t>();
  c.inputs = load_tensors(c.base_dir + "/inputs.safetensors");
  c.conditioning.prompt_embeds = c.inputs.at("prompt_embeds");
  if (c.inputs.count("negative_prompt_embeds")) {
    c.conditioning.negative_prompt_embeds = c.inputs.at("negative_prompt_embeds");
  }
  const auto noise = load_tensors(dir + "/noise.safetensors");
  for (const auto& draw : c.json.at("noise_draws_in_order")) c.noise.push_back(noise.at(draw.at("name")));
  if (std::ifstream(dir + "/trace.safetensors")) c.trace = load_tensors(dir + "/trace.safetensors");
  c.output = load_tensors(dir + "/output.safetensors");
  return c;
}

std::unique_ptr<model::SkyReelsV2Transformer> load_fixture_transformer(const std::string& dir) {
  using namespace model;
  TransformerConfig config = parse_transformer_config(dir + "/config.json").config;
  const auto source = checkpoint::Source::open(dir);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& key : source.keys()) tensors[key] = source.tensor(key);
  auto weights = checkpoint::place_strict(tensors, transformer_parameter_specs(config), {}, dir);
  return std::make_unique<SkyReelsV2Transformer>(std::move(config), std::move(weights), c10::Device(c10::kCPU),
                                                 at::kFloat);
}

void set_condition_latents(const at::Tensor& all, PipelineCase& c) {
  if (c.params.last_image) {
    const int64_t half = all.size(0) / 2;
    c.conditioning.prefix_latents = all.narrow(0, 0, half);
    c.conditioning.last_image_latents = all.narrow(0, half, half);
  } else {
    c.conditioning.prefix_latents = all;
  }
}

void use_recorded_conditioning(PipelineCase& c) {
  model::PixelConditioning pixels;
  if (c.inputs.count("image")) pixels.image = c.inputs.at("image");
  if (c.inputs.count("last_image")) pixels.last_image = c.inputs.at("last_image");
  if (c.inputs.count("video")) pixels.video = c.inputs.at("video");
  if (!pixels.image.defined() && !pixels.video.defined()) return;
  model::describe_conditioning(pixels, c.conditioning.prompt_embeds.size(0), c.params);
  set_condition_latents(load_tensors(c.base_dir + "/condition.safetensors").at("condition_latents"), c);
}

std::string row_key(int64_t chunk, int64_t row, const char* what) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "c%lld_r%03lld_%s", static_cast<long long>(chunk), static_cast<long long>(row), what);
  return buf;
}

model::Denoiser trace_denoiser(const PipelineCase& c, int* calls) {
  return [&c, calls](const model::DenoiseCall& call) {
    ++*calls;
    EXPECT_TRUE(all_close(call.latent_model_input, c.trace.at(row_key(call.chunk, call.row, "model_input")), 1e-6))
        << "model input of chunk " << call.chunk << " row " << call.row;
    EXPECT_TRUE(at::equal(call.timestep, c.trace.at(row_key(call.chunk, call.row, "model_timestep"))))
        << "timestep of chunk " << call.chunk << " row " << call.row;
    return c.trace.at(row_key(call.chunk, call.row, call.unconditional ? "noise_pred_uncond" : "noise_pred_cond"));
  };
}

model::DenoiserInfo fixture_info(const PipelineCase& c) {
  model::DenoiserInfo info;
  info.num_frame_per_block = c.model_block;
  return info;
}

at::Tensor run_chunks(const PipelineCase& c, const model::Denoiser& denoiser, const model::DenoiserInfo& info,
                      model::NoiseSource& noise, double atol) {
  const model::ChunkPlan plan = model::plan_chunks(c.params, info.num_frame_per_block);
  at::Tensor video;
  for (const model::ChunkSpec& chunk : plan.chunks) {
    const at::Tensor latents =
        model::run_chunk(denoiser, info, c.params, plan, chunk.index, c.conditioning, video, noise);
    EXPECT_TRUE(all_close(latents, c.output.at("chunk" + std::to_string(chunk.index) + "_latents_end"), atol))
        << c.name << " chunk " << chunk.index;
    video = model::accumulate(video, latents, chunk);
  }
  return video;
}

std::string generate_flags(const PipelineCase& c) {
  const model::GenerationParams& p = c.params;
  std::ostringstream os;
  os << " --model " << c.base_dir << "/weights/diffusers --inputs " << c.base_dir << "/inputs.safetensors --num-frames "
     << p.num_frames << " --height " << p.height << " --width " << p.width << " --guidance-scale "
     << p.guidance_scale << " --base-num-frames " << p.base_num_frames << " --ar-step " << p.ar_step
     << " --addnoise-condition " << p.addnoise_condition;
  if (p.sampler == model::SamplerKind::kEuler) {
    os << " --sampler euler --flow-shift " << p.flow_shift;
    if (p.timesteps.empty()) os << " --num-inference-steps " << p.num_inference_steps;
    for (size_t i = 0; i < p.timesteps.size(); ++i) os << (i == 0 ? " --timesteps " : ",") << p.timesteps[i];
  } else {
    os << " --num-inference-steps " << p.num_inference_steps << " --scheduler-config " << c.dir
       << "/scheduler/scheduler_config.json";
  }
  if (p.overlap_history) os << " --overlap-history " << *p.overlap_history;
  if (p.causal_block_size) os << " --causal-block-size " << *p.causal_block_size;
  return os.str();
}

double expect_generate_matches(const PipelineCase& c, const std::string& extra_flags) {
  const std::string out = temp_dir("generate") + "/out.safetensors";
  std::string log;
  const int status =
      run_command(bin_path("skyreels") + " generate" + generate_flags(c) + extra_flags + " --out " + out, &log);
  EXPECT_EQ(status, 0) << log;
  if (status != 0) return std::numeric_limits<double>::quiet_NaN();
  const auto produced = load_tensors(out);
  for (const auto& [name, expected] : c.output) {
    if (!produced.count(name)) {
      ADD_FAILURE() << "skyreels generate wrote no " << name;
      continue;
    }
    EXPECT_TRUE(all_close(produced.at(name), expected, 1e-4)) << name;
  }
  return produced.count("latents") ? max_abs_diff(produced.at("latents"), c.output.at("latents"))
                                   : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace skyreels::test
