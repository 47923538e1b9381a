// A diffusers diffusion-forcing pipeline fixture (tests/data/golden/pipeline_df*, case.json + tensors) and the
// helpers that replay it: shared by the text-to-video and the image / video conditioning suites.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::test {

struct PipelineCase {
  std::string name;  // as the suite names it (for messages and its own lookups)
  std::string dir;   // the fixture folder
  // Where its weights, inputs.safetensors and condition.safetensors live: `dir`, or the golden case that case.json's
  // "base" names (tests/data/euler: the same models and inputs, another sampler).
  std::string base_dir;
  nlohmann::json json;
  model::GenerationParams params;  // the call's arguments (defaults in effect, then call_kwargs)
  int64_t model_block = 1;         // the transformer config's num_frame_per_block before the call
  model::Conditioning conditioning;
  std::vector<at::Tensor> noise;  // noise_000, noise_001, ... in draw order
  std::map<std::string, at::Tensor> inputs, trace, output;
};

PipelineCase load_pipeline_case(const std::string& name, const std::string& dir);

// condition.safetensors' condition_latents `all`, split as the pipeline splits them (image | last_image) into the
// case's conditioning.
void set_condition_latents(const at::Tensor& all, PipelineCase& c);
// An image or video case without the VAE: the pixels' description (image / last_image / video in its inputs) and the
// recorded condition latents of base_dir/condition.safetensors. Nothing for a text case.
void use_recorded_conditioning(PipelineCase& c);

// trace.safetensors' key of one denoising row, e.g. c1_r004_model_input.
std::string row_key(int64_t chunk, int64_t row, const char* what);

// The recorded transformer outputs, checking on the way that the loop feeds the model what diffusers fed it.
model::Denoiser trace_denoiser(const PipelineCase& c, int* calls);
model::DenoiserInfo fixture_info(const PipelineCase& c);

// Chunk after chunk through run_chunk, as the server runs them; checks each chunk's end latents within `atol`.
at::Tensor run_chunks(const PipelineCase& c, const model::Denoiser& denoiser, const model::DenoiserInfo& info,
                      model::NoiseSource& noise, double atol);

// A fixture's transformer (its weights/diffusers folder) on CPU in fp32, placed strictly.
std::unique_ptr<model::SkyReelsV2Transformer> load_fixture_transformer(const std::string& weights_dir);

// `skyreels generate` flags that make the fixture's call (model, prompts, every argument), without the noise source.
std::string generate_flags(const PipelineCase& c);
// Runs `skyreels generate <generate_flags(c)> <extra_flags>` and checks every tensor of output.safetensors within
// 1e-4; returns max |diff| of the latents (NaN when the command failed).
double expect_generate_matches(const PipelineCase& c, const std::string& extra_flags);

}  // namespace skyreels::test
