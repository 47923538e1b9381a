// LoRA adapters for the SkyReels-V2 transformer, read as diffusers reads them (SkyReelsV2LoraLoaderMixin). Either
// merged into the weights at load: W' = W + scale * (alpha / r) * B @ A, in float32, before the cast to the compute
// dtype (so a step costs what it costs without the adapter); or placed on the model's device (place_lora) and applied
// unmerged per call, y = W x + b + scale * (alpha / r) * B (A x) (TransformerForwardArgs::adapters, the bank of
// model/adapter_bank.h), leaving the weights as they are.
//
// Key formats (detected as diffusers detects them, from the first key that shows one):
//   diffusers / PEFT   transformer.<module>.lora_A.weight, .lora_B.weight, optional .lora_B.bias and .alpha
//                      (<module>: the internal (diffusers) name of a linear layer, e.g. blocks.0.attn1.to_q); a
//                      module without .alpha takes lora_alpha / alpha_pattern of the PEFT config diffusers saves
//                      in __metadata__["lora_adapter_metadata"] (use_rslora / use_dora: refused), else r
//   original / kohya   diffusion_model.<original module>.lora_down.weight / .lora_up.weight (or lora_A / lora_B),
//                      .alpha, .diff_b (a bias delta); diffusers' _convert_non_diffusers_wan_lora_to_diffusers
//   musubi-tuner       lora_unet_blocks_<N>_<module>.lora_down.weight / .lora_up.weight / .alpha (alpha required);
//                      diffusers' _convert_musubi_wan_lora_to_diffusers
// The module names of the two non-diffusers formats are a table in lora.cpp. alpha defaults to r where a format
// allows it to be absent; the bias delta of .diff_b is scale * diff_b (diffusers folds alpha / r into A and B
// only). Keys diffusers drops too (norm .diff/.diff_b, time_projection without weights, dora_scale, remaining .diff
// weight diffs) are skipped with a spdlog warning; every other problem is a std::invalid_argument naming the file
// and the key.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace skyreels::model {

// One --lora FILE[:SCALE].
struct LoraSpec {
  std::string path;
  double scale = 1.0;
};
// "FILE" or "FILE:SCALE" (SCALE a finite number; the text after the last ':' is the scale when it parses as one).
// Throws std::invalid_argument on an empty path or a bad scale.
LoraSpec parse_lora_spec(const std::string& text);
// "file.safetensors:1,other.safetensors:0.5" (file names without folders): for logs and the build-info label.
std::string describe_loras(const std::vector<LoraSpec>& specs);

enum class LoraFormat { Diffusers, Original, Musubi };
const char* lora_format_name(LoraFormat format);  // "diffusers", "original", "musubi"

// One update of one parameter: value += factor * (up @ down) (a low-rank weight update: down [r, in], up [out, r]),
// or value += factor * delta (a bias delta, or a full weight diff). Tensors are float32 CPU as read_lora returns them;
// place_lora moves them to a model's device and dtypes.
struct LoraUpdate {
  std::string key;  // the adapter key it came from (for messages)
  at::Tensor down;
  at::Tensor up;
  at::Tensor delta;
  double factor = 1.0;  // scale * alpha / r for low-rank updates; scale for deltas
};

struct LoraAdapter {
  LoraSpec spec;
  LoraFormat format = LoraFormat::Diffusers;
  std::map<std::string, LoraUpdate> updates;  // internal parameter name -> update
  std::vector<std::string> ignored;           // keys skipped as diffusers skips them (each warned once)
  int64_t max_rank = 0;
};

// Reads, maps and checks one adapter file (shapes between A and B, rank, alpha, finiteness); the model is not needed.
LoraAdapter read_lora(const LoraSpec& spec);
// The same from a file already open (spec.path names it in messages).
LoraAdapter read_lora(const LoraSpec& spec, const safetensors::File& file);

// An adapter file as its header describes it, no tensor read: every key mapped and every check that needs no tensor
// value (the values' finiteness and alpha > 0 are read_lora's). Throws what read_lora throws for those problems.
struct LoraLayout {
  LoraFormat format = LoraFormat::Diffusers;
  struct Target {
    std::string key;             // the adapter key (lora_A / lora_down of a low-rank update)
    std::vector<int64_t> shape;  // the parameter shape the update implies
    int64_t rank = 0;            // 0: a delta (bias delta or full weight diff)
  };
  std::map<std::string, Target> targets;  // internal parameter name -> its update
  std::vector<std::string> ignored;       // keys diffusers drops too
  int64_t max_rank = 0;
};
LoraLayout read_lora_layout(const std::string& path, const safetensors::Header& header);
// check_loras for a layout: every target exists in `specs` with the implied shape.
void check_lora_layout(const std::string& path, const LoraLayout& layout,
                       const std::vector<checkpoint::ParamSpec>& specs);

// Checks the adapters against the model's parameters: every target exists and has the shape the update implies.
// Throws std::invalid_argument naming the adapter, its key and both shapes.
void check_loras(const std::vector<LoraAdapter>& adapters, const std::vector<checkpoint::ParamSpec>& specs);

// Adds every adapter's update of parameter `name` to `value` (float32, in place, in adapter order). Returns true when
// any adapter touches it.
bool merge_loras(const std::vector<LoraAdapter>& adapters, const std::string& name, at::Tensor& value);

// A copy of `adapter` whose tensors lie on `device` in the dtype of the parameter they update: float32 for fp32 islands
// (checkpoint::ParamSpec::keep_fp32), else `compute_dtype`. For the unmerged branch.
LoraAdapter place_lora(const LoraAdapter& adapter, const std::vector<checkpoint::ParamSpec>& specs, c10::Device device,
                       at::ScalarType compute_dtype);

// What was merged (for the load report, GetServerInfo and logs).
struct LoraReport {
  std::string path;
  double scale = 1.0;
  std::string format;
  int64_t parameters = 0;  // parameters it changes
  int64_t max_rank = 0;
  int64_t ignored = 0;
};
LoraReport lora_report(const LoraAdapter& adapter);

}  // namespace skyreels::model
