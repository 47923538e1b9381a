// The UMT5 text encoder of Wan / SkyReels-V2 (transformers' UMT5EncoderModel), plain ATen ops.
//
// Per block: x += o(attn(norm1(x))), x += wo(gelu_new(wi_0(n)) * wi_1(n)) with n = norm2(x); a final norm at the end.
// Attention has no 1/sqrt(d) scaling, adds a bidirectional relative-position bias that EVERY layer owns (UMT5, not
// T5) plus finfo.min at padded keys, and runs its softmax in fp32. Norms are T5's RMS norm (variance in fp32, weight
// applied after casting back to the weight's dtype). In bfloat16, `wo` stays float32 (transformers'
// _keep_in_fp32_modules), so the residual stream turns float32 after the first feed-forward, exactly as in
// transformers; the output is cast by the final norm to the compute dtype.
//
// Internal parameter names are transformers' names (`shared.weight`, `encoder.block.N.layer.0.SelfAttention.q.weight`,
// ...). Both checkpoint layouts are mapped onto them: transformers (`shared.weight` or `encoder.embed_tokens.weight`
// as the embedding; a full UMT5 model's decoder and lm_head are ignored) and the original Wan T5 names
// (`token_embedding`, `blocks.N.attn.q`, `blocks.N.pos_embedding.embedding`, `blocks.N.ffn.gate.0`, `ffn.fc1`,
// `ffn.fc2`, `norm1`, `norm2`, `norm`).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/checkpoint.h"

namespace skyreels::model {

struct UMT5Config {
  int64_t vocab_size = 256384;
  int64_t d_model = 4096;
  int64_t d_kv = 64;
  int64_t d_ff = 10240;
  int64_t num_layers = 24;
  int64_t num_heads = 64;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;

  int64_t inner_dim() const { return num_heads * d_kv; }
  static UMT5Config umt5_xxl();  // google/umt5-xxl encoder, as in Wan / SkyReels-V2 text_encoder/config.json
  // Throws std::invalid_argument naming the field when a value is unusable.
  void validate() const;
  // The config.json transformers' save_pretrained writes for a UMT5EncoderModel with this config.
  std::string to_transformers_json() const;
};

// Every parameter of the encoder (internal names). `wo` is an fp32 island (keep_fp32), as in transformers.
std::vector<checkpoint::ParamSpec> umt5_parameter_specs(const UMT5Config& config);

// Per-layer values of one forward pass, for tests (filled when a trace is passed).
struct UMT5Trace {
  at::Tensor embeddings;                    // [B, T, d_model]
  at::Tensor extended_attention_mask;       // [B, 1, 1, T]
  std::vector<at::Tensor> position_bias;    // per layer [1, heads, T, T]
  std::vector<at::Tensor> after_attention;  // per layer, hidden states after the attention sublayer
  std::vector<at::Tensor> block_out;        // per layer, hidden states after the block
};

class UMT5Encoder {
 public:
  // Takes exactly the tensors named by umt5_parameter_specs(config), already placed (checkpoint::place_strict).
  // Throws std::invalid_argument on a missing or misshaped tensor.
  UMT5Encoder(UMT5Config config, checkpoint::StateDict weights, c10::Device device, at::ScalarType compute_dtype);
  ~UMT5Encoder();
  UMT5Encoder(const UMT5Encoder&) = delete;
  UMT5Encoder& operator=(const UMT5Encoder&) = delete;

  // last_hidden_state [B, T, d_model] in the compute dtype on the model's device. input_ids and attention_mask are
  // integer [B, T] (any device); ids must lie in [0, vocab_size). Thread-compatible (no mutable state).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask, UMT5Trace* trace = nullptr) const;

  const UMT5Config& config() const;
  c10::Device device() const;
  at::ScalarType compute_dtype() const;
  const checkpoint::StateDict& weights() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// transformers' UMT5Attention._relative_position_bucket for the encoder (bidirectional): int64 buckets of the int64
// relative positions (key - query), computed with the same float32 ops.
at::Tensor umt5_relative_position_bucket(const at::Tensor& relative_position, int64_t num_buckets,
                                         int64_t max_distance);

// The pipeline's post-processing (diffusers _get_t5_prompt_embeds): row b keeps its first seq_len[b] positions,
// seq_len = number of nonzero entries of its attention mask, and is zero from there on. Same shape and dtype.
at::Tensor umt5_zero_pad_rows(const at::Tensor& last_hidden_state, const at::Tensor& attention_mask);

// ---- loading ------------------------------------------------------------------------------------------------------

enum class UMT5Layout { Transformers, Original };
const char* umt5_layout_name(UMT5Layout layout);  // "transformers", "original"

struct UMT5LoadOptions {
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string dtype = "float32";  // float32, bfloat16, auto (runtime::resolve_dtype_name)
};

struct UMT5LoadReport {
  UMT5Layout layout = UMT5Layout::Transformers;
  std::string config_source;  // "config.json (transformers)", "config.json (original)", "inferred from shapes"
  std::vector<std::string> files;
  std::vector<std::string> notes;  // embedding key used, ignored keys, ...
  int64_t parameter_count = 0;
  double seconds = 0.0;
};

struct LoadedUMT5 {
  std::unique_ptr<UMT5Encoder> model;
  UMT5LoadReport report;
};

// `path`: a text encoder folder (config.json + model.safetensors, sharded with an index, or the original names), a
// diffusers pipeline folder (uses text_encoder/), a .safetensors file or an index json. Throws
// checkpoint::CheckpointError naming every problem (a missing token embedding is always an error).
LoadedUMT5 load_umt5_encoder(const std::string& path, const UMT5LoadOptions& options = {});

// The layout of a set of keys; throws CheckpointError when none is recognised or both are mixed.
UMT5Layout detect_umt5_layout(const std::vector<std::string>& keys);
// Rename table of a layout: checkpoint key -> internal name (checkpoint::apply_rules).
const std::vector<checkpoint::RenameRule>& umt5_rename_rules(UMT5Layout layout);

// Writes a random UMT5 encoder in the transformers layout (config.json + model.safetensors, `shared.weight` holding
// the embedding, as save_pretrained does): the tiny text encoder of the README demo and of tests. Weights are drawn
// from a CPU generator seeded with `seed` (embedding N(0,1), linears N(0, 1/sqrt(fan_in)), biases N(0,1), norms
// 1 + N(0, 0.1)).
void write_random_umt5_encoder(const std::string& dir, const UMT5Config& config, uint64_t seed);
// The README demo's text encoder: 2 layers, 2 heads, d_ff = 2 d_model, vocab 1024 (covers a <= 1024-piece
// tokenizer such as the fixtures' spiece.model).
UMT5Config tiny_umt5_config(int64_t d_model, int64_t vocab_size = 1024);
void write_tiny_text_encoder(const std::string& dir, int64_t d_model, uint64_t seed);

}  // namespace skyreels::model
