// The Wan VAE's encoder and decoder, and the whole model's layer tree (encoder, decoder, quant convs) in diffusers'
// module order, so the ParamSpecs and the bound weights come out of one construction (vae_wan_layers.h).
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "model/vae_wan_layers.h"

namespace skyreels::model::wan_vae_detail {

// ---------------------------------------------------------------------------------------------------------------
// Encoder.
Encoder::Encoder(Binder& b, const WanVaeConfig& c) {
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

at::Tensor Encoder::forward(const at::Tensor& x, FeatCache& cache) const {
  cache.start_call();
  at::Tensor h = cached_conv(conv_in, x, cache);
  for (const auto& block : down_blocks) {
    h = std::visit([&](const auto& layer) { return layer.forward(h, cache); }, block);
  }
  h = mid->forward(h, cache);
  return head_conv(norm_out, conv_out, h, cache);
}

std::string Encoder::block_name() const { return "encoder.down_blocks." + std::to_string(down_blocks.size()); }

// ---------------------------------------------------------------------------------------------------------------
// Decoder.
Decoder::Decoder(Binder& b, const WanVaeConfig& c) {
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

at::Tensor Decoder::forward(const at::Tensor& x, FeatCache& cache) const {
  cache.start_call();
  at::Tensor h = cached_conv(conv_in, x, cache);
  h = mid->forward(h, cache);
  for (const auto& block : up_blocks) {
    for (const auto& resnet : block.resnets) h = resnet.forward(h, cache);
    if (block.upsampler) h = block.upsampler->forward(h, cache);
  }
  return head_conv(norm_out, conv_out, h, cache);
}

// ---------------------------------------------------------------------------------------------------------------
// The whole model.
Model::Model(Binder& b, const WanVaeConfig& c)
    : encoder(b, c),
      decoder(b, c),
      quant_conv(b, "quant_conv", c.z_dim * 2, c.z_dim * 2, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}),
      post_quant_conv(b, "post_quant_conv", c.z_dim, c.z_dim, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}) {}

}  // namespace skyreels::model::wan_vae_detail
