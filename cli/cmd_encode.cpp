// `skyreels encode`: a video (or image) -> Wan VAE latents: the posterior mode, normalised as the I2V/V2V pipelines
// use it, plus the raw mean and logvar.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "cli/command.h"
#include "model/checkpoint.h"
#include "model/runtime.h"
#include "model/safetensors.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"

namespace {

namespace fs = std::filesystem;
using skyreels::cli::Args;
using skyreels::cli::UsageError;

const char* kUsage =
    "usage: skyreels encode --vae DIR --video IN --out OUT.safetensors [--device cpu] [--dtype float32]\n\n"
    "  --vae DIR     diffusers AutoencoderKLWan folder, or a pipeline folder holding vae/\n"
    "  --video IN    .safetensors with `video` [B,3,T,H,W] (or [3,T,H,W]) in [-1,1], or any file FFmpeg reads\n"
    "                (.mp4, or a .png/.jpg image as one frame). T should be 1 + 4k: diffusers drops the rest.\n"
    "  --out OUT     .safetensors with `latents` (normalised posterior mode: (mean - latents_mean) / latents_std),\n"
    "                `mean` and `logvar` [B,16,1+(T-1)/4,H/8,W/8]\n"
    "  --device D    cpu, cuda, cuda:N (default cpu)\n"
    "  --dtype T     float32 (default), bfloat16 or auto";

at::Tensor read_video_input(const std::string& path) {
  if (fs::path(path).extension() == ".safetensors") {
    auto file = skyreels::safetensors::File::open(path);
    if (!file->contains("video")) throw std::runtime_error("'" + path + "' holds no tensor `video`");
    at::Tensor video = file->tensor("video").clone();
    if (video.dim() == 4) video = video.unsqueeze(0);
    if (video.dim() != 5) throw std::runtime_error("'" + path + "': `video` must be [B, 3, T, H, W]");
    return video;
  }
  const auto decoded = skyreels::video::read_video(path);
  if (decoded.info.frames == 0) throw std::runtime_error("'" + path + "' has no frames");
  spdlog::info("read {} ({}, {}x{}, {} frames)", path, decoded.info.codec, decoded.info.width, decoded.info.height,
               decoded.info.frames);
  return skyreels::video::from_rgb_uint8(decoded.frames).unsqueeze(0);
}

int run_encode(const std::vector<std::string>& raw) {
  const Args args(raw);
  args.reject_unknown({"vae", "video", "out", "device", "dtype"});
  const std::string vae_dir = args.require("vae");
  const std::string in = args.require("video");
  const std::string out = args.require("out");
  if (fs::path(out).extension() != ".safetensors") throw UsageError("--out must end in .safetensors");

  skyreels::checkpoint::PlaceOptions place;
  place.device = args.get("device", "cpu");
  place.dtype = skyreels::checkpoint::parse_dtype(
      skyreels::runtime::resolve_dtype_name(args.get("dtype", "float32"), place.device));

  const at::Tensor video = read_video_input(in);
  const auto vae = skyreels::model::WanVae::load(vae_dir, place);
  const auto posterior = vae.encode(video);
  const at::Tensor mean = posterior.mean.to(at::kCPU, at::kFloat);
  const at::Tensor latents = vae.normalize(posterior.mode()).to(at::kCPU);
  skyreels::safetensors::save(
      out, {{"latents", latents}, {"mean", mean}, {"logvar", posterior.logvar.to(at::kCPU, at::kFloat)}});
  spdlog::info("wrote {} (latents {})", out, skyreels::checkpoint::shape_str(latents.sizes().vec()));
  return 0;
}

}  // namespace

SKYREELS_COMMAND("encode", "encode a video or image into Wan VAE latents", kUsage, run_encode);
