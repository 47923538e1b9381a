// A video job as the model sees it: the validated request (generation params with every default resolved, the seed,
// the prompt embeddings, the chunk plan), the state carried between chunks (the tail of the latent video, on the
// replica that produced it: what a handoff moves), and its torch-free description. Its chunk results are not kept
// here: run_chunk hands each to the scheduler, which commits it to the job store, where readers find it. Torch-free
// header.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "server/job/job_request.h"
#include "server/replica/chunk_executor.h"

namespace at {
class Tensor;
}

namespace skyreels::model {
struct RankGroups;
class AdapterCatalogue;
class ClipVisionEncoder;
class SkyReelsV2Transformer;
class WanVae;
struct ActiveAdapter;
struct ClipImageProcessorConfig;
struct StepHooks;
}  // namespace skyreels::model

namespace skyreels::server {

// A chunk's denoising loop as one rank of a replica runs it: on the rank's model, with its hooks and its groups
// (null on a one-device replica).
using RankLoop = std::function<at::Tensor(const model::SkyReelsV2Transformer& model, const model::StepHooks& hooks,
                                          const model::RankGroups* groups)>;
// Runs a loop on every rank of a replica of several devices at once and returns rank 0's result.
using RankRunner = std::function<at::Tensor(const RankLoop& loop)>;

// Where an MP4 segment a download waits for stands (VideoEncoder::wait_segment).
struct SegmentWait {
  bool making = false;  // still being made: the wait ran out first
  std::string error;    // it cannot be made (set: the rest does not matter)
};

// The i2v pipeline's CLIP image encoder and its preprocessing (skyreels-server --image-encoder), shared by every job.
struct ImageEncoder {
  std::shared_ptr<const model::ClipVisionEncoder> model;
  std::shared_ptr<const model::ClipImageProcessorConfig> processor;
};

// The server's optional model parts a job may use; a request that needs a missing one is FAILED_PRECONDITION naming it.
struct JobParts {
  TextEncoderFn text_encoder;                         // text prompts
  std::shared_ptr<const model::WanVae> vae;           // image / video conditioning, the i2v condition video
  std::function<void(double seconds)> on_vae_encode;  // metrics
  std::shared_ptr<const ImageEncoder> image_encoder;  // the i2v pipeline's CLIP tokens
  std::shared_ptr<const model::AdapterCatalogue> adapters;  // --lora-dir: what GenerationParams.loras may name
};

// A job runs one of three pipelines (GenerationParams.pipeline). Diffusion forcing ("df") runs as planned chunks;
// text-to-video and image-to-video ("t2v", "i2v") denoise the whole video at once, so their plan is one chunk: the
// whole video is one unit of work for the scheduler, retried and resumed like a chunk (from its seed, bit-identical).
class ModelJob : public JobPayload {
 public:
  // Validates every field (ValidationError / PreconditionError) and plans the chunks. `random_seed` is used when
  // the request has no seed. Images and videos are decoded here (bounded by the request's size and --max-frames);
  // parts.vae (and for i2v parts.image_encoder) encode them later, once, when the job's first chunk runs (after
  // admission). Adapters are checked against parts.adapters and their files' SHA-256 recorded (params().loras).
  static std::shared_ptr<ModelJob> create(const JobRequest& request, const ModelDescription& model,
                                          const ServerLimits& limits, uint64_t random_seed,
                                          const JobParts& parts = {});
  ~ModelJob() override;

  const ResolvedParams& params() const;
  std::shared_ptr<const JobDescription> description() const;
  const std::vector<std::string>& warnings() const;  // e.g. overlap frames dropped by the block size
  int64_t chunk_count() const;
  std::vector<double> chunk_work() const;     // latent positions x rows x model passes, per chunk
  int64_t max_chunk_tokens() const;           // transformer tokens of the largest chunk
  int64_t total_work() const;                 // token-forwards of the whole job (ServerLimits::max_job_work)
  std::vector<int64_t> chunk_rows() const;    // denoising rows per chunk
  std::vector<int64_t> latent_shape() const;  // [1, C, F, h, w] of the whole video
  std::pair<int64_t, int64_t> chunk_latent_range(int64_t chunk) const;
  int64_t chunk_pixel_frames(int64_t chunk) const;   // frames chunk `chunk` adds to the decoded video
  int64_t chunk_suffix_frames(int64_t chunk) const;  // ChunkLayout::suffix_frames
  uint64_t fingerprint() const;                      // of everything that determines the output (idempotency)
  const std::string& fingerprint_v2() const;         // the same as SHA-256 ("sha256:..."; server/fingerprint.h)
  // The embeddings the job conditions on (F32 [1, T, text_dim]); the negative ones only with guidance.
  RawTensor prompt_embeddings(bool negative = false) const;
  // Prompt change `index`'s embeddings (F32), as given or as its text was encoded at submit.
  RawTensor prompt_change_embeddings(size_t index) const;

  // Runs one chunk on `model` (on the calling replica's device). Reads the tail left by the previous chunk, wherever
  // it is; leaves the new tail on this device. Returns the chunk's result (safetensors: `latents` fp32
  // [1, C, frames, h, w], the chunk's new frames), which the scheduler commits to the job store: results are read
  // from there, the job does not keep them. Throws model::GenerationCancelled when hooks.cancelled() turns true.
  // `adapters`: params().loras placed on the replica's device (its AdapterBank), applied unmerged.
  // `ranks`: on a replica of several devices (--parallel), runs the chunk's loop on every rank and returns rank 0's
  // latents; every rank draws the same noise, and rank 0's draws are the ones committed.
  std::string run_chunk(const model::SkyReelsV2Transformer& model, int64_t chunk, const model::StepHooks& hooks,
                        const std::vector<model::ActiveAdapter>& adapters = {}, const RankRunner* ranks = nullptr);

  // After a restart: continues after the chunks that were committed (chunk 0, 1, ... in order, safetensors bytes as
  // run_chunk made them), taking the next chunk's tail from them. Its noise is re-derived from the seed (a fresh
  // seeded source skips ahead to any chunk), so the video is bit-identical to an uninterrupted run. Throws
  // std::runtime_error when a result does not fit the plan.
  void restore_results(const std::vector<std::string>& chunk_bytes);

 private:
  ModelJob();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skyreels::server
