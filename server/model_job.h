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

#include "server/limits.h"
#include "server/replica_pool.h"

namespace skyreels::model {
class SkyReelsV2Transformer;
class WanVae;
struct StepHooks;
}  // namespace skyreels::model

namespace skyreels::server {

// A bad request field: INVALID_ARGUMENT. The message starts with the field name.
class ValidationError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A valid request this server cannot serve as configured (a text prompt without a text encoder):
// FAILED_PRECONDITION.
class PreconditionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A tensor as it arrives over the wire: safetensors dtype name ("F32", "BF16", "F16"), shape, raw little-endian bytes.
struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;
};

// Pixels as they arrive: the bytes of a PNG/JPEG/MP4, or a float tensor in [0, 1] (exactly one of the two).
struct PixelRequest {
  std::optional<std::string> encoded;
  std::optional<RawTensor> tensor;
};

// A prompt taking over from a pixel frame on: embeddings (negative optional) or text (needs a text encoder).
struct PromptChangeRequest {
  int64_t from_frame = 0;
  std::optional<RawTensor> prompt_embeds;
  std::optional<RawTensor> negative_prompt_embeds;
  std::optional<std::string> text;
};

// The request, transport-neutral. Unset optionals take diffusers' defaults.
struct JobRequest {
  std::optional<RawTensor> prompt_embeds;
  std::optional<RawTensor> negative_prompt_embeds;
  std::optional<std::string> embeddings_safetensors;  // a safetensors file's bytes
  std::optional<std::string> prompt;                  // text (needs a text encoder)
  std::optional<std::string> negative_prompt;

  std::optional<int64_t> num_frames, height, width, num_inference_steps, base_num_frames, overlap_history, ar_step,
      causal_block_size, fps;
  std::optional<double> guidance_scale, flow_shift, addnoise_condition;
  std::optional<uint64_t> seed;
  // The sampler's scheduler_config settings.
  std::optional<int64_t> num_train_timesteps, solver_order;
  std::optional<std::string> solver_type, final_sigmas_type;
  std::optional<bool> lower_order_final;
  std::vector<int64_t> disable_corrector;
  // Fewer transformer passes (exact savings, step cache).
  std::optional<bool> exact_savings;
  std::optional<std::string> cache, cache_scope;
  std::optional<double> cache_threshold;
  std::optional<int64_t> cache_max_skips;
  // Image-to-video (image, optionally last_image) or video extension (video).
  std::optional<PixelRequest> image, last_image, video;
  std::vector<PromptChangeRequest> prompt_changes;
};

// Every generation parameter with its value in effect (what the job reports back).
struct ResolvedParams {
  int64_t num_frames = 0, height = 0, width = 0, num_inference_steps = 0, base_num_frames = 0;
  std::optional<int64_t> overlap_history;
  int64_t ar_step = 0, causal_block_size = 0, fps = 0;
  double guidance_scale = 0, flow_shift = 0, addnoise_condition = 0;
  uint64_t seed = 0;
  int64_t num_train_timesteps = 0, solver_order = 0;
  std::string solver_type, final_sigmas_type;
  bool lower_order_final = true;
  std::vector<int64_t> disable_corrector;
  bool exact_savings = true;
  std::string cache, cache_scope;
  double cache_threshold = 0;
  int64_t cache_max_skips = 0;
};

struct ServerLimits {
  int64_t max_pixel_input_bytes = 32 << 20;  // one image / video of a request, encoded or as a tensor
  int64_t max_prompt_changes = 64;
  int64_t max_frames = 1457;
  int64_t max_height = 1280;
  int64_t max_width = 1280;
  int64_t max_steps = 100;
  int64_t max_text_tokens = 512;  // diffusers' max_sequence_length
  // Work limits (server/limits.h derives the server's defaults from the model and the device memory): transformer
  // tokens of one chunk, token-forwards of the whole job (tokens x rows x passes, summed), chunks of one job.
  int64_t max_chunk_tokens = kAttentionTokenCeiling;
  int64_t max_job_work = default_max_job_work(kAttentionTokenCeiling, 100);  // 100: max_steps' default
  int64_t max_chunks = kDefaultMaxChunks;
  // Memory for the kept keys/values of final frames per chunk loop (exact savings); < 0: the model's default.
  int64_t kv_cache_bytes = -1;
};

// What validation needs to know about the loaded model.
struct ModelDescription {
  int64_t text_dim = 4096;
  int64_t num_frame_per_block = 1;
  int64_t latent_channels = 16;
  int64_t patch_size[3] = {1, 2, 2};  // latent positions per transformer token (frames, height, width)
};

// Turns text prompts into [1, T, text_dim] float32 embeddings each (data as raw F32 bytes), one call per submission
// for all its texts (prompt, negative prompt, prompt changes), so the encoder can batch them and encode a text
// that occurs twice once; unset: no text encoder.
using TextEncoderFn = std::function<std::vector<RawTensor>(const std::vector<std::string>& texts)>;

// A chunk's place in the whole video.
struct ChunkLayout {
  int64_t latent_begin = 0;  // new latent frames [begin, end) of the whole video
  int64_t latent_end = 0;
  // Latent frames at the end of the chunk's result that are conditioning, not video (the last_image latent): decoding
  // leaves them out, as diffusers does.
  int64_t suffix_frames = 0;
};

// What the transport and the video encoder read of a job (JobSnapshot::description), fixed when the job is created:
// the parameters in effect and the layout of its chunk results (the results themselves are in the job store).
struct JobDescription {
  ResolvedParams params;
  std::vector<int64_t> latent_shape;  // [1, C, F, h, w] of the whole video
  std::vector<ChunkLayout> chunks;
};

// Where an MP4 segment a download waits for stands (VideoEncoder::wait_segment).
struct SegmentWait {
  bool making = false;  // still being made: the wait ran out first
  std::string error;    // it cannot be made (set: the rest does not matter)
};

class ModelJob : public JobPayload {
 public:
  // Validates every field (ValidationError / PreconditionError) and plans the chunks. `random_seed` is used when
  // the request has no seed. Images and videos are decoded here (bounded by the request's size and --max-frames);
  // `vae` encodes them later, once, when the job's first chunk runs (after admission); null: they are refused.
  static std::shared_ptr<ModelJob> create(const JobRequest& request, const ModelDescription& model,
                                          const ServerLimits& limits, uint64_t random_seed,
                                          const TextEncoderFn& text_encoder = {},
                                          std::shared_ptr<const model::WanVae> vae = nullptr,
                                          std::function<void(double seconds)> on_vae_encode = {});
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
  std::string run_chunk(const model::SkyReelsV2Transformer& model, int64_t chunk, const model::StepHooks& hooks);

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
