// The Wan VAE's layers (vae_wan_layers.h): parameter binding, the causal 3-D convolution and its feature cache, the
// 2-D convolution, the RMS norm, and the blocks built on them (residual, attention, mid, resample).
#include "model/vae_wan_layers.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace skyreels::model::wan_vae_detail {

// ---------------------------------------------------------------------------------------------------------------
// Parameter binding.
at::Tensor Binder::param(const std::string& name, std::vector<int64_t> shape) {
  specs_.push_back({name, shape, false});
  if (weights_ == nullptr) return {};
  auto it = weights_->find(name);
  if (it == weights_->end()) throw WanVaeError("Wan VAE: missing parameter '" + name + "'");
  if (it->second.sizes().vec() != shape) {
    throw WanVaeError("Wan VAE: parameter '" + name + "' has shape " + checkpoint::shape_str(it->second.sizes().vec()) +
                      ", the config needs " + checkpoint::shape_str(shape));
  }
  at::Tensor t = std::move(it->second);
  weights_->erase(it);
  return t;
}

// ---------------------------------------------------------------------------------------------------------------
// The feature cache.
at::Tensor last_frames(const at::Tensor& x, int64_t n) {
  const int64_t t = x.size(2);
  return x.narrow(2, std::max<int64_t>(0, t - n), std::min(t, n));
}

// ---------------------------------------------------------------------------------------------------------------
// The causal 3-D convolution.
CausalConv3d::CausalConv3d(Binder& b, const std::string& name, int64_t in, int64_t out, std::array<int64_t, 3> kernel,
                           std::array<int64_t, 3> stride_, std::array<int64_t, 3> padding_)
    : stride(stride_), padding(padding_) {
  weight = b.param(name + ".weight", {out, in, kernel[0], kernel[1], kernel[2]});
  bias = b.param(name + ".bias", {out});
}

at::Tensor CausalConv3d::forward(at::Tensor x, const at::Tensor& cache) const {
  const int64_t pad_t = 2 * padding[0], pad_h = padding[1], pad_w = padding[2];
  if (pad_t > 0 || pad_h > 0 || pad_w > 0) x = padded_input(x, pad_t > 0 ? cache : at::Tensor(), pad_t, pad_h, pad_w);
  if (use_onednn(x)) {
    return at::mkldnn_convolution(x, weight, bias, {0, 0, 0}, {stride[0], stride[1], stride[2]}, {1, 1, 1}, 1);
  }
  return at::conv3d(x, weight, bias, {stride[0], stride[1], stride[2]});
}

at::Tensor CausalConv3d::padded_input(const at::Tensor& x, const at::Tensor& cache, int64_t pad_t, int64_t pad_h,
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

bool CausalConv3d::use_onednn(const at::Tensor& x) {
  return x.is_cpu() && x.scalar_type() == at::kFloat && at::hasMKLDNN() && at::globalContext().userEnabledMkldnn();
}

at::Tensor cached_conv(const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache) {
  Slot& slot = cache.next();
  at::Tensor keep = last_frames(x, kCacheT).clone();
  if (keep.size(2) < kCacheT && slot.has_tensor()) keep = at::cat({last_frames(slot.frames, 1), keep}, 2);
  at::Tensor out = conv.forward(x, slot.has_tensor() ? slot.frames : at::Tensor());
  slot.set(std::move(keep));
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Per-frame layers: the 2-D convolution and the RMS norm.
Conv2d::Conv2d(Binder& b, const std::string& name, int64_t in, int64_t out, int64_t kernel, int64_t stride_,
               int64_t padding_)
    : stride(stride_), padding(padding_) {
  weight = b.param(name + ".weight", {out, in, kernel, kernel});
  bias = b.param(name + ".bias", {out});
}

at::Tensor Conv2d::forward(const at::Tensor& x) const { return at::conv2d(x, weight, bias, stride, padding); }

RmsNorm::RmsNorm(Binder& b, const std::string& name, int64_t dim, bool images)
    : scale(std::sqrt(static_cast<double>(dim))) {
  gamma = images ? b.param(name + ".gamma", {dim, 1, 1}) : b.param(name + ".gamma", {dim, 1, 1, 1});
}

at::Tensor RmsNorm::forward(const at::Tensor& x) const {
  at::Tensor norm = at::linalg_vector_norm(x, 2, at::IntArrayRef{1}, /*keepdim=*/true).clamp_min(1e-12);
  return x / norm * scale * gamma;
}

at::Tensor frames_to_images(const at::Tensor& x) {
  return x.permute({0, 2, 1, 3, 4}).reshape({x.size(0) * x.size(2), x.size(1), x.size(3), x.size(4)});
}
at::Tensor images_to_frames(const at::Tensor& x, int64_t batch) {
  return x.view({batch, x.size(0) / batch, x.size(1), x.size(2), x.size(3)}).permute({0, 2, 1, 3, 4});
}

// ---------------------------------------------------------------------------------------------------------------
// Blocks.
ResidualBlock::ResidualBlock(Binder& b, const std::string& name, int64_t in, int64_t out) {
  norm1 = RmsNorm(b, name + ".norm1", in, false);
  conv1 = CausalConv3d(b, name + ".conv1", in, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
  norm2 = RmsNorm(b, name + ".norm2", out, false);
  conv2 = CausalConv3d(b, name + ".conv2", out, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1});
  if (in != out) shortcut = CausalConv3d(b, name + ".conv_shortcut", in, out, {1, 1, 1}, {1, 1, 1}, {0, 0, 0});
}

at::Tensor ResidualBlock::forward(const at::Tensor& x, FeatCache& cache) const {
  at::Tensor h = shortcut ? shortcut->forward(x) : x;
  at::Tensor y = cached_conv(conv1, at::silu(norm1.forward(x)), cache);
  y = cached_conv(conv2, at::silu(norm2.forward(y)), cache);  // dropout: identity at inference
  return y + h;
}

AttentionBlock::AttentionBlock(Binder& b, const std::string& name, int64_t dim) {
  norm = RmsNorm(b, name + ".norm", dim, true);
  to_qkv = Conv2d(b, name + ".to_qkv", dim, dim * 3, 1, 1, 0);
  proj = Conv2d(b, name + ".proj", dim, dim, 1, 1, 0);
}

at::Tensor AttentionBlock::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
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

at::Tensor AttentionBlock::forward(const at::Tensor& x) const {
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

MidBlock::MidBlock(Binder& b, const std::string& name, int64_t dim)
    : res0(b, name + ".resnets.0", dim, dim),
      attn(b, name + ".attentions.0", dim),
      res1(b, name + ".resnets.1", dim, dim) {}

at::Tensor MidBlock::forward(const at::Tensor& x, FeatCache& cache) const {
  return res1.forward(attn.forward(res0.forward(x, cache)), cache);
}

// ---------------------------------------------------------------------------------------------------------------
// Resampling.
Resample::Resample(Binder& b, const std::string& name, int64_t dim, Mode mode_, int64_t up_out_dim) : mode(mode_) {
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

at::Tensor Resample::forward(at::Tensor x, FeatCache& cache) const {
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

at::Tensor Resample::upsample_time(const at::Tensor& x, FeatCache& cache) const {
  Slot& slot = cache.next();
  if (slot.state == Slot::State::kEmpty) {
    slot.state = Slot::State::kRep;
    if (x.size(2) == 1) return x;
    return at::cat({x.narrow(2, 0, 1), double_frames(x.narrow(2, 1, x.size(2) - 1), slot)}, 2);
  }
  return double_frames(x, slot);
}

at::Tensor Resample::double_frames(const at::Tensor& x, Slot& slot) const {
  at::Tensor keep = last_frames(x, kCacheT).clone();
  if (keep.size(2) < kCacheT) {
    keep = at::cat({slot.has_tensor() ? last_frames(slot.frames, 1) : at::zeros_like(keep), keep}, 2);
  }
  at::Tensor y = slot.has_tensor() ? time_conv->forward(x, slot.frames) : time_conv->forward(x);
  slot.set(std::move(keep));
  const int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
  return y.view({b, 2, c, t, h, w}).permute({0, 2, 3, 1, 4, 5}).reshape({b, c, t * 2, h, w});
}

at::Tensor Resample::downsample_time(const at::Tensor& x, FeatCache& cache) const {
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

at::Tensor head_conv(const RmsNorm& norm, const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache) {
  return cached_conv(conv, at::silu(norm.forward(x)), cache);
}

}  // namespace skyreels::model::wan_vae_detail
