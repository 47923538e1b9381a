// The compatibility loader for SkyReels-V2 transformer checkpoints: detects the layout from the keys (diffusers,
// original SkyReels-V2/Wan with optional `model.diffusion_model.` prefix, diffusers PR #11850 `norm_out.linear`),
// maps it onto the internal (diffusers) names with a table, reads or infers the config, checks strictly, and places
// every tensor straight onto the target device in the target dtype.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

enum class TransformerLayout { Diffusers, Original, NormOutLinear };
const char* layout_name(TransformerLayout layout);  // "diffusers", "original", "norm_out_linear"

struct TransformerLoadOptions {
  std::string device = "cpu";      // cpu, cuda, cuda:N
  std::string dtype = "float32";   // float32, bfloat16, auto (runtime::resolve_dtype_name)
};

// What the loader found and did; also what `skyreels inspect` prints.
struct TransformerLoadReport {
  TransformerLayout layout = TransformerLayout::Diffusers;
  std::string config_source;                 // "config.json (diffusers)", "config.json (original)", "inferred ..."
  std::vector<std::string> files;
  std::vector<std::string> notes;            // mapping applied, conversions, inferences
  std::map<std::string, int64_t> stored_dtypes;  // "F32" -> tensor count
  int64_t parameter_count = 0;
  uint64_t bytes = 0;
  double seconds = 0.0;
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
  TransformerLoadReport report;
};
MappedTransformerCheckpoint map_transformer_checkpoint(const std::string& path);

}  // namespace skyreels::model
