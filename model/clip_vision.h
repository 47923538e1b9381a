// The image encoder of the SkyReels-V2 / Wan image-to-video models: transformers' CLIPVisionModelWithProjection
// (laion ViT-H/14 in the real checkpoints), plain ATen ops. The pipeline's image tokens are its penultimate hidden
// states (diffusers' encode_image: hidden_states[-2]), the input of the last encoder layer; `image_embeds` (the
// projected, post-LayerNorm CLS token) is what the model class returns, unused by the pipeline.
//
// Per layer (pre-norm): x += out_proj(attn(layer_norm1(x))), x += fc2(act(fc1(layer_norm2(x)))); attention as
// transformers' eager CLIPAttention (q scaled by head_dim^-0.5 before q k^T, softmax, no mask). Embeddings: a patch
// convolution without bias, the CLS embedding in front, learned positions, then pre_layrnorm.
//
// Internal parameter names are transformers' (`vision_model.encoder.layers.N.self_attn.q_proj.weight`, ...).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace skyreels::model {

struct ClipVisionConfig {
  int64_t hidden_size = 1280;
  int64_t intermediate_size = 5120;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 16;
  int64_t image_size = 224;
  int64_t patch_size = 14;
  int64_t num_channels = 3;
  int64_t projection_dim = 1024;
  std::string hidden_act = "gelu";  // gelu (erf), quick_gelu, gelu_new / gelu_pytorch_tanh (tanh)
  double layer_norm_eps = 1e-5;

  static ClipVisionConfig vit_h_14();  // laion/CLIP-ViT-H-14: the I2V checkpoints' image_encoder
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int64_t tokens() const { return num_patches() + 1; }
  // Throws std::invalid_argument naming the field.
  void validate() const;
  // A transformers config.json (CLIPVisionConfig, or a CLIPConfig's vision_config). Throws
  // checkpoint::CheckpointError naming the file and the field.
  static ClipVisionConfig from_file(const std::string& path);
  std::string to_transformers_json() const;
};

// Every parameter, with its shape (transformers' names).
std::vector<checkpoint::ParamSpec> clip_vision_parameter_specs(const ClipVisionConfig& config);

struct ClipVisionOutput {
  at::Tensor penultimate;                 // hidden_states[-2] [N, tokens, hidden]: the pipeline's image tokens
  at::Tensor image_embeds;                // [N, projection_dim]; undefined unless asked for
  std::vector<at::Tensor> hidden_states;  // hidden_states[0..L] when asked for (tests)
};

class ClipVisionEncoder {
 public:
  // Takes exactly the tensors named by clip_vision_parameter_specs(config), already placed
  // (checkpoint::place_strict). Throws std::invalid_argument on a missing or misshapen tensor.
  ClipVisionEncoder(ClipVisionConfig config, checkpoint::StateDict weights, c10::Device device,
                    at::ScalarType compute_dtype);
  ~ClipVisionEncoder();
  ClipVisionEncoder(const ClipVisionEncoder&) = delete;
  ClipVisionEncoder& operator=(const ClipVisionEncoder&) = delete;

  // pixel_values [N, num_channels, image_size, image_size] (clip_preprocess). The last layer runs only when
  // image_embeds or every hidden state is asked for (the image tokens are the input of that layer). Outputs are
  // float32 on the CPU. Thread-compatible.
  ClipVisionOutput forward(const at::Tensor& pixel_values, bool image_embeds = false,
                           bool all_hidden_states = false) const;

  const ClipVisionConfig& config() const;
  c10::Device device() const;
  at::ScalarType compute_dtype() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct ClipVisionLoadOptions {
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string dtype = "float32";  // float32, bfloat16, auto
};

// The checkpoint layouts of the image encoder: transformers' (`vision_model.*`, `visual_projection.weight`) and the
// original Wan / SkyReels-V2 one (`open-clip-xlm-roberta-large-vit-huge-14`: Wan's clip.py VisionTransformer under
// `visual.*`, with a fused `attn.to_qkv` and `head` as a [hidden, projection] matrix).
enum class ClipVisionLayout { Transformers, Original };
const char* clip_vision_layout_name(ClipVisionLayout layout);  // "transformers", "original"

// The ordered rename table of the original layout (checkpoint::apply_rules), onto the internal names; the tensor
// transforms no rename can express (the qkv split, [1, 1, H] / [1, T, H] embeddings flattened, head transposed) are
// done by the loader after it, each documented there.
const std::vector<checkpoint::RenameRule>& clip_vision_original_rules();

struct LoadedClipVision {
  std::unique_ptr<ClipVisionEncoder> model;
  std::string path;  // the folder or file read (a pipeline's image_encoder/)
  ClipVisionLayout layout = ClipVisionLayout::Transformers;
  std::string config_source;       // "config.json" or "inferred from shapes ..."
  std::vector<std::string> notes;  // ignored tensors, assumptions
};

// `path`: an image encoder folder (config.json + model.safetensors, or shards with an index), a .safetensors file, or
// a diffusers pipeline folder holding image_encoder/; in either layout. The original layout needs no config.json:
// the config is read off the shapes (16 heads of 80 for the 1280-wide ViT-H/14, i.e. heads = hidden / 80; gelu, eps
// 1e-5 as Wan's clip_xlm_roberta_vit_h_14). Strict: every tensor must be a parameter and every parameter present
// with its shape; the text tower of a full CLIP model is ignored. Throws checkpoint::CheckpointError naming the
// folder and every problem (with the checkpoint's own key names).
LoadedClipVision load_clip_vision_encoder(const std::string& path, const ClipVisionLoadOptions& options = {});

}  // namespace skyreels::model
