#include "server/replica/model_job.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/adapter_bank.h"
#include "model/clip_vision.h"
#include "model/diffusion_forcing.h"
#include "model/image_processor.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/pixel_conditioning.h"
#include "model/safetensors.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"
#include "model/safetensors_limits.h"
#include "model/guidance.h"
#include "model/video_shape.h"
#include "server/job/blob.h"
#include "server/job/fingerprint.h"
#include "server/job/generation_params.h"
#include "server/job/generation_params_model.h"

namespace skyreels::server {

namespace {

constexpr int64_t kMaxTensorElements = int64_t{1} << 28;
constexpr size_t kMaxPromptBytes = 16384;  // the tokenizer keeps 512 tokens anyway
// An i2v image is resized by the pipeline (any size goes in); its side is bounded on the file's header, before
// decoding, so that a decode holds at most 4096 x 4096 x 3 bytes.
constexpr int64_t kMaxImageSide = 4096;

[[noreturn]] void invalid(const std::string& message) { throw ValidationError(message); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// ---- checks -----------------------------------------------------------------------------------------------------

void check_range(const std::string& field, int64_t value, int64_t lo, int64_t hi, const std::string& why = "") {
  if (value < lo || value > hi) {
    invalid(field + ": " + std::to_string(value) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
            "]" + (why.empty() ? "" : " (" + why + ")"));
  }
}

// ---- tensors ------------------------------------------------------------------------------------------------------

at::Tensor to_tensor(const RawTensor& raw, const std::string& field) {
  at::ScalarType type;
  if (raw.dtype == "F32") {
    type = at::kFloat;
  } else if (raw.dtype == "BF16") {
    type = at::kBFloat16;
  } else if (raw.dtype == "F16") {
    type = at::kHalf;
  } else {
    invalid(field + ": dtype " + (raw.dtype.empty() ? std::string("(unset)") : raw.dtype) +
            " is not supported (F32, BF16 or F16)");
  }
  int64_t numel = 1;
  for (int64_t d : raw.shape) {
    if (d <= 0) invalid(field + ": shape " + shape_text(raw.shape) + " has a dimension < 1");
    if (numel > kMaxTensorElements / d) invalid(field + ": shape " + shape_text(raw.shape) + " is too large");
    numel *= d;
  }
  const auto bytes = static_cast<size_t>(numel) * at::elementSize(type);
  if (raw.data.size() != bytes) {
    invalid(field + ": " + std::to_string(raw.data.size()) + " bytes of data, but shape " + shape_text(raw.shape) +
            " x " + raw.dtype + " needs " + std::to_string(bytes));
  }
  at::Tensor t = at::empty(raw.shape, at::TensorOptions().dtype(type));
  std::memcpy(t.data_ptr(), raw.data.data(), bytes);
  return t.to(at::kFloat);
}

at::Tensor embeddings(const RawTensor& raw, const std::string& field, const ModelDescription& model,
                      const ServerLimits& limits) {
  if (raw.shape.size() != 3) {
    invalid(field + ": expected [1, T, text_dim] = [1, T, " + std::to_string(model.text_dim) + "], got shape " +
            shape_text(raw.shape));
  }
  if (raw.shape[0] != 1) invalid(field + ": batch must be 1, got shape " + shape_text(raw.shape));
  check_range(field + " tokens (shape[1])", raw.shape[1], 1, limits.max_text_tokens);
  if (raw.shape[2] != model.text_dim) {
    invalid(field + ": last dimension " + std::to_string(raw.shape[2]) + " does not match the model's text_dim " +
            std::to_string(model.text_dim));
  }
  at::Tensor t = to_tensor(raw, field);
  if (!at::isfinite(t).all().item<bool>()) invalid(field + ": contains NaN or infinite values");
  return t;
}

// The two tensors of a safetensors file sent as bytes.
void parse_embeddings_file(const std::string& bytes, std::optional<RawTensor>& prompt,
                           std::optional<RawTensor>& negative) {
  const std::string field = "embeddings_safetensors";
  if (bytes.size() < 8) invalid(field + ": " + std::to_string(bytes.size()) + " bytes is not a safetensors file");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  if (header_len > bytes.size() - 8) {
    invalid(field + ": header length " + std::to_string(header_len) + " is past the end (" +
            std::to_string(bytes.size()) + " bytes)");
  }
  // Checked before the header is copied or parsed: a huge nested header costs seconds and gigabytes to parse.
  if (header_len > safetensors::kMaxBlobHeaderBytes) {
    invalid(field + ": header of " + std::to_string(header_len) + " bytes is over the limit of " +
            std::to_string(safetensors::kMaxBlobHeaderBytes) + " bytes");
  }
  std::vector<safetensors::TensorInfo> infos;
  std::map<std::string, std::string> metadata;
  try {
    safetensors::parse_header("(request)", bytes.substr(8, header_len), header_len, bytes.size(), infos, metadata);
  } catch (const safetensors::FormatError& e) {
    invalid(field + ": " + e.what());
  }
  for (const auto& info : infos) {
    RawTensor raw;
    raw.dtype = safetensors::dtype_name(info.dtype);
    raw.shape = info.shape;
    raw.data = bytes.substr(8 + header_len + info.begin, info.end - info.begin);
    if (info.name == "prompt_embeds") {
      prompt = std::move(raw);
    } else if (info.name == "negative_prompt_embeds") {
      negative = std::move(raw);
    } else {
      invalid(field + ": unexpected tensor '" + info.name + "' (expected prompt_embeds and optionally " +
              "negative_prompt_embeds)");
    }
  }
  if (!prompt) invalid(field + ": no tensor named prompt_embeds");
}

// ---- image / video conditioning -------------------------------------------------------------------------------

// One image or video, bounded and shape-checked before any decode or copy; decoders get the request's exact size as
// their limit, so nothing larger than the video being made is ever allocated.
at::Tensor pixel_input(const PixelRequest& r, const std::string& field, model::PixelKind kind,
                       const model::GenerationParams& p, const ServerLimits& limits) {
  if (r.encoded.has_value() == r.tensor.has_value()) invalid(field + ": give either encoded bytes or a tensor");
  const auto max_bytes = static_cast<size_t>(limits.max_pixel_input_bytes);
  if (r.encoded) {
    if (r.encoded->empty()) invalid(field + ".encoded: empty");
    if (r.encoded->size() > max_bytes) {
      invalid(field + ".encoded: " + std::to_string(r.encoded->size()) + " bytes, more than the limit " +
              std::to_string(max_bytes));
    }
    video::ReadLimits read;
    read.max_width = static_cast<int>(p.width);
    read.max_height = static_cast<int>(p.height);
    read.max_frames = kind == model::PixelKind::kImage ? 1 : limits.max_frames;
    // A video is continued from its last overlap_history frames: only those are kept while decoding.
    if (kind == model::PixelKind::kVideo && p.overlap_history) read.keep_last = *p.overlap_history;
    const std::vector<uint8_t> bytes(r.encoded->begin(), r.encoded->end());
    try {
      return model::decode_pixels(bytes, kind, read, field + ".encoded");
    } catch (const std::invalid_argument& e) {
      invalid(e.what());
    }
  }
  const RawTensor& t = *r.tensor;
  const std::vector<int64_t> expected_tail = {3, p.height, p.width};
  const size_t dims = kind == model::PixelKind::kImage ? 4 : 5;
  const bool shape_ok =
      t.shape.size() == dims && std::equal(expected_tail.begin(), expected_tail.end(), t.shape.end() - 3);
  if (!shape_ok) {
    invalid(field + ".tensor: expected " +
            (kind == model::PixelKind::kImage ? std::string("[1, 3, ") : std::string("[1, F, 3, ")) +
            std::to_string(p.height) + ", " + std::to_string(p.width) + "] (the request's height x width), got " +
            shape_text(t.shape));
  }
  if (kind == model::PixelKind::kVideo)
    check_range(field + ".tensor frames (shape[1])", t.shape[1], 1, limits.max_frames);
  if (t.data.size() > max_bytes) {
    invalid(field + ".tensor: " + std::to_string(t.data.size()) + " bytes, more than the limit " +
            std::to_string(max_bytes));
  }
  at::Tensor pixels = to_tensor(t, field + ".tensor");
  if (kind == model::PixelKind::kVideo && p.overlap_history && pixels.size(1) > *p.overlap_history) {
    pixels = pixels.narrow(1, pixels.size(1) - *p.overlap_history, *p.overlap_history).clone();  // what is encoded
  }
  return pixels;
}

model::PixelConditioning pixel_conditioning(const JobRequest& r, const model::GenerationParams& p,
                                            const ServerLimits& limits) {
  model::PixelConditioning pixels;
  if (r.image && r.video) invalid("image: an image (image-to-video) and a video (video extension) are exclusive");
  if (r.last_image && !r.image) invalid("last_image: needs an image as the first frame");
  if (r.image) pixels.image = pixel_input(*r.image, "image", model::PixelKind::kImage, p, limits);
  if (r.last_image) pixels.last_image = pixel_input(*r.last_image, "last_image", model::PixelKind::kImage, p, limits);
  if (r.video) pixels.video = pixel_input(*r.video, "video", model::PixelKind::kVideo, p, limits);
  return pixels;
}

// The i2v pipeline's images: PNG / JPEG bytes of any size up to kMaxImageSide (its CLIP and VAE sides resize them as
// Pillow does), decoded to uint8 RGB [H, W, 3].
at::Tensor pipeline_image(const PixelRequest& r, const std::string& field, const ServerLimits& limits) {
  if (!r.encoded) {
    invalid(field + ".tensor: the i2v pipeline takes an encoded PNG / JPEG image (its CLIP and VAE sides resize it as "
                    "Pillow does); send it as " + field + ".encoded");
  }
  if (r.encoded->empty()) invalid(field + ".encoded: empty");
  if (r.encoded->size() > static_cast<size_t>(limits.max_pixel_input_bytes)) {
    invalid(field + ".encoded: " + std::to_string(r.encoded->size()) + " bytes, more than the limit " +
            std::to_string(limits.max_pixel_input_bytes));
  }
  const std::vector<uint8_t> bytes(r.encoded->begin(), r.encoded->end());
  try {
    return model::convert_to_rgb(model::decode_image(bytes, field + ".encoded", model::ImageLimits{kMaxImageSide, 2}));
  } catch (const std::invalid_argument& e) {
    invalid(e.what());
  }
}

// GenerationParams.loras against the server's catalogue: names, scales and count checked, each file's SHA-256
// recorded; a sha256 the request already carries (a client's pin, or a stored job's) must still be the file's.
std::vector<AdapterChoice> resolve_adapters(const std::vector<AdapterChoice>& asked,
                                            const model::AdapterCatalogue* catalogue) {
  if (asked.empty()) return {};
  if (catalogue == nullptr) {
    throw PreconditionError("loras: this server has no adapters to choose from (start it with --lora-dir DIR)");
  }
  std::vector<model::AdapterRequest> requests;
  for (const AdapterChoice& a : asked) requests.push_back({a.name, a.scale.value_or(1.0)});
  std::vector<model::ResolvedAdapter> resolved;
  try {
    resolved = catalogue->resolve(requests, "loras");
  } catch (const std::invalid_argument& e) {
    invalid(e.what());
  }
  std::vector<AdapterChoice> out;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (!asked[i].sha256.empty() && asked[i].sha256 != resolved[i].sha256) {
      throw PreconditionError("loras[" + std::to_string(i) + "]: adapter '" + resolved[i].name +
                              "' is not the file this job was accepted with (sha256 " + asked[i].sha256 +
                              "); the file in --lora-dir now has sha256 " + resolved[i].sha256);
    }
    out.push_back({resolved[i].name, resolved[i].scale, resolved[i].sha256});
  }
  return out;
}

// A pipeline the loaded model does not run: FAILED_PRECONDITION naming what it runs.
void check_pipeline_served(const std::string& pipeline, const ModelDescription& model) {
  if (std::find(model.pipelines.begin(), model.pipelines.end(), pipeline) != model.pipelines.end()) return;
  std::string served;
  for (const auto& p : model.pipelines) served += (served.empty() ? "" : ", ") + p;
  throw PreconditionError("pipeline: " + pipeline + " needs " +
                          (pipeline == "i2v" ? std::string("an image-to-video (I2V) checkpoint")
                                             : std::string("a diffusion-forcing or text-to-video checkpoint")) +
                          "; this server's model runs " + served);
}

// ---- fingerprint ----------------------------------------------------------------------------------------------

// The request's bytes in a fixed order, into both fingerprint versions (server/fingerprint.h).
struct RequestHasher {
  FingerprintHasher h;
  void bytes(const void* data, size_t n) { h.bytes(data, n); }
  void str(const std::string& s) {
    add(static_cast<uint64_t>(s.size()));
    bytes(s.data(), s.size());
  }
  template <typename T>
  void add(const T& v) {
    bytes(&v, sizeof v);
  }
  void tensor(const std::optional<RawTensor>& t) {
    add(static_cast<uint8_t>(t.has_value()));
    if (!t) return;
    str(t->dtype);
    for (int64_t d : t->shape) add(d);
    str(t->data);
  }
};

struct RequestFingerprint {
  uint64_t v1 = 0;
  std::string v2;
};

// `adapters`: the job's, resolved (their files' SHA-256); none adds nothing (older fingerprints stay valid).
RequestFingerprint fingerprint_of(const JobRequest& r, const std::vector<AdapterChoice>& adapters) {
  RequestHasher f;
  f.tensor(r.prompt_embeds);
  f.tensor(r.negative_prompt_embeds);
  f.add(static_cast<uint8_t>(r.embeddings_safetensors.has_value()));
  if (r.embeddings_safetensors) f.str(*r.embeddings_safetensors);
  f.add(static_cast<uint8_t>(r.prompt.has_value()));
  if (r.prompt) f.str(*r.prompt);
  f.add(static_cast<uint8_t>(r.negative_prompt.has_value()));
  if (r.negative_prompt) f.str(*r.negative_prompt);
  fingerprint_generation_params(r, [&f](const void* data, size_t size) { f.bytes(data, size); });
  for (const auto* pixels : {&r.image, &r.last_image, &r.video}) {
    f.add(static_cast<uint8_t>(pixels->has_value()));
    if (!*pixels) continue;
    f.add(static_cast<uint8_t>((*pixels)->encoded.has_value()));
    if ((*pixels)->encoded) f.str(*(*pixels)->encoded);
    f.tensor((*pixels)->tensor);
  }
  f.add(static_cast<uint64_t>(r.prompt_changes.size()));
  for (const auto& change : r.prompt_changes) {
    f.add(change.from_frame);
    f.tensor(change.prompt_embeds);
    f.tensor(change.negative_prompt_embeds);
    f.add(static_cast<uint8_t>(change.text.has_value()));
    if (change.text) f.str(*change.text);
  }
  for (const AdapterChoice& a : adapters) {
    f.str(a.name);
    f.add(a.scale.value_or(1.0));
    f.str(a.sha256);
  }
  const uint64_t v1 = f.h.v1();
  return {v1, f.h.v2()};
}

// ---- prompt changes ---------------------------------------------------------------------------------------------

// Every text of a request, in order: the prompt, the negative prompt (with guidance), then each prompt change's
// text; checked before anything is encoded.
std::vector<std::string> request_texts(const JobRequest& r, bool guidance, const TextEncoderFn& text_encoder) {
  std::vector<std::string> texts;
  if (r.prompt) {
    if (!text_encoder) {
      throw PreconditionError(
          "text: this server has no text encoder (start it with --text-encoder and "
          "--tokenizer), send prompt embeddings instead");
    }
    if (r.prompt->empty()) invalid("text.prompt: must not be empty");
    if (r.prompt->size() > kMaxPromptBytes || r.negative_prompt.value_or("").size() > kMaxPromptBytes) {
      invalid("text.prompt: longer than " + std::to_string(kMaxPromptBytes) + " bytes");
    }
    texts.push_back(*r.prompt);
    if (guidance) texts.push_back(r.negative_prompt.value_or(""));
  }
  for (size_t i = 0; i < r.prompt_changes.size(); ++i) {
    const PromptChangeRequest& c = r.prompt_changes[i];
    if (!c.text) continue;
    const std::string field = "prompt_changes[" + std::to_string(i) + "]";
    if (!text_encoder) throw PreconditionError(field + ".text: this server has no text encoder; send embeddings");
    if (c.text->empty() || c.text->size() > kMaxPromptBytes) {
      invalid(field + ".text: must be 1 to " + std::to_string(kMaxPromptBytes) + " bytes");
    }
    texts.push_back(*c.text);
  }
  return texts;
}

// `encoded(text)`: the embeddings of a text of request_texts().
std::vector<model::PromptChange> prompt_changes(const JobRequest& r, const ModelDescription& model,
                                                const ServerLimits& limits,
                                                const std::function<RawTensor(const std::string&)>& encoded) {
  check_range("prompt_changes (count)", static_cast<int64_t>(r.prompt_changes.size()), 0, limits.max_prompt_changes);
  std::vector<model::PromptChange> out;
  int64_t previous = -1;
  for (size_t i = 0; i < r.prompt_changes.size(); ++i) {
    const PromptChangeRequest& c = r.prompt_changes[i];
    const std::string field = "prompt_changes[" + std::to_string(i) + "]";
    check_range(field + ".from_frame", c.from_frame, previous + 1, limits.max_frames, "ascending, within --max-frames");
    previous = c.from_frame;
    if (c.prompt_embeds.has_value() == c.text.has_value()) invalid(field + ": give either embeddings or text");
    model::PromptChange change;
    change.from_frame = c.from_frame;
    if (c.text) {
      change.prompt_embeds = embeddings(encoded(*c.text), field + ".text", model, limits);
    } else {
      change.prompt_embeds = embeddings(*c.prompt_embeds, field + ".prompt_embeds", model, limits);
      if (c.negative_prompt_embeds) {
        change.negative_prompt_embeds =
            embeddings(*c.negative_prompt_embeds, field + ".negative_prompt_embeds", model, limits);
      }
    }
    out.push_back(std::move(change));
  }
  return out;
}

}  // namespace

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
                              const model::GenerationParams& params);
  // The job's random streams, positioned after the last chunk that succeeded (committed only on success).
  std::unique_ptr<model::NoiseSource> noise;
  std::shared_ptr<const JobDescription> description;
};

// The VAE encode of the job's image / video, on the first chunk's replica thread. Chunks of one job never run
// concurrently, so the job's state needs no lock here.
void ModelJob::Impl::encode_conditioning_once() {
  if (pixels.empty()) return;
  model::EncodedConditioning encoded;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    encoded = model::encode_conditioning(*vae, pixels, generation);
  } catch (const std::invalid_argument& e) {
    throw ValidationError(e.what());
  }
  if (on_vae_encode) on_vae_encode(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  conditioning.prefix_latents = encoded.prefix_latents;
  conditioning.last_image_latents = encoded.last_image_latents;
  pixels = {};
}

// The i2v images' CLIP tokens and VAE condition video, as `skyreels generate --pipeline i2v` makes them.
void ModelJob::Impl::encode_images_once(const model::TransformerConfig& config) {
  if (!image_rgb.defined()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> images{image_rgb};
  if (last_image_rgb.defined()) images.push_back(last_image_rgb);
  const at::Tensor tokens =
      image_encoder->model->forward(model::clip_preprocess(*image_encoder->processor, images).pixel_values).penultimate;
  video.image_tokens = model::prepare_image_tokens(config, tokens.narrow(0, 0, 1),
                                                   last_image_rgb.defined() ? tokens.narrow(0, 1, 1) : at::Tensor());
  auto vae_side = [&](const at::Tensor& rgb) {
    return rgb.defined() ? model::vae_image_preprocess(rgb, generation.height, generation.width) : at::Tensor();
  };
  video.condition =
      model::prepare_i2v_condition(*vae, vae_side(image_rgb), vae_side(last_image_rgb), generation.num_frames)
          .condition;
  if (on_vae_encode) on_vae_encode(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  image_rgb = at::Tensor();
  last_image_rgb = at::Tensor();
}

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

// The t2v / i2v request's images, checked against the model and the server's encoders, decoded into the job.
void take_pipeline_images(const JobRequest& request, const ModelDescription& model, const ServerLimits& limits,
                          const std::string& pipeline, bool have_vae, bool have_image_encoder, at::Tensor& image,
                          at::Tensor& last_image) {
  if (request.video) {
    invalid("video: video extension runs on the diffusion-forcing pipeline; pipeline " + pipeline + " takes no video");
  }
  if (pipeline == "t2v") {
    if (request.image || request.last_image) {
      invalid(std::string(request.image ? "image" : "last_image") +
              ": pipeline t2v takes no image (image-to-video: pipeline df, or i2v on an I2V checkpoint)");
    }
    return;
  }
  if (!request.image) invalid("image: pipeline i2v needs an image (the video's first frame)");
  if (request.last_image && !model.first_last_frame) {
    invalid("last_image: this I2V model takes one image (it has no first-last-frame position embedding)");
  }
  if (!request.last_image && model.first_last_frame) {
    invalid("last_image: this first-last-frame I2V model needs a last image as well");
  }
  if (!have_vae) throw PreconditionError("image: this server has no VAE to encode the condition video (start it with --vae)");
  if (!have_image_encoder) {
    throw PreconditionError("image: this server has no image encoder for the i2v pipeline (start it with "
                            "--image-encoder)");
  }
  image = pipeline_image(*request.image, "image", limits);
  if (request.last_image) last_image = pipeline_image(*request.last_image, "last_image", limits);
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
      request, ResolveContext{model.num_frame_per_block, random_seed, model.default_pipeline});
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
  if (limits.kv_cache_bytes >= 0) d.generation.kv_cache_max_bytes = limits.kv_cache_bytes;
  const model::GenerationParams& p = d.generation;

  const int sources = static_cast<int>(request.prompt_embeds.has_value()) +
                      static_cast<int>(request.embeddings_safetensors.has_value()) +
                      static_cast<int>(request.prompt.has_value());
  if (sources != 1) {
    invalid("conditioning: exactly one of embeddings, embeddings_safetensors or text is required (got " +
            std::to_string(sources) + ")");
  }
  std::optional<RawTensor> prompt = request.prompt_embeds;
  std::optional<RawTensor> negative = request.negative_prompt_embeds;
  if (request.embeddings_safetensors) parse_embeddings_file(*request.embeddings_safetensors, prompt, negative);
  // Every text of the request in one encoder call (prompt-change texts included).
  const bool guidance = model::guided(p.guidance_scale);
  const std::vector<std::string> texts = request_texts(request, guidance, text_encoder);
  std::vector<RawTensor> encoded_texts;
  if (!texts.empty()) {
    encoded_texts = text_encoder(texts);
    if (encoded_texts.size() != texts.size()) throw std::logic_error("text encoder: one result per text expected");
  }
  auto encoded = [&](const std::string& text) -> const RawTensor& {
    const auto it = std::find(texts.begin(), texts.end(), text);
    if (it == texts.end()) throw std::logic_error("text encoder: a text of the request was not encoded");
    return encoded_texts[static_cast<size_t>(it - texts.begin())];
  };
  if (request.prompt) {
    prompt = encoded(*request.prompt);
    if (guidance) negative = encoded(request.negative_prompt.value_or(""));
  }
  d.conditioning.prompt_embeds = embeddings(*prompt, "prompt_embeds", model, limits);
  if (guidance) {
    if (!negative) {
      invalid("negative_prompt_embeds: required when guidance_scale > 1 (classifier-free guidance), got " +
              std::to_string(p.guidance_scale));
    }
    d.conditioning.negative_prompt_embeds = embeddings(*negative, "negative_prompt_embeds", model, limits);
  }
  d.conditioning.prompt_changes = prompt_changes(request, model, limits, encoded);

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
    d.plan = diffusion_forcing ? model::plan_chunks(p, model.num_frame_per_block) : whole_video_plan(p);
  } catch (const std::invalid_argument& e) {
    invalid(e.what());  // plan_chunks names the field first
  }
  d.latent_channels = model.latent_channels;
  std::copy(std::begin(model.patch_size), std::end(model.patch_size), std::begin(d.patch_size));
  RequestFingerprint fingerprint = fingerprint_of(request, d.resolved.loras);
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

namespace {
// A chunk's result as the job store keeps it: its new latent frames (fp32, CPU) and where they belong.
std::string chunk_result_bytes(const at::Tensor& fresh, int64_t chunk, int64_t chunk_count,
                               const model::ChunkSpec& spec, uint64_t seed) {
  if (fresh.size(2) != spec.output_end - spec.output_begin) {
    throw std::logic_error("chunk " + std::to_string(chunk) + " produced " + std::to_string(fresh.size(2)) +
                           " new latent frames, the plan expects " +
                           std::to_string(spec.output_end - spec.output_begin));
  }
  return safetensors_bytes("latents", fresh.sizes().vec(), fresh.data_ptr<float>(),
                           {{"chunk_index", std::to_string(chunk)},
                            {"chunk_count", std::to_string(chunk_count)},
                            {"latent_frame_begin", std::to_string(spec.output_begin)},
                            {"latent_frame_end", std::to_string(spec.output_end)},
                            {"seed", std::to_string(seed)}});
}
}  // namespace

// The t2v / i2v call, as `skyreels generate --pipeline t2v|i2v` makes it: one video from the job's noise stream.
std::string ModelJob::Impl::run_whole_video(const model::SkyReelsV2Transformer& transformer,
                                            const model::StepHooks& hooks, const model::GenerationParams& params) {
  encode_images_once(transformer.config());
  if (!noise) noise = model::make_seeded_noise(resolved.seed);
  std::unique_ptr<model::NoiseSource> draws = noise->clone();
  model::VideoHooks video_hooks;
  video_hooks.cancelled = hooks.cancelled;
  video_hooks.on_step = [&hooks](int64_t step, int64_t steps, const at::Tensor&) {
    if (hooks.on_step) hooks.on_step(0, step, steps);
  };
  const at::Tensor latents =
      model::generate_video(transformer, pipeline, params, video, *draws, 1, video_hooks).contiguous();
  std::string bytes = chunk_result_bytes(latents, 0, 1, plan.chunks.front(), resolved.seed);
  noise = std::move(draws);
  return bytes;
}

std::string ModelJob::run_chunk(const model::SkyReelsV2Transformer& transformer, int64_t chunk,
                                const model::StepHooks& hooks, const std::vector<model::ActiveAdapter>& adapters) {
  Impl& d = *impl_;
  model::GenerationParams params = d.generation;  // the job's, with this replica's copy of its adapters
  params.adapters = adapters;
  if (d.pipeline != model::PipelineKind::kDiffusionForcing) return d.run_whole_video(transformer, hooks, params);
  const model::ChunkSpec& spec = d.plan.chunks.at(static_cast<size_t>(chunk));
  // Chunk k's noise depends on (seed, k) only, never on where chunk k-1 ran. The chunk draws from a copy of the
  // job's committed streams (O(chunk) draws, not O(all chunks so far)); a failed chunk leaves them untouched, so its
  // retry, on any replica, draws the same values.
  d.encode_conditioning_once();
  if (!d.noise) d.noise = model::make_seeded_noise(d.resolved.seed);
  std::unique_ptr<model::NoiseSource> noise = d.noise->clone();
  const at::Tensor latents =
      model::run_chunk(transformer, params, d.plan, chunk, d.conditioning, d.tail, *noise, hooks);

  // The video's tail for the next chunk, on this replica's device, as diffusers' accumulated video would end.
  const int64_t overlap = d.plan.overlap_latent_frames;
  at::Tensor tail;
  if (overlap > 0 && chunk + 1 < chunk_count()) {
    const at::Tensor video = model::accumulate(chunk == 0 ? at::Tensor() : d.tail.to(latents.device()), latents, spec);
    tail = video.narrow(2, video.size(2) - overlap, overlap).clone();
  }
  const at::Tensor fresh =
      latents.narrow(2, spec.keep_from, latents.size(2) - spec.keep_from).to(at::kCPU, at::kFloat).contiguous();
  std::string bytes = chunk_result_bytes(fresh, chunk, chunk_count(), spec, d.resolved.seed);
  d.tail = tail;
  d.noise = std::move(noise);
  return bytes;
}

void ModelJob::restore_results(const std::vector<std::string>& chunk_bytes) {
  Impl& d = *impl_;
  const auto n = static_cast<int64_t>(chunk_bytes.size());
  if (n > chunk_count()) throw std::runtime_error("more stored chunks than the plan has");
  // The accumulated video is chunk 0's whole output (keep_from is 0) then every later chunk's new frames; the next
  // chunk reads its last overlap frames.
  const int64_t overlap = d.plan.overlap_latent_frames;
  const bool need_tail = overlap > 0 && n > 0 && n < chunk_count();
  std::vector<at::Tensor> video;
  for (int64_t k = 0; k < n; ++k) {
    const model::ChunkSpec& spec = d.plan.chunks[static_cast<size_t>(k)];
    const F32View view = parse_f32_tensor(chunk_bytes[static_cast<size_t>(k)], "latents");
    if (view.shape.size() != 5 || view.shape[2] != spec.output_end - spec.output_begin) {
      throw std::runtime_error("stored chunk " + std::to_string(k) + " does not match the job's plan");
    }
    if (need_tail) {
      at::Tensor t = at::empty(view.shape, at::kFloat);
      std::memcpy(t.data_ptr<float>(), view.data, view.bytes);
      video.push_back(std::move(t));
    }
  }
  if (need_tail) {
    const at::Tensor joined = at::cat(video, 2);
    if (joined.size(2) < overlap) {
      throw std::runtime_error("the stored chunks hold fewer latent frames than the next chunk's overlap");
    }
    d.tail = joined.narrow(2, joined.size(2) - overlap, overlap).clone();
  }
}

}  // namespace skyreels::server
