// Internal to the SkyReels-V2 transformer (transformer_skyreels_v2.cpp, transformer_forward.cpp,
// transformer_block_cache.cpp): the layers a call computes with and the adapters-per-call machinery. The linear layer
// with its call's adapter terms (LinearAdapters, Linear), the weights of a block and of the model (Layers), the one
// table of the linear layers' names (for_each_linear), and a call's copy of the layers with its adapters attached
// (AdaptedLayers). Separate from the forward because binding the weights, listing the adaptable modules and running a
// call all share it. Not a public header: only the transformer's files include it.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/active_adapter.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model::transformer_impl {

using at::Tensor;
namespace detail = transformer_detail;

// The adapters of one linear layer in one call (TransformerForwardArgs::adapters), each term with its call's scale.
struct LinearAdapters {
  struct Term {
    Tensor down, up;  // a low-rank update: down [r, in], up [out, r]
    Tensor delta;     // or a full weight delta [out, in] / a bias delta [out]
    double factor = 1.0;
  };
  std::vector<Term> weight, bias;

  // y += factor * (x down^T) up^T, factor * x delta^T, factor * bias delta, in adapter order; x [N, in], y [N, out].
  // The rank-r product first: x never meets an [out, in] matrix the model does not hold.
  void add_to(Tensor& y, const Tensor& x) const {
    for (const Term& t : weight) {
      if (t.delta.defined()) {
        y.addmm_(x, t.delta.t(), 1.0, t.factor);
      } else {
        y.addmm_(at::mm(x, t.down.t()), t.up.t(), 1.0, t.factor);
      }
    }
    for (const Term& t : bias) y.add_(t.delta, t.factor);
  }
};

// y = x W^T + b over the last dim, through a 2-D view so LibTorch takes its addmm (oneDNN for bf16) path; plus the
// call's adapter terms when the layer is a per-call copy that has some.
struct Linear {
  Tensor weight;
  Tensor bias;
  const LinearAdapters* adapters = nullptr;
  Tensor operator()(const Tensor& x) const {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    const Tensor flat = x.reshape({-1, x.size(-1)});
    Tensor y = at::linear(flat, weight, bias);
    if (adapters != nullptr) adapters->add_to(y, flat);
    return y.view(shape);
  }
};

struct AttentionWeights {
  Linear to_q, to_k, to_v, to_out;
  Tensor norm_q, norm_k;
};

// I2V: the cross-attention's key / value projections of the image tokens (undefined in other models).
struct ImageKvWeights {
  Linear add_k, add_v;
  Tensor norm_added_k;
};

struct BlockWeights {
  Tensor scale_shift_table;  // [1, 6, D] fp32
  AttentionWeights attn1, attn2;
  ImageKvWeights image_kv;
  Tensor norm2_weight, norm2_bias;  // fp32; undefined without cross_attn_norm
  Linear ffn_in, ffn_out;
};

// Every layer a call computes with. A call with adapters runs on a copy whose linear layers point at its terms (the
// tensors are shared, never written), so the model itself holds no per-call state.
struct Layers {
  Linear time_1, time_2, time_proj, text_1, text_2, proj_out, fps_1, fps_2;
  Linear image_ff_in, image_ff_out;  // I2V image embedder
  std::vector<BlockWeights> blocks;
};

// Calls fn(module name, linear) for every linear layer of `layers` (all but the patch embedding, a convolution) in one
// fixed order: the one table of their names, for binding the weights and for adapters.
template <class L, class Fn>
void for_each_linear(L& layers, const TransformerConfig& c, Fn&& fn) {
  fn("condition_embedder.time_embedder.linear_1", layers.time_1);
  fn("condition_embedder.time_embedder.linear_2", layers.time_2);
  fn("condition_embedder.time_proj", layers.time_proj);
  fn("condition_embedder.text_embedder.linear_1", layers.text_1);
  fn("condition_embedder.text_embedder.linear_2", layers.text_2);
  fn("proj_out", layers.proj_out);
  if (c.inject_sample_info) {
    fn("fps_projection.net.0.proj", layers.fps_1);
    fn("fps_projection.net.2", layers.fps_2);
  }
  if (c.image_dim) {
    fn("condition_embedder.image_embedder.ff.net.0.proj", layers.image_ff_in);
    fn("condition_embedder.image_embedder.ff.net.2", layers.image_ff_out);
  }
  for (size_t i = 0; i < layers.blocks.size(); ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    auto& b = layers.blocks[i];
    for (auto* a : {&b.attn1, &b.attn2}) {
      const std::string attn = p + (a == &b.attn1 ? "attn1." : "attn2.");
      fn(attn + "to_q", a->to_q);
      fn(attn + "to_k", a->to_k);
      fn(attn + "to_v", a->to_v);
      fn(attn + "to_out.0", a->to_out);
    }
    if (c.image_dim) {
      fn(p + "attn2.add_k_proj", b.image_kv.add_k);
      fn(p + "attn2.add_v_proj", b.image_kv.add_v);
    }
    fn(p + "ffn.net.0.proj", b.ffn_in);
    fn(p + "ffn.net.2", b.ffn_out);
  }
}

// Calls fn(tensor) for every tensor of a block (defined or not), in one fixed order: what weight sharding splits.
template <class B, class Fn>
void for_each_block_tensor(B& b, Fn&& fn) {
  fn(b.scale_shift_table);
  for (auto* a : {&b.attn1, &b.attn2}) {
    for (auto* l : {&a->to_q, &a->to_k, &a->to_v, &a->to_out}) {
      fn(l->weight);
      fn(l->bias);
    }
    fn(a->norm_q);
    fn(a->norm_k);
  }
  fn(b.image_kv.add_k.weight);
  fn(b.image_kv.add_k.bias);
  fn(b.image_kv.add_v.weight);
  fn(b.image_kv.add_v.bias);
  fn(b.image_kv.norm_added_k);
  fn(b.norm2_weight);
  fn(b.norm2_bias);
  fn(b.ffn_in.weight);
  fn(b.ffn_in.bias);
  fn(b.ffn_out.weight);
  fn(b.ffn_out.bias);
}

// The layers of one call with its adapters attached (TransformerForwardArgs::adapters): a copy of the model's layers
// whose adapted linears point at their terms here. Checked before anything runs: every update targets a linear layer's
// weight or bias of the implied shape, on its device in its dtype (place_lora), with a finite scale. Metadata only:
// no host sync.
class AdaptedLayers {
 public:
  AdaptedLayers(const Layers& base, const TransformerConfig& c, const std::vector<ActiveAdapter>& active)
      : layers_(base) {
    std::map<std::string, Linear*> linears;
    for_each_linear(layers_, c, [&](const std::string& name, Linear& l) { linears[name] = &l; });
    for (size_t k = 0; k < active.size(); ++k) {
      const ActiveAdapter& a = active[k];
      if (!a.adapter) throw std::invalid_argument("adapters[" + std::to_string(k) + "]: no adapter");
      const std::string where = "adapter '" + a.adapter->spec.path + "'";
      if (!std::isfinite(a.scale)) throw std::invalid_argument(where + ": scale must be a finite number");
      for (const auto& [name, u] : a.adapter->updates) add_term(where, name, u, a.scale, linears);
    }
    for (auto& [module, terms] : terms_) linears.at(module)->adapters = &terms;
  }
  AdaptedLayers(const AdaptedLayers&) = delete;
  AdaptedLayers& operator=(const AdaptedLayers&) = delete;

  const Layers& layers() const { return layers_; }

 private:
  void add_term(const std::string& where, const std::string& name, const LoraUpdate& u, double scale,
                const std::map<std::string, Linear*>& linears) {
    const std::string at_key = where + ": key '" + u.key + "': ";
    const size_t dot = name.rfind('.');
    const std::string module = name.substr(0, dot), what = dot == std::string::npos ? "" : name.substr(dot + 1);
    auto it = linears.find(module);
    if (it == linears.end() || (what != "weight" && what != "bias") || (what == "bias" && !u.delta.defined())) {
      throw std::invalid_argument(at_key + "targets '" + name +
                                  "', which is not a linear layer's weight or bias "
                                  "(adapters per call change linear layers only)");
    }
    const Tensor& target = what == "bias" ? it->second->bias : it->second->weight;
    const std::vector<int64_t> implied =
        u.delta.defined() ? u.delta.sizes().vec() : std::vector<int64_t>{u.up.size(0), u.down.size(1)};
    if (implied != target.sizes().vec()) {
      throw std::invalid_argument(at_key + "implies " + checkpoint::shape_str(implied) + " for '" + name +
                                  "', which is " + checkpoint::shape_str(target.sizes().vec()) + " in this model");
    }
    for (const Tensor* t : {&u.down, &u.up, &u.delta}) {
      if (t->defined() && (t->scalar_type() != target.scalar_type() || t->device() != target.device())) {
        throw std::invalid_argument(at_key + "is " + c10::toString(t->scalar_type()) + " on " + t->device().str() +
                                    ", '" + name + "' is " + c10::toString(target.scalar_type()) + " on " +
                                    target.device().str() + " (place_lora places an adapter for a model)");
      }
    }
    LinearAdapters& terms = terms_[module];
    (what == "bias" ? terms.bias : terms.weight).push_back({u.down, u.up, u.delta, scale * u.factor});
  }

  Layers layers_;
  std::map<std::string, LinearAdapters> terms_;  // module -> its terms (map nodes never move)
};

}  // namespace skyreels::model::transformer_impl
