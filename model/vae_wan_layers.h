// Internal to the Wan VAE, which is split by concept over vae_wan_layers.cpp (parameter binding, the feature cache, the
// causal convolution and the blocks built on it), vae_wan_encoder_decoder.cpp (the encoder, the decoder and the
// model's whole layer tree), vae_wan_config.cpp (WanVaeConfig) and vae_wan.cpp (WanVae: weights, loading, decode,
// encode, decode sessions): the layer tree these files share. Not a public header: only those files include it.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "model/checkpoint.h"
#include "model/vae_wan.h"

namespace skyreels::model::wan_vae_detail {

// Causal convolutions keep the last CACHE_T input frames of the previous call.
inline constexpr int64_t kCacheT = 2;

// ---------------------------------------------------------------------------------------------------------------
// Parameter binding. The same code builds the layer tree for two purposes: listing ParamSpecs (no tensors) and
// taking the tensors of a state dict (checked against the same shapes), so the specs can never drift from the model.
class Binder {
 public:
  explicit Binder(checkpoint::StateDict* weights) : weights_(weights) {}

  at::Tensor param(const std::string& name, std::vector<int64_t> shape);

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

at::Tensor last_frames(const at::Tensor& x, int64_t n);

// ---------------------------------------------------------------------------------------------------------------
// Layers (vae_wan_layers.cpp).
struct CausalConv3d {
  at::Tensor weight, bias;
  std::array<int64_t, 3> stride{1, 1, 1};
  std::array<int64_t, 3> padding{0, 0, 0};  // (t, h, w) as given to diffusers; time is padded 2*t in front only

  CausalConv3d() = default;
  CausalConv3d(Binder& b, const std::string& name, int64_t in, int64_t out, std::array<int64_t, 3> kernel,
               std::array<int64_t, 3> stride_, std::array<int64_t, 3> padding_);

  // `cache` (may be undefined) holds the previous frames; it replaces that much of the causal zero padding.
  at::Tensor forward(at::Tensor x, const at::Tensor& cache = {}) const;

  // diffusers' cat([cache, x], time) then zero padding (causal in time), written in one pass into one buffer: only
  // the borders are zeroed, the cached frames and x are copied once.
  static at::Tensor padded_input(const at::Tensor& x, const at::Tensor& cache, int64_t pad_t, int64_t pad_h,
                                 int64_t pad_w);

  // LibTorch's heuristic sends fp32 CPU conv3d with few channels x frames x rows to its native path, 3-6x slower
  // than oneDNN at the decoder's shapes (same results to 1e-6); large shapes go to oneDNN anyway.
  static bool use_onednn(const at::Tensor& x);
};

// A causal conv fed through its cache slot: diffusers' repeated `cache_x = x[:, :, -CACHE_T:]` block.
at::Tensor cached_conv(const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache);

struct Conv2d {
  at::Tensor weight, bias;
  int64_t stride = 1, padding = 0;
  Conv2d() = default;
  Conv2d(Binder& b, const std::string& name, int64_t in, int64_t out, int64_t kernel, int64_t stride_,
         int64_t padding_);
  at::Tensor forward(const at::Tensor& x) const;
};

// RMS norm over channels (dim 1): F.normalize(x, dim=1) * sqrt(dim) * gamma.
struct RmsNorm {
  at::Tensor gamma;
  double scale = 1.0;
  RmsNorm() = default;
  RmsNorm(Binder& b, const std::string& name, int64_t dim, bool images);
  at::Tensor forward(const at::Tensor& x) const;
};

// [B, C, T, H, W] <-> [B*T, C, H, W] for the per-frame 2-D layers.
at::Tensor frames_to_images(const at::Tensor& x);
at::Tensor images_to_frames(const at::Tensor& x, int64_t batch);

struct ResidualBlock {
  RmsNorm norm1, norm2;
  CausalConv3d conv1, conv2;
  std::optional<CausalConv3d> shortcut;

  ResidualBlock(Binder& b, const std::string& name, int64_t in, int64_t out);
  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const;
};

// Single-head self-attention over the pixels of each frame.
struct AttentionBlock {
  RmsNorm norm;
  Conv2d to_qkv, proj;

  AttentionBlock(Binder& b, const std::string& name, int64_t dim);

  // softmax(q k^T / sqrt(c)) v, in row blocks so the score matrix stays bounded at high resolution (each row's
  // softmax is independent, so the blocks give the same numbers).
  static at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

  at::Tensor forward(const at::Tensor& x) const;
};

struct MidBlock {
  // Declaration order is construction order: resnets.0, attentions.0, resnets.1 (diffusers' module order).
  ResidualBlock res0;
  AttentionBlock attn;
  ResidualBlock res1;
  MidBlock(Binder& b, const std::string& name, int64_t dim);
  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const;
};

// Spatial (and for *3d, temporal) resampling: nearest 2x + conv (up) or zero pad + stride-2 conv (down).
struct Resample {
  enum class Mode { kUp2d, kUp3d, kDown2d, kDown3d };
  Mode mode;
  Conv2d resample;
  std::optional<CausalConv3d> time_conv;

  Resample(Binder& b, const std::string& name, int64_t dim, Mode mode_, int64_t up_out_dim);
  at::Tensor forward(at::Tensor x, FeatCache& cache) const;

 private:
  // The first latent frame passes alone ("Rep"); afterwards time_conv doubles every frame: channels [0, c) give
  // frame 2i, [c, 2c) frame 2i+1. A first call with several frames is that first frame, then the rest as the next
  // call (which sees zeros, not the first frame, before it: diffusers' "Rep" slot).
  at::Tensor upsample_time(const at::Tensor& x, FeatCache& cache) const;
  at::Tensor double_frames(const at::Tensor& x, Slot& slot) const;
  // The first chunk keeps all its frames; later chunks are strided over time with the previous chunk's last frame.
  at::Tensor downsample_time(const at::Tensor& x, FeatCache& cache) const;
};

// norm -> silu -> cached causal conv: the encoder's and the decoder's output head.
at::Tensor head_conv(const RmsNorm& norm, const CausalConv3d& conv, const at::Tensor& x, FeatCache& cache);

// ---------------------------------------------------------------------------------------------------------------
// The encoder, the decoder and the whole model (vae_wan_encoder_decoder.cpp).
struct Encoder {
  CausalConv3d conv_in, conv_out;
  std::vector<std::variant<ResidualBlock, Resample>> down_blocks;
  std::optional<MidBlock> mid;
  RmsNorm norm_out;

  Encoder(Binder& b, const WanVaeConfig& c);
  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const;

 private:
  std::string block_name() const;
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

  Decoder(Binder& b, const WanVaeConfig& c);
  // n latent frames (after post_quant_conv) -> 1 + 4(n - 1) pixel frames the first time, 4n afterwards.
  at::Tensor forward(const at::Tensor& x, FeatCache& cache) const;
};

// The whole model; built by one function so specs and loading share it.
struct Model {
  Encoder encoder;
  Decoder decoder;
  CausalConv3d quant_conv, post_quant_conv;
  Model(Binder& b, const WanVaeConfig& c);
};

}  // namespace skyreels::model::wan_vae_detail
