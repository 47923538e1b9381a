// The SkyReels-V2 pipelines that are not diffusion forcing, as diffusers runs them with output_type="latent":
// SkyReelsV2Pipeline (text to video) and SkyReelsV2ImageToVideoPipeline (image to video, optionally ending on a last
// image). One timestep for every frame, the whole latent video through the sampler at once, classifier-free
// guidance; an I2V model reads 36 channels per frame: the noisy latents, a 4-channel frame mask and the VAE-encoded
// condition video, and attends to the image's CLIP tokens.
//
// Where diffusers is wrong this does the right thing: prompt and image embeddings are repeated for
// num_videos_per_prompt (diffusers repeats neither when they are passed in, and two prompts with two videos each
// raise), the image tokens never share the text's rows (see TransformerForwardArgs), and a model with an fps
// embedding gets the request's fps as the DF pipeline passes it (diffusers' T2V pipeline passes none and raises).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "model/diffusion_forcing.h"
#include "model/video_shape.h"

namespace skyreels::model {

class SkyReelsV2Transformer;
struct TransformerConfig;
struct RankGroups;
class WanVae;

// Which diffusers pipeline a request runs.
enum class PipelineKind {
  kDiffusionForcing,  // "df": SkyReelsV2DiffusionForcing{,ImageToVideo,VideoToVideo}Pipeline (diffusion_forcing.h)
  kTextToVideo,       // "t2v": SkyReelsV2Pipeline
  kImageToVideo,      // "i2v": SkyReelsV2ImageToVideoPipeline
};
const char* pipeline_kind_name(PipelineKind kind);  // "df", "t2v", "i2v"
// Throws std::invalid_argument naming `pipeline` on anything else.
PipelineKind pipeline_kind_from_name(const std::string& name);
// What a checkpoint runs unless told otherwise: a model with the image branch is I2V; any other (DF and T2V share
// the architecture) diffusion forcing.
PipelineKind default_pipeline(const TransformerConfig& config);
// Throws std::invalid_argument when `kind` cannot run on a model of `config` (T2V / DF on an I2V model, I2V on a
// model without the image branch), naming the pipeline and what the model lacks.
void check_pipeline_fits(PipelineKind kind, const TransformerConfig& config);

// diffusers' num_frames of the non-DF pipelines: when (num_frames - 1) is not a multiple of the VAE's temporal
// factor it is rounded down to num_frames // 4 * 4 + 1 (with a warning there); at least 1.
int64_t round_num_frames(int64_t num_frames, int64_t temporal_factor = kVaeTemporalFactor);

// The I2V pipeline's frame mask [1, 4, f, h, w] fp32 for num_frames pixel frames: 1 on pixel frame 0 (and on the
// last with a last image), frame 0 repeated 4 times so that each latent frame has 4 mask channels.
at::Tensor i2v_frame_mask(int64_t num_frames, int64_t latent_height, int64_t latent_width, bool last_image,
                          int64_t temporal_factor = kVaeTemporalFactor);

struct I2vCondition {
  at::Tensor condition;       // [1, 4 + z_dim, f, h, w] fp32 on the CPU: the frame mask, then the normalised latent
  at::Tensor posterior_mode;  // [1, z_dim, f, h, w] fp32: the VAE's mode before the normalisation (tests)
};

// diffusers' prepare_latents of the I2V pipeline, the condition half: the image (and the last image) placed at
// pixel frame 0 (and num_frames - 1) of a num_frames video of zeros in [-1, 1], VAE-encoded once (posterior mode),
// normalised with the VAE's latents mean / std, behind the frame mask. `image` / `last_image`: float [1, 3, H, W] in
// [0, 1] at the call's size (vae_image_preprocess); last_image may be undefined. Throws std::invalid_argument naming
// the field on bad shapes.
I2vCondition prepare_i2v_condition(const WanVae& vae, const at::Tensor& image, const at::Tensor& last_image,
                                   int64_t num_frames);

// Everything a T2V / I2V call is conditioned on, per prompt (before num_videos_per_prompt).
struct VideoConditioning {
  at::Tensor prompt_embeds;                          // [B, T, text_dim]
  std::optional<at::Tensor> negative_prompt_embeds;  // [B, T', text_dim], required when guidance_scale > 1
  // I2V only. image_tokens: [1 or B, N, image_dim], CLIP's penultimate hidden states of the image; a first-last-frame
  // model takes both images' tokens one after the other, N = 2n (prepare_image_tokens). condition: [1 or B, 20, f,
  // h, w] (prepare_i2v_condition).
  at::Tensor image_tokens;
  at::Tensor condition;
};

// The image tokens an I2V model attends to, from the CLIP tokens of the image [1, n, d] and, for a first-last-frame
// model, of the last image [1, n, d]: [1, n, d], or [1, 2n, d] (diffusers' encode_image([image, last_image]) viewed
// as its FLF2V embedder views it). Throws std::invalid_argument when a last image is given to a model without the
// position embedding or missing for one that has it (diffusers raises in both cases, at a shape).
at::Tensor prepare_image_tokens(const TransformerConfig& config, const at::Tensor& image_tokens,
                                const at::Tensor& last_image_tokens);

struct VideoHooks {
  std::function<void(int64_t step, int64_t steps, const at::Tensor& latents)> on_step;  // after each sampler step
  std::function<bool()> cancelled;  // polled before each step and after each transformer block
  // After each transformer call (chunk 0, row = step): its work and the step cache's decision.
  std::function<void(const TransformerCallReport&)> on_call;
};

// What generate_video checks of params.cache before its first step (std::invalid_argument naming the field): a kind
// this pipeline runs, TaylorSeer's modules and settings, MagCache's ratios and settings.
void check_video_step_cache(const SkyReelsV2Transformer& model, const StepCacheConfig& cache, int64_t steps);

// The whole T2V or I2V call: params.num_frames (rounded as diffusers rounds it), height, width, steps, guidance,
// flow_shift and the sampler (params.scheduler / sampler / timesteps), params.fps for a model with the fps
// embedding. The noise is `noise.latent_noise(0, [B * num_videos_per_prompt, 16, f, h, w])` (diffusers'
// prepare_latents draw). Returns the fp32 latents [B * num_videos_per_prompt, 16, f, h, w] on the CPU; video b * n + v
// is prompt b's v-th. Throws std::invalid_argument naming the field on a bad request, GenerationCancelled when
// hooks.cancelled turns true. params.cache: none, or diffusers' TaylorSeer / MagCache (one state per guidance
// context, as diffusers' cache_context("cond") / ("uncond")); MagCache needs params.cache.magcache.mag_ratios (any
// length, resampled to the steps as diffusers does) unless it calibrates. `ranks`: this rank's groups on a replica
// of several devices (as run_chunk's).
at::Tensor generate_video(const SkyReelsV2Transformer& model, PipelineKind kind, const GenerationParams& params,
                          const VideoConditioning& conditioning, NoiseSource& noise, int64_t num_videos_per_prompt = 1,
                          const VideoHooks& hooks = {}, const RankGroups* ranks = nullptr);

}  // namespace skyreels::model
