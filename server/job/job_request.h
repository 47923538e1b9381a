// A job's request as every layer sees it, transport-neutral and torch-free: the wire tensors and pixels, the
// generation parameters as asked (JobRequest) and in effect (ResolvedParams), the server's limits, what validation
// knows of the model, and the description of a job the transport and the video encoder read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/transformer_config.h"
#include "server/job/generation_param_list.h"
#include "server/job/limits.h"

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

// A LoRA adapter of the server's --lora-dir for one job (GenerationParams.loras), applied unmerged. Not a row of the
// generation-parameter table: a list of records, checked against the server's adapter catalogue (model_job.cpp).
struct AdapterChoice {
  std::string name;
  std::optional<double> scale;  // 1.0 when unset
  std::string sha256;           // pinned by the client, or recorded when the job was accepted; "" : not yet
};

// The request, transport-neutral. Unset optionals take diffusers' defaults.
struct JobRequest {
  std::optional<RawTensor> prompt_embeds;
  std::optional<RawTensor> negative_prompt_embeds;
  std::optional<std::string> embeddings_safetensors;  // a safetensors file's bytes
  std::optional<std::string> prompt;                  // text (needs a text encoder)
  std::optional<std::string> negative_prompt;
  std::string described_prompt;  // the text embeddings were encoded from (JobSpec.prompt_text): description only
  // Image-to-video (image, optionally last_image) or video extension (video).
  std::optional<PixelRequest> image, last_image, video;
  std::vector<PromptChangeRequest> prompt_changes;
  std::vector<AdapterChoice> loras;
  // The generation parameters as asked (generation_param_list.h).
#define SKYREELS_REQUEST_MEMBER(member, name, request_type, ...) request_type member;
  SKYREELS_GENERATION_PARAMS(SKYREELS_REQUEST_MEMBER)
#undef SKYREELS_REQUEST_MEMBER
};

// Every generation parameter with its value in effect (what the job reports back; generation_param_list.h).
struct ResolvedParams {
#define SKYREELS_RESOLVED_MEMBER(member, name, request_type, resolved_type, initial, ...) resolved_type member = initial;
  SKYREELS_GENERATION_PARAMS(SKYREELS_RESOLVED_MEMBER)
#undef SKYREELS_RESOLVED_MEMBER
  std::vector<AdapterChoice> loras;  // every scale set, every sha256 the file's (model_job.cpp)
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
  // Its transformer's config (text_dim, num_frame_per_block, out_channels: the latent channels, patch_size: latent
  // positions per token), as the loader read it.
  model::TransformerConfig config;
  // The pipelines it runs (model::check_pipeline_fits): "df" and "t2v" (DF and T2V checkpoints share the
  // architecture), or "i2v" (an I2V checkpoint); and what a request that names none runs.
  std::vector<std::string> pipelines = {"df", "t2v"};
  std::string default_pipeline = "df";
  bool first_last_frame = false;  // i2v: the model takes a first and a last image (pos_embed)
  std::vector<float> magcache_ratios;  // --magcache-ratios (cache "magcache" is refused without them)
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
  int64_t pixel_begin = 0;  // the chunk's pixel frames [begin, end) of the decoded video
  int64_t pixel_end = 0;
};

// What the transport and the video encoder read of a job (JobSnapshot::description), fixed when the job is created:
// the parameters in effect and the layout of its chunk results (the results themselves are in the job store).
struct JobDescription {
  ResolvedParams params;
  std::string prompt;  // the text prompt; empty when asked for by embeddings
  std::vector<int64_t> latent_shape;  // [1, C, F, h, w] of the whole video
  std::vector<ChunkLayout> chunks;
};

}  // namespace skyreels::server
