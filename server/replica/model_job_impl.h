// Internal to ModelJob (included by server/replica/model_job*.cpp only): the job's state (ModelJob::Impl) and the
// steps its files share. model_job.cpp: create (the request -> a planned job) and the plan's numbers;
// model_job_inputs.cpp: the request's fields checked and converted into the model's inputs; model_job_run.cpp: running
// a chunk (or a whole t2v / i2v video), its result's bytes, and a job restored from its stored results.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/pixel_conditioning.h"
#include "server/replica/model_job.h"

namespace skyreels::model {
struct TransformerConfig;
}  // namespace skyreels::model

namespace skyreels::server {

// ---- the job --------------------------------------------------------------------------------------------------

struct ModelJob::Impl {
  model::PipelineKind pipeline = model::PipelineKind::kDiffusionForcing;
  model::GenerationParams generation;
  ResolvedParams resolved;
  model::ChunkPlan plan;
  model::Conditioning conditioning;
  int64_t latent_channels = 16;
  int64_t patch_size[3] = {1, 2, 2};
  uint64_t fingerprint = 0;
  std::string fingerprint_v2;
  at::Tensor tail;  // last overlap frames of the latent video so far, on the replica that made them
  // Image / video conditioning: the pixels until the first chunk encodes them with `vae` (once; the latents then
  // live in `conditioning`, so a retried or handed-off chunk never encodes again).
  model::PixelConditioning pixels;
  std::shared_ptr<const model::WanVae> vae;
  std::function<void(double seconds)> on_vae_encode;  // metrics
  void encode_conditioning_once();
  // i2v: the images (uint8 RGB [H, W, 3]) until the first run encodes them with the CLIP encoder and the VAE (once,
  // into `video`).
  at::Tensor image_rgb, last_image_rgb;
  std::shared_ptr<const ImageEncoder> image_encoder;
  model::VideoConditioning video;
  void encode_images_once(const model::TransformerConfig& config);
  std::string run_whole_video(const model::SkyReelsV2Transformer& transformer, const model::StepHooks& hooks,
                              const model::GenerationParams& params, const RankRunner* ranks);
  // The job's random streams, positioned after the last chunk that succeeded (committed only on success).
  std::unique_ptr<model::NoiseSource> noise;
  std::shared_ptr<const JobDescription> description;
};

namespace model_job_detail {

[[noreturn]] void invalid(const std::string& message);  // ValidationError (INVALID_ARGUMENT)

// ---- the request's fields -> the model's inputs (model_job_inputs.cpp) -----------------------------------------

// GenerationParams.loras against the server's catalogue: names, scales and count checked, each file's SHA-256
// recorded; a sha256 the request already carries (a client's pin, or a stored job's) must still be the file's.
std::vector<AdapterChoice> resolve_adapters(const std::vector<AdapterChoice>& asked,
                                            const model::AdapterCatalogue* catalogue);

// A pipeline the loaded model does not run: FAILED_PRECONDITION naming what it runs.
void check_pipeline_served(const std::string& pipeline, const ModelDescription& model);

// The prompt's, the negative prompt's (with guidance) and the prompt changes' embeddings, given or encoded (every
// text of the request in one encoder call), checked against the model, into `conditioning`.
void take_prompts(const JobRequest& request, const ModelDescription& model, const ServerLimits& limits,
                  const TextEncoderFn& text_encoder, const model::GenerationParams& p,
                  model::Conditioning& conditioning);

// The diffusion-forcing pipeline's image / video conditioning, decoded within the request's size.
model::PixelConditioning pixel_conditioning(const JobRequest& r, const model::GenerationParams& p,
                                            const ServerLimits& limits);

// The t2v / i2v request's images, checked against the model and the server's encoders, decoded into the job.
void take_pipeline_images(const JobRequest& request, const ModelDescription& model, const ServerLimits& limits,
                          const std::string& pipeline, bool have_vae, bool have_image_encoder, at::Tensor& image,
                          at::Tensor& last_image);

}  // namespace model_job_detail
}  // namespace skyreels::server
