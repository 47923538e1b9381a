// Generic checkpoint access: a folder or file of safetensors (single or sharded through *.safetensors.index.json),
// renamed onto a model's internal names by an ordered table of rules, checked strictly against the model's parameter
// specs, and placed straight onto the target device in the target dtype.
//
// Model-specific layouts (the transformer's diffusers / original / norm_out.linear forms, the VAE, UMT5) are tables
// of RenameRule plus, where a layout needs it, a documented tensor transform; they live next to the loader of each
// model, never inside the model.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace skyreels::checkpoint {

using StateDict = std::map<std::string, at::Tensor>;

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Every tensor of a checkpoint, by key, without reading any data yet.
class Source {
 public:
  // `path` is a .safetensors file, a *.safetensors.index.json, or a folder holding exactly one of
  // (an index json, a single .safetensors file, several shards named *-0000k-of-0000n.safetensors).
  // `preferred_stem` picks e.g. "diffusion_pytorch_model" or "model" when a folder holds several candidates.
  static Source open(const std::string& path, const std::string& preferred_stem = "");

  const std::string& folder() const { return folder_; }  // where config.json would be
  const std::vector<std::string>& files() const { return files_; }
  std::vector<std::string> keys() const;  // sorted
  bool contains(const std::string& key) const { return where_.count(key) != 0; }
  const safetensors::TensorInfo& info(const std::string& key) const;
  const std::string& file_of(const std::string& key) const;
  at::Tensor tensor(const std::string& key) const;  // CPU view of the mapped bytes
  uint64_t total_bytes() const;                     // sum of tensor bytes

 private:
  std::string folder_;
  std::vector<std::string> files_;
  std::vector<std::shared_ptr<safetensors::File>> opened_;
  std::map<std::string, size_t> where_;  // key -> index into opened_
};

// Ordered substring replacement, as diffusers' converters do it: every rule whose `from` occurs in the key is applied
// in order, each to the result of the previous. Rules with an empty `from` are ignored.
struct RenameRule {
  std::string from;
  std::string to;
};
std::string apply_rules(const std::string& key, const std::vector<RenameRule>& rules);

// What the model expects for one parameter. keep_fp32: an fp32 island (kept in float32 whatever the compute dtype).
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool keep_fp32 = false;
};

// A parameter's value when it is not the stored tensor cast to its placed dtype (fp8 codes decoded and scaled, LoRA
// adapters merged): place_strict calls it once per parameter, in spec order, with the stored tensor; it returns the
// value as a float32 CPU tensor, or an undefined tensor to place the stored tensor as it is. Parameter by parameter,
// so what a hook holds at a time is bounded by the largest tensor.
using ValueHook = std::function<at::Tensor(const std::string& name, const at::Tensor& stored)>;

struct PlaceOptions {
  std::string device = "cpu";         // "cpu", "cuda", "cuda:N"
  at::ScalarType dtype = at::kFloat;  // compute dtype for everything that is not an fp32 island
  ValueHook value = nullptr;
  // Names whose stored tensor holds codes (fp8 as uint8) that `value` decodes into floats.
  std::set<std::string> encoded = {};
};

// Where internal names came from, so that errors name both the internal name and the checkpoint key.
struct KeyOrigins {
  std::map<std::string, std::string> source_key;                // internal name -> checkpoint key it was read from
  std::function<std::string(const std::string&)> expected_key;  // internal name -> checkpoint key that would hold it
  // "name" when the checkpoint key is the same, else "name (checkpoint key 'key')"; for names absent from
  // source_key, expected_key (when set) supplies the key.
  std::string describe(const std::string& internal) const;
};

// The outcome of matching checkpoint tensors against specs; empty() means a perfect match.
struct MatchProblems {
  std::vector<std::string> missing;         // spec names with no tensor
  std::vector<std::string> unexpected;      // tensor names with no spec (KeyOrigins::describe form)
  std::vector<std::string> shape_mismatch;  // "name (checkpoint key ..): checkpoint [..] vs model [..]"
  std::vector<std::string> bad_dtype;       // non-floating tensors where floats were expected
  std::vector<std::string> duplicates;      // several checkpoint keys renamed onto one internal name
  bool empty() const {
    return missing.empty() && unexpected.empty() && shape_mismatch.empty() && bad_dtype.empty() && duplicates.empty();
  }
  size_t count() const;
  std::string describe() const;  // one message listing all of them
};

// Checks `tensors` against `specs` without placing anything (what `inspect` reports).
// `encoded`: names stored as codes that decode to floats (fp8), so not "non-floating tensors".
MatchProblems match_specs(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                          const KeyOrigins& origins = {}, const std::set<std::string>& encoded = {});

// Strictly places `tensors` (internal name -> CPU tensor, e.g. mapped views) according to `specs`.
// Throws CheckpointError("<context>: ...all problems...") unless every spec is matched exactly once by shape.
// Every placed tensor is memory of its own, never a view of a file's mapping (a checkpoint rewritten in place while
// serving changes nothing); each stored tensor's mapped pages are released once it is placed, so the RSS holds the
// weights and one stored tensor at a time. On CUDA the stored bytes go to the device first and are converted there
// (no full converted copy on the host).
StateDict place_strict(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                       const PlaceOptions& options, const std::string& context);
StateDict place_strict(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                       const PlaceOptions& options, const std::string& context, const KeyOrigins& origins);

// The dtype a parameter is placed in: fp32 islands stay float32; fp16 becomes float32 on CPU (LibTorch 1.13 has no
// fp16 matmul there).
at::ScalarType placed_dtype(const ParamSpec& spec, const PlaceOptions& options);

// Parses "cpu", "cuda", "cuda:N"; throws CheckpointError on anything else, and on CUDA when this LibTorch has none.
c10::Device parse_device(const std::string& device);

// dtype names: "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16".
at::ScalarType parse_dtype(const std::string& name);

std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace skyreels::checkpoint
