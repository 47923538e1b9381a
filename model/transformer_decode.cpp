// How the stored tensors of a transformer checkpoint become parameter values: fp8 codes decoded exactly, the scale
// tensors of the fp8 files in circulation (ComfyUI scaled_fp8, compressed-tensors / vLLM / ModelOpt) applied or
// refused by name, and the PR #11850 norm_out.linear pair folded into scale_shift_table. Separate from the loader
// because these are value transforms with conventions of their own; the loader only calls them in order.
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "model/transformer_loader.h"
#include "model/transformer_loader_detail.h"

namespace skyreels::model {

using checkpoint::CheckpointError;
using loader_detail::shape_of;

namespace loader_detail {

// ---- PR #11850 fold ----------------------------------------------------------------------------------------------

// norm_out.linear computes [I; I]·temb + b; with exactly that weight it equals the shipped head, where
// scale_shift_table [1, 2, D] = b viewed as [1, 2, D] (shift row first). Anything else cannot be expressed by the
// model and is refused: loading it would silently change the output.
void fold_norm_out_linear(TransformerCheckpointAnalysis& a, const std::string& prefix) {
  const std::string wkey = "norm_out.linear.weight";
  const std::string bkey = "norm_out.linear.bias";
  auto w_it = a.tensors.find(wkey);
  auto b_it = a.tensors.find(bkey);
  if (w_it == a.tensors.end() || b_it == a.tensors.end()) {
    a.problems.push_back("norm_out.linear layout: '" + prefix + (w_it == a.tensors.end() ? wkey : bkey) +
                         "' is missing; both norm_out.linear.weight and .bias are needed to rebuild scale_shift_table");
    return;
  }
  if (a.tensors.count("scale_shift_table")) {
    a.problems.push_back("both 'scale_shift_table' and '" + prefix +
                         "norm_out.linear.*' are present: the output modulation is ambiguous");
    return;
  }
  const at::Tensor w = a.value(wkey);
  const at::Tensor b = a.value(bkey);
  const std::string wname = "'" + prefix + wkey + "'";
  if (w.dim() != 2 || w.size(0) != 2 * w.size(1)) {
    a.problems.push_back(wname + " has shape " + shape_of(w) + "; the norm_out.linear layout needs [2D, D]");
    return;
  }
  const int64_t D = w.size(1);
  if (b.dim() != 1 || b.size(0) != 2 * D) {
    a.problems.push_back("'" + prefix + bkey + "' has shape " + shape_of(b) + "; expected [" + std::to_string(2 * D) +
                         "] to match " + wname + " " + shape_of(w));
    return;
  }
  if (!at::isFloatingType(w_it->second.scalar_type()) && !a.decodings.count(wkey)) {
    a.problems.push_back(wname + " / bias are not floating point");
    return;
  }
  if (!at::isFloatingType(b_it->second.scalar_type()) && !a.decodings.count(bkey)) {
    a.problems.push_back(wname + " / bias are not floating point");
    return;
  }
  // 0 and 1 are exact in every float dtype, so the comparison is exact; the deviation is reported in float32.
  const at::Tensor eye = at::eye(D, at::kFloat);
  const at::Tensor deviation = (w.to(at::kFloat) - at::cat({eye, eye}, 0)).abs();
  const double max_dev = deviation.max().item<double>();
  if (max_dev != 0.0 || !std::isfinite(max_dev)) {
    const int64_t flat = deviation.nan_to_num(1e30).argmax().item<int64_t>();
    std::ostringstream os;
    os << wname << " is not two stacked identities [I; I] (max deviation " << max_dev << " at row " << flat / D
       << ", column " << flat % D << "); this PR #11850 layout can only be folded into scale_shift_table when it "
       << "is, since the model has no output linear. Refusing to load it.";
    a.problems.push_back(os.str());
    return;
  }
  // Still a view of the mapped bias, unless it had to be decoded (fp8 or scaled: its float32 value, 2D numbers).
  a.tensors["scale_shift_table"] = (a.decodings.count(bkey) ? b : b_it->second).view({1, 2, D});
  a.decodings.erase(wkey);
  a.decodings.erase(bkey);
  a.origins.source_key["scale_shift_table"] = prefix + bkey;
  a.origins.source_key.erase(wkey);
  a.origins.source_key.erase(bkey);
  a.tensors.erase(wkey);
  a.tensors.erase(bkey);
  a.report.notes.push_back("folded norm_out.linear into scale_shift_table [1, 2, " + std::to_string(D) +
                           "] = bias viewed as [1, 2, D] (weight checked to be exactly [I; I])");
}

std::set<std::string> encoded_names(const TransformerCheckpointAnalysis& a) {
  std::set<std::string> out;
  for (const auto& [name, d] : a.decodings) {
    if (d.format) out.insert(name);
  }
  return out;
}

namespace {

std::string last_component(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// ---- fp8 and scale tensors ---------------------------------------------------------------------------------------
// Conventions of the fp8 files in circulation (ComfyUI and its wrappers, llm-compressor / vLLM / ModelOpt):
//   <module>.scale_weight   ComfyUI "scaled fp8": weight = fp8 codes x scale_weight (with a `scaled_fp8` marker)
//   <module>.weight_scale   compressed-tensors / vLLM / ModelOpt: the same product
//   <module>.scale_input, <module>.input_scale   activation scales for an fp8 matmul; weights are upcast here, so
//                           they are dropped (noted)
//   scaled_fp8              ComfyUI's marker (an empty tensor whose dtype is the fp8 format): dropped (noted)
// Any other tensor whose last name part mentions "scale" (e.g. DeepSeek-style block-wise weight_scale_inv) is refused
// by name rather than loaded as a stray parameter or applied wrongly.
struct ScaleConvention {
  const char* suffix;  // last name part
  bool weight_scale;   // true: scales <module>.weight; false: an activation scale, dropped
};
constexpr ScaleConvention kScaleConventions[] = {
    {"scale_weight", true}, {"weight_scale", true}, {"scale_input", false}, {"input_scale", false}};
constexpr const char* kScaledFp8Marker = "scaled_fp8";

void erase_tensor(TransformerCheckpointAnalysis& a, const std::string& name) {
  a.tensors.erase(name);
  a.origins.source_key.erase(name);
}

// The checkpoint's own key of a tensor (its name where the layout renamed none).
std::string source_key(const TransformerCheckpointAnalysis& a, const std::string& name) {
  auto it = a.origins.source_key.find(name);
  return it == a.origins.source_key.end() ? name : it->second;
}

// Every tensor stored as F8_E4M3 / F8_E5M2 is decoded from its codes.
void mark_fp8_tensors(const checkpoint::Source& src, TransformerCheckpointAnalysis& a) {
  for (const auto& [name, key] : a.origins.source_key) {
    const safetensors::DType dtype = src.info(key).dtype;
    if (safetensors::is_fp8(dtype)) {
      a.decodings[name].format = dtype == safetensors::DType::F8_E4M3 ? fp8::Format::E4M3FN : fp8::Format::E5M2;
    }
  }
}

void drop_scaled_fp8_marker(const checkpoint::Source& src, TransformerCheckpointAnalysis& a) {
  if (!a.tensors.count(kScaledFp8Marker)) return;
  a.report.notes.push_back(std::string("'") + source_key(a, kScaledFp8Marker) + "': ComfyUI scaled-fp8 marker (" +
                           safetensors::dtype_name(src.info(source_key(a, kScaledFp8Marker)).dtype) + "), dropped");
  a.decodings.erase(kScaledFp8Marker);
  erase_tensor(a, kScaledFp8Marker);
}

// The scale tensors taken, for the load report.
struct ScaleCounts {
  int64_t dropped_inputs = 0;                   // activation scales
  std::map<std::string, int64_t> weight_kinds;  // weight scales applied, by last name part
};

// `scale` (stored as `key`, already out of the tensors) scales '<module>.weight' of the scale's name `name` (last
// part `part`): checked (a float, one value or one per output row, finite and positive) and set on that weight's
// decoding; false with a problem recorded otherwise.
bool attach_weight_scale(TransformerCheckpointAnalysis& a, const std::string& name, const std::string& part,
                         const std::string& key, const at::Tensor& scale, bool scale_is_fp8) {
  const std::string target = name.substr(0, name.size() - part.size()) + "weight";
  auto w = a.tensors.find(target);
  if (w == a.tensors.end()) {
    a.problems.push_back("'" + key + "': a weight scale, but the checkpoint has no '" +
                         key.substr(0, key.size() - part.size()) + "weight' to scale");
    return false;
  }
  if (scale_is_fp8 || !at::isFloatingType(scale.scalar_type())) {
    a.problems.push_back("'" + key + "': a weight scale must be stored as F32, BF16 or F16");
    return false;
  }
  const int64_t rows = w->second.dim() > 0 ? w->second.size(0) : 1;
  const bool per_tensor = scale.numel() == 1;
  const bool per_row = scale.numel() == rows && (scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1));
  if (!per_tensor && !per_row) {
    a.problems.push_back("'" + key + "': scale of shape " + shape_of(scale) + " for '" + source_key(a, target) + "' " +
                         shape_of(w->second) + "; expected one value, or one per output row [" + std::to_string(rows) +
                         "]");
    return false;
  }
  at::Tensor s = scale.to(at::kFloat).reshape({per_tensor ? 1 : rows});
  if (!(at::isfinite(s).all().item<bool>() && (s > 0).all().item<bool>())) {
    a.problems.push_back("'" + key + "': scale is not a finite positive number (" +
                         std::to_string(s.min().item<double>()) + " ... " + std::to_string(s.max().item<double>()) +
                         ")");
    return false;
  }
  if (!per_tensor) {
    std::vector<int64_t> shape(static_cast<size_t>(w->second.dim()), 1);
    shape[0] = rows;
    s = s.view(shape);
  }
  StoredDecoding& d = a.decodings[target];
  d.scale = s;
  d.scale_key = key;
  return true;
}

// Every tensor whose last name part mentions "scale" (scale_shift_table aside) leaves the tensors: a weight scale is
// attached to its weight, an activation scale dropped, any other refused by name (kScaleConventions).
ScaleCounts take_scale_tensors(TransformerCheckpointAnalysis& a) {
  std::vector<std::string> names;
  for (const auto& [name, t] : a.tensors) names.push_back(name);
  ScaleCounts counts;
  for (const auto& name : names) {
    const std::string part = last_component(name);
    if (part.find("scale") == std::string::npos || part == "scale_shift_table") continue;
    const std::string key = source_key(a, name);
    const ScaleConvention* convention = nullptr;
    for (const auto& c : kScaleConventions) {
      if (part == c.suffix) convention = &c;
    }
    if (convention == nullptr) {
      a.problems.push_back("'" + key +
                           "': unknown scale tensor (supported: <module>.scale_weight and <module>.weight_scale, "
                           "one scale per tensor or per output row; scale_input / input_scale are dropped)");
      continue;
    }
    const at::Tensor scale = a.tensors.at(name);
    const bool scale_is_fp8 = a.decodings.count(name) != 0;
    a.decodings.erase(name);
    erase_tensor(a, name);
    if (!convention->weight_scale) {
      ++counts.dropped_inputs;
      continue;
    }
    if (attach_weight_scale(a, name, part, key, scale, scale_is_fp8)) ++counts.weight_kinds[part];
  }
  return counts;
}

// The load report's counts and notes: fp8 tensors by format, weight scales by convention, activation scales dropped.
void report_decodings(TransformerCheckpointAnalysis& a, const ScaleCounts& counts) {
  for (const auto& [name, d] : a.decodings) {
    a.report.fp8_tensors += d.format ? 1 : 0;
    a.report.scaled_tensors += d.scale.defined() ? 1 : 0;
  }
  if (a.report.fp8_tensors > 0) {
    std::map<std::string, int64_t> formats;
    for (const auto& [name, d] : a.decodings) {
      if (d.format) formats[fp8::format_name(*d.format)] += 1;
    }
    std::string list;
    for (const auto& [f, n] : formats) list += (list.empty() ? "" : ", ") + std::to_string(n) + " " + f;
    a.report.notes.push_back("fp8: " + list + " tensors, decoded exactly (256-entry table) to the compute dtype at "
                             "load, tensor by tensor");
  }
  for (const auto& [kind, n] : counts.weight_kinds) {
    a.report.notes.push_back("scales: " + std::to_string(n) + " '<module>." + kind +
                             "' tensors applied in float32 (value = stored value x scale) before the cast");
  }
  if (counts.dropped_inputs > 0) {
    a.report.notes.push_back("dropped " + std::to_string(counts.dropped_inputs) +
                             " activation scales (scale_input / input_scale): weights are upcast, no fp8 matmul");
  }
}

}  // namespace

void collect_decodings(const checkpoint::Source& src, TransformerCheckpointAnalysis& a) {
  mark_fp8_tensors(src, a);
  drop_scaled_fp8_marker(src, a);
  report_decodings(a, take_scale_tensors(a));
}

}  // namespace loader_detail

at::Tensor stored_value(const at::Tensor& stored, const StoredDecoding* decoding) {
  if (decoding == nullptr) return stored.to(at::kFloat);
  at::Tensor value = decoding->format ? fp8::decode(stored, *decoding->format) : stored.to(at::kFloat);
  if (decoding->scale.defined()) value = value * decoding->scale;
  return value;
}

namespace {
at::Tensor value_in(const std::map<std::string, at::Tensor>& tensors, const StoredDecodings& decodings,
                    const std::string& name) {
  auto it = tensors.find(name);
  if (it == tensors.end()) throw CheckpointError("checkpoint has no tensor '" + name + "'");
  auto d = decodings.find(name);
  return stored_value(it->second, d == decodings.end() ? nullptr : &d->second);
}
}  // namespace

at::Tensor MappedTransformerCheckpoint::value(const std::string& name) const {
  return value_in(tensors, decodings, name);
}

at::Tensor TransformerCheckpointAnalysis::value(const std::string& name) const {
  return value_in(tensors, decodings, name);
}

}  // namespace skyreels::model
