// A job as the model sees it: created from a request (its parameters resolved and checked, its inputs converted,
// its chunks planned, the work it asks for admitted) and the plan's numbers the scheduler reads. The request's
// fields are converted in model_job_inputs.cpp and fingerprinted by server/job/fingerprint.h; chunks run in
// model_job_run.cpp.
#include "server/replica/model_job.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "model/guidance.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"
#include "model/video_shape.h"
#include "server/job/fingerprint.h"
#include "server/job/generation_params.h"
#include "server/job/generation_params_model.h"
#include "server/replica/model_job_impl.h"

namespace skyreels::server {

using model_job_detail::check_pipeline_served;
using model_job_detail::invalid;
using model_job_detail::pixel_conditioning;
using model_job_detail::resolve_adapters;
using model_job_detail::take_pipeline_images;
using model_job_detail::take_prompts;

namespace {

// A t2v / i2v video denoises every frame at once: its plan is one chunk holding the whole video, one row per step.
model::ChunkPlan whole_video_plan(const model::GenerationParams& p) {
  model::ChunkPlan plan;
  plan.total_latent_frames = model::latent_frames_of(p.num_frames);
  plan.base_latent_frames = plan.total_latent_frames;
  plan.latent_height = model::latent_size_of(p.height);
  plan.latent_width = model::latent_size_of(p.width);
  model::ChunkSpec chunk;
  chunk.num_latent_frames = plan.total_latent_frames;
  chunk.output_end = plan.total_latent_frames;
  chunk.timestep_rows = p.num_inference_steps;
  plan.chunks.push_back(chunk);
  return plan;
}

// Admission of the work itself (issue 12, item 4): a request within every field limit can still be one chunk of
// millions of tokens (quadratic attention, gigabytes) or hundreds of chunks. Refused before it is queued.
void check_work(const ModelJob& job, const ServerLimits& limits) {
  const auto& p = job.params();
  if (p.cache != "none" && p.cache_scope == "request") {
    invalid("cache_scope: request keeps the step cache from chunk to chunk, but a server runs each chunk on its own "
            "(on any replica or pod, after a retry or a restart); use cache_scope chunk");
  }
  if (job.max_chunk_tokens() > limits.max_chunk_tokens && p.pipeline != "df") {
    invalid("num_frames: pipeline " + p.pipeline + " denoises the whole video at once, and " +
            std::to_string(p.num_frames) + " frames at " + std::to_string(p.width) + "x" + std::to_string(p.height) +
            " are " + std::to_string(job.max_chunk_tokens()) + " transformer tokens, over --max-chunk-tokens " +
            std::to_string(limits.max_chunk_tokens) + "; lower num_frames, height or width");
  }
  if (job.max_chunk_tokens() > limits.max_chunk_tokens) {
    invalid("base_num_frames: a chunk of " + std::to_string(std::min(p.num_frames, p.base_num_frames)) + " frames at " +
            std::to_string(p.width) + "x" + std::to_string(p.height) + " is " + std::to_string(job.max_chunk_tokens()) +
            " transformer tokens, over --max-chunk-tokens " + std::to_string(limits.max_chunk_tokens) +
            "; lower base_num_frames, height or width");
  }
  if (job.chunk_count() > limits.max_chunks) {
    invalid("num_frames: " + std::to_string(p.num_frames) + " frames in chunks of base_num_frames " +
            std::to_string(p.base_num_frames) + " with overlap_history " +
            std::to_string(p.overlap_history.value_or(0)) + " make " + std::to_string(job.chunk_count()) +
            " chunks, over --max-chunks " + std::to_string(limits.max_chunks) +
            "; raise base_num_frames or lower overlap_history or num_frames");
  }
  if (job.total_work() > limits.max_job_work) {
    invalid("num_frames: the job is " + std::to_string(job.total_work()) +
            " token-forwards (tokens x denoising rows x guidance passes, over " + std::to_string(job.chunk_count()) +
            " chunks), over --max-job-work " + std::to_string(limits.max_job_work) +
            "; lower num_frames, num_inference_steps, ar_step, height or width");
  }
}

// The model's part of a step cache: MagCache's ratios (the server's --magcache-ratios; refused without them), and
// TaylorSeer's module patterns matched against the model.
void step_cache_of_model(const ModelDescription& model, model::StepCacheConfig& cache) {
  if (cache.kind == model::StepCacheKind::kMagCache) {
    if (model.magcache_ratios.empty()) {
      invalid(
          "cache: \"magcache\" needs the model's magnitude ratios, and this server has none (start it with "
          "--magcache-ratios FILE, made by `skyreels calibrate-magcache`)");
    }
    cache.magcache.mag_ratios = model.magcache_ratios;
  }
  if (cache.kind == model::StepCacheKind::kTaylorSeer) {
    try {
      model::taylorseer_hooked_modules(cache.taylorseer, model.config);
    } catch (const std::invalid_argument& e) {
      invalid(e.what());
    }
  }
}

std::shared_ptr<const JobDescription> describe(const ModelJob& job, const JobRequest& request) {
  auto description = std::make_shared<JobDescription>();
  description->params = job.params();
  description->prompt = request.prompt.value_or(request.described_prompt);
  description->latent_shape = job.latent_shape();
  int64_t pixels = 0;
  for (int64_t k = 0; k < job.chunk_count(); ++k) {
    const auto [begin, end] = job.chunk_latent_range(k);
    const int64_t pixel_begin = pixels;
    pixels += job.chunk_pixel_frames(k);
    description->chunks.push_back({begin, end, job.chunk_suffix_frames(k), pixel_begin, pixels});
  }
  return description;
}

}  // namespace

ModelJob::ModelJob() : impl_(std::make_unique<Impl>()) {}
ModelJob::~ModelJob() = default;

std::shared_ptr<ModelJob> ModelJob::create(const JobRequest& request, const ModelDescription& model,
                                           const ServerLimits& limits, uint64_t random_seed,
                                           const JobParts& parts) {
  const TextEncoderFn& text_encoder = parts.text_encoder;
  std::shared_ptr<const model::WanVae> vae = parts.vae;
  std::shared_ptr<const ImageEncoder> image_encoder = parts.image_encoder;
  std::shared_ptr<ModelJob> job(new ModelJob());
  Impl& d = *job->impl_;
  d.on_vae_encode = parts.on_vae_encode;
  d.resolved = resolve_generation_params(
      request, ResolveContext{model.config.num_frame_per_block, random_seed, model.default_pipeline});
  validate_generation_params(d.resolved, limits);
  check_pipeline_served(d.resolved.pipeline, model);
  check_pipeline_params(request, d.resolved);
  d.resolved.loras = resolve_adapters(request.loras, parts.adapters.get());
  d.pipeline = model::pipeline_kind_from_name(d.resolved.pipeline);
  const bool diffusion_forcing = d.pipeline == model::PipelineKind::kDiffusionForcing;
  if (!diffusion_forcing && !request.prompt_changes.empty()) {
    invalid("prompt_changes: a prompt per chunk is a diffusion-forcing feature; pipeline " + d.resolved.pipeline +
            " runs one prompt for the whole video");
  }
  d.generation = model_params(d.resolved);
  step_cache_of_model(model, d.generation.cache);
  if (limits.kv_cache_bytes >= 0) d.generation.kv_cache_max_bytes = limits.kv_cache_bytes;
  const model::GenerationParams& p = d.generation;

  take_prompts(request, model, limits, text_encoder, p, d.conditioning);

  if (!diffusion_forcing) {
    take_pipeline_images(request, model, limits, d.resolved.pipeline, vae != nullptr, image_encoder != nullptr,
                         d.image_rgb, d.last_image_rgb);
    if (d.image_rgb.defined()) {
      d.vae = std::move(vae);
      d.image_encoder = std::move(image_encoder);
    }
    d.video.prompt_embeds = d.conditioning.prompt_embeds;
    d.video.negative_prompt_embeds = d.conditioning.negative_prompt_embeds;
  } else if (request.image || request.video) {
    if (!vae) {
      throw PreconditionError(std::string(request.image ? "image" : "video") +
                              ": this server has no VAE to encode it (start it with --vae)");
    }
    d.pixels = pixel_conditioning(request, d.generation, limits);
    d.vae = std::move(vae);
    try {
      model::describe_conditioning(d.pixels, 1, d.generation);
    } catch (const std::invalid_argument& e) {
      invalid(e.what());
    }
  } else if (request.last_image) {
    invalid("last_image: needs an image as the first frame");
  }

  try {
    d.plan = diffusion_forcing ? model::plan_chunks(p, model.config.num_frame_per_block) : whole_video_plan(p);
  } catch (const std::invalid_argument& e) {
    invalid(e.what());  // plan_chunks names the field first
  }
  d.latent_channels = model.config.out_channels;
  std::copy(model.config.patch_size.begin(), model.config.patch_size.end(), std::begin(d.patch_size));
  Fingerprint fingerprint = request_fingerprint(request, d.resolved.loras);
  d.fingerprint = fingerprint.v1;
  d.fingerprint_v2 = std::move(fingerprint.v2);

  check_work(*job, limits);
  d.description = describe(*job, request);
  return job;
}

const ResolvedParams& ModelJob::params() const { return impl_->resolved; }
std::shared_ptr<const JobDescription> ModelJob::description() const { return impl_->description; }
const std::vector<std::string>& ModelJob::warnings() const { return impl_->plan.warnings; }
int64_t ModelJob::chunk_count() const { return static_cast<int64_t>(impl_->plan.chunks.size()); }
uint64_t ModelJob::fingerprint() const { return impl_->fingerprint; }
const std::string& ModelJob::fingerprint_v2() const { return impl_->fingerprint_v2; }

namespace {
RawTensor f32_raw(const at::Tensor& tensor) {
  const at::Tensor t = tensor.to(at::kFloat).contiguous();
  RawTensor raw;
  raw.dtype = "F32";
  raw.shape = t.sizes().vec();
  raw.data.assign(reinterpret_cast<const char*>(t.data_ptr<float>()), static_cast<size_t>(t.numel()) * sizeof(float));
  return raw;
}
}  // namespace

RawTensor ModelJob::prompt_embeddings(bool negative) const {
  const auto& c = impl_->conditioning;
  if (negative && !c.negative_prompt_embeds) return RawTensor{"F32", {}, {}};
  return f32_raw(negative ? *c.negative_prompt_embeds : c.prompt_embeds);
}

RawTensor ModelJob::prompt_change_embeddings(size_t index) const {
  return f32_raw(impl_->conditioning.prompt_changes.at(index).prompt_embeds);
}

std::vector<double> ModelJob::chunk_work() const {
  const auto& plan = impl_->plan;
  const auto passes = static_cast<double>(model::passes_per_row(impl_->generation.guidance_scale));
  std::vector<double> work;
  for (const auto& c : plan.chunks) {
    work.push_back(static_cast<double>(c.num_latent_frames * plan.latent_height * plan.latent_width) *
                   static_cast<double>(c.timestep_rows) * passes);
  }
  return work;
}

namespace {
int64_t chunk_tokens(const model::ChunkPlan& plan, const model::ChunkSpec& chunk, const int64_t (&patch)[3]) {
  return (chunk.num_latent_frames / patch[0]) * (plan.latent_height / patch[1]) * (plan.latent_width / patch[2]);
}
}  // namespace

int64_t ModelJob::max_chunk_tokens() const {
  int64_t most = 0;
  for (const auto& c : impl_->plan.chunks) most = std::max(most, chunk_tokens(impl_->plan, c, impl_->patch_size));
  return most;
}

int64_t ModelJob::total_work() const {
  const int64_t passes = model::passes_per_row(impl_->generation.guidance_scale);
  int64_t work = 0;
  for (const auto& c : impl_->plan.chunks) {
    work += chunk_tokens(impl_->plan, c, impl_->patch_size) * c.timestep_rows * passes;
  }
  return work;
}

std::vector<int64_t> ModelJob::chunk_rows() const {
  std::vector<int64_t> rows;
  for (const auto& c : impl_->plan.chunks) rows.push_back(c.timestep_rows);
  return rows;
}

std::vector<int64_t> ModelJob::latent_shape() const {
  const auto& plan = impl_->plan;
  return {1, impl_->latent_channels, plan.total_latent_frames, plan.latent_height, plan.latent_width};
}

std::pair<int64_t, int64_t> ModelJob::chunk_latent_range(int64_t chunk) const {
  const auto& c = impl_->plan.chunks.at(static_cast<size_t>(chunk));
  return {c.output_begin, c.output_end};
}

int64_t ModelJob::chunk_suffix_frames(int64_t chunk) const {
  return impl_->plan.chunks.at(static_cast<size_t>(chunk)).suffix_frames;
}

int64_t ModelJob::chunk_pixel_frames(int64_t chunk) const {
  const auto [begin, end] = chunk_latent_range(chunk);
  // The frames its latents decode to less those before it (the first latent frame is a single pixel frame).
  return model::pixel_frames_of(end - chunk_suffix_frames(chunk)) - model::pixel_frames_of(begin);
}

}  // namespace skyreels::server
