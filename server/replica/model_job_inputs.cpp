// A job's request checked and converted into the model's inputs: tensors and embeddings (given, in a safetensors
// file, or encoded from text), prompt changes, images and videos (bounded before any decode), the adapters chosen and
// the pipeline asked for. Every refusal names its field (ValidationError: INVALID_ARGUMENT; PreconditionError:
// FAILED_PRECONDITION when the server lacks what the request needs).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

#include "model/adapter_bank.h"
#include "model/guidance.h"
#include "model/image_processor.h"
#include "model/pixel_conditioning.h"
#include "model/safetensors.h"
#include "model/safetensors_limits.h"
#include "server/replica/model_job_impl.h"

namespace skyreels::server::model_job_detail {

void invalid(const std::string& message) { throw ValidationError(message); }

namespace {

constexpr int64_t kMaxTensorElements = int64_t{1} << 28;
constexpr size_t kMaxPromptBytes = 16384;  // the tokenizer keeps 512 tokens anyway
// An i2v image is resized by the pipeline (any size goes in); its side is bounded on the file's header, before
// decoding, so that a decode holds at most 4096 x 4096 x 3 bytes.
constexpr int64_t kMaxImageSide = 4096;

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
    invalid(field + ": expected [1, T, text_dim] = [1, T, " + std::to_string(model.config.text_dim) + "], got shape " +
            shape_text(raw.shape));
  }
  if (raw.shape[0] != 1) invalid(field + ": batch must be 1, got shape " + shape_text(raw.shape));
  check_range(field + " tokens (shape[1])", raw.shape[1], 1, limits.max_text_tokens);
  if (raw.shape[2] != model.config.text_dim) {
    invalid(field + ": last dimension " + std::to_string(raw.shape[2]) + " does not match the model's text_dim " +
            std::to_string(model.config.text_dim));
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

}  // namespace

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

namespace {

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

}  // namespace

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

namespace {

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

// The prompt's embeddings: exactly one source (embeddings, a safetensors file, or text); the negative ones with
// guidance; then the prompt changes'.
void take_prompts(const JobRequest& request, const ModelDescription& model, const ServerLimits& limits,
                  const TextEncoderFn& text_encoder, const model::GenerationParams& p,
                  model::Conditioning& conditioning) {
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
  conditioning.prompt_embeds = embeddings(*prompt, "prompt_embeds", model, limits);
  if (guidance) {
    if (!negative) {
      invalid("negative_prompt_embeds: required when guidance_scale > 1 (classifier-free guidance), got " +
              std::to_string(p.guidance_scale));
    }
    conditioning.negative_prompt_embeds = embeddings(*negative, "negative_prompt_embeds", model, limits);
  }
  conditioning.prompt_changes = prompt_changes(request, model, limits, encoded);
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

}  // namespace skyreels::server::model_job_detail
