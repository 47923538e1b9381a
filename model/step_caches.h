// The settings of diffusers' TaylorSeer and MagCache step caches (TransformerForwardArgs::taylorseer / magcache,
// StepCacheConfig), apart from the transformer so that the generation parameters can name them without its header
// (torch-free).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace skyreels::model {

// taylor_factors_dtype: the dtype TaylorSeer keeps its factors in (diffusers' default bfloat16).
enum class TaylorFactorsDtype { kBFloat16, kFloat32, kFloat16 };

// diffusers' TaylorSeer (hooks/taylorseer_cache.py, TaylorSeerCacheConfig; model/transformer_taylorseer.cpp): the
// hooked modules compute every call before disable_cache_before_step, every cache_interval-th call after it and every
// call from disable_cache_after_step on; the other calls predict a "cache" module's output by a Taylor series of order
// max_order from its last computed outputs (divided differences over the call index, kept in factors_dtype) and give
// zeros (of its last computed shape) for a "skip" module. The calls are counted per TransformerCallState (diffusers'
// context: cond / uncond). Modules are named as diffusers names them and chosen by regular expressions matched against
// the whole name (re.fullmatch): of this model, blocks.N, blocks.N.attn1, blocks.N.attn2, blocks.N.ffn and proj_out
// can be hooked; a pattern matching any other module, or a module and one inside it, is refused (std::invalid_argument
// naming the field). lite: diffusers' lite mode (blocks.N skipped, proj_out cached; the patterns are ignored).
struct TaylorSeerCache {
  int64_t cache_interval = 5;
  int64_t disable_cache_before_step = 3;
  std::optional<int64_t> disable_cache_after_step;
  int64_t max_order = 1;
  TaylorFactorsDtype factors_dtype = TaylorFactorsDtype::kBFloat16;
  std::vector<std::string> cache_modules;  // cache_identifiers
  std::vector<std::string> skip_modules;   // skip_predict_identifiers
  bool lite = false;
};
// diffusers' MagCache (hooks/mag_cache.py, MagCacheConfig; model/transformer_magcache.cpp): per call (counted per
// TransformerCallState up to num_inference_steps, then it starts over), from step round(retention_ratio * steps) on
// the accumulated ratio, steps and error grow by mag_ratios[step] (fp32, as diffusers' tensor); while a previous
// residual exists, the error is <= threshold and at most max_skip_steps steps accumulated, the whole block stack is
// skipped: its output is its input plus the last computed call's residual (last block's output - block 0's input).
// mag_ratios (already of length num_inference_steps: magcache_ratios_for_steps) is ignored when calibrating.
// calibrate: never skips; each call after the first records mean(|r| / (|r_prev| + 1e-8)) over the tokens
// (TransformerCallStats::magcache_ratio; the first call 1.0).
struct MagCache {
  double threshold = 0.06;
  int64_t max_skip_steps = 3;
  double retention_ratio = 0.2;
  int64_t num_inference_steps = 28;
  std::vector<float> mag_ratios;
  bool calibrate = false;
};
// "a,b,c" -> {"a", "b", "c"} (empty entries dropped): the taylorseer_*_modules parameters' lists.
inline std::vector<std::string> split_module_patterns(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string::npos ? text.size() : comma;
    if (end > start) out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace skyreels::model
