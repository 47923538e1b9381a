// The transformer's config: the presets of the published models, config.json in diffusers form (what `convert`
// writes), the consistency checks, and the parameter specs a config implies (names, shapes, fp32 islands), which the
// loader places and the model checks. Separate from the model because it needs no tensors of the model: the loader,
// `inspect` and `convert` use it without building one.
#include "model/transformer_config.h"
#include "model/transformer_skyreels_v2.h"

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace skyreels::model {

TransformerConfig TransformerConfig::df_1_3b() {
  TransformerConfig c;
  c.num_attention_heads = 12;
  c.ffn_dim = 8960;
  c.num_layers = 30;
  c.inject_sample_info = true;
  return c;
}

TransformerConfig TransformerConfig::df_14b() {
  TransformerConfig c;
  c.num_attention_heads = 40;
  c.ffn_dim = 13824;
  c.num_layers = 40;
  return c;
}

TransformerConfig TransformerConfig::i2v_1_3b() {
  TransformerConfig c = df_1_3b();
  c.inject_sample_info = false;
  c.in_channels = 36;  // 16 noise + 4 frame mask + 16 image latent
  c.image_dim = 1280;  // CLIP ViT-H/14
  c.added_kv_proj_dim = c.inner_dim();
  return c;
}

TransformerConfig TransformerConfig::i2v_14b() {
  TransformerConfig c = df_14b();
  c.in_channels = 36;
  c.image_dim = 1280;
  c.added_kv_proj_dim = c.inner_dim();
  return c;
}

std::string TransformerConfig::to_diffusers_json() const {
  nlohmann::ordered_json j;
  j["_class_name"] = "SkyReelsV2Transformer3DModel";
  j["patch_size"] = patch_size;
  j["num_attention_heads"] = num_attention_heads;
  j["attention_head_dim"] = attention_head_dim;
  j["in_channels"] = in_channels;
  j["out_channels"] = out_channels;
  j["text_dim"] = text_dim;
  j["freq_dim"] = freq_dim;
  j["ffn_dim"] = ffn_dim;
  j["num_layers"] = num_layers;
  j["cross_attn_norm"] = cross_attn_norm;
  j["qk_norm"] = "rms_norm_across_heads";
  j["eps"] = eps;
  j["image_dim"] = image_dim ? nlohmann::ordered_json(*image_dim) : nlohmann::ordered_json();
  j["added_kv_proj_dim"] = added_kv_proj_dim ? nlohmann::ordered_json(*added_kv_proj_dim) : nlohmann::ordered_json();
  j["rope_max_seq_len"] = rope_max_seq_len;
  j["pos_embed_seq_len"] = pos_embed_seq_len ? nlohmann::ordered_json(*pos_embed_seq_len) : nlohmann::ordered_json();
  j["inject_sample_info"] = inject_sample_info;
  j["num_frame_per_block"] = num_frame_per_block;
  return j.dump(2);
}

void TransformerConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(patch_size[0] >= 1 && patch_size[1] >= 1 && patch_size[2] >= 1, "patch_size: every entry must be >= 1");
  require(num_attention_heads >= 1, "num_attention_heads: must be >= 1");
  require(attention_head_dim >= 2 && attention_head_dim % 2 == 0, "attention_head_dim: must be even and >= 2");
  require(in_channels >= 1 && out_channels >= 1, "in_channels/out_channels: must be >= 1");
  require(text_dim >= 1 && ffn_dim >= 1 && num_layers >= 1, "text_dim/ffn_dim/num_layers: must be >= 1");
  require(freq_dim >= 2 && freq_dim % 2 == 0, "freq_dim: must be even and >= 2");
  require(rope_max_seq_len >= 1, "rope_max_seq_len: must be >= 1");
  require(num_frame_per_block >= 1, "num_frame_per_block: must be >= 1");
  require(image_dim.has_value() == added_kv_proj_dim.has_value(),
          "image_dim/added_kv_proj_dim: an image-to-video model needs both (or neither)");
  if (image_dim) {
    require(*image_dim >= 1, "image_dim: must be >= 1");
    // The image embedder's output (inner_dim wide) is what add_k_proj / add_v_proj read.
    require(*added_kv_proj_dim == inner_dim(), "added_kv_proj_dim: " + std::to_string(*added_kv_proj_dim) +
                                                   " must equal the inner dim " + std::to_string(inner_dim()) +
                                                   " (the image embedder's width)");
  }
  require(!pos_embed_seq_len || (image_dim && *pos_embed_seq_len >= 2 && *pos_embed_seq_len % 2 == 0),
          "pos_embed_seq_len: needs image_dim and an even length >= 2 (the tokens of the first and the last image)");
}

std::vector<checkpoint::ParamSpec> transformer_parameter_specs(const TransformerConfig& c) {
  const int64_t D = c.inner_dim();
  const int64_t patch_out = c.out_channels * c.patch_size[0] * c.patch_size[1] * c.patch_size[2];
  std::vector<checkpoint::ParamSpec> specs;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool fp32 = false) {
    specs.push_back({name, std::move(shape), fp32});
  };
  auto linear = [&](const std::string& prefix, int64_t out, int64_t in, bool fp32 = false) {
    add(prefix + ".weight", {out, in}, fp32);
    add(prefix + ".bias", {out}, fp32);
  };
  add("patch_embedding.weight", {D, c.in_channels, c.patch_size[0], c.patch_size[1], c.patch_size[2]});
  add("patch_embedding.bias", {D});
  linear("condition_embedder.time_embedder.linear_1", D, c.freq_dim, true);
  linear("condition_embedder.time_embedder.linear_2", D, D, true);
  linear("condition_embedder.time_proj", 6 * D, D);
  linear("condition_embedder.text_embedder.linear_1", D, c.text_dim);
  linear("condition_embedder.text_embedder.linear_2", D, D);
  if (c.image_dim) {
    const int64_t I = *c.image_dim;
    const std::string e = "condition_embedder.image_embedder.";
    add(e + "norm1.weight", {I}, true);
    add(e + "norm1.bias", {I}, true);
    linear(e + "ff.net.0.proj", I, I);
    linear(e + "ff.net.2", D, I);
    add(e + "norm2.weight", {D}, true);
    add(e + "norm2.bias", {D}, true);
    if (c.pos_embed_seq_len) add(e + "pos_embed", {1, *c.pos_embed_seq_len, I});
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    add(b + "scale_shift_table", {1, 6, D}, true);
    for (const char* attn : {"attn1", "attn2"}) {
      for (const char* proj : {"to_q", "to_k", "to_v", "to_out.0"}) linear(b + attn + "." + proj, D, D);
      add(b + attn + ".norm_q.weight", {D});
      add(b + attn + ".norm_k.weight", {D});
    }
    if (c.image_dim) {
      linear(b + "attn2.add_k_proj", D, *c.added_kv_proj_dim);
      linear(b + "attn2.add_v_proj", D, *c.added_kv_proj_dim);
      add(b + "attn2.norm_added_k.weight", {D});
    }
    if (c.cross_attn_norm) {
      add(b + "norm2.weight", {D}, true);
      add(b + "norm2.bias", {D}, true);
    }
    linear(b + "ffn.net.0.proj", c.ffn_dim, D);
    linear(b + "ffn.net.2", D, c.ffn_dim);
  }
  add("scale_shift_table", {1, 2, D}, true);
  linear("proj_out", patch_out, D);
  if (c.inject_sample_info) {
    add("fps_embedding.weight", {2, D});
    linear("fps_projection.net.0.proj", D, D);
    linear("fps_projection.net.2", 6 * D, D);
  }
  return specs;
}

}  // namespace skyreels::model
