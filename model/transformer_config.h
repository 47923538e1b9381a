// The transformer's config, described once: the published models' presets, the diffusers config.json it writes, and
// its consistency rules (transformer_config.cpp). Torch-free, so that the server's descriptions of the model
// (ModelDescription, ModelSummary) hold it instead of restating its fields.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace skyreels::model {

struct TransformerConfig {
  std::array<int64_t, 3> patch_size{1, 2, 2};
  int64_t num_attention_heads = 16;
  int64_t attention_head_dim = 128;
  int64_t in_channels = 16;
  int64_t out_channels = 16;
  int64_t text_dim = 4096;
  int64_t freq_dim = 256;
  int64_t ffn_dim = 8192;
  int64_t num_layers = 32;
  bool cross_attn_norm = true;
  double eps = 1e-6;
  int64_t rope_max_seq_len = 1024;
  bool inject_sample_info = false;
  // Checkpoint default only. The block-causal mask of a request comes from ForwardArgs::num_frame_per_block;
  // nothing at run time writes back into the config (diffusers does, and leaks it into later calls).
  int64_t num_frame_per_block = 1;
  // Image-to-video (I2V) models: image tokens (CLIP's penultimate hidden states, image_dim wide) pass the image
  // embedder and every block's cross-attention attends to them through its own key / value projections
  // (added_kv_proj_dim = inner_dim, the embedder's width). First-last-frame models add a learned position embedding
  // to the tokens of both images (pos_embed_seq_len = 2 x the tokens of one image).
  std::optional<int64_t> image_dim;
  std::optional<int64_t> added_kv_proj_dim;
  std::optional<int64_t> pos_embed_seq_len;

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  bool has_image_branch() const { return image_dim.has_value(); }

  static TransformerConfig df_1_3b();   // Skywork/SkyReels-V2-DF-1.3B-540P
  static TransformerConfig df_14b();    // Skywork/SkyReels-V2-DF-14B-540P / 720P (and T2V-14B: the same shapes)
  static TransformerConfig i2v_1_3b();  // Skywork/SkyReels-V2-I2V-1.3B-540P
  static TransformerConfig i2v_14b();   // Skywork/SkyReels-V2-I2V-14B-540P / 720P

  // diffusers config.json (what `convert` writes); the loader owns parsing of every accepted form.
  std::string to_diffusers_json() const;
  // Throws std::invalid_argument naming the field when the config is inconsistent or unsupported.
  void validate() const;
};

}  // namespace skyreels::model
