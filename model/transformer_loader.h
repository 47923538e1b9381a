// The compatibility loader for SkyReels-V2 transformer checkpoints: detects the layout from the keys (diffusers,
// original SkyReels-V2/Wan with optional `model.diffusion_model.` prefix, diffusers PR #11850 `norm_out.linear`),
// maps it onto the internal (diffusers) names with a table, reads or infers the config, checks strictly, and places
// every tensor straight onto the target device in the target dtype.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/fp8.h"
#include "model/lora.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

enum class TransformerLayout { Diffusers, Original, NormOutLinear };
const char* layout_name(TransformerLayout layout);  // "diffusers", "original", "norm_out_linear"

struct TransformerLoadOptions {
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string dtype = "float32";  // float32, bfloat16, auto (runtime::resolve_dtype_name)
  // LoRA adapters merged into the weights at load, in float32, in this order (model/lora.h).
  std::vector<LoraSpec> loras = {};
};

// How a stored tensor becomes its value, when it is not just the stored tensor: fp8 codes (a uint8 view) decoded
// exactly, and/or a scale tensor the file carries for it (value = decoded value x scale, in float32; the scale is a
// scalar, or one value per output row).
struct StoredDecoding {
  std::optional<fp8::Format> format;  // set: the stored tensor holds codes of this format
  at::Tensor scale;                   // defined: multiply by it (float32, broadcast over the rows)
  std::string scale_key;              // the checkpoint key of the scale
};
using StoredDecodings = std::map<std::string, StoredDecoding>;  // internal name -> decoding

// The float32 value of a stored tensor: `stored` itself converted, or decoded (and scaled) when `decoding` says so.
at::Tensor stored_value(const at::Tensor& stored, const StoredDecoding* decoding);

// What the loader found and did; also what `skyreels inspect` prints.
struct TransformerLoadReport {
  TransformerLayout layout = TransformerLayout::Diffusers;
  std::string config_source;  // "config.json (diffusers)", "config.json (original)", "inferred ..."
  std::vector<std::string> files;
  std::vector<std::string> notes;                // mapping applied, conversions, inferences
  std::map<std::string, int64_t> stored_dtypes;  // "F32" -> tensor count (fp8 ones as "F8_E4M3" / "F8_E5M2")
  int64_t fp8_tensors = 0;                       // parameters stored as fp8 codes
  int64_t scaled_tensors = 0;                    // parameters with a scale tensor (ComfyUI scaled_fp8, ...)
  std::vector<LoraReport> loras;                 // adapters merged, in order
  int64_t parameter_count = 0;
  uint64_t bytes = 0;
  double seconds = 0.0;
  // Every tensor the built model holds (parameters and buffers such as the RoPE tables), checked after the build to
  // lie on the requested device and never on meta: their count there, and how many of them are float32.
  int64_t placed_tensors = 0;
  int64_t placed_fp32 = 0;
  std::string placed_device;  // e.g. "cuda:0"
};

struct LoadedTransformer {
  std::unique_ptr<SkyReelsV2Transformer> model;
  TransformerLoadReport report;
};

// `path`: a transformer folder (config.json + weights), a diffusers pipeline folder (uses transformer/), a
// .safetensors file, or an index json. Throws checkpoint::CheckpointError listing every problem at once.
LoadedTransformer load_transformer(const std::string& path, const TransformerLoadOptions& options = {});

// The checkpoint mapped onto internal names and checked, without building a model (for inspect and convert).
struct MappedTransformerCheckpoint {
  TransformerConfig config;
  std::map<std::string, at::Tensor> tensors;  // internal name -> CPU tensor as stored (mapped, not copied)
  StoredDecodings decodings;                  // tensors stored as fp8 codes or with a scale
  TransformerLoadReport report;
  at::Tensor value(const std::string& name) const;  // float32 value of a tensor (fp8 decoded and scaled)
};
MappedTransformerCheckpoint map_transformer_checkpoint(const std::string& path);

// ---- the pieces, exposed for `inspect`, `convert` and tests --------------------------------------------------------

// The layout of a set of checkpoint keys (an optional `model.diffusion_model.` prefix is allowed). Throws
// CheckpointError when no transformer key is recognised, or when original and diffusers names are mixed.
TransformerLayout detect_transformer_layout(const std::vector<std::string>& keys);

// The ordered rename table of a layout: checkpoint key -> internal (diffusers) name, applied with
// checkpoint::apply_rules. The prefix rule comes first in every table.
const std::vector<checkpoint::RenameRule>& transformer_rename_rules(TransformerLayout layout);
// The inverse direction: the checkpoint key (without prefix) a layout stores an internal name under. Used to name
// the key of a missing parameter; for norm_out_linear, `scale_shift_table` is stored as norm_out.linear.bias.
std::string transformer_checkpoint_key(TransformerLayout layout, const std::string& internal);

// config.json in diffusers form (SkyReelsV2Transformer3DModel) or original form (WanModel: dim, num_heads, ...).
// Fields a file leaves out take that form's defaults, each listed in `notes`. Throws CheckpointError naming the
// file and field on a malformed or unsupported config.
struct ParsedTransformerConfig {
  TransformerConfig config;
  std::string form;  // "diffusers" or "original"
  std::vector<std::string> notes;
};
ParsedTransformerConfig parse_transformer_config(const std::string& config_json_path);

// The config implied by (internal-named) tensor shapes. The head split is not recorded in the weights (the q/k
// RMSNorm spans all heads): it assumes attention_head_dim 128, as every published SkyReels-V2/Wan model has, and
// throws CheckpointError when the inner dim is not a multiple of 128. eps, rope_max_seq_len and
// num_frame_per_block take their defaults. Every assumption is appended to `notes`.
TransformerConfig infer_transformer_config(const std::map<std::string, at::Tensor>& tensors,
                                           std::vector<std::string>* notes = nullptr);

// Fields on which `config` contradicts the tensor shapes, each naming the field and the tensor that disagrees.
std::vector<std::string> transformer_config_contradictions(const TransformerConfig& config,
                                                           const std::map<std::string, at::Tensor>& tensors,
                                                           const std::string& form = "diffusers");

// Everything the loader finds, with problems collected instead of thrown (what `inspect` prints). Only unreadable
// inputs throw (missing path, damaged safetensors, missing shard, unrecognised or mixed key names).
struct TransformerCheckpointAnalysis {
  std::string path;                           // what was read (a pipeline's transformer/ folder, for instance)
  std::optional<TransformerConfig> config;    // absent when it could not be read or inferred
  std::map<std::string, at::Tensor> tensors;  // internal name -> CPU tensor as stored (mapped views)
  StoredDecodings decodings;                  // tensors stored as fp8 codes or with a scale
  checkpoint::KeyOrigins origins;             // internal name -> checkpoint key
  TransformerLoadReport report;
  std::vector<std::string> problems;  // config and layout problems, each naming its field/key/file
  checkpoint::MatchProblems match;    // strict comparison with the model's parameters
  bool ok() const { return problems.empty() && match.empty(); }
  std::string error_message() const;  // every problem in one message
  at::Tensor value(const std::string& name) const;  // float32 value of a tensor (fp8 decoded and scaled)
};
TransformerCheckpointAnalysis analyze_transformer_checkpoint(const std::string& path);

// Writes the checkpoint at `src` (any accepted layout) in the diffusers layout: config.json plus
// diffusion_pytorch_model.safetensors, or shards diffusion_pytorch_model-0000k-of-0000n.safetensors with
// diffusion_pytorch_model.safetensors.index.json when it is larger than max_shard_size. `dst` must not exist or be
// empty. The source is checked strictly first; nothing is written for a checkpoint that would not load.
// --dtype float8_e4m3fn stores every matrix weight (2 or more dims, not an fp32 island) as F8_E4M3 codes
// (fp8::encode_e4m3fn: round to nearest, ties to even, as PyTorch's .to(torch.float8_e4m3fn); a value PyTorch would
// turn into NaN is an error naming the tensor), without scales; other tensors keep their stored dtype. An fp8 source
// needs a --dtype (there is no diffusers layout for its scales).
struct ConvertOptions {
  std::string dtype;  // "" keeps stored dtypes; float32, bfloat16 (fp32 islands stay fp32) or float8_e4m3fn
  uint64_t max_shard_size = 5'000'000'000ull;  // bytes per shard, 5 GB like diffusers' save_pretrained
};
struct ConvertResult {
  std::vector<std::string> files;  // written, config.json and index included
  uint64_t bytes = 0;              // tensor bytes written
  TransformerLoadReport source;    // what was read
};
ConvertResult convert_transformer_checkpoint(const std::string& src, const std::string& dst,
                                             const ConvertOptions& options = {});

}  // namespace skyreels::model
