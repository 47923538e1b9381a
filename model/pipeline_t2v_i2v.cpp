#include "model/pipeline_t2v_i2v.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <spdlog/spdlog.h>

#include <sstream>
#include <stdexcept>

#include "model/guidance.h"
#include "model/guided_prediction.h"
#include "model/rank_group.h"
#include "model/shape_text.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"

namespace skyreels::model {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

constexpr int64_t kLatentChannels = 16;

}  // namespace

const char* pipeline_kind_name(PipelineKind kind) {
  switch (kind) {
    case PipelineKind::kDiffusionForcing:
      return "df";
    case PipelineKind::kTextToVideo:
      return "t2v";
    case PipelineKind::kImageToVideo:
      return "i2v";
  }
  return "?";
}

PipelineKind pipeline_kind_from_name(const std::string& name) {
  if (name == "df") return PipelineKind::kDiffusionForcing;
  if (name == "t2v") return PipelineKind::kTextToVideo;
  if (name == "i2v") return PipelineKind::kImageToVideo;
  throw std::invalid_argument("pipeline: '" + name + "' is not one of df, t2v, i2v");
}

PipelineKind default_pipeline(const TransformerConfig& config) {
  return config.has_image_branch() ? PipelineKind::kImageToVideo : PipelineKind::kDiffusionForcing;
}

void check_pipeline_fits(PipelineKind kind, const TransformerConfig& config) {
  const std::string name = pipeline_kind_name(kind);
  if (kind == PipelineKind::kImageToVideo) {
    require(config.has_image_branch(),
            "pipeline i2v: this checkpoint has no image branch (image_dim); it is a text-to-video / diffusion-forcing "
            "model, use --pipeline t2v or df");
    require(config.in_channels == 2 * kLatentChannels + 4,
            "pipeline i2v: the model takes " + std::to_string(config.in_channels) +
                " input channels; the I2V pipeline feeds 36 (16 latent + 4 mask + 16 condition)");
    return;
  }
  require(!config.has_image_branch(), "pipeline " + name +
                                          ": this checkpoint is an image-to-video model (image branch, " +
                                          std::to_string(config.in_channels) + " input channels); use --pipeline i2v");
  require(config.in_channels == kLatentChannels, "pipeline " + name + ": the model takes " +
                                                     std::to_string(config.in_channels) +
                                                     " input channels; the pipeline feeds 16");
}

int64_t round_num_frames(int64_t num_frames, int64_t temporal_factor) {
  if (num_frames % temporal_factor != 1) {
    const int64_t rounded = std::max<int64_t>(num_frames / temporal_factor * temporal_factor + 1, 1);
    spdlog::warn("num_frames {}: (num_frames - 1) must be a multiple of {}; using {} as diffusers rounds it",
                 num_frames, temporal_factor, rounded);
    return rounded;
  }
  return std::max<int64_t>(num_frames, 1);
}

at::Tensor i2v_frame_mask(int64_t num_frames, int64_t latent_height, int64_t latent_width, bool last_image,
                          int64_t temporal_factor) {
  // Per pixel frame: 1 where a given image sits. Frame 0 is repeated temporal_factor times so that the
  // 1 + 4 (f - 1) frames fill f latent frames of 4 channels each.
  at::Tensor per_frame = at::zeros({num_frames}, at::kFloat);
  per_frame[0] = 1.0;
  if (last_image) per_frame[num_frames - 1] = 1.0;
  const at::Tensor padded = at::cat({per_frame.narrow(0, 0, 1).expand({temporal_factor - 1}), per_frame});
  const int64_t latent_frames = padded.size(0) / temporal_factor;
  return padded.view({1, latent_frames, temporal_factor, 1, 1})
      .transpose(1, 2)
      .expand({1, temporal_factor, latent_frames, latent_height, latent_width})
      .contiguous();
}

I2vCondition prepare_i2v_condition(const WanVae& vae, const at::Tensor& image, const at::Tensor& last_image,
                                   int64_t num_frames) {
  auto check = [](const at::Tensor& t, const std::string& field) {
    require(t.dim() == 4 && t.size(0) == 1 && t.size(1) == 3 && at::isFloatingType(t.scalar_type()),
            field + ": expected float [1, 3, H, W] pixels in [0, 1], got " + shape_text(t.sizes()));
  };
  check(image, "image");
  const int64_t height = image.size(2), width = image.size(3);
  if (last_image.defined()) {
    check(last_image, "last_image");
    require(last_image.size(2) == height && last_image.size(3) == width,
            "last_image: " + shape_text(last_image.sizes()) + " differs from the image's size");
  }
  require(num_frames >= (last_image.defined() ? 2 : 1) && is_4k_plus_1(num_frames),
          "num_frames: " + std::to_string(num_frames) + " must be 4k + 1 (and at least 2 with a last image)");
  // [image, zeros, ..., (last_image)] in [-1, 1]: the zeros are mid-grey frames, encoded like the rest.
  at::Tensor video = at::zeros({1, 3, num_frames, height, width}, at::kFloat);
  video.select(2, 0).copy_(image.to(at::kFloat) * 2 - 1);
  if (last_image.defined()) video.select(2, num_frames - 1).copy_(last_image.to(at::kFloat) * 2 - 1);
  I2vCondition out;
  out.posterior_mode = vae.encode(video.to(vae.device(), vae.dtype())).mode().to(at::kCPU, at::kFloat);
  const at::Tensor latent = vae.normalize(out.posterior_mode).to(at::kCPU, at::kFloat);
  const at::Tensor mask = i2v_frame_mask(num_frames, latent.size(3), latent.size(4), last_image.defined());
  out.condition = at::cat({mask, latent}, 1);
  return out;
}

at::Tensor prepare_image_tokens(const TransformerConfig& config, const at::Tensor& image_tokens,
                                const at::Tensor& last_image_tokens) {
  require(image_tokens.defined() && image_tokens.dim() == 3 && image_tokens.size(0) == 1,
          "image_tokens: expected the image's CLIP tokens [1, n, d]" +
              (image_tokens.defined() ? ", got " + shape_text(image_tokens.sizes()) : std::string()));
  if (!config.pos_embed_seq_len) {
    require(!last_image_tokens.defined(),
            "last_image: this I2V model has no first-last-frame position embedding (pos_embed_seq_len); a last image "
            "needs a first-last-frame (FLF2V) checkpoint");
    return image_tokens;
  }
  require(last_image_tokens.defined(), "last_image: this first-last-frame model (pos_embed_seq_len " +
                                           std::to_string(*config.pos_embed_seq_len) + ") needs a last image");
  require(last_image_tokens.sizes() == image_tokens.sizes(),
          "last_image: its tokens " + shape_text(last_image_tokens.sizes()) + " differ from the image's " +
              shape_text(image_tokens.sizes()));
  return at::cat({image_tokens, last_image_tokens}, 1);
}

namespace {

// [1 or B, ...] -> [B * n, ...], each prompt's row repeated for its n videos (diffusers' repeat + view of the embeds
// it computes itself).
at::Tensor per_video(const at::Tensor& t, int64_t prompts, int64_t videos_per_prompt, const std::string& field) {
  require(t.size(0) == 1 || t.size(0) == prompts,
          field + ": batch " + std::to_string(t.size(0)) + " must be 1 or the prompts' " + std::to_string(prompts));
  if (t.size(0) == 1) {
    std::vector<int64_t> shape = t.sizes().vec();
    shape[0] = prompts * videos_per_prompt;
    return t.expand(shape).contiguous();
  }
  return t.repeat_interleave(videos_per_prompt, 0);
}

struct VideoGeometry {
  int64_t batch = 0, frames = 0, latent_frames = 0, latent_height = 0, latent_width = 0;
};

VideoGeometry check_request(const SkyReelsV2Transformer& model, PipelineKind kind, const GenerationParams& p,
                            const VideoConditioning& c, int64_t videos_per_prompt) {
  require(kind != PipelineKind::kDiffusionForcing, "pipeline: generate_video runs t2v or i2v (df: run_chunk)");
  check_pipeline_fits(kind, model.config());
  require(p.height > 0 && p.width > 0 && p.height % kPixelMultiple == 0 && p.width % kPixelMultiple == 0,
          "height/width: " + std::to_string(p.height) + "x" + std::to_string(p.width) +
              " must be positive multiples of " + std::to_string(kPixelMultiple));
  require(p.num_frames >= 1, "num_frames: must be >= 1");
  require(p.num_inference_steps >= 1, "num_inference_steps: must be >= 1");
  require(videos_per_prompt >= 1, "num_videos_per_prompt: must be >= 1");
  require(c.prompt_embeds.defined() && c.prompt_embeds.dim() == 3 && c.prompt_embeds.size(0) >= 1,
          "prompt_embeds: expected [B, T, text_dim]");
  const int64_t prompts = c.prompt_embeds.size(0);
  if (guided(p.guidance_scale)) {
    require(c.negative_prompt_embeds.has_value() && c.negative_prompt_embeds->defined(),
            "negative_prompt_embeds: required when guidance_scale > 1 (classifier-free guidance)");
    require(c.negative_prompt_embeds->size(0) == prompts, "negative_prompt_embeds: batch " +
                                                              std::to_string(c.negative_prompt_embeds->size(0)) +
                                                              " differs from the prompts' " + std::to_string(prompts));
  }
  VideoGeometry g;
  g.batch = prompts * videos_per_prompt;
  g.frames = round_num_frames(p.num_frames);
  g.latent_frames = latent_frames_of(g.frames);
  g.latent_height = latent_size_of(p.height);
  g.latent_width = latent_size_of(p.width);
  if (kind == PipelineKind::kImageToVideo) {
    require(c.image_tokens.defined(), "image: the i2v pipeline needs an image (its CLIP tokens)");
    require(c.condition.defined() && c.condition.dim() == 5,
            "image: the i2v pipeline needs the image's VAE condition [1, 20, f, h, w]");
    const std::vector<int64_t> want{4 + kLatentChannels, g.latent_frames, g.latent_height, g.latent_width};
    require(c.condition.sizes().slice(1).vec() == want,
            "image: the condition " + shape_text(c.condition.sizes()) + " was not made for " +
                std::to_string(g.frames) + " frames of " + std::to_string(p.width) + "x" + std::to_string(p.height));
  } else {
    require(!c.image_tokens.defined() && !c.condition.defined(), "image: the t2v pipeline takes no image");
  }
  return g;
}

// The step cache of a T2V / I2V call: diffusers' TaylorSeer or MagCache on the transformer, one state per guidance
// context; with none, plain forwards.
class VideoStepCache {
 public:
  VideoStepCache(const SkyReelsV2Transformer& model, const StepCacheConfig& cache, int64_t steps)
      : kind_(cache.kind), taylorseer_(cache.taylorseer), magcache_(cache.magcache) {
    require(kind_ == StepCacheKind::kNone || kind_ == StepCacheKind::kTaylorSeer || kind_ == StepCacheKind::kMagCache,
            "cache: first-block and first-block-per-block run on the df pipeline (t2v / i2v: taylorseer, magcache)");
    if (kind_ == StepCacheKind::kTaylorSeer) taylorseer_hooked_modules(taylorseer_, model.config());  // checks it
    if (kind_ == StepCacheKind::kMagCache) {
      magcache_.num_inference_steps = steps;
      if (!magcache_.calibrate) {
        require(!magcache_.mag_ratios.empty(),
                "cache: magcache needs the model's magnitude ratios (the server's --magcache-ratios FILE, made by "
                "`skyreels calibrate-magcache`)");
        magcache_.mag_ratios = magcache_ratios_for_steps(magcache_.mag_ratios, steps);
      }
      check_magcache(magcache_);
    }
  }

  at::Tensor forward(const SkyReelsV2Transformer& model, TransformerForwardArgs& args, int64_t step, bool uncond,
                     const VideoHooks& hooks) {
    TransformerCallStats stats;
    args.stats = &stats;
    args.state = kind_ == StepCacheKind::kNone ? nullptr : uncond ? &uncond_ : &cond_;
    args.taylorseer = kind_ == StepCacheKind::kTaylorSeer ? &taylorseer_ : nullptr;
    args.magcache = kind_ == StepCacheKind::kMagCache ? &magcache_ : nullptr;
    at::Tensor out = model.forward(args);
    if (hooks.on_call) hooks.on_call(report(stats, step, uncond));
    return out;
  }

 private:
  TransformerCallReport report(const TransformerCallStats& stats, int64_t step, bool uncond) const {
    TransformerCallReport r;
    r.row = step;
    r.unconditional = uncond;
    r.token_blocks_full = stats.token_blocks_full;
    r.token_blocks_computed = stats.token_blocks_computed;
    r.token_blocks_saved_cache = stats.token_blocks_cached;
    r.step_cache = kind_ != StepCacheKind::kNone;
    r.cache_kind = kind_;
    r.skipped = stats.skipped;
    r.predicted = stats.predicted;
    r.accumulated_err = stats.magcache_err;
    r.calibration_ratio = stats.magcache_ratio;
    return r;
  }

  StepCacheKind kind_;
  TaylorSeerCache taylorseer_;
  MagCache magcache_;
  TransformerCallState cond_, uncond_;
};

}  // namespace

void check_video_step_cache(const SkyReelsV2Transformer& model, const StepCacheConfig& cache, int64_t steps) {
  VideoStepCache checked(model, cache, steps);
}

at::Tensor generate_video(const SkyReelsV2Transformer& model, PipelineKind kind, const GenerationParams& params,
                          const VideoConditioning& conditioning, NoiseSource& noise, int64_t num_videos_per_prompt,
                          const VideoHooks& hooks, const RankGroups* ranks) {
  const VideoGeometry g = check_request(model, kind, params, conditioning, num_videos_per_prompt);
  const int64_t prompts = conditioning.prompt_embeds.size(0);
  const c10::Device device = model.device();
  const at::ScalarType dtype = model.compute_dtype();
  c10::NoGradGuard no_grad;

  // Embeddings per video (diffusers casts them to the transformer's dtype).
  auto text = [&](const at::Tensor& t, const std::string& field) {
    return per_video(t, prompts, num_videos_per_prompt, field).to(device, dtype);
  };
  const at::Tensor prompt = text(conditioning.prompt_embeds, "prompt_embeds");
  const bool guidance = guided(params.guidance_scale);
  const at::Tensor negative =
      guidance ? text(*conditioning.negative_prompt_embeds, "negative_prompt_embeds") : at::Tensor();
  at::Tensor image_tokens, condition;
  if (kind == PipelineKind::kImageToVideo) {
    image_tokens = text(conditioning.image_tokens, "image_tokens");
    condition = per_video(conditioning.condition, prompts, num_videos_per_prompt, "condition").to(device, at::kFloat);
  }

  const std::vector<int64_t> shape{g.batch, kLatentChannels, g.latent_frames, g.latent_height, g.latent_width};
  at::Tensor latents = noise.latent_noise(0, shape).to(device, at::kFloat);
  require(latents.sizes().vec() == shape,
          "noise: the latent noise is " + shape_text(latents.sizes()) + ", the call needs " + shape_text(shape));
  ChunkSampler sampler = make_chunk_sampler(params, g.latent_frames);
  std::vector<int64_t> all_frames(static_cast<size_t>(g.latent_frames));
  for (int64_t f = 0; f < g.latent_frames; ++f) all_frames[static_cast<size_t>(f)] = f;

  TransformerForwardArgs args;
  if (model.config().inject_sample_info) {
    const int64_t fps_index = params.fps == 16 ? 0 : 1;  // as the DF pipeline passes it
    args.fps = at::full({g.batch}, fps_index, at::TensorOptions().dtype(at::kLong).device(device));
  }
  args.encoder_hidden_states_image = image_tokens;
  args.adapters = params.adapters;
  args.sequence_parallel = ranks ? ranks->ulysses : nullptr;
  args.weight_ranks = ranks ? ranks->all : nullptr;
  if (hooks.cancelled) {
    args.after_block = [&hooks] {
      if (hooks.cancelled()) throw GenerationCancelled("generation cancelled inside a forward");
    };
  }
  const int64_t steps = static_cast<int64_t>(sampler.step_template.size());
  VideoStepCache cache(model, params.cache, steps);
  for (int64_t i = 0; i < steps; ++i) {
    if (hooks.cancelled && hooks.cancelled()) {
      throw GenerationCancelled("generation cancelled before step " + std::to_string(i));
    }
    args.hidden_states = (condition.defined() ? at::cat({latents, condition}, 1) : latents).to(dtype);
    args.timestep = at::full({g.batch}, sampler.step_template[static_cast<size_t>(i)],
                             at::TensorOptions().dtype(at::kLong).device(device));
    const at::Tensor noise_pred = guided_prediction(
        [&](bool unconditional) {
          args.encoder_hidden_states = unconditional ? negative : prompt;
          return cache.forward(model, args, i, unconditional, hooks);
        },
        params.guidance_scale, ranks ? ranks->cfg : nullptr);
    latents = sampler.frames->step(all_frames, noise_pred, latents);
    if (hooks.on_step) hooks.on_step(i, steps, latents);
  }
  return latents.to(at::kCPU);
}

}  // namespace skyreels::model
