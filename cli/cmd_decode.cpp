// `skyreels decode`: latents (the generator's normalised output, or the VAE's own z) -> MP4 per batch item, or the
// decoded video tensor as safetensors. MP4 output is decoded and encoded latent frame by latent frame, so memory
// stays flat however long the video is.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
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
    "usage: skyreels decode --vae DIR --latents IN.safetensors --out OUT(.mp4|.safetensors)\n"
    "                       [--fps 24] [--crf 10] [--device cpu] [--dtype float32]\n\n"
    "  --vae DIR       diffusers AutoencoderKLWan folder (config.json + diffusion_pytorch_model.safetensors),\n"
    "                  or a pipeline folder holding vae/\n"
    "  --latents IN    safetensors holding `latents` [B,16,F,h,w] (normalised, as the generator returns them:\n"
    "                  de-normalised with the VAE's latents_mean/latents_std first) or `z` (the VAE's own latent\n"
    "                  space, decoded as is)\n"
    "  --out OUT       .mp4: one H.264 file per batch item (OUT, then OUT's stem with _1, _2, ...);\n"
    "                  .safetensors: tensor `video` [B,3,1+4(F-1),8h,8w] in [-1,1]\n"
    "  --fps N         frame rate of the MP4 (default 24)\n"
    "  --crf N         libx264 quality, 0..51, lower is better (default 10: SkyReels' imageio quality=8)\n"
    "  --device D      cpu, cuda, cuda:N (default cpu)\n"
    "  --dtype T       float32 (default; SkyReels decodes in fp32), bfloat16 or auto";

// Picks the one latent tensor of the file and says which space it is in.
at::Tensor read_latents(const std::string& path, bool* normalised) {
  auto file = skyreels::safetensors::File::open(path);
  const bool has_latents = file->contains("latents");
  const bool has_z = file->contains("z");
  if (has_latents == has_z) {
    std::string names;
    for (const auto& n : file->names()) names += (names.empty() ? "" : ", ") + n;
    throw std::runtime_error("'" + path + "' must hold exactly one of the tensors `latents` (normalised) or `z` " +
                             "(VAE latent space); it holds: " + (names.empty() ? "nothing" : names));
  }
  *normalised = has_latents;
  at::Tensor t = file->tensor(has_latents ? "latents" : "z").clone();
  if (t.dim() == 4) t = t.unsqueeze(0);
  if (t.dim() != 5) {
    throw std::runtime_error("'" + path + "': `" + std::string(has_latents ? "latents" : "z") +
                             "` must be [B, C, F, h, w], got " + std::to_string(t.dim()) + " dims");
  }
  return t;
}

std::string item_path(const fs::path& out, int64_t index) {
  if (index == 0) return out.string();
  fs::path p = out;
  p.replace_filename(out.stem().string() + "_" + std::to_string(index) + out.extension().string());
  return p.string();
}

void decode_to_mp4(const skyreels::model::WanVae& vae, const at::Tensor& z, const fs::path& out,
                   const skyreels::video::Mp4Options& options) {
  const int64_t spatial = vae.config().spatial_factor();
  const int width = static_cast<int>(z.size(4) * spatial);
  const int height = static_cast<int>(z.size(3) * spatial);
  for (int64_t b = 0; b < z.size(0); ++b) {
    const std::string path = item_path(out, b);
    // As many latent frames per call as the memory budget allows: each call's pixels go to the writer and are gone.
    const int64_t per_call = vae.decode_frames_per_call(1, z.size(3), z.size(4));
    skyreels::model::WanVaeDecodeSession session(vae, per_call);
    skyreels::video::Mp4Writer writer(path, width, height, options);
    for (int64_t f = 0; f < z.size(2); f += per_call) {
      const at::Tensor pixels = session.decode(z.narrow(0, b, 1).narrow(2, f, std::min(per_call, z.size(2) - f)));
      writer.write_video(pixels[0]);
    }
    writer.finish();
    spdlog::info("wrote {} ({} frames, {}x{}, {} fps)", path, writer.frames_written(), width, height, options.fps);
  }
}

int run_decode(const std::vector<std::string>& raw) {
  const Args args(raw);
  args.reject_unknown({"vae", "latents", "out", "fps", "crf", "device", "dtype"});
  const std::string vae_dir = args.require("vae");
  const std::string in = args.require("latents");
  const fs::path out = args.require("out");
  const std::string ext = out.extension().string();
  if (ext != ".mp4" && ext != ".safetensors") throw UsageError("--out must end in .mp4 or .safetensors");
  skyreels::video::Mp4Options mp4;
  mp4.fps = args.get_int("fps", mp4.fps);
  mp4.crf = args.get_int("crf", 10);
  if (mp4.fps <= 0) throw UsageError("--fps must be > 0");

  skyreels::checkpoint::PlaceOptions place;
  place.device = args.get("device", "cpu");
  place.dtype = skyreels::checkpoint::parse_dtype(
      skyreels::runtime::resolve_dtype_name(args.get("dtype", "float32"), place.device));

  bool normalised = false;
  const at::Tensor input = read_latents(in, &normalised);
  const auto vae = skyreels::model::WanVae::load(vae_dir, place);
  const at::Tensor z = normalised ? vae.denormalize(input) : input;
  spdlog::info("decoding {} {} of shape {}", in, normalised ? "normalised latents" : "z",
               skyreels::checkpoint::shape_str(input.sizes().vec()));

  const auto start = std::chrono::steady_clock::now();
  if (ext == ".mp4") {
    decode_to_mp4(vae, z, out, mp4);
  } else {
    const at::Tensor video = vae.decode(z).to(at::kCPU, at::kFloat);
    skyreels::safetensors::save(out.string(), {{"video", video}});
    spdlog::info("wrote {} (video {})", out.string(), skyreels::checkpoint::shape_str(video.sizes().vec()));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("decoded {} latent frame(s) x {} item(s) in {:.2f} s", z.size(2), z.size(0), seconds);
  return 0;
}

}  // namespace

SKYREELS_COMMAND("decode", "decode latents with the Wan VAE into MP4 (or a video tensor)", kUsage, run_decode);
