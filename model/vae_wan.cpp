// WanVae: the weights bound to the layer tree (vae_wan_layers.h), loading a diffusers folder, the latents'
// normalisation, decode (through WanVaeDecodeSession, its causal cache kept between calls), encode, and the memory
// budget's frames per call.
#include "model/vae_wan.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "model/vae_wan_layers.h"
#include "model/video_shape.h"

namespace skyreels::model {

using wan_vae_detail::Binder;
using wan_vae_detail::FeatCache;
using wan_vae_detail::Model;

namespace {

namespace fs = std::filesystem;

std::string list_str(const std::vector<int64_t>& v) { return checkpoint::shape_str(v); }

void check_input(const at::Tensor& x, int64_t channels, const char* what, const char* layout) {
  if (!x.defined() || x.dim() != 5 || x.size(1) != channels) {
    std::ostringstream os;
    os << "Wan VAE: " << what << " must be " << layout << " with " << channels << " channels, got "
       << (x.defined() ? list_str(x.sizes().vec()) : std::string("an undefined tensor"));
    throw std::invalid_argument(os.str());
  }
  if (!at::isFloatingType(x.scalar_type()))
    throw std::invalid_argument(std::string("Wan VAE: ") + what + " must be floating point");
}

}  // namespace

std::vector<checkpoint::ParamSpec> wan_vae_parameter_specs(const WanVaeConfig& config) {
  config.validate();
  Binder binder(nullptr);
  Model model(binder, config);
  return binder.specs();
}

// =================================================================================================================
// WanVae
struct WanVae::Impl {
  WanVaeConfig config;
  c10::Device device;
  at::ScalarType dtype;
  Model model;
  at::Tensor mean, inv_std;  // float32 [1, z, 1, 1, 1] on the device: the pipeline's latents_mean, 1 / latents_std

  Impl(WanVaeConfig c, Binder& binder, c10::Device dev, at::ScalarType dt)
      : config(std::move(c)), device(dev), dtype(dt), model(binder, config) {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    const int64_t z = config.z_dim;
    mean = at::tensor(std::vector<float>(config.latents_mean.begin(), config.latents_mean.end()), opts)
               .view({1, z, 1, 1, 1})
               .to(device);
    // 1.0 / float32 tensor, as the pipeline builds it.
    inv_std = (1.0 / at::tensor(std::vector<float>(config.latents_std.begin(), config.latents_std.end()), opts))
                  .view({1, z, 1, 1, 1})
                  .to(device);
  }

  at::Tensor prepare(const at::Tensor& x) const { return x.to(device, dtype); }
};

WanVae::WanVae(WanVaeConfig config, checkpoint::StateDict weights, c10::Device device, at::ScalarType dtype) {
  config.validate();
  for (const auto& [name, tensor] : weights) {
    if (tensor.device() != device || tensor.scalar_type() != dtype) {
      throw WanVaeError("Wan VAE: parameter '" + name + "' is " + c10::toString(tensor.scalar_type()) + " on " +
                        tensor.device().str() + ", expected " + c10::toString(dtype) + " on " + device.str());
    }
  }
  Binder binder(&weights);
  impl_ = std::make_unique<Impl>(std::move(config), binder, device, dtype);
  if (!weights.empty()) {
    std::string names;
    for (const auto& [name, tensor] : weights) names += (names.empty() ? "" : ", ") + name;
    throw WanVaeError("Wan VAE: unexpected parameters (not in the config's model): " + names);
  }
}

WanVae::~WanVae() = default;
WanVae::WanVae(WanVae&&) noexcept = default;
WanVae& WanVae::operator=(WanVae&&) noexcept = default;

WanVae WanVae::load(const std::string& path, const checkpoint::PlaceOptions& options) {
  fs::path dir(path);
  if (fs::is_directory(dir) && !fs::exists(dir / "config.json") && fs::exists(dir / "vae" / "config.json")) {
    dir /= "vae";  // a pipeline folder
  }
  if (!fs::is_directory(dir)) throw WanVaeError("Wan VAE: '" + path + "' is not a folder");
  const fs::path config_path = dir / "config.json";
  std::ifstream in(config_path);
  if (!in) throw WanVaeError("Wan VAE: cannot read '" + config_path.string() + "'");
  std::stringstream text;
  text << in.rdbuf();
  WanVaeConfig config;
  try {
    config = WanVaeConfig::from_json(text.str(), config_path.string());
  } catch (const std::invalid_argument& e) {
    throw WanVaeError(e.what());
  }

  const checkpoint::Source source = checkpoint::Source::open(dir.string(), "diffusion_pytorch_model");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& key : source.keys()) tensors[key] = source.tensor(key);
  checkpoint::StateDict placed =
      checkpoint::place_strict(tensors, wan_vae_parameter_specs(config), options, "Wan VAE '" + dir.string() + "'");
  const c10::Device device = checkpoint::parse_device(options.device);
  const at::ScalarType dtype = placed.empty() ? options.dtype : placed.begin()->second.scalar_type();
  spdlog::info("Wan VAE loaded from {} ({} tensors, {} on {})", dir.string(), placed.size(), c10::toString(dtype),
               device.str());
  return WanVae(std::move(config), std::move(placed), device, dtype);
}

const WanVaeConfig& WanVae::config() const { return impl_->config; }
c10::Device WanVae::device() const { return impl_->device; }
at::ScalarType WanVae::dtype() const { return impl_->dtype; }

at::Tensor WanVae::denormalize(const at::Tensor& latents) const {
  check_input(latents, impl_->config.z_dim, "latents", "[B, z_dim, F, h, w]");
  // The pipeline: latents / (1 / std) + mean, in the latents' float32, then cast to the VAE's dtype.
  const at::Tensor x = latents.to(impl_->device, at::kFloat);
  return (x / impl_->inv_std + impl_->mean).to(impl_->dtype);
}

at::Tensor WanVae::normalize(const at::Tensor& z) const {
  check_input(z, impl_->config.z_dim, "z", "[B, z_dim, F, h, w]");
  const at::Tensor x = z.to(impl_->device, at::kFloat);
  return (x - impl_->mean) * impl_->inv_std;
}

at::Tensor WanVae::post_quant_conv(const at::Tensor& z) const {
  check_input(z, impl_->config.z_dim, "z", "[B, z_dim, F, h, w]");
  return impl_->model.post_quant_conv.forward(impl_->prepare(z));
}

at::Tensor WanVae::decode(const at::Tensor& z, int64_t frames_per_call) const {
  check_input(z, impl_->config.z_dim, "z", "[B, z_dim, F, h, w]");
  if (z.size(2) < 1) throw std::invalid_argument("Wan VAE decode: z has no frames");
  if (frames_per_call <= 0) frames_per_call = decode_frames_per_call(z.size(0), z.size(3), z.size(4));
  // Call by call into a preallocated video: the parts are never all held twice.
  WanVaeDecodeSession session(*this, frames_per_call);
  at::Tensor video;
  int64_t filled = 0;
  for (int64_t f = 0; f < z.size(2);) {
    const int64_t n = std::min(z.size(2) - f, frames_per_call);
    const at::Tensor part = session.decode(z.narrow(2, f, n), true);
    if (!video.defined()) {
      video = at::empty({part.size(0), part.size(1), impl_->config.pixel_frames(z.size(2)), part.size(3), part.size(4)},
                        part.options());
    }
    video.narrow(2, filled, part.size(2)).copy_(part);
    filled += part.size(2);
    f += n;
  }
  return video;
}

// The largest live set is at the decoder's last levels: the nearest-upsampled input of the last spatial upsampler
// (2 * dim channels at full size) and the full-size residual blocks' tensors (input, norm, silu, padded copy, conv
// out, sum: about 6 of dim channels), temporal_factor frames per latent frame, plus the allocator's slack: 10 tensors
// of dim channels. Measured (bench_vae --mode stream, fp32, 64x64, docs/BENCHMARKS.md): peak RSS above the weights
// 522 MiB at 4 latent frames per call, about 1.1 GiB at 21; the estimate is 60 MiB per latent frame there.
int64_t WanVae::decode_bytes_per_latent_frame(int64_t batch, int64_t h, int64_t w) const {
  const WanVaeConfig& c = impl_->config;
  const int64_t pixels = h * w * c.spatial_factor() * c.spatial_factor();
  const int64_t element = static_cast<int64_t>(c10::elementSize(impl_->dtype));
  return batch * c.temporal_factor() * pixels * c.decoder_dim() * element * 10;
}

// The encoder's first level: base_dim channels at full size, 4 frames per chunk (plus 2 cached), the same 10 live
// tensors.
int64_t WanVae::encode_bytes_per_chunk(int64_t batch, int64_t h, int64_t w) const {
  const WanVaeConfig& c = impl_->config;
  const int64_t element = static_cast<int64_t>(c10::elementSize(impl_->dtype));
  return batch * c.temporal_factor() * h * w * c.base_dim * element * 10;
}

int64_t WanVae::decode_frames_per_call(int64_t batch, int64_t h, int64_t w, int64_t budget_bytes) const {
  return std::max<int64_t>(1, budget_bytes / std::max<int64_t>(1, decode_bytes_per_latent_frame(batch, h, w)));
}

int64_t WanVae::encode_chunks_per_call(int64_t batch, int64_t h, int64_t w, int64_t budget_bytes) const {
  return std::max<int64_t>(1, budget_bytes / std::max<int64_t>(1, encode_bytes_per_chunk(batch, h, w)));
}

WanVae::Posterior WanVae::encode(const at::Tensor& video, int64_t chunks_per_call) const {
  const WanVaeConfig& c = impl_->config;
  check_input(video, c.in_channels, "video", "[B, C, T, H, W]");
  const at::Tensor x = impl_->prepare(video);
  const int64_t frames = x.size(2);
  const int64_t chunks = latent_frames_of(frames);
  if (!is_4k_plus_1(frames)) {
    spdlog::warn("Wan VAE encode: {} frames is not 1 + 4k; the last {} frame(s) are dropped (as diffusers does)",
                 frames, frames - four_k_plus_one_below(frames));
  }
  if (chunks_per_call <= 0) chunks_per_call = encode_chunks_per_call(x.size(0), x.size(3), x.size(4));
  // The first frame alone (its downsamplers keep it whole), then chunks_per_call chunks of 4 per call: the strided
  // time convolutions see the same frames, as each chunk of 4 has an even length at every level.
  FeatCache cache;
  std::vector<at::Tensor> outs{impl_->model.encoder.forward(x.narrow(2, 0, 1), cache)};
  for (int64_t i = 1; i < chunks; i += chunks_per_call) {
    const int64_t n = std::min(chunks_per_call, chunks - i);
    outs.push_back(impl_->model.encoder.forward(x.narrow(2, pixel_frames_of(i), kVaeTemporalFactor * n), cache));
  }
  const at::Tensor h = impl_->model.quant_conv.forward(outs.size() == 1 ? outs[0] : at::cat(outs, 2));
  Posterior p;
  p.mean = h.narrow(1, 0, c.z_dim);
  p.logvar = at::clamp(h.narrow(1, c.z_dim, c.z_dim), -30.0, 20.0);
  return p;
}

// =================================================================================================================
// WanVaeDecodeSession
struct WanVaeDecodeSession::Cache {
  FeatCache feat;
};

WanVaeDecodeSession::WanVaeDecodeSession(const WanVae& vae, int64_t frames_per_call)
    : vae_(vae), cache_(std::make_unique<Cache>()), frames_per_call_(std::max<int64_t>(0, frames_per_call)) {}
WanVaeDecodeSession::~WanVaeDecodeSession() = default;

at::Tensor WanVaeDecodeSession::decode(const at::Tensor& z, bool clamp) {
  const WanVae::Impl& impl = *vae_.impl_;
  check_input(z, impl.config.z_dim, "z", "[B, z_dim, F, h, w]");
  const std::vector<int64_t> shape{z.size(0), z.size(3), z.size(4)};
  if (shape_.empty()) {
    shape_ = shape;
  } else if (shape != shape_) {
    throw std::invalid_argument("Wan VAE decode session: batch/height/width changed from " + list_str(shape_) + " to " +
                                list_str(shape));
  }
  if (z.size(2) < 1) throw std::invalid_argument("Wan VAE decode session: z has no frames");
  if (frames_per_call_ == 0) frames_per_call_ = vae_.decode_frames_per_call(z.size(0), z.size(3), z.size(4));
  // post_quant_conv is 1x1x1, so applying it per call equals diffusers' whole-sequence application.
  const at::Tensor x = impl.model.post_quant_conv.forward(impl.prepare(z));
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < x.size(2); i += frames_per_call_) {
    const int64_t n = std::min(frames_per_call_, x.size(2) - i);
    outs.push_back(impl.model.decoder.forward(x.narrow(2, i, n), cache_->feat));
    frames_done_ += n;
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 2);
  return clamp ? at::clamp(out, -1.0, 1.0) : out;
}

}  // namespace skyreels::model
