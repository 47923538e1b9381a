// The denoising loop of diffusion-forcing generation (diffusers' SkyReelsV2DiffusionForcingPipeline, chunk by chunk):
// a chunk's conditioning and prompt, its initial latents from the previous chunk's tail and the noise source, the
// rows of its timestep matrix (addnoise_condition, the denoiser calls with classifier-free guidance, the sampler's
// updates of the frames each row advances), previews, and the accumulation of the chunks into the video. The other
// concepts live beside it: df_timesteps.cpp, df_chunk_plan.cpp, df_noise.cpp and df_transformer_denoiser.cpp.
#include "model/diffusion_forcing.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/guidance.h"
#include "model/guided_prediction.h"
#include "model/shape_text.h"
#include "model/video_shape.h"

namespace skyreels::model {

// ---- the denoising loop of one chunk ---------------------------------------------------------------------------

namespace {

struct ChunkInputs {
  at::Tensor prompt;    // compute dtype, device
  at::Tensor negative;  // undefined without CFG
  bool guidance = false;
};

ChunkInputs prepare_conditioning(const Conditioning& c, const GenerationParams& p, const DenoiserInfo& info) {
  if (!c.prompt_embeds.defined() || c.prompt_embeds.dim() != 3) {
    throw std::invalid_argument("prompt_embeds: expected [B, T, text_dim], got " +
                                (c.prompt_embeds.defined() ? shape_text(c.prompt_embeds.sizes()) : "nothing"));
  }
  ChunkInputs in;
  in.guidance = guided(p.guidance_scale);
  in.prompt = c.prompt_embeds.to(info.device, info.dtype);
  if (in.guidance) {
    if (!c.negative_prompt_embeds || !c.negative_prompt_embeds->defined()) {
      throw std::invalid_argument("negative_prompt_embeds: required when guidance_scale > 1 (got " +
                                  std::to_string(p.guidance_scale) + ")");
    }
    const at::Tensor& n = *c.negative_prompt_embeds;
    if (n.dim() != 3 || n.size(0) != c.prompt_embeds.size(0) || n.size(2) != c.prompt_embeds.size(2)) {
      throw std::invalid_argument("negative_prompt_embeds: shape " + shape_text(n.sizes()) +
                                  " does not match prompt_embeds " + shape_text(c.prompt_embeds.sizes()));
    }
    in.negative = n.to(info.device, info.dtype);
  }
  return in;
}

// Normalised condition latents for `batch` items (one per item, or one for all), checked against the chunk.
at::Tensor condition_frames(const at::Tensor& latents, const std::string& field, int64_t frames, int64_t batch,
                            const ChunkPlan& plan, const DenoiserInfo& info) {
  if (!latents.defined() || latents.dim() != 5 || (latents.size(0) != batch && latents.size(0) != 1) ||
      latents.size(1) != info.latent_channels || latents.size(2) < frames || latents.size(3) != plan.latent_height ||
      latents.size(4) != plan.latent_width) {
    throw std::invalid_argument(field + ": expected [" + std::to_string(batch) + " or 1, " +
                                std::to_string(info.latent_channels) + ", >= " + std::to_string(frames) + ", " +
                                std::to_string(plan.latent_height) + ", " + std::to_string(plan.latent_width) +
                                "] (encode_conditioning), got " +
                                (latents.defined() ? shape_text(latents.sizes()) : "nothing"));
  }
  return latents.narrow(2, 0, frames).expand({batch, -1, -1, -1, -1});
}

// The previous chunk's tail: diffusers' prefix = video[:, :, -O:] cut to P frames.
at::Tensor previous_tail(const ChunkPlan& plan, const ChunkSpec& chunk, const DenoiserInfo& info, int64_t batch,
                         const at::Tensor& previous) {
  const int64_t overlap = plan.overlap_latent_frames;
  if (!previous.defined() || previous.dim() != 5 || previous.size(2) < overlap || previous.size(0) != batch ||
      previous.size(1) != info.latent_channels || previous.size(3) != plan.latent_height ||
      previous.size(4) != plan.latent_width) {
    throw std::invalid_argument(
        "previous_latents: chunk " + std::to_string(chunk.index) + " needs the accumulated latents with at least " +
        std::to_string(overlap) + " frames of [" + std::to_string(batch) + ", " + std::to_string(info.latent_channels) +
        ", F, " + std::to_string(plan.latent_height) + ", " + std::to_string(plan.latent_width) + "], got " +
        (previous.defined() ? shape_text(previous.sizes()) : "nothing"));
  }
  return previous.narrow(2, previous.size(2) - overlap, chunk.prefix_frames);
}

// The chunk's starting latents: fresh fp32 noise with the prefix copied in (chunk 0: the image / video condition;
// later chunks: the previous chunk's tail), and the last_image latent appended to the last chunk. Both go through
// the transformer dtype first, as in diffusers (bf16 rounding).
at::Tensor initial_latents(const ChunkPlan& plan, const ChunkSpec& chunk, const DenoiserInfo& info, int64_t batch,
                           const Conditioning& conditioning, const at::Tensor& previous, NoiseSource& noise) {
  const std::vector<int64_t> shape = {batch, info.latent_channels, chunk.num_latent_frames, plan.latent_height,
                                      plan.latent_width};
  at::Tensor latents = noise.latent_noise(chunk.index, shape);
  if (latents.sizes() != at::IntArrayRef(shape)) {
    throw std::logic_error("noise source returned " + shape_text(latents.sizes()) + " for latent shape " +
                           shape_text(shape));
  }
  latents = latents.to(info.device, at::kFloat).contiguous();
  if (chunk.prefix_frames > 0) {
    const at::Tensor prefix = chunk.index == 0 ? condition_frames(conditioning.prefix_latents, "prefix_latents",
                                                                  chunk.prefix_frames, batch, plan, info)
                                               : previous_tail(plan, chunk, info, batch, previous);
    latents.narrow(2, 0, chunk.prefix_frames).copy_(prefix.to(info.device).to(info.dtype));
  }
  if (chunk.suffix_frames > 0) {
    const at::Tensor suffix =
        condition_frames(conditioning.last_image_latents, "last_image_latents", chunk.suffix_frames, batch, plan, info);
    latents = at::cat({latents, suffix.to(info.device).to(info.dtype).to(at::kFloat)}, 2);
  }
  return latents;
}

// addnoise_condition: lightly noise the clean prefix in the model input only, and tell the model its timestep.
void noise_condition(at::Tensor& model_input, at::Tensor& timestep, const GenerationParams& p, const ChunkSpec& chunk,
                     int64_t start, int64_t row, NoiseSource& noise) {
  if (!(p.addnoise_condition > 0.0) || start >= chunk.prefix_frames) return;
  const double factor = 0.001 * p.addnoise_condition;
  at::Tensor part = model_input.narrow(2, start, chunk.prefix_frames - start);
  const at::Tensor n = noise.condition_noise(chunk.index, row, part.sizes()).to(part.device()).to(part.scalar_type());
  part.copy_(part * (1.0 - factor) + n * factor);
  timestep.narrow(1, start, chunk.prefix_frames - start).fill_(p.addnoise_condition);  // int64: truncated
}

// Scheduler updates of one row: frames sharing a step counter are advanced together.
void update_frames(FrameSampler& schedulers, at::Tensor& latents, const at::Tensor& prediction,
                   const at::Tensor& row_mask, const at::Tensor& row_index, int64_t start, int64_t end) {
  const auto mask = row_mask.accessor<bool, 1>();
  const auto index = row_index.accessor<int64_t, 1>();
  std::map<int64_t, std::vector<int64_t>> groups;  // step counter -> frames
  for (int64_t f = start; f < end; ++f) {
    if (!mask[f]) continue;
    const int64_t k = schedulers.steps_taken(f);
    if (index[f] != k + 1) {
      throw std::logic_error("diffusion forcing: frame " + std::to_string(f) + " is at step " + std::to_string(k) +
                             " but the timestep matrix expects step " + std::to_string(index[f] - 1));
    }
    groups[k].push_back(f);
  }
  for (const auto& [k, frames] : groups) {
    const bool contiguous = frames.back() - frames.front() + 1 == static_cast<int64_t>(frames.size());
    const auto count = static_cast<int64_t>(frames.size());
    if (contiguous) {
      const at::Tensor out = schedulers.step(frames, prediction.narrow(2, frames.front() - start, count),
                                             latents.narrow(2, frames.front(), count));
      latents.narrow(2, frames.front(), count).copy_(out);
    } else {
      const at::Tensor idx = at::tensor(frames, at::kLong).to(latents.device());
      const at::Tensor out =
          schedulers.step(frames, prediction.index_select(2, idx - start), latents.index_select(2, idx));
      latents.index_copy_(2, idx, out);
    }
  }
}

// Which frames of row i's call are updated, and which are final: at timestep 0, not updated, and not re-noised by
// addnoise_condition. The timestep matrix only moves frames forward, so a final frame stays final.
void mark_frames(DenoiseCall& call, const TimestepMatrix& matrix, const GenerationParams& p, const ChunkSpec& chunk,
                 int64_t row, int64_t start, int64_t end) {
  const auto mask = matrix.update_mask.accessor<bool, 2>();
  const auto steps = matrix.step_matrix.accessor<int64_t, 2>();
  const int64_t renoised = p.addnoise_condition > 0.0 ? chunk.prefix_frames : 0;
  call.updated.assign(static_cast<size_t>(end - start), 0);
  call.final_frames.assign(static_cast<size_t>(end - start), 0);
  for (int64_t f = start; f < end; ++f) {
    const auto i = static_cast<size_t>(f - start);
    call.updated[i] = mask[row][f] ? 1 : 0;
    call.final_frames[i] = !mask[row][f] && steps[row][f] == 0 && f >= renoised ? 1 : 0;
  }
}

// The running chunk's clean-latent estimate for previews (made only when they are asked for): the first video of the
// batch, the chunk's new frames. It reads the loop's tensors and writes only its own.
class PreviewEstimate {
 public:
  PreviewEstimate(const at::Tensor& latents, const ChunkSpec& chunk)
      : from_(chunk.keep_from),
        x0_(latents.narrow(0, 0, 1).narrow(2, from_, chunk.num_latent_frames - from_).clone()),
        first_frame_(chunk.output_begin) {}

  static bool due(const GenerationParams& p, const StepHooks& hooks, int64_t row, int64_t rows) {
    return p.preview_every > 0 && hooks.on_preview && ((row + 1) % p.preview_every == 0 || row + 1 == rows);
  }

  // Before row `row`'s update: the frames it updates get x_t - sigma * v (their own sigma); frames already final
  // their latents; the others keep their last estimate.
  void record(const at::Tensor& latents, const at::Tensor& prediction, const FrameSampler& sampler,
              const TimestepMatrix& matrix, int64_t row, int64_t start, int64_t end) {
    const auto mask = matrix.update_mask.accessor<bool, 2>();
    const auto steps = matrix.step_matrix.accessor<int64_t, 2>();
    for (int64_t f = from_; f < from_ + x0_.size(2); ++f) {
      at::Tensor x0 = x0_.narrow(2, f - from_, 1);
      const at::Tensor x_t = latents.narrow(0, 0, 1).narrow(2, f, 1);
      if (f >= start && f < end && mask[row][f]) {
        const at::Tensor v = prediction.narrow(0, 0, 1).narrow(2, f - start, 1).to(at::kFloat);
        x0.copy_(x_t - v * static_cast<double>(sampler.sigma(f)));
      } else if (steps[row][f] == 0) {
        x0.copy_(x_t);
      }
    }
  }

  ChunkPreview preview(int64_t chunk, int64_t row, int64_t rows) const {
    return ChunkPreview{chunk, row, rows, first_frame_, x0_.clone()};
  }

 private:
  int64_t from_;
  at::Tensor x0_;  // fp32 [1, 16, F_new, h, w]
  int64_t first_frame_;
};

void check_plan(const ChunkPlan& plan, int64_t chunk_index, const GenerationParams& p) {
  if (p.preview_every < 0) {
    throw std::invalid_argument("preview_every: " + std::to_string(p.preview_every) + " is negative (0: no previews)");
  }
  if (chunk_index < 0 || chunk_index >= static_cast<int64_t>(plan.chunks.size())) {
    throw std::invalid_argument("chunk_index: " + std::to_string(chunk_index) + " outside the plan's " +
                                std::to_string(plan.chunks.size()) + " chunks");
  }
  if (plan.latent_height != latent_size_of(p.height) || plan.latent_width != latent_size_of(p.width)) {
    throw std::invalid_argument("plan: latent size " + std::to_string(plan.latent_height) + "x" +
                                std::to_string(plan.latent_width) + " does not match height/width of the params");
  }
}

}  // namespace

Conditioning prompt_for_chunk(const Conditioning& conditioning, const ChunkSpec& chunk) {
  Conditioning out;
  out.prompt_embeds = conditioning.prompt_embeds;
  out.negative_prompt_embeds = conditioning.negative_prompt_embeds;
  int64_t last_from = -1;
  for (const PromptChange& change : conditioning.prompt_changes) {
    if (change.from_frame <= last_from) {
      throw std::invalid_argument("prompt_changes: frames must be given in increasing order (" +
                                  std::to_string(change.from_frame) + " after " + std::to_string(last_from) + ")");
    }
    last_from = change.from_frame;
    const at::Tensor& e = change.prompt_embeds;
    if (!e.defined() || e.dim() != 3 || !out.prompt_embeds.defined() || e.size(0) != out.prompt_embeds.size(0) ||
        e.size(2) != out.prompt_embeds.size(2)) {
      throw std::invalid_argument("prompt_changes: the prompt from frame " + std::to_string(change.from_frame) +
                                  " has shape " + (e.defined() ? shape_text(e.sizes()) : "nothing") +
                                  ", not [B, T, text_dim] like prompt_embeds");
    }
    if (change.from_frame > chunk.first_new_pixel_frame()) continue;
    out.prompt_embeds = change.prompt_embeds;
    if (change.negative_prompt_embeds) out.negative_prompt_embeds = change.negative_prompt_embeds;
  }
  return out;
}

at::Tensor run_chunk(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                     const ChunkPlan& plan, int64_t chunk_index, const Conditioning& conditioning,
                     const at::Tensor& previous_latents, NoiseSource& noise, const StepHooks& hooks) {
  check_plan(plan, chunk_index, params);
  const ChunkSpec& chunk = plan.chunks[static_cast<size_t>(chunk_index)];
  const ChunkInputs inputs = prepare_conditioning(prompt_for_chunk(conditioning, chunk), params, info);
  const int64_t batch = conditioning.prompt_embeds.size(0);

  const int64_t frames = chunk.num_latent_frames + chunk.suffix_frames;
  ChunkSampler sampler = make_chunk_sampler(params, frames);
  const TimestepMatrix matrix = chunk_timestep_matrix(chunk, sampler.step_template, params.ar_step, plan.causal_block_size);
  if (matrix.step_matrix.size(1) != frames) {
    throw std::invalid_argument("causal_block_size: chunk " + std::to_string(chunk_index) + " has " +
                                std::to_string(frames) + " latent frames, not a multiple of " +
                                std::to_string(plan.causal_block_size) + " (use plan_chunks)");
  }

  noise.begin_chunk(plan, chunk_index);
  at::Tensor latents = initial_latents(plan, chunk, info, batch, conditioning, previous_latents, noise);
  FrameSampler& schedulers = *sampler.frames;
  spdlog::debug("chunk {}/{}: {} latent frames, prefix {}, {} rows", chunk_index + 1, plan.chunks.size(),
                chunk.num_latent_frames, chunk.prefix_frames, matrix.rows());

  const at::Tensor timestep_rows = matrix.step_matrix.to(info.device);
  std::optional<PreviewEstimate> estimate;
  if (params.preview_every > 0 && hooks.on_preview) estimate.emplace(latents, chunk);
  for (int64_t i = 0; i < matrix.rows(); ++i) {
    if (hooks.cancelled && hooks.cancelled()) {
      throw GenerationCancelled("generation cancelled at chunk " + std::to_string(chunk_index) + ", row " +
                                std::to_string(i));
    }
    const auto [start, end] = matrix.valid_interval[static_cast<size_t>(i)];
    DenoiseCall call;
    call.latent_model_input = latents.narrow(2, start, end - start).to(info.dtype).clone();
    call.timestep = timestep_rows.select(0, i).expand({batch, -1}).narrow(1, start, end - start).clone();
    noise_condition(call.latent_model_input, call.timestep, params, chunk, start, i, noise);
    call.chunk = chunk_index;
    call.row = i;
    call.num_frame_per_block = plan.causal_block_size;
    call.first_frame = start;
    mark_frames(call, matrix, params, chunk, i, start, end);
    const at::Tensor prediction = guided_prediction(
        [&](bool unconditional) {
          call.encoder_hidden_states = unconditional ? inputs.negative : inputs.prompt;
          call.unconditional = unconditional;
          return denoiser(call);
        },
        params.guidance_scale, info.guidance_ranks);
    if (prediction.sizes() != call.latent_model_input.sizes()) {
      throw std::logic_error("denoiser returned " + shape_text(prediction.sizes()) + " for input " +
                             shape_text(call.latent_model_input.sizes()));
    }
    const bool preview = PreviewEstimate::due(params, hooks, i, matrix.rows());
    if (preview) estimate->record(latents, prediction, schedulers, matrix, i, start, end);
    update_frames(schedulers, latents, prediction, matrix.update_mask.select(0, i), matrix.step_index.select(0, i),
                  start, end);
    if (hooks.on_step) hooks.on_step(chunk_index, i, matrix.rows());
    if (preview) hooks.on_preview(estimate->preview(chunk_index, i, matrix.rows()));
  }
  return latents;
}

at::Tensor accumulate(const at::Tensor& accumulated, const at::Tensor& chunk_latents, const ChunkSpec& chunk) {
  if (chunk.index == 0 || !accumulated.defined()) return chunk_latents;
  const at::Tensor fresh = chunk_latents.narrow(2, chunk.keep_from, chunk_latents.size(2) - chunk.keep_from);
  return at::cat({accumulated, fresh.to(accumulated.device())}, 2);
}

at::Tensor generate(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks,
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk) {
  const ChunkPlan plan = plan_chunks(params, info.num_frame_per_block);
  at::Tensor video;
  for (const ChunkSpec& chunk : plan.chunks) {
    const at::Tensor latents = run_chunk(denoiser, info, params, plan, chunk.index, conditioning, video, noise, hooks);
    if (on_chunk) on_chunk(chunk.index, latents);
    video = accumulate(video, latents, chunk);
  }
  return video;
}

}  // namespace skyreels::model
