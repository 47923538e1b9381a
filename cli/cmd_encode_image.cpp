// `skyreels encode-image`: images -> the I2V pipeline's image tokens, exactly as diffusers' encode_image makes them
// (transformers' CLIPImageProcessor, then CLIPVisionModelWithProjection's hidden_states[-2]).
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "model/clip_vision.h"
#include "model/image_processor.h"
#include "model/safetensors.h"

namespace {

constexpr const char* kUsage =
    "usage: skyreels encode-image --image-encoder DIR [--image-processor DIR] --image FILE [--image FILE ...]\n"
    "                             [--dtype auto|float32|bfloat16] [--device cpu|cuda:N] --out OUT.safetensors\n"
    "\n"
    "Encodes images with the CLIP image encoder as the SkyReels-V2 image-to-video pipeline does (CLIPImageProcessor:\n"
    "RGB, shortest-edge resize with Pillow's arithmetic, centre crop, rescale, normalise; then the encoder's\n"
    "penultimate hidden states) and writes `pixel_values` float32 [N, 3, S, S], `image_tokens` float32\n"
    "[N, tokens, hidden] and `image_embeds` float32 [N, projection_dim] (the model's projected CLS token).\n"
    "\n"
    "  --image-encoder DIR    transformers CLIPVisionModelWithProjection folder (config.json + model.safetensors),\n"
    "                         a diffusers pipeline folder holding image_encoder/, or the original Wan / SkyReels-V2\n"
    "                         open-clip-xlm-roberta-large-vit-huge-14 weights (visual.*) as a .safetensors file\n"
    "  --image-processor DIR  folder with preprocessor_config.json (default: image_processor/ beside the encoder's\n"
    "                         folder, as diffusers lays out a pipeline, else the encoder's folder itself)\n"
    "  --image FILE           PNG or JPEG (decoded to 8-bit RGB, alpha dropped as Pillow's convert(\"RGB\")), or a\n"
    "                         .safetensors file with `image` uint8 [H, W, C] (C = 1, 2, 3, 4: made RGB as the\n"
    "                         processor does, Pillow's convert(\"RGB\")); repeat for a batch\n"
    "  --dtype D              encoder compute dtype (default float32); outputs are float32\n"
    "  --device D             cpu (default), cuda, cuda:N\n"
    "  --out FILE             output safetensors file";

namespace fs = std::filesystem;

std::string processor_dir_of(const std::string& encoder_dir) {
  const std::string found = skyreels::model::find_image_processor_dir(encoder_dir);
  if (found.empty()) {
    throw skyreels::cli::UsageError("no preprocessor_config.json found for '" + encoder_dir +
                                    "' (looked in image_processor/ beside it and in it); pass --image-processor DIR");
  }
  return found;
}

int run_encode_image(const std::vector<std::string>& argv) {
  using skyreels::cli::UsageError;
  namespace model = skyreels::model;
  const skyreels::cli::Args args(argv);
  args.reject_unknown({"image-encoder", "image-processor", "image", "dtype", "device", "out"});
  const std::string encoder_dir = args.require("image-encoder");
  const std::string out = args.require("out");
  const std::vector<std::string> paths = args.all("image");
  if (paths.empty()) throw UsageError("at least one --image is required");
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");

  const std::string processor_dir =
      args.has("image-processor") ? args.get("image-processor") : processor_dir_of(encoder_dir);
  const auto processor =
      model::ClipImageProcessorConfig::from_file((fs::path(processor_dir) / "preprocessor_config.json").string());
  std::vector<at::Tensor> images;
  for (const auto& path : paths) images.push_back(model::read_image(path));

  const auto t0 = std::chrono::steady_clock::now();
  model::ClipVisionLoadOptions options;
  options.device = args.get("device", "cpu");
  options.dtype = args.get("dtype", "float32");
  const model::LoadedClipVision encoder = model::load_clip_vision_encoder(encoder_dir, options);
  const auto t1 = std::chrono::steady_clock::now();
  const model::ClipPreprocessed pre = model::clip_preprocess(processor, images);
  const model::ClipVisionOutput encoded = encoder.model->forward(pre.pixel_values, /*image_embeds=*/true);
  const auto t2 = std::chrono::steady_clock::now();

  nlohmann::json meta_images = paths;
  skyreels::safetensors::save(out,
                              {{"pixel_values", pre.pixel_values},
                               {"image_tokens", encoded.penultimate},
                               {"image_embeds", encoded.image_embeds}},
                              {{"images", meta_images.dump()}, {"image_processor", processor_dir}});
  std::cout << "wrote " << out << ": image_tokens [" << encoded.penultimate.size(0) << ", "
            << encoded.penultimate.size(1) << ", " << encoded.penultimate.size(2) << "] float32 (load "
            << std::chrono::duration<double>(t1 - t0).count() << " s, encode "
            << std::chrono::duration<double>(t2 - t1).count() << " s)\n";
  return 0;
}

}  // namespace

SKYREELS_COMMAND("encode-image", "images -> image tokens with the CLIP image encoder (as the I2V pipeline)", kUsage,
                 run_encode_image);
