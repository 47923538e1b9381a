#include "model/vae_wan.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <variant>

#include "model/video_shape.h"

namespace skyreels::model {
namespace {

namespace fs = std::filesystem;

// Causal convolutions keep the last CACHE_T input frames of the previous call.
constexpr int64_t kCacheT = 2;

std::vector<double> wan21_latents_mean() {
  return {-0.7571, -0.7089, -0.9113, 0.1075,  -0.1745, 0.9653,  -0.1517, 1.5508,
          0.4134,  -0.0715, 0.5517,  -0.3632, -0.1922, -0.9497, 0.2503,  -0.2921};
}
std::vector<double> wan21_latents_std() {
  return {2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160};
}

// ---------------------------------------------------------------------------------------------------------------
// Parameter binding. The same code builds the layer tree for two purposes: listing ParamSpecs (no tensors) and
// taking the tensors of a state dict (checked against the same shapes), so the specs can never drift from the model.
class Binder {
 public:
  explicit Binder(checkpoint::StateDict* weights) : weights_(weights) {}

  at::Tensor param(const std::string& name, std::vector<int64_t> shape) {
    specs_.push_back({name, shape, false});
    if (weights_ == nullptr) return {};
    auto it = weights_->find(name);
    if (it == weights_->end()) throw WanVaeError("Wan VAE: missing parameter '" + name + "'");
    if (it->second.sizes().vec() != shape) {
      throw WanVaeError("Wan VAE: parameter '" + name + "' has shape " +
                        checkpoint::shape_str(it->second.sizes().vec()) + ", the config needs " +
                        checkpoint::shape_str(shape));
    }
    at::Tensor t = std::move(it->second);
    weights_->erase(it);
    return t;
  }

  const std::vector<checkpoint::ParamSpec>& specs() const { return specs_; }

 private:
  checkpoint::StateDict* weights_;
  std::vector<checkpoint::ParamSpec> specs_;
};

// ---------------------------------------------------------------------------------------------------------------
// The feature cache: one slot per cached convolution, in call order. An upsample3d slot starts as "Rep" (diffusers'
// marker for "the first frame went through without its time_conv").
struct Slot {
  enum class State { kEmpty, kRep, kTensor };
  State state = State::kEmpty;
  at::Tensor frames;
  bool has_tensor() const { return state == State::kTensor; }
  void set(at::Tensor t) {
    frames = std::move(t);
    state = State::kTensor;
  }
};

struct FeatCache {
  std::vector<Slot> slots;
  size_t next_index = 0;
  void start_call() { next_index = 0; }
  Slot& next() {
    if (next_index == slots.size()) slots.emplace_back();
    return slots[next_index++];
  }
};

at::Tensor last_frames(const at::Tensor& x, int64_t n) {
  const int64_t t = x.size(2);
  return x.narrow(2, std::max<int64_t>(0, t - n), std::min(t, n));
}

// ---------------------------------------------------------------------------------------------------------------
// Layers.
struct CausalConv3d {
  at::Tensor weight, bias;
  std::array<int64_t, 3> stride{1, 1, 1};
  std::array<int64_t, 3> padding{0, 0, 0};  // (t, h, w) as given to diffusers; time is padded 2*t in front only

  CausalConv3d() = default;
  CausalConv3d(Binder& b, const std::string& name, int64_t in, int64_t out, std::array<int64_t, 3> kernel,
               std::array<int64_t, 3> stride_, std::array<int64_t, 3> padding_)
      : stride(stride_), padding(padding_) {
    weight = b.param(name + ".weight", {out, in, kernel[0], kernel[1], kernel[2]});
    bias = b.param(name + ".bias", {out});
  }

  // `cache` (may be undefined) holds the previous frames; it replaces that much of the causal zero padding.
  at::Tensor forward(at::Tensor x, const at::Tensor& cache = {}) const {
    const int64_t pad_t = 2 * padding[0], pad_h = padding[1], pad_w = padding[2];
    if (pad_t > 0 || pad_h > 0 || pad_w > 0) x = padded_input(x, pad_t > 0 ? cache : at::Tensor(), pad_t, pad_h, pad_w);
    if (use_onednn(x)) {
      return at::mkldnn_convolution(x, weight, bias, {0, 0, 0}, {stride[0], stride[1], stride[2]}, {1, 1, 1}, 1);
    }
    return at::conv3d(x, weight, bias, {stride[0], stride[1], stride[2]});
  }

  // diffusers' cat([cache, x], time) then zero padding (causal in time), written in one pass into one buffer: only
  // the borders are zeroed, the cached frames and x are copied once.
  static at::Tensor padded_input(const at::Tensor& x, const at::Tensor& cache, int64_t pad_t, int64_t pad_h,
                                 int64_t pad_w) {
    const int64_t cached = cache.defined() ? cache.size(2) : 0, t = x.size(2), h = x.size(3), w = x.size(4);
    const int64_t zeros_t = pad_t - cached;
    at::Tensor buf = at::empty({x.size(0), x.size(1), pad_t + t, h + 2 * pad_h, w + 2 * pad_w}, x.options());
    if (zeros_t > 0) buf.narrow(2, 0, zeros_t).zero_();
    at::Tensor rest = buf.narrow(2, std::max<int64_t>(zeros_t, 0), pad_t + t - std::max<int64_t>(zeros_t, 0));
    if (pad_h > 0) {
      rest.narrow(3, 0, pad_h).zero_();
      rest.narrow(3, h + pad_h, pad_h).zero_();
    }
    if (pad_w > 0) {
      rest.narrow(4, 0, pad_w).zero_();
      rest.narrow(4, w + pad_w, pad_w).zero_();
    }
    auto interior = [&](int64_t start, int64_t frames) {
      return buf.narrow(2, start, frames).narrow(3, pad_h, h).narrow(4, pad_w, w);
    };
    if (cached > 0) interior(zeros_t, cached).copy_(cache);
    interior(pad_t, t).copy_(x);
    return buf;
  }

  // LibTorch's heuristic sends fp32 CPU conv3d with few channels x frames x rows to its native path, 3-6x slower
  // than oneDNN at the decoder's shapes (same results to 1e-6); large shapes go to oneDNN anyway.
  static bool use_onednn(const at::Tensor& x) {
    return x.is_cpu() && x.scalar_type() == at::kFloat && at::hasMKLDNN() && at::globalContext().userEnabledMkldnn();
  }
};

// A causal conv fed through its cache slot: diffusers' repeated `cache_x = x[:, :, -CACHE_T:]` block.
at::Tensor cached_conv(const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache) {
  Slot& slot = cache.next();
  at::Tensor keep = last_frames(x, kCacheT).clone();
  if (keep.size(2) < kCacheT && slot.has_tensor()) keep = at::cat({last_frames(slot.frames, 1), keep}, 2);
  at::Tensor out = conv.forward(x, slot.has_tensor() ? slot.frames : at::Tensor());
  slot.set(std::move(keep));
  return out;
}

struct Conv2d {
  at::Tensor weight, bias;
  int64_t stride = 1, padding = 0;
  Conv2d() = default;
  Conv2d(Binder& b, const std::string& name, int64_t in, int64_t out, int64_t kernel, int64_t stride_, int64_t padding_)
      : stride(stride_), padding(padding_) {
    weight = b.param(name + ".weight", {out, in, kernel, kernel});
    bias = b.param(name + ".bias", {out});
  }
  at::Tensor forward(const at::Tensor& x) const { return at::conv2d(x, weight, bias, stride, padding); }
};

// RMS norm over channels (dim 1): F.normalize(x, dim=1) * sqrt(dim) * gamma.
struct RmsNorm {
  at::Tensor gamma;
  double scale = 1.0;
  RmsNorm() = default;
  RmsNorm(Binder& b, const std::string& name, int64_t dim, bool images) : scale(std::sqrt(static_cast<double>(dim))) {
    gamma = images ? b.param(name + ".gamma", {dim, 1, 1}) : b.param(name + ".gamma", {dim, 1, 1, 1});
  }
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor norm = at::linalg_vector_norm(x, 2, at::IntArrayRef{1}, /*keepdim=*/true).clamp_min(1e-12);
    return x / norm * scale * gamma;
  }
};

// [B, C, T, H, W] <-> [B*T, C, H, W] for the per-frame 2-D layers.
at::Tensor frames_to_images(const at::Tensor& x) {
  return x.permute({0, 2, 1, 3, 4}).reshape({x.size(0) * x.size(2), x.size(1), x.size(3), x.size(4)});
}
at::Tensor images_to_frames(const at::Tensor& x, int64_t batch) {
  return x.view({batch, x.size(0) / batch, x.size(1), x.size(2), x.size(3)}).permute({0, 2, 1, 3, 4});
}

struct ResidualBlock {
  RmsNorm norm1, norm2;
  CausalConv3d conv1, conv2;
  std::optional<CausalConv3d> shortcut;

  ResidualBlock(Binder& b, const std::string& name, int64_t in, int64_t out) {
    norm1 = RmsNorm(b, name + ".norm1", in, false);
    conv1 = CausalConv3d(b, name + ".conv1", in, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
    norm2 = RmsNorm(b, name + ".norm2", out, false);
    conv2 = CausalConv3d(b, name + ".conv2", out, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
    if (in != out) shortcut = CausalConv3d(b, name + ".conv_shortcut", in, out, {1, 1, 1}, {1, 1, 1}, {0, 0, 0});
  }

  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const {
    at::Tensor h = shortcut ? shortcut->forward(x) : x;
    at::Tensor y = cached_conv(conv1, at::silu(norm1.forward(x)), cache);
    y = cached_conv(conv2, at::silu(norm2.forward(y)), cache);  // dropout: identity at inference
    return y + h;
  }
};

// Single-head self-attention over the pixels of each frame.
struct AttentionBlock {
  RmsNorm norm;
  Conv2d to_qkv, proj;

  AttentionBlock(Binder& b, const std::string& name, int64_t dim) {
    norm = RmsNorm(b, name + ".norm", dim, true);
    to_qkv = Conv2d(b, name + ".to_qkv", dim, dim * 3, 1, 1, 0);
    proj = Conv2d(b, name + ".proj", dim, dim, 1, 1, 0);
  }

  // softmax(q k^T / sqrt(c)) v, in row blocks so the score matrix stays bounded at high resolution (each row's
  // softmax is independent, so the blocks give the same numbers).
  static at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const at::Tensor kt = k.transpose(-2, -1);
    constexpr int64_t kRows = 2048;
    const int64_t n = q.size(-2);
    if (n <= kRows) return at::matmul(at::softmax(at::matmul(q, kt) * scale, -1), v);
    std::vector<at::Tensor> parts;
    for (int64_t start = 0; start < n; start += kRows) {
      const at::Tensor qs = q.narrow(-2, start, std::min(kRows, n - start));
      parts.push_back(at::matmul(at::softmax(at::matmul(qs, kt) * scale, -1), v));
    }
    return at::cat(parts, -2);
  }

  at::Tensor forward(const at::Tensor& x) const {
    const int64_t b = x.size(0), c = x.size(1), h = x.size(3), w = x.size(4);
    at::Tensor y = norm.forward(frames_to_images(x));
    const int64_t bt = y.size(0);
    at::Tensor qkv = to_qkv.forward(y).reshape({bt, 1, c * 3, h * w}).permute({0, 1, 3, 2}).contiguous();
    auto parts = qkv.chunk(3, -1);
    y = attention(parts[0], parts[1], parts[2]);  // [bt, 1, hw, c]
    y = y.squeeze(1).permute({0, 2, 1}).reshape({bt, c, h, w});
    y = proj.forward(y);
    return images_to_frames(y, b) + x;
  }
};

struct MidBlock {
  // Declaration order is construction order: resnets.0, attentions.0, resnets.1 (diffusers' module order).
  ResidualBlock res0;
  AttentionBlock attn;
  ResidualBlock res1;
  MidBlock(Binder& b, const std::string& name, int64_t dim)
      : res0(b, name + ".resnets.0", dim, dim),
        attn(b, name + ".attentions.0", dim),
        res1(b, name + ".resnets.1", dim, dim) {}

  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const {
    return res1.forward(attn.forward(res0.forward(x, cache)), cache);
  }
};

// Spatial (and for *3d, temporal) resampling: nearest 2x + conv (up) or zero pad + stride-2 conv (down).
struct Resample {
  enum class Mode { kUp2d, kUp3d, kDown2d, kDown3d };
  Mode mode;
  Conv2d resample;
  std::optional<CausalConv3d> time_conv;

  Resample(Binder& b, const std::string& name, int64_t dim, Mode mode_, int64_t up_out_dim) : mode(mode_) {
    switch (mode) {
      case Mode::kUp3d:
        resample = Conv2d(b, name + ".resample.1", dim, up_out_dim, 3, 1, 1);
        time_conv = CausalConv3d(b, name + ".time_conv", dim, dim * 2, {3, 1, 1}, {1, 1, 1}, {1, 0, 0});
        break;
      case Mode::kUp2d:
        resample = Conv2d(b, name + ".resample.1", dim, up_out_dim, 3, 1, 1);
        break;
      case Mode::kDown3d:
        resample = Conv2d(b, name + ".resample.1", dim, dim, 3, 2, 0);
        time_conv = CausalConv3d(b, name + ".time_conv", dim, dim, {3, 1, 1}, {2, 1, 1}, {0, 0, 0});
        break;
      case Mode::kDown2d:
        resample = Conv2d(b, name + ".resample.1", dim, dim, 3, 2, 0);
        break;
    }
  }

  at::Tensor forward(at::Tensor x, FeatCache& cache) const {
    const int64_t b = x.size(0);
    if (mode == Mode::kUp3d) x = upsample_time(x, cache);
    at::Tensor img = frames_to_images(x);
    if (mode == Mode::kUp2d || mode == Mode::kUp3d) {
      // nearest-exact at an exact 2x equals nearest; diffusers upsamples in float32 and casts back.
      const at::Tensor up = at::upsample_nearest2d(img.to(at::kFloat), {img.size(2) * 2, img.size(3) * 2});
      img = resample.forward(up.to(img.scalar_type()));
    } else {
      img = resample.forward(at::constant_pad_nd(img, {0, 1, 0, 1}, 0.0));
    }
    x = images_to_frames(img, b);
    if (mode == Mode::kDown3d) x = downsample_time(x, cache);
    return x;
  }

 private:
  // The first latent frame passes alone ("Rep"); afterwards time_conv doubles every frame: channels [0, c) give
  // frame 2i, [c, 2c) frame 2i+1. A first call with several frames is that first frame, then the rest as the next
  // call (which sees zeros, not the first frame, before it: diffusers' "Rep" slot).
  at::Tensor upsample_time(const at::Tensor& x, FeatCache& cache) const {
    Slot& slot = cache.next();
    if (slot.state == Slot::State::kEmpty) {
      slot.state = Slot::State::kRep;
      if (x.size(2) == 1) return x;
      return at::cat({x.narrow(2, 0, 1), double_frames(x.narrow(2, 1, x.size(2) - 1), slot)}, 2);
    }
    return double_frames(x, slot);
  }

  at::Tensor double_frames(const at::Tensor& x, Slot& slot) const {
    at::Tensor keep = last_frames(x, kCacheT).clone();
    if (keep.size(2) < kCacheT) {
      keep = at::cat({slot.has_tensor() ? last_frames(slot.frames, 1) : at::zeros_like(keep), keep}, 2);
    }
    at::Tensor y = slot.has_tensor() ? time_conv->forward(x, slot.frames) : time_conv->forward(x);
    slot.set(std::move(keep));
    const int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
    return y.view({b, 2, c, t, h, w}).permute({0, 2, 3, 1, 4, 5}).reshape({b, c, t * 2, h, w});
  }

  // The first chunk keeps all its frames; later chunks are strided over time with the previous chunk's last frame.
  at::Tensor downsample_time(const at::Tensor& x, FeatCache& cache) const {
    Slot& slot = cache.next();
    if (!slot.has_tensor()) {
      slot.set(x.clone());
      return x;
    }
    at::Tensor keep = last_frames(x, 1).clone();
    at::Tensor y = time_conv->forward(at::cat({last_frames(slot.frames, 1), x}, 2));
    slot.set(std::move(keep));
    return y;
  }
};

at::Tensor head_conv(const RmsNorm& norm, const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache) {
  return cached_conv(conv, at::silu(norm.forward(x)), cache);
}

struct Encoder {
  CausalConv3d conv_in, conv_out;
  std::vector<std::variant<ResidualBlock, Resample>> down_blocks;
  std::optional<MidBlock> mid;
  RmsNorm norm_out;

  Encoder(Binder& b, const WanVaeConfig& c) {
    std::vector<int64_t> dims{c.base_dim};
    for (int64_t m : c.dim_mult) dims.push_back(c.base_dim * m);
    conv_in = CausalConv3d(b, "encoder.conv_in", c.in_channels, dims[0], {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
    const size_t levels = c.dim_mult.size();
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      int64_t in = dims[i];
      const int64_t out = dims[i + 1];
      for (int64_t r = 0; r < c.num_res_blocks; ++r) {
        down_blocks.emplace_back(ResidualBlock(b, block_name(), in, out));
        in = out;
      }
      if (i + 1 != levels) {
        const auto mode = c.temperal_downsample[i] ? Resample::Mode::kDown3d : Resample::Mode::kDown2d;
        down_blocks.emplace_back(Resample(b, block_name(), out, mode, 0));
      }
    }
    mid.emplace(b, "encoder.mid_block", dims.back());
    norm_out = RmsNorm(b, "encoder.norm_out", dims.back(), false);
    conv_out = CausalConv3d(b, "encoder.conv_out", dims.back(), c.z_dim * 2, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
  }

  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const {
    cache.start_call();
    at::Tensor h = cached_conv(conv_in, x, cache);
    for (const auto& block : down_blocks) {
      h = std::visit([&](const auto& layer) { return layer.forward(h, cache); }, block);
    }
    h = mid->forward(h, cache);
    return head_conv(norm_out, conv_out, h, cache);
  }

 private:
  std::string block_name() const { return "encoder.down_blocks." + std::to_string(down_blocks.size()); }
};

struct UpBlock {
  std::vector<ResidualBlock> resnets;
  std::optional<Resample> upsampler;
};

struct Decoder {
  CausalConv3d conv_in, conv_out;
  std::optional<MidBlock> mid;
  std::vector<UpBlock> up_blocks;
  RmsNorm norm_out;

  Decoder(Binder& b, const WanVaeConfig& c) {
    const int64_t dim = c.decoder_dim();
    std::vector<int64_t> dims{dim * c.dim_mult.back()};
    for (auto it = c.dim_mult.rbegin(); it != c.dim_mult.rend(); ++it) dims.push_back(dim * *it);
    const std::vector<bool> temperal_upsample(c.temperal_downsample.rbegin(), c.temperal_downsample.rend());

    conv_in = CausalConv3d(b, "decoder.conv_in", c.z_dim, dims[0], {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
    mid.emplace(b, "decoder.mid_block", dims[0]);
    const size_t levels = c.dim_mult.size();
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      // Wan 2.1: every upsampler halves the channels, so the next level starts from half of its nominal width.
      int64_t in = i > 0 ? dims[i] / 2 : dims[i];
      const int64_t out = dims[i + 1];
      const std::string name = "decoder.up_blocks." + std::to_string(i);
      UpBlock block;
      for (int64_t r = 0; r <= c.num_res_blocks; ++r) {
        block.resnets.emplace_back(b, name + ".resnets." + std::to_string(r), in, out);
        in = out;
      }
      if (i + 1 != levels) {
        const auto mode = temperal_upsample[i] ? Resample::Mode::kUp3d : Resample::Mode::kUp2d;
        block.upsampler.emplace(b, name + ".upsamplers.0", out, mode, out / 2);
      }
      up_blocks.push_back(std::move(block));
    }
    norm_out = RmsNorm(b, "decoder.norm_out", dims.back(), false);
    conv_out = CausalConv3d(b, "decoder.conv_out", dims.back(), c.out_channels, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
  }

  // n latent frames (after post_quant_conv) -> 1 + 4(n - 1) pixel frames the first time, 4n afterwards.
  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const {
    cache.start_call();
    at::Tensor h = cached_conv(conv_in, x, cache);
    h = mid->forward(h, cache);
    for (const auto& block : up_blocks) {
      for (const auto& resnet : block.resnets) h = resnet.forward(h, cache);
      if (block.upsampler) h = block.upsampler->forward(h, cache);
    }
    return head_conv(norm_out, conv_out, h, cache);
  }
};

// The whole model; built by one function so specs and loading share it.
struct Model {
  Encoder encoder;
  Decoder decoder;
  CausalConv3d quant_conv, post_quant_conv;
  Model(Binder& b, const WanVaeConfig& c)
      : encoder(b, c),
        decoder(b, c),
        quant_conv(b, "quant_conv", c.z_dim * 2, c.z_dim * 2, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}),
        post_quant_conv(b, "post_quant_conv", c.z_dim, c.z_dim, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}) {}
};

// ---------------------------------------------------------------------------------------------------------------
// Config parsing.
template <typename T>
T json_get(const nlohmann::json& j, const std::string& key, const T& fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + ": field '" + key + "' has the wrong type (" + e.what() + ")");
  }
}

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

// =================================================================================================================
// WanVaeConfig
WanVaeConfig WanVaeConfig::wan_2_1() {
  WanVaeConfig c;
  c.latents_mean = wan21_latents_mean();
  c.latents_std = wan21_latents_std();
  return c;
}

int64_t WanVaeConfig::temporal_factor() const {
  int64_t f = 1;
  for (bool d : temperal_downsample) f *= d ? 2 : 1;
  return f;
}

int64_t WanVaeConfig::spatial_factor() const { return int64_t{1} << temperal_downsample.size(); }

int64_t WanVaeConfig::pixel_frames(int64_t latent_frames) const {
  return latent_frames <= 0 ? 0 : 1 + temporal_factor() * (latent_frames - 1);
}

void WanVaeConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument("Wan VAE config: " + message);
  };
  require(base_dim >= 1, "base_dim must be >= 1");
  require(decoder_dim() >= 1, "decoder_base_dim must be >= 1");
  require(z_dim >= 1, "z_dim must be >= 1");
  require(!dim_mult.empty(), "dim_mult must not be empty");
  for (int64_t m : dim_mult) require(m >= 1, "dim_mult entries must be >= 1");
  require(num_res_blocks >= 1, "num_res_blocks must be >= 1");
  require(temperal_downsample.size() + 1 == dim_mult.size(),
          "temperal_downsample needs len(dim_mult) - 1 = " + std::to_string(dim_mult.size() - 1) + " entries, has " +
              std::to_string(temperal_downsample.size()));
  require(static_cast<int64_t>(latents_mean.size()) == z_dim,
          "latents_mean has " + std::to_string(latents_mean.size()) + " entries, z_dim is " + std::to_string(z_dim));
  require(static_cast<int64_t>(latents_std.size()) == z_dim,
          "latents_std has " + std::to_string(latents_std.size()) + " entries, z_dim is " + std::to_string(z_dim));
  for (double s : latents_std) require(s > 0.0, "latents_std entries must be > 0");
  require(in_channels >= 1 && out_channels >= 1, "in_channels/out_channels must be >= 1");
  // Upsamplers halve the channels; the level after one must start from an integer width.
  for (size_t i = 0; i + 1 < dim_mult.size(); ++i) {
    require(decoder_dim() * dim_mult[dim_mult.size() - 1 - i] % 2 == 0,
            "decoder widths must be even where an upsampler halves them");
  }
}

WanVaeConfig WanVaeConfig::from_json(const std::string& json_text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + " is not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw std::invalid_argument(where + " is not a JSON object");
  const std::string cls = json_get<std::string>(j, "_class_name", "AutoencoderKLWan", where);
  if (cls != "AutoencoderKLWan") {
    throw std::invalid_argument(where + ": _class_name is '" + cls + "', expected 'AutoencoderKLWan'");
  }
  if (json_get<bool>(j, "is_residual", false, where)) {
    throw std::invalid_argument(where + ": is_residual = true (the Wan 2.2 VAE) is not supported; only Wan 2.1");
  }
  if (json_get<int64_t>(j, "patch_size", 1, where) != 1) {
    throw std::invalid_argument(where + ": patch_size > 1 (the Wan 2.2 VAE) is not supported; only Wan 2.1");
  }
  if (!json_get<std::vector<double>>(j, "attn_scales", {}, where).empty()) {
    // diffusers' encoder calls attention blocks with cache arguments they do not take, so no checkpoint has them.
    throw std::invalid_argument(where + ": attn_scales must be [] (as in every Wan 2.1 VAE)");
  }
  const WanVaeConfig d = wan_2_1();
  WanVaeConfig c;
  c.base_dim = json_get<int64_t>(j, "base_dim", d.base_dim, where);
  if (j.contains("decoder_base_dim") && !j["decoder_base_dim"].is_null()) {
    c.decoder_base_dim = json_get<int64_t>(j, "decoder_base_dim", 0, where);
  }
  c.z_dim = json_get<int64_t>(j, "z_dim", d.z_dim, where);
  c.dim_mult = json_get<std::vector<int64_t>>(j, "dim_mult", d.dim_mult, where);
  c.num_res_blocks = json_get<int64_t>(j, "num_res_blocks", d.num_res_blocks, where);
  c.temperal_downsample = json_get<std::vector<bool>>(j, "temperal_downsample", d.temperal_downsample, where);
  c.latents_mean = json_get<std::vector<double>>(j, "latents_mean", d.latents_mean, where);
  c.latents_std = json_get<std::vector<double>>(j, "latents_std", d.latents_std, where);
  c.in_channels = json_get<int64_t>(j, "in_channels", d.in_channels, where);
  c.out_channels = json_get<int64_t>(j, "out_channels", d.out_channels, where);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
  return c;
}

std::string WanVaeConfig::to_json() const {
  nlohmann::ordered_json j;
  j["_class_name"] = "AutoencoderKLWan";
  j["base_dim"] = base_dim;
  j["decoder_base_dim"] = decoder_base_dim ? nlohmann::ordered_json(*decoder_base_dim) : nlohmann::ordered_json();
  j["z_dim"] = z_dim;
  j["dim_mult"] = dim_mult;
  j["num_res_blocks"] = num_res_blocks;
  j["attn_scales"] = nlohmann::ordered_json::array();
  j["temperal_downsample"] = temperal_downsample;
  j["dropout"] = 0.0;
  j["latents_mean"] = latents_mean;
  j["latents_std"] = latents_std;
  j["is_residual"] = false;
  j["in_channels"] = in_channels;
  j["out_channels"] = out_channels;
  j["patch_size"] = nullptr;
  j["scale_factor_temporal"] = temporal_factor();
  j["scale_factor_spatial"] = spatial_factor();
  return j.dump(2);
}

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
