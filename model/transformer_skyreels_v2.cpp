#include "model/transformer_skyreels_v2.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>

#include "model/lora.h"

namespace skyreels::model {

TransformerConfig TransformerConfig::df_1_3b() {
  TransformerConfig c;
  c.num_attention_heads = 12;
  c.ffn_dim = 8960;
  c.num_layers = 30;
  c.inject_sample_info = true;
  return c;
}

TransformerConfig TransformerConfig::df_14b() {
  TransformerConfig c;
  c.num_attention_heads = 40;
  c.ffn_dim = 13824;
  c.num_layers = 40;
  return c;
}

TransformerConfig TransformerConfig::i2v_1_3b() {
  TransformerConfig c = df_1_3b();
  c.inject_sample_info = false;
  c.in_channels = 36;  // 16 noise + 4 frame mask + 16 image latent
  c.image_dim = 1280;  // CLIP ViT-H/14
  c.added_kv_proj_dim = c.inner_dim();
  return c;
}

TransformerConfig TransformerConfig::i2v_14b() {
  TransformerConfig c = df_14b();
  c.in_channels = 36;
  c.image_dim = 1280;
  c.added_kv_proj_dim = c.inner_dim();
  return c;
}

std::string TransformerConfig::to_diffusers_json() const {
  nlohmann::ordered_json j;
  j["_class_name"] = "SkyReelsV2Transformer3DModel";
  j["patch_size"] = patch_size;
  j["num_attention_heads"] = num_attention_heads;
  j["attention_head_dim"] = attention_head_dim;
  j["in_channels"] = in_channels;
  j["out_channels"] = out_channels;
  j["text_dim"] = text_dim;
  j["freq_dim"] = freq_dim;
  j["ffn_dim"] = ffn_dim;
  j["num_layers"] = num_layers;
  j["cross_attn_norm"] = cross_attn_norm;
  j["qk_norm"] = "rms_norm_across_heads";
  j["eps"] = eps;
  j["image_dim"] = image_dim ? nlohmann::ordered_json(*image_dim) : nlohmann::ordered_json();
  j["added_kv_proj_dim"] = added_kv_proj_dim ? nlohmann::ordered_json(*added_kv_proj_dim) : nlohmann::ordered_json();
  j["rope_max_seq_len"] = rope_max_seq_len;
  j["pos_embed_seq_len"] = pos_embed_seq_len ? nlohmann::ordered_json(*pos_embed_seq_len) : nlohmann::ordered_json();
  j["inject_sample_info"] = inject_sample_info;
  j["num_frame_per_block"] = num_frame_per_block;
  return j.dump(2);
}

void TransformerConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(patch_size[0] >= 1 && patch_size[1] >= 1 && patch_size[2] >= 1, "patch_size: every entry must be >= 1");
  require(num_attention_heads >= 1, "num_attention_heads: must be >= 1");
  require(attention_head_dim >= 2 && attention_head_dim % 2 == 0, "attention_head_dim: must be even and >= 2");
  require(in_channels >= 1 && out_channels >= 1, "in_channels/out_channels: must be >= 1");
  require(text_dim >= 1 && ffn_dim >= 1 && num_layers >= 1, "text_dim/ffn_dim/num_layers: must be >= 1");
  require(freq_dim >= 2 && freq_dim % 2 == 0, "freq_dim: must be even and >= 2");
  require(rope_max_seq_len >= 1, "rope_max_seq_len: must be >= 1");
  require(num_frame_per_block >= 1, "num_frame_per_block: must be >= 1");
  require(image_dim.has_value() == added_kv_proj_dim.has_value(),
          "image_dim/added_kv_proj_dim: an image-to-video model needs both (or neither)");
  if (image_dim) {
    require(*image_dim >= 1, "image_dim: must be >= 1");
    // The image embedder's output (inner_dim wide) is what add_k_proj / add_v_proj read.
    require(*added_kv_proj_dim == inner_dim(), "added_kv_proj_dim: " + std::to_string(*added_kv_proj_dim) +
                                                   " must equal the inner dim " + std::to_string(inner_dim()) +
                                                   " (the image embedder's width)");
  }
  require(!pos_embed_seq_len || (image_dim && *pos_embed_seq_len >= 2 && *pos_embed_seq_len % 2 == 0),
          "pos_embed_seq_len: needs image_dim and an even length >= 2 (the tokens of the first and the last image)");
}

std::vector<checkpoint::ParamSpec> transformer_parameter_specs(const TransformerConfig& c) {
  const int64_t D = c.inner_dim();
  const int64_t patch_out = c.out_channels * c.patch_size[0] * c.patch_size[1] * c.patch_size[2];
  std::vector<checkpoint::ParamSpec> specs;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool fp32 = false) {
    specs.push_back({name, std::move(shape), fp32});
  };
  auto linear = [&](const std::string& prefix, int64_t out, int64_t in, bool fp32 = false) {
    add(prefix + ".weight", {out, in}, fp32);
    add(prefix + ".bias", {out}, fp32);
  };
  add("patch_embedding.weight", {D, c.in_channels, c.patch_size[0], c.patch_size[1], c.patch_size[2]});
  add("patch_embedding.bias", {D});
  linear("condition_embedder.time_embedder.linear_1", D, c.freq_dim, true);
  linear("condition_embedder.time_embedder.linear_2", D, D, true);
  linear("condition_embedder.time_proj", 6 * D, D);
  linear("condition_embedder.text_embedder.linear_1", D, c.text_dim);
  linear("condition_embedder.text_embedder.linear_2", D, D);
  if (c.image_dim) {
    const int64_t I = *c.image_dim;
    const std::string e = "condition_embedder.image_embedder.";
    add(e + "norm1.weight", {I}, true);
    add(e + "norm1.bias", {I}, true);
    linear(e + "ff.net.0.proj", I, I);
    linear(e + "ff.net.2", D, I);
    add(e + "norm2.weight", {D}, true);
    add(e + "norm2.bias", {D}, true);
    if (c.pos_embed_seq_len) add(e + "pos_embed", {1, *c.pos_embed_seq_len, I});
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    add(b + "scale_shift_table", {1, 6, D}, true);
    for (const char* attn : {"attn1", "attn2"}) {
      for (const char* proj : {"to_q", "to_k", "to_v", "to_out.0"}) linear(b + attn + "." + proj, D, D);
      add(b + attn + ".norm_q.weight", {D});
      add(b + attn + ".norm_k.weight", {D});
    }
    if (c.image_dim) {
      linear(b + "attn2.add_k_proj", D, *c.added_kv_proj_dim);
      linear(b + "attn2.add_v_proj", D, *c.added_kv_proj_dim);
      add(b + "attn2.norm_added_k.weight", {D});
    }
    if (c.cross_attn_norm) {
      add(b + "norm2.weight", {D}, true);
      add(b + "norm2.bias", {D}, true);
    }
    linear(b + "ffn.net.0.proj", c.ffn_dim, D);
    linear(b + "ffn.net.2", D, c.ffn_dim);
  }
  add("scale_shift_table", {1, 2, D}, true);
  linear("proj_out", patch_out, D);
  if (c.inject_sample_info) {
    add("fps_embedding.weight", {2, D});
    linear("fps_projection.net.0.proj", D, D);
    linear("fps_projection.net.2", 6 * D, D);
  }
  return specs;
}

// ---- the model ------------------------------------------------------------------------------------------------
// Dtype rules (spec 3.4-3.9): linears, attention, the text/fps paths and the cross-attention residual run in the
// compute dtype; the time embedder, every modulation sum, the LayerNorms and the gated residual adds run in fp32.

namespace transformer_detail {

RopeSplit rope_split(int64_t head_dim) {
  RopeSplit s;
  s.h = s.w = 2 * (head_dim / 6);
  s.t = head_dim - s.h - s.w;
  return s;
}

at::Tensor timestep_sinusoid(const at::Tensor& timestep, int64_t dim) {
  // float64 as diffusers' get_1d_sincos_pos_embed_from_grid: at t ~ 999 fp32 angles are off by ~1e-4 rad.
  const int64_t half = dim / 2;
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(timestep.device());
  at::Tensor omega = at::pow(10000.0, at::arange(half, f64).div_(static_cast<double>(half))).reciprocal_();
  at::Tensor angle = at::outer(timestep.reshape({-1}).to(at::kDouble), omega);
  std::vector<int64_t> shape = timestep.sizes().vec();
  shape.push_back(2 * half);
  return at::cat({at::cos(angle), at::sin(angle)}, 1).view(shape);
}

namespace {

// Writes softmax(q k^T / sqrt(Dh)) v into dst ([B, Nh, Lq, Dh], any strides).
void attend_into(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 [[maybe_unused]] int64_t max_score_bytes) {
#if TORCH_VERSION_MAJOR >= 2
  dst.copy_(at::scaled_dot_product_attention(q, k, v));
#else
  // LibTorch 1.x has no public SDPA: the reference math per head, over chunks of query rows whose [rows, Lk] score
  // matrix stays under max_score_bytes (L x L at 540P would be tens of GB). The two score buffers are reused by
  // every chunk: on CPU, fresh large allocations cost a page fault per 4 KiB. Per-head 2-D GEMMs also keep
  // LibTorch 1.13 off its slow batched path for a transposed operand.
  const int64_t lq = q.size(2), lk = k.size(2);
  const int64_t rows = std::clamp<int64_t>(max_score_bytes / (lk * static_cast<int64_t>(q.element_size())), 1, lq);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor scores = at::empty({rows, lk}, q.options());
  const at::Tensor probs = at::empty({rows, lk}, q.options());
  for (int64_t b = 0; b < q.size(0); ++b) {
    for (int64_t h = 0; h < q.size(1); ++h) {
      const at::Tensor qh = q[b][h], kh_t = k[b][h].t(), vh = v[b][h], out = dst[b][h];
      for (int64_t r = 0; r < lq; r += rows) {
        const int64_t n = std::min(rows, lq - r);
        at::Tensor s = scores.narrow(0, 0, n), p = probs.narrow(0, 0, n), o = out.narrow(0, r, n);
        at::addmm_out(s, s, qh.narrow(0, r, n), kh_t, /*beta=*/0, /*alpha=*/scale);
        at::_softmax_out(p, s, -1, false);
        at::mm_out(o, p, vh);
      }
    }
  }
#endif
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t causal_block_tokens,
                     int64_t max_score_bytes, int64_t query_offset) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes() || q.size(0) != k.size(0) ||
      q.size(1) != k.size(1) || q.size(3) != k.size(3)) {
    throw std::invalid_argument("attention: expected q [B, Nh, Lq, Dh] and k, v [B, Nh, Lk, Dh]");
  }
  const int64_t lq = q.size(2);
  if (causal_block_tokens > 0 && query_offset + lq != k.size(2)) {
    throw std::invalid_argument("attention: the block-causal mask needs query_offset + Lq keys");
  }
  if (query_offset < 0 || (query_offset > 0 && (causal_block_tokens <= 0 || query_offset % causal_block_tokens))) {
    throw std::invalid_argument("attention: query_offset must be whole blocks of a block-causal mask");
  }
  at::Tensor out = at::empty({q.size(0), lq, q.size(1), q.size(3)}, q.options());
  const at::Tensor dst = out.transpose(1, 2);
  if (causal_block_tokens <= 0 || (query_offset == 0 && causal_block_tokens >= lq)) {
    attend_into(dst, q, k, v, max_score_bytes);
    return out;
  }
  // Keys of later blocks are masked out anyway: attending each query block to its key prefix is the same softmax,
  // without an L x L mask and with about half the work.
  for (int64_t start = 0; start < lq; start += causal_block_tokens) {
    const int64_t n = std::min(causal_block_tokens, lq - start);
    const int64_t keys = query_offset + start + n;
    attend_into(dst.narrow(2, start, n), q.narrow(2, start, n), k.narrow(2, 0, keys), v.narrow(2, 0, keys),
                max_score_bytes);
  }
  return out;
}

}  // namespace transformer_detail

namespace {

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

// Token geometry of one call. Modulation tensors are per frame ([B, Fm, 1, D], Fm = F in diffusion forcing, else 1)
// and broadcast over the S = pph * ppw tokens of each frame through the [B, F, S, D] view of the tokens.
struct Geometry {
  int64_t batch = 0, frames = 0, height = 0, width = 0;  // input latent shape
  int64_t ppf = 0, pph = 0, ppw = 0;                     // post-patch grid
  int64_t tokens_per_frame = 0, tokens = 0, dim = 0;
  std::vector<int64_t> per_frame() const { return {batch, ppf, tokens_per_frame, dim}; }
  std::vector<int64_t> flat() const { return {batch, tokens, dim}; }
};

// What every block's cross-attention attends to: the projected text rows and, in I2V models, the embedded image
// tokens (undefined otherwise), each attended on its own and the two outputs added.
struct CrossContext {
  Tensor text;   // [B, T, D]
  Tensor image;  // [B, N, D]
};

// LayerNorm over the last dim computed in fp32 (diffusers' FP32LayerNorm); returns fp32.
Tensor layer_norm_fp32(const Tensor& x, double eps, const Tensor& weight = {}, const Tensor& bias = {}) {
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight, bias, eps);
}

// CPU performance notes for the elementwise helpers below:
// - mixed-dtype ops (bf16 with fp32) take a scalar casting path in LibTorch 1.13, 10-20x slower than converting
//   first, so they convert explicitly (same numbers: the mixed op upcasts the same way);
// - every fresh large tensor costs page faults, so helpers that consume a temporary (`x` passed by value, owned
//   by the caller's expression) work in place on it or on its fp32 copy.

// torch.nn.RMSNorm over the whole projection (all heads at once): fp32 statistics and weight multiply, one rounding.
// Consumes x.
Tensor rms_norm_across_heads(Tensor x, const Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  Tensor xf = x.to(at::kFloat);  // x itself in fp32
  const Tensor inv = at::rsqrt(xf.pow(2).mean(-1, true).add_(eps));
  xf.mul_(inv).mul_(weight.to(at::kFloat));
  return xf.to(dtype);
}

// diffusers' own RMSNorm class (attention's norm_added_k): fp32 statistics, the normalised value rounded to the
// weight's dtype when that is half precision, then multiplied by the weight in it (torch.nn.RMSNorm above multiplies
// in fp32 and rounds once; the same numbers in fp32).
Tensor rms_norm_diffusers(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor xf = x.to(at::kFloat);
  const Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true).add_(eps));
  if (weight.scalar_type() == at::kFloat) return (normed * weight).to(x.scalar_type());
  return normed.to(weight.scalar_type()) * weight;
}

// (LN(x) * (1 + scale) + shift) in fp32, rounded to `dtype`. x [B, L, D]; scale/shift [B, Fm, 1, D] fp32.
Tensor modulated_norm(const Tensor& x, const Tensor& scale, const Tensor& shift, const Geometry& g, double eps,
                      at::ScalarType dtype) {
  Tensor n = layer_norm_fp32(x, eps);
  n.view(g.per_frame()).mul_(1 + scale).add_(shift);
  return n.to(dtype);
}

// (x.float() + y * gate) rounded to x's dtype: the fp32 residual of self-attention and the FFN. Consumes y.
Tensor gated_residual(const Tensor& x, Tensor y, const Tensor& gate, const Geometry& g) {
  Tensor sum = y.to(at::kFloat);  // y itself in fp32
  sum.view(g.per_frame()).mul_(gate).add_(x.to(at::kFloat).view(g.per_frame()));
  return sum.to(x.scalar_type()).view(g.flat());
}

// The per-call RoPE tables in the form apply_rope uses, [1, L, 1, Dh] fp32: cos repeated over each pair (diffusers'
// table as is) and sin with the pair's first entry negated.
struct RopeTables {
  Tensor cos, signed_sin;
};

// Rotates interleaved pairs (x[2k], x[2k+1]) of every head of x [B, L, D] by the per-token angles:
// out[2k] = x[2k] cos - x[2k+1] sin, out[2k+1] = x[2k] sin + x[2k+1] cos, computed as x * cos + swap(x) * signed_sin
// (the same products and sums, so the same fp32 numbers as diffusers), rounded once to x's dtype. Consumes x.
Tensor apply_rope(Tensor x, const RopeTables& rope, int64_t heads) {
  const int64_t b = x.size(0), l = x.size(1), dh = x.size(2) / heads;
  const at::ScalarType dtype = x.scalar_type();
  Tensor xf = x.to(at::kFloat).view({b, l, heads, dh});  // x itself in fp32
  const Tensor pairs = xf.view({b, l, heads, dh / 2, 2});
  Tensor swapped = at::stack({pairs.select(-1, 1), pairs.select(-1, 0)}, -1).view({b, l, heads, dh});
  xf.mul_(rope.cos).add_(swapped.mul_(rope.signed_sin));
  return xf.to(dtype).view({b, l, heads * dh});
}

// [B, L, D] -> [B, Nh, L, Dh] (a view).
Tensor split_heads(const Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, x.size(2) / heads}).transpose(1, 2);
}

}  // namespace

// ---- per-context call state (exact savings, FirstBlockCache) ---------------------------------------------------

struct TransformerCallState::Impl {
  // Exact savings: per layer, the keys / values [B, Nh, kept tokens, Dh] of the leading final frames (undefined
  // where a layer keeps none), and the geometry they were made for.
  std::vector<Tensor> k, v;
  int64_t kept_frames = 0, tokens_per_frame = 0, batch = 0;
  // FirstBlockCache: block 0's output residual and the tail residual (last block's output - block 0's output) of
  // the last call that computed, over every token of the call [B, L, D].
  Tensor prev_residual, tail_residual;
  // The cache per causal block, by block (counted from the chunk's frame 0): its block-0 residual, its tail
  // residual and, per layer 1..L-1, its keys before RoPE and its values [B, block tokens, D], all of its last
  // computed call; and how many calls in a row it skipped since.
  struct BlockEntry {
    Tensor residual, tail;
    std::vector<Tensor> k, v;
    int64_t skips = 0;
    bool final = false;     // computed while it and every block before it in the call were final
    int64_t window = 0;     // the call's first block then
  };
  std::map<int64_t, BlockEntry> blocks;

  void reset_kv() {
    k.clear();
    v.clear();
    kept_frames = tokens_per_frame = batch = 0;
  }
};

TransformerCallState::TransformerCallState() : impl_(std::make_unique<Impl>()) {}
TransformerCallState::~TransformerCallState() = default;
TransformerCallState::TransformerCallState(TransformerCallState&&) noexcept = default;
TransformerCallState& TransformerCallState::operator=(TransformerCallState&&) noexcept = default;
void TransformerCallState::reset() { *impl_ = Impl(); }
void TransformerCallState::reset_kv() { impl_->reset_kv(); }
int64_t TransformerCallState::kept_frames() const { return impl_->kept_frames; }
int64_t TransformerCallState::kept_bytes() const {
  int64_t bytes = 0;
  auto add = [&bytes](const std::vector<Tensor>& list) {
    for (const Tensor& t : list) bytes += t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  add(impl_->k);
  add(impl_->v);
  for (const auto& [block, entry] : impl_->blocks) {
    add(entry.k);
    add(entry.v);
  }
  return bytes;
}

namespace {

// One layer's kept keys / values in a call: the first reuse_tokens come from them, and the first keep_tokens of
// this call's keys / values are kept for later calls.
struct KvSlot {
  Tensor* k = nullptr;
  Tensor* v = nullptr;
  int64_t reuse_tokens = 0, keep_tokens = 0;
};

struct BlockPlan;  // the cache per causal block's plan of one call (defined with per_block_layers)

// One layer's self-attention under the cache per causal block: the layer runs on the computed blocks' tokens only;
// the skipped blocks before them contribute the keys / values of their last computed call, RoPE'd at their place
// in this call. The computed blocks' keys (before RoPE) and values are handed out to be kept.
struct BlockSparseAttention {
  int64_t block_tokens = 0;
  std::vector<int64_t> computed;                  // blocks of the call that run, ascending
  std::vector<int64_t> stale;                     // blocks of the call that skip, ascending
  std::vector<const Tensor*> stale_k, stale_v;    // per stale block: keys before RoPE, values [B, block tokens, D]
  std::vector<RopeTables> stale_rope;             // per stale block: its rows of the call's tables
  std::vector<Tensor>* fresh_k = nullptr;         // out: per computed block, keys before RoPE [B, block tokens, D]
  std::vector<Tensor>* fresh_v = nullptr;         // out: per computed block, values
};

// The call's tokens from frame `first` on (exact savings compute a suffix of the frames; patch_size[0] == 1).
Geometry frames_from(const Geometry& g, int64_t first) {
  Geometry s = g;
  s.frames = g.frames - first;
  s.ppf = g.ppf - first;
  s.tokens = s.ppf * g.tokens_per_frame;
  return s;
}

}  // namespace

struct SkyReelsV2Transformer::Impl {
  TransformerConfig config;
  checkpoint::StateDict weights;
  c10::Device device{c10::kCPU};
  at::ScalarType dtype = at::kFloat;

  int64_t chunk_bytes = 0;  // size of the token-chunked FFN hidden state and of attention score buffers
  detail::RopeSplit split;
  Tensor rope_cos, rope_sin;  // [rope_max_seq_len, Dh] fp32, diffusers' freqs_cos / freqs_sin
  Linear patch_embedding;     // the conv3d with kernel == stride, as a linear over flattened patches
  Layers base_layers;         // every linear layer and the blocks, as loaded
  Tensor fps_embedding, head_table;
  // I2V image embedder: FP32LayerNorm -> Linear -> GELU -> Linear -> FP32LayerNorm, after the optional pos_embed.
  Tensor image_norm1_weight, image_norm1_bias, image_norm2_weight, image_norm2_bias, image_pos_embed;

  const Tensor& w(const std::string& name) const { return weights.at(name); }
  Linear linear(const std::string& prefix) const { return {w(prefix + ".weight"), w(prefix + ".bias")}; }

  void check_weights() const;
  void bind_weights();
  void build_rope();

  Geometry check_inputs(const TransformerForwardArgs& args) const;
  Tensor self_attention(const AttentionWeights& a, const Tensor& n, const RopeTables& rope, const Geometry& g,
                        int64_t causal_block_tokens, const KvSlot* kv, const BlockSparseAttention* sparse) const;
  Tensor block_sparse_attention(const AttentionWeights& a, const Tensor& n, const RopeTables& rope, const Geometry& g,
                                int64_t causal_block_tokens, const BlockSparseAttention& sparse) const;
  Tensor embed_image(const Layers& l, const Tensor& image_tokens) const;
  Tensor cross_attention(const BlockWeights& b, const Tensor& n, const CrossContext& context) const;
  Tensor feed_forward(const BlockWeights& b, const Tensor& n) const;
  Tensor block_forward(const BlockWeights& b, Tensor x, const CrossContext& context, const Tensor& modulation,
                       const RopeTables& rope, const Geometry& g, int64_t causal_block_tokens,
                       const KvSlot* kv = nullptr, const BlockSparseAttention* sparse = nullptr) const;
  Tensor patchify(const Tensor& hidden_states, const Geometry& g, int64_t first_frame) const;
  // Blocks 0..L-1 under the cache per causal block (TransformerForwardArgs::per_block_cache); computed_blocks runs
  // blocks 1..L-1 over the blocks that the plan computes and writes them into `out`.
  Tensor per_block_layers(const std::vector<BlockWeights>& blocks, Tensor x, const PerBlockCache& cache,
                          TransformerCallState::Impl& state, const CrossContext& context, const Tensor& modulation,
                          const RopeTables& rope, const Geometry& g, int64_t frames_per_block,
                          const std::function<void()>& after_block, TransformerCallStats& stats) const;
  Tensor computed_blocks(const std::vector<BlockWeights>& blocks, const Tensor& block0_out, Tensor out,
                         const BlockPlan& plan, const CrossContext& context, const Tensor& modulation,
                         const RopeTables& rope, const Geometry& g, int64_t frames_per_block,
                         const std::function<void()>& after_block, std::vector<std::vector<Tensor>>& fresh_k,
                         std::vector<std::vector<Tensor>>& fresh_v, TransformerCallStats& stats) const;
  Tensor head(const Linear& proj_out, const Tensor& x, const Tensor& temb, const Geometry& g) const;
};

namespace {

bool on_device(const Tensor& t, const c10::Device& device) {
  return t.device().type() == device.type() && (!device.has_index() || device.is_cpu() || t.device() == device);
}

std::string join_problems(const std::vector<std::string>& problems) {
  std::string out;
  const size_t shown = std::min<size_t>(problems.size(), 12);
  for (size_t i = 0; i < shown; ++i) out += "\n  " + problems[i];
  if (problems.size() > shown) out += "\n  ... and " + std::to_string(problems.size() - shown) + " more";
  return out;
}

}  // namespace

void SkyReelsV2Transformer::Impl::check_weights() const {
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const auto& spec : transformer_parameter_specs(config)) {
    expected.insert(spec.name);
    auto it = weights.find(spec.name);
    if (it == weights.end() || !it->second.defined()) {
      problems.push_back(spec.name + ": missing");
      continue;
    }
    const Tensor& t = it->second;
    if (t.sizes().vec() != spec.shape) {
      problems.push_back(spec.name + ": shape " + checkpoint::shape_str(t.sizes().vec()) + ", expected " +
                         checkpoint::shape_str(spec.shape));
    }
    const at::ScalarType want = spec.keep_fp32 ? at::kFloat : dtype;
    if (t.scalar_type() != want) {
      problems.push_back(spec.name + ": dtype " + c10::toString(t.scalar_type()) + ", expected " + c10::toString(want) +
                         (spec.keep_fp32 ? " (fp32 island)" : ""));
    }
    if (!on_device(t, device))
      problems.push_back(spec.name + ": on " + t.device().str() + ", expected " + device.str());
  }
  for (const auto& [name, t] : weights) {
    if (!expected.count(name)) problems.push_back(name + ": unexpected (no such parameter in this config)");
  }
  if (!problems.empty()) {
    throw std::invalid_argument("SkyReelsV2Transformer: " + std::to_string(problems.size()) +
                                " weight problem(s):" + join_problems(problems));
  }
}

void SkyReelsV2Transformer::Impl::bind_weights() {
  const Tensor& patch = w("patch_embedding.weight");
  patch_embedding = {patch.reshape({patch.size(0), -1}), w("patch_embedding.bias")};
  base_layers.blocks.assign(static_cast<size_t>(config.num_layers), BlockWeights{});
  for_each_linear(base_layers, config, [&](const std::string& name, Linear& l) { l = linear(name); });
  head_table = w("scale_shift_table");
  if (config.inject_sample_info) fps_embedding = w("fps_embedding.weight");
  if (config.image_dim) {
    const std::string e = "condition_embedder.image_embedder.";
    image_norm1_weight = w(e + "norm1.weight");
    image_norm1_bias = w(e + "norm1.bias");
    image_norm2_weight = w(e + "norm2.weight");
    image_norm2_bias = w(e + "norm2.bias");
    if (config.pos_embed_seq_len) image_pos_embed = w(e + "pos_embed");
  }
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    BlockWeights& b = base_layers.blocks[static_cast<size_t>(i)];
    if (config.image_dim) b.image_kv.norm_added_k = w(p + "attn2.norm_added_k.weight");
    b.scale_shift_table = w(p + "scale_shift_table");
    b.attn1.norm_q = w(p + "attn1.norm_q.weight");
    b.attn1.norm_k = w(p + "attn1.norm_k.weight");
    b.attn2.norm_q = w(p + "attn2.norm_q.weight");
    b.attn2.norm_k = w(p + "attn2.norm_k.weight");
    if (config.cross_attn_norm) {
      b.norm2_weight = w(p + "norm2.weight");
      b.norm2_bias = w(p + "norm2.bias");
    }
  }
}

void SkyReelsV2Transformer::Impl::build_rope() {
  // Per axis d: w_j = 1 / 10000^(2j/d) and angles p * w_j in float64, cos/sin repeated pairwise, then fp32.
  split = detail::rope_split(config.attention_head_dim);
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  const Tensor positions = at::arange(config.rope_max_seq_len, f64);
  std::vector<Tensor> cos_parts, sin_parts;
  for (int64_t d : {split.t, split.h, split.w}) {
    const Tensor exponent = at::arange(0, d, 2, f64).slice(0, 0, d / 2).div_(static_cast<double>(d));
    const Tensor angle = at::outer(positions, at::pow(10000.0, exponent).reciprocal_());
    cos_parts.push_back(at::cos(angle).repeat_interleave(2, 1).to(at::kFloat));
    sin_parts.push_back(at::sin(angle).repeat_interleave(2, 1).to(at::kFloat));
  }
  rope_cos = at::cat(cos_parts, 1);
  rope_sin = at::cat(sin_parts, 1);
}

SkyReelsV2Transformer::SkyReelsV2Transformer(TransformerConfig config, checkpoint::StateDict weights,
                                             c10::Device device, at::ScalarType compute_dtype)
    : impl_(nullptr) {
  config.validate();
  if (compute_dtype != at::kFloat && compute_dtype != at::kBFloat16 && compute_dtype != at::kHalf) {
    throw std::invalid_argument(std::string("compute_dtype: expected float32, bfloat16 or float16, got ") +
                                c10::toString(compute_dtype));
  }
  if (compute_dtype == at::kHalf && device.is_cpu()) {
    throw std::invalid_argument("compute_dtype: float16 is not supported on CPU (LibTorch has no fp16 CPU matmul)");
  }
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  impl->weights = std::move(weights);
  impl->device = device;
  impl->dtype = compute_dtype;
  impl->check_weights();
  impl->device = impl->weights.at("patch_embedding.weight").device();  // "cuda" -> the concrete "cuda:N"
  // CPU: temporaries under glibc's 32 MiB mmap threshold are recycled instead of page-faulted in again.
  impl->chunk_bytes = impl->device.is_cpu() ? int64_t{16} << 20 : int64_t{512} << 20;
  impl->bind_weights();
  impl->build_rope();
  impl_ = impl.release();
}

SkyReelsV2Transformer::~SkyReelsV2Transformer() { delete impl_; }

std::vector<std::string> transformer_linear_modules(const TransformerConfig& config) {
  Layers layers;
  layers.blocks.resize(static_cast<size_t>(config.num_layers));
  std::vector<std::string> names;
  for_each_linear(layers, config, [&](const std::string& name, const Linear&) { names.push_back(name); });
  return names;
}

const TransformerConfig& SkyReelsV2Transformer::config() const { return impl_->config; }
c10::Device SkyReelsV2Transformer::device() const { return impl_->device; }
at::ScalarType SkyReelsV2Transformer::compute_dtype() const { return impl_->dtype; }

std::vector<std::pair<std::string, at::Tensor>> SkyReelsV2Transformer::named_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out(impl_->weights.begin(), impl_->weights.end());
  out.emplace_back("rope.freqs_cos", impl_->rope_cos);
  out.emplace_back("rope.freqs_sin", impl_->rope_sin);
  return out;
}

std::pair<at::Tensor, at::Tensor> SkyReelsV2Transformer::rope_tables(int64_t ppf, int64_t pph, int64_t ppw) const {
  const int64_t max_len = impl_->config.rope_max_seq_len;
  if (ppf < 1 || pph < 1 || ppw < 1 || ppf > max_len || pph > max_len || ppw > max_len) {
    throw std::invalid_argument("rope_tables: the post-patch grid " + std::to_string(ppf) + "x" + std::to_string(pph) +
                                "x" + std::to_string(ppw) +
                                " must be positive and at most rope_max_seq_len=" + std::to_string(max_len));
  }
  const auto& s = impl_->split;
  auto grid = [&](const Tensor& table) {
    const Tensor t = table.slice(1, 0, s.t).slice(0, 0, ppf).view({ppf, 1, 1, s.t}).expand({ppf, pph, ppw, s.t});
    const Tensor h =
        table.slice(1, s.t, s.t + s.h).slice(0, 0, pph).view({1, pph, 1, s.h}).expand({ppf, pph, ppw, s.h});
    const Tensor w = table.slice(1, s.t + s.h).slice(0, 0, ppw).view({1, 1, ppw, s.w}).expand({ppf, pph, ppw, s.w});
    return at::cat({t, h, w}, -1).reshape({1, ppf * pph * ppw, 1, table.size(1)});
  };
  return {grid(impl_->rope_cos), grid(impl_->rope_sin)};
}

// ---- forward --------------------------------------------------------------------------------------------------

Geometry SkyReelsV2Transformer::Impl::check_inputs(const TransformerForwardArgs& a) const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  const auto& c = config;
  const Tensor& x = a.hidden_states;
  require(x.defined() && x.dim() == 5, "hidden_states: expected [B, in_channels, F, H, W]" +
                                           (x.defined() ? ", got " + checkpoint::shape_str(x.sizes().vec()) : ""));
  require(at::isFloatingType(x.scalar_type()), "hidden_states: expected a floating-point tensor");
  require(x.size(1) == c.in_channels, "hidden_states: expected in_channels=" + std::to_string(c.in_channels) +
                                          " channels, got " + std::to_string(x.size(1)));
  Geometry g;
  g.batch = x.size(0);
  g.frames = x.size(2);
  g.height = x.size(3);
  g.width = x.size(4);
  const char* axis[] = {"frames", "height", "width"};
  const int64_t extent[] = {g.frames, g.height, g.width};
  for (int i = 0; i < 3; ++i) {
    require(extent[i] > 0 && extent[i] % c.patch_size[i] == 0,
            std::string("hidden_states: ") + axis[i] + " " + std::to_string(extent[i]) +
                " must be a positive multiple of patch_size[" + std::to_string(i) +
                "]=" + std::to_string(c.patch_size[i]));
    require(extent[i] / c.patch_size[i] <= c.rope_max_seq_len,
            std::string("hidden_states: ") + axis[i] + " " + std::to_string(extent[i]) +
                " exceeds the RoPE table (rope_max_seq_len=" + std::to_string(c.rope_max_seq_len) + " patches)");
  }
  require(g.batch > 0, "hidden_states: batch must be >= 1");
  g.ppf = g.frames / c.patch_size[0];
  g.pph = g.height / c.patch_size[1];
  g.ppw = g.width / c.patch_size[2];
  g.tokens_per_frame = g.pph * g.ppw;
  g.tokens = g.ppf * g.tokens_per_frame;
  g.dim = c.inner_dim();

  const Tensor& t = a.timestep;
  require(t.defined() && (t.dim() == 1 || t.dim() == 2) && t.size(0) == g.batch && (t.dim() == 1 || t.size(1) == g.ppf),
          "timestep: expected [B] or [B, F] with B=" + std::to_string(g.batch) + ", F=" + std::to_string(g.ppf) +
              (t.defined() ? ", got " + checkpoint::shape_str(t.sizes().vec()) : ""));
  require(t.scalar_type() != at::kBool, "timestep: expected integer or floating-point values");

  const Tensor& e = a.encoder_hidden_states;
  require(e.defined() && e.dim() == 3 && e.size(0) == g.batch && e.size(1) >= 1 && e.size(2) == c.text_dim,
          "encoder_hidden_states: expected [B, T, text_dim] with B=" + std::to_string(g.batch) + ", text_dim=" +
              std::to_string(c.text_dim) + (e.defined() ? ", got " + checkpoint::shape_str(e.sizes().vec()) : ""));
  require(at::isFloatingType(e.scalar_type()), "encoder_hidden_states: expected a floating-point tensor");

  const Tensor& img = a.encoder_hidden_states_image;
  if (c.image_dim) {
    const int64_t tokens = c.pos_embed_seq_len.value_or(0);
    require(img.defined() && img.dim() == 3 && img.size(0) == g.batch && img.size(1) >= 1 &&
                img.size(2) == *c.image_dim && (tokens == 0 || img.size(1) == tokens),
            "encoder_hidden_states_image: this image-to-video model needs image tokens [B, N, image_dim] with B=" +
                std::to_string(g.batch) + ", image_dim=" + std::to_string(*c.image_dim) +
                (tokens ? ", N=" + std::to_string(tokens) + " (pos_embed_seq_len: the first and the last image)"
                        : std::string()) +
                (img.defined() ? ", got " + checkpoint::shape_str(img.sizes().vec()) : ", got none"));
    require(at::isFloatingType(img.scalar_type()), "encoder_hidden_states_image: expected a floating-point tensor");
  } else {
    require(!img.defined(),
            "encoder_hidden_states_image: this model has no image branch (image_dim is unset); "
            "image tokens need an image-to-video checkpoint");
  }

  if (c.inject_sample_info) {
    require(a.fps.has_value() && a.fps->defined(),
            "fps: this model has an fps embedding (inject_sample_info); pass fps [B] with 0 for 16 fps, else 1");
    const Tensor& f = *a.fps;
    require(f.dim() == 1 && f.size(0) == g.batch && at::isIntegralType(f.scalar_type(), false),
            "fps: expected an integer tensor [B] with B=" + std::to_string(g.batch));
    require(f.min().item<int64_t>() >= 0 && f.max().item<int64_t>() <= 1,
            "fps: values must be 0 (16 fps) or 1 (any other rate)");
  }
  // (fps given to a model without the embedding is ignored, as diffusers does: pipelines always pass it.)

  require(a.num_frame_per_block >= 1, "num_frame_per_block: must be >= 1");
  require(g.ppf % a.num_frame_per_block == 0,
          "num_frame_per_block: " + std::to_string(g.ppf) + " latent frames are not a multiple of " +
              std::to_string(a.num_frame_per_block) + " (the block-causal mask needs whole blocks)");
  return g;
}

Tensor SkyReelsV2Transformer::Impl::self_attention(const AttentionWeights& a, const Tensor& n, const RopeTables& rope,
                                                   const Geometry& g, int64_t causal_block_tokens,
                                                   const KvSlot* kv, const BlockSparseAttention* sparse) const {
  if (sparse != nullptr) return block_sparse_attention(a, n, rope, g, causal_block_tokens, *sparse);
  // Heads made contiguous: oneDNN's bf16 GEMM is several times slower on row-strided operands.
  const int64_t heads = config.num_attention_heads;
  const Tensor q = apply_rope(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), rope, heads);
  Tensor k = split_heads(apply_rope(rms_norm_across_heads(a.to_k(n), a.norm_k, config.eps), rope, heads), heads)
                 .contiguous();
  Tensor v = split_heads(a.to_v(n), heads).contiguous();
  int64_t offset = 0;
  if (kv != nullptr) {
    offset = kv->reuse_tokens;
    if (offset > 0) {  // the kept frames' keys first, as they stand in the full call
      k = at::cat({kv->k->narrow(2, 0, offset), k}, 2);
      v = at::cat({kv->v->narrow(2, 0, offset), v}, 2);
    }
    if (kv->keep_tokens > (kv->k->defined() ? kv->k->size(2) : 0)) {
      *kv->k = k.narrow(2, 0, kv->keep_tokens).clone(at::MemoryFormat::Contiguous);
      *kv->v = v.narrow(2, 0, kv->keep_tokens).clone(at::MemoryFormat::Contiguous);
    }
  }
  const Tensor o =
      detail::attention(split_heads(q, heads).contiguous(), k, v, causal_block_tokens, chunk_bytes, offset);
  return a.to_out(o.view(g.flat()));
}

Tensor SkyReelsV2Transformer::Impl::block_sparse_attention(const AttentionWeights& a, const Tensor& n,
                                                           const RopeTables& rope, const Geometry& g,
                                                           int64_t causal_block_tokens,
                                                           const BlockSparseAttention& sparse) const {
  // n: the computed blocks' tokens in order; rope: their rows of the call's tables.
  const int64_t heads = config.num_attention_heads, bt = sparse.block_tokens;
  const Tensor q = split_heads(apply_rope(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), rope, heads), heads)
                       .contiguous();
  const Tensor k_pre = rms_norm_across_heads(a.to_k(n), a.norm_k, config.eps);
  const Tensor v_new = a.to_v(n);
  const Tensor k_new = apply_rope(k_pre.clone(), rope, heads);  // apply_rope consumes its input: k_pre is kept
  const size_t nc = sparse.computed.size();
  sparse.fresh_k->assign(nc, Tensor());
  sparse.fresh_v->assign(nc, Tensor());
  for (size_t i = 0; i < nc; ++i) {
    const int64_t at = static_cast<int64_t>(i) * bt;
    (*sparse.fresh_k)[i] = k_pre.narrow(1, at, bt).clone(at::MemoryFormat::Contiguous);
    (*sparse.fresh_v)[i] = v_new.narrow(1, at, bt).clone(at::MemoryFormat::Contiguous);
  }
  // Keys / values of the call's blocks up to the last computed one, each at its place.
  const int64_t key_blocks = sparse.computed.back() + 1;
  Tensor k_all = at::empty({g.batch, key_blocks * bt, g.dim}, k_new.options());
  Tensor v_all = at::empty({g.batch, key_blocks * bt, g.dim}, v_new.options());
  for (size_t i = 0; i < nc; ++i) {
    const int64_t block = sparse.computed[i], from = static_cast<int64_t>(i) * bt;
    k_all.narrow(1, block * bt, bt).copy_(k_new.narrow(1, from, bt));
    v_all.narrow(1, block * bt, bt).copy_(v_new.narrow(1, from, bt));
  }
  for (size_t i = 0; i < sparse.stale.size(); ++i) {
    const int64_t block = sparse.stale[i];
    if (block >= key_blocks) break;  // after every computed block: nothing attends to it
    k_all.narrow(1, block * bt, bt).copy_(apply_rope(sparse.stale_k[i]->clone(), sparse.stale_rope[i], heads));
    v_all.narrow(1, block * bt, bt).copy_(*sparse.stale_v[i]);
  }
  const Tensor k = split_heads(k_all, heads).contiguous(), v = split_heads(v_all, heads).contiguous();
  // One attention per run of consecutive computed blocks: its queries see the keys of every block up to its own.
  std::vector<Tensor> outs;
  for (size_t i = 0; i < nc;) {
    size_t j = i + 1;
    while (j < nc && sparse.computed[j] == sparse.computed[j - 1] + 1) ++j;
    const int64_t first = sparse.computed[i], end = sparse.computed[j - 1] + 1;
    outs.push_back(detail::attention(q.narrow(2, static_cast<int64_t>(i) * bt, (end - first) * bt).contiguous(),
                                     k.narrow(2, 0, end * bt), v.narrow(2, 0, end * bt), causal_block_tokens,
                                     chunk_bytes, first * bt));
    i = j;
  }
  const Tensor o = outs.size() == 1 ? outs.front() : at::cat(outs, 1);
  return a.to_out(o.reshape(g.flat()));
}

Tensor SkyReelsV2Transformer::Impl::embed_image(const Layers& l, const Tensor& image_tokens) const {
  // diffusers' SkyReelsV2ImageEmbedding: (+ pos_embed) -> FP32LayerNorm -> Linear -> GELU (erf) -> Linear ->
  // FP32LayerNorm; its LayerNorms keep torch's default eps 1e-5, not the config's.
  constexpr double kEps = 1e-5;
  Tensor x = image_tokens.to(device, dtype);
  if (image_pos_embed.defined()) x = x + image_pos_embed;
  const Tensor n = layer_norm_fp32(x, kEps, image_norm1_weight, image_norm1_bias).to(dtype);
  const Tensor h = l.image_ff_out(at::gelu(l.image_ff_in(n)));
  return layer_norm_fp32(h, kEps, image_norm2_weight, image_norm2_bias).to(dtype);
}

Tensor SkyReelsV2Transformer::Impl::cross_attention(const BlockWeights& b, const Tensor& n,
                                                    const CrossContext& context) const {
  // No RoPE and no mask: zero-padded text rows are attended, as in diffusers. The image tokens get their own keys
  // and values and one attention of the same queries; both outputs are summed before to_out (diffusers' I2V
  // processor, minus its `total - 512` split: the two contexts are never concatenated here).
  const AttentionWeights& a = b.attn2;
  const int64_t heads = config.num_attention_heads;
  const Tensor q = split_heads(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), heads).contiguous();
  const Tensor k = split_heads(rms_norm_across_heads(a.to_k(context.text), a.norm_k, config.eps), heads).contiguous();
  const Tensor v = split_heads(a.to_v(context.text), heads).contiguous();
  Tensor o = detail::attention(q, k, v, 0, chunk_bytes);
  if (context.image.defined()) {
    const ImageKvWeights& kv = b.image_kv;
    const Tensor k_img =
        split_heads(rms_norm_diffusers(kv.add_k(context.image), kv.norm_added_k, config.eps), heads).contiguous();
    const Tensor v_img = split_heads(kv.add_v(context.image), heads).contiguous();
    o.add_(detail::attention(q, k_img, v_img, 0, chunk_bytes));
  }
  return a.to_out(o.view({n.size(0), n.size(1), n.size(2)}));
}

Tensor SkyReelsV2Transformer::Impl::feed_forward(const BlockWeights& b, const Tensor& n) const {
  // Linear -> GELU(tanh) -> Linear, token-wise: run over chunks of tokens so the [tokens, ffn_dim] hidden state
  // (0.9 GB in bf16 at 540P for 1.3B) is never whole.
  const int64_t tokens = n.size(0) * n.size(1), dim = n.size(2);
  const int64_t chunk =
      std::clamp<int64_t>(chunk_bytes / (config.ffn_dim * static_cast<int64_t>(n.element_size())), 1, tokens);
  const Tensor flat = n.view({tokens, dim});
  Tensor out = at::empty({tokens, dim}, n.options());
  const Tensor w_out_t = b.ffn_out.weight.t();
  for (int64_t r = 0; r < tokens; r += chunk) {
    const int64_t m = std::min(chunk, tokens - r);
    const Tensor rows = flat.narrow(0, r, m);
    Tensor hidden = at::linear(rows, b.ffn_in.weight, b.ffn_in.bias);
    if (b.ffn_in.adapters != nullptr) b.ffn_in.adapters->add_to(hidden, rows);
    at::gelu_(hidden, "tanh");
    Tensor o = out.narrow(0, r, m);
    at::addmm_out(o, b.ffn_out.bias, hidden, w_out_t);
    if (b.ffn_out.adapters != nullptr) b.ffn_out.adapters->add_to(o, hidden);
  }
  return out.view(n.sizes());
}

Tensor SkyReelsV2Transformer::Impl::block_forward(const BlockWeights& b, Tensor x, const CrossContext& context,
                                                  const Tensor& modulation, const RopeTables& rope, const Geometry& g,
                                                  int64_t causal_block_tokens, const KvSlot* kv,
                                                  const BlockSparseAttention* sparse) const {
  // e = table + temb in fp32, rows [shift, scale, gate, c_shift, c_scale, c_gate], each [B, Fm, 1, D].
  const Tensor e = b.scale_shift_table.view({1, 1, 6, g.dim}) + modulation;
  auto row = [&](int64_t i) { return e.select(2, i).unsqueeze(2); };
  {
    const Tensor n = modulated_norm(x, row(1), row(0), g, config.eps, dtype);
    x = gated_residual(x, self_attention(b.attn1, n, rope, g, causal_block_tokens, kv, sparse), row(2), g);
  }
  {
    const Tensor n =
        config.cross_attn_norm ? layer_norm_fp32(x, config.eps, b.norm2_weight, b.norm2_bias).to(dtype) : x;
    x.add_(cross_attention(b, n, context));  // plain add in the compute dtype (no fp32 island)
  }
  {
    const Tensor n = modulated_norm(x, row(4), row(3), g, config.eps, dtype);
    x = gated_residual(x, feed_forward(b, n), row(5), g);
  }
  return x;
}

Tensor SkyReelsV2Transformer::Impl::head(const Linear& proj_out, const Tensor& x, const Tensor& temb,
                                         const Geometry& g) const {
  // shift/scale = table [1, 2, D] (fp32) + temb (compute dtype) -> fp32 [B, Fm, 1, D].
  const Tensor e = head_table.view({1, 1, 2, g.dim}) + temb.unsqueeze(2);
  const Tensor n = modulated_norm(x, e.select(2, 1).unsqueeze(2), e.select(2, 0).unsqueeze(2), g, config.eps, dtype);
  const Tensor out = proj_out(n);  // [B, L, pt*ph*pw*C], features ordered (pt, ph, pw, c)
  const auto& p = config.patch_size;
  return out.view({g.batch, g.ppf, g.pph, g.ppw, p[0], p[1], p[2], config.out_channels})
      .permute({0, 7, 1, 4, 2, 5, 3, 6})
      .reshape({g.batch, config.out_channels, g.frames, g.height, g.width});
}

Tensor SkyReelsV2Transformer::Impl::patchify(const Tensor& hidden_states, const Geometry& g, int64_t first) const {
  // Patch embedding: conv3d with kernel == stride is a linear over flattened (c, pt, ph, pw) patches; token order
  // f * pph * ppw + h * ppw + w.
  const auto& p = config.patch_size;
  const Geometry s = frames_from(g, first);
  Tensor x = hidden_states.narrow(2, first, s.frames)
                 .to(device, dtype)
                 .reshape({g.batch, config.in_channels, s.ppf, p[0], g.pph, p[1], g.ppw, p[2]})  // inputs may be views
                 .permute({0, 2, 4, 6, 1, 3, 5, 7})
                 .reshape({g.batch, s.tokens, config.in_channels * p[0] * p[1] * p[2]});
  return patch_embedding(x);
}

namespace {

// What a call may skip (TransformerForwardArgs' exact savings and FirstBlockCache), checked against the call.
struct Savings {
  TransformerCallState::Impl* state = nullptr;
  int64_t reuse = 0, keep = 0;  // frames
  std::optional<double> threshold;
};

Savings check_savings(const TransformerForwardArgs& a, const TransformerConfig& c, const Geometry& g) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  Savings s{a.state ? &a.state->impl() : nullptr, a.reuse_frames, a.keep_frames, a.first_block_threshold};
  require(s.state || (s.reuse == 0 && s.keep == 0 && !s.threshold),
          "state: reuse_frames, keep_frames and first_block_threshold need a TransformerCallState");
  if (s.reuse != 0 || s.keep != 0) {
    const int64_t block = a.num_frame_per_block;
    require(block > 1 && a.timestep.dim() == 2 && c.patch_size[0] == 1,
            "reuse_frames/keep_frames: exact savings need per-frame timesteps [B, F], the block-causal mask "
            "(num_frame_per_block > 1) and patch_size[0] = 1");
    require(s.reuse >= 0 && s.reuse <= s.keep && s.keep <= g.frames && s.reuse < g.frames && s.reuse % block == 0 &&
                s.keep % block == 0,
            "reuse_frames/keep_frames: need 0 <= reuse (" + std::to_string(s.reuse) + ") <= keep (" +
                std::to_string(s.keep) + ") <= F (" + std::to_string(g.frames) + "), reuse < F, whole blocks of " +
                std::to_string(block));
    const auto& st = *s.state;
    require(s.reuse == 0 || (s.reuse <= st.kept_frames && st.tokens_per_frame == g.tokens_per_frame &&
                             st.batch == g.batch),
            "reuse_frames: " + std::to_string(s.reuse) + " frames asked, the state keeps " +
                std::to_string(st.kept_frames) + " of another call's geometry");
  }
  if (const PerBlockCache* pb = a.per_block_cache) {
    require(s.state && s.reuse == 0 && s.keep == 0 && !s.threshold,
            "per_block_cache: needs a TransformerCallState and excludes reuse_frames, keep_frames and "
            "first_block_threshold");
    require(a.num_frame_per_block > 1 && a.timestep.dim() == 2 && c.patch_size[0] == 1,
            "per_block_cache: needs per-frame timesteps [B, F], the block-causal mask (num_frame_per_block > 1) and "
            "patch_size[0] = 1");
    require(pb->updated_blocks.size() == static_cast<size_t>(g.frames / a.num_frame_per_block),
            "per_block_cache: updated_blocks has " + std::to_string(pb->updated_blocks.size()) + " entries for " +
                std::to_string(g.frames / a.num_frame_per_block) + " causal blocks");
    require(std::isfinite(pb->threshold) && pb->threshold >= 0 && pb->max_skips >= 1 && pb->first_block >= 0,
            "per_block_cache: needs a finite threshold >= 0, max_skips >= 1 and first_block >= 0");
    require(c.num_layers >= 2, "per_block_cache: needs at least 2 transformer blocks");
  }
  if (s.threshold) {
    require(std::isfinite(*s.threshold) && *s.threshold >= 0, "first_block_threshold: must be a finite value >= 0");
    require(c.num_layers >= 2, "first_block_threshold: FirstBlockCache needs at least 2 transformer blocks");
  }
  return s;
}

// The change both step caches decide on (diffusers' FBCHeadBlockHook): rel = mean|r - r_prev| / mean|r_prev| in the
// hidden states' dtype, still on the device.
Tensor relative_change(const Tensor& residual, const Tensor& previous) {
  return (residual - previous).abs().mean() / previous.abs().mean();
}

// FirstBlockCache's decision: rel as a host number; compute when there is no r_prev or rel > threshold.
std::optional<double> first_block_rel(const Tensor& residual, const Tensor& previous) {
  if (!previous.defined()) return std::nullopt;
  if (previous.sizes() != residual.sizes()) {
    throw std::invalid_argument("first_block_cache: this call has " + std::to_string(residual.size(1)) +
                                " tokens, the context's last computed call had " + std::to_string(previous.size(1)) +
                                " (cache state kept across calls of different shapes)");
  }
  return relative_change(residual, previous).item<double>();
}

}  // namespace

namespace {

using BlockEntry = TransformerCallState::Impl::BlockEntry;

// What the cache per causal block does with each block of a call: its decisions, and the blocks that run (computed)
// or lend their kept keys / values (stale: skipped or reused), with the stale blocks' states.
struct BlockPlan {
  std::vector<TransformerCallStats::BlockDecision> decisions;
  std::vector<int64_t> computed, stale;
  std::vector<BlockEntry*> stale_entries;
  std::vector<bool> leading_final;  // per block: it and every block before it are final
};

BlockPlan plan_blocks(const PerBlockCache& cache, TransformerCallState::Impl& state, const Tensor& residual,
                      int64_t blocks, int64_t block_tokens, int64_t layers) {
  BlockPlan plan;
  std::vector<BlockEntry*> entries(static_cast<size_t>(blocks), nullptr);
  std::vector<bool> reused(static_cast<size_t>(blocks), false);
  std::vector<Tensor> rels;  // of the blocks with a state that are not reused, read to the host once for the call
  bool leading_final = true;
  for (int64_t j = 0; j < blocks; ++j) {
    leading_final = leading_final && cache.final_blocks[static_cast<size_t>(j)] != 0;
    plan.leading_final.push_back(leading_final);
    auto found = state.blocks.find(cache.first_block + j);
    if (found == state.blocks.end()) continue;
    BlockEntry& e = found->second;
    entries[static_cast<size_t>(j)] = &e;
    // A final block computed while final in this window: its kept keys / values are exact.
    reused[static_cast<size_t>(j)] = static_cast<int64_t>(e.k.size()) == layers - 1 && leading_final && e.final &&
                                     e.window == cache.first_block;
    if (!reused[static_cast<size_t>(j)]) {
      rels.push_back(relative_change(residual.narrow(1, j * block_tokens, block_tokens), e.residual));
    }
  }
  const Tensor host_rels = rels.empty() ? Tensor() : at::stack(rels).to(at::kCPU, at::kDouble);
  size_t next_rel = 0;
  for (int64_t j = 0; j < blocks; ++j) {
    TransformerCallStats::BlockDecision d;
    d.block = cache.first_block + j;
    d.updated = cache.updated_blocks[static_cast<size_t>(j)] != 0;
    d.reused = reused[static_cast<size_t>(j)];
    BlockEntry* e = entries[static_cast<size_t>(j)];
    if (e != nullptr && !d.reused) {
      d.rel = host_rels.data_ptr<double>()[next_rel++];
      d.skipped = static_cast<int64_t>(e->k.size()) == layers - 1 && d.updated && *d.rel <= cache.threshold &&
                  e->skips < cache.max_skips;
    }
    if (d.skipped || d.reused) {
      plan.stale.push_back(j);
      plan.stale_entries.push_back(e);
    } else {
      plan.computed.push_back(j);
    }
    plan.decisions.push_back(d);
  }
  return plan;
}

// Keys / values the states of blocks other than `computed` keep.
int64_t kept_bytes_besides(const TransformerCallState::Impl& state, const PerBlockCache& cache,
                           const std::vector<int64_t>& computed) {
  int64_t kept = 0;
  for (const auto& [block, entry] : state.blocks) {
    if (std::find(computed.begin(), computed.end(), block - cache.first_block) != computed.end()) continue;
    for (const auto* list : {&entry.k, &entry.v}) {
      for (const Tensor& t : *list) kept += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  return kept;
}

}  // namespace

Tensor SkyReelsV2Transformer::Impl::per_block_layers(const std::vector<BlockWeights>& blocks, Tensor x,
                                                     const PerBlockCache& cache, TransformerCallState::Impl& state,
                                                     const CrossContext& context, const Tensor& modulation,
                                                     const RopeTables& rope, const Geometry& g,
                                                     int64_t frames_per_block, const std::function<void()>& after_block,
                                                     TransformerCallStats& stats) const {
  const int64_t layers = static_cast<int64_t>(blocks.size()), bt = frames_per_block * g.tokens_per_frame;
  const int64_t nb = g.frames / frames_per_block;
  // Blocks before the call's window never come back in this chunk (the window only moves forward).
  state.blocks.erase(state.blocks.begin(), state.blocks.lower_bound(cache.first_block));

  const Tensor block_in = x;
  x = block_forward(blocks[0], std::move(x), context, modulation, rope, g, bt);
  stats.token_blocks_computed += g.batch * g.tokens;
  if (after_block) after_block();
  const Tensor block0_out = x, residual = x - block_in;

  const BlockPlan plan = plan_blocks(cache, state, residual, nb, bt, layers);
  int64_t cache_skips = 0;
  for (const auto& d : plan.decisions) cache_skips += d.skipped ? 1 : 0;
  stats.blocks = plan.decisions;
  stats.skipped = cache_skips == nb;                                     // every block of the call skipped
  stats.token_blocks_cached = g.batch * cache_skips * bt * (layers - 1);  // reused final blocks: exact savings

  // Stale blocks: block 0's output plus their own last tail residual.
  Tensor out = block0_out.clone();
  for (size_t i = 0; i < plan.stale.size(); ++i) {
    out.narrow(1, plan.stale[i] * bt, bt).add_(plan.stale_entries[i]->tail);
  }
  std::vector<std::vector<Tensor>> fresh_k(static_cast<size_t>(layers)), fresh_v(static_cast<size_t>(layers));
  if (!plan.computed.empty()) {
    out = computed_blocks(blocks, block0_out, std::move(out), plan, context, modulation, rope, g, frames_per_block,
                          after_block, fresh_k, fresh_v, stats);
  }

  // The computed blocks' states, within the memory budget (what the other blocks keep counts first).
  for (size_t i = 0; i < plan.stale.size(); ++i) {
    if (plan.decisions[static_cast<size_t>(plan.stale[i])].skipped) ++plan.stale_entries[i]->skips;
  }
  int64_t kept = kept_bytes_besides(state, cache, plan.computed);
  const int64_t bytes = 2 * (layers - 1) * g.batch * bt * g.dim * static_cast<int64_t>(out.element_size());
  for (size_t i = 0; i < plan.computed.size(); ++i) {
    const int64_t j = plan.computed[i];
    BlockEntry& e = state.blocks[cache.first_block + j];
    e.residual = residual.narrow(1, j * bt, bt).clone(at::MemoryFormat::Contiguous);
    e.tail = (out.narrow(1, j * bt, bt) - block0_out.narrow(1, j * bt, bt)).contiguous();
    e.skips = 0;
    e.final = plan.leading_final[static_cast<size_t>(j)];
    e.window = cache.first_block;
    e.k.clear();
    e.v.clear();
    if (kept + bytes > cache.max_kv_bytes) continue;  // no keys / values kept: this block cannot skip
    kept += bytes;
    for (int64_t l = 1; l < layers; ++l) {
      e.k.push_back(fresh_k[static_cast<size_t>(l)][i]);
      e.v.push_back(fresh_v[static_cast<size_t>(l)][i]);
    }
  }
  return out;
}

Tensor SkyReelsV2Transformer::Impl::computed_blocks(const std::vector<BlockWeights>& blocks, const Tensor& block0_out,
                                                    Tensor out, const BlockPlan& plan, const CrossContext& context,
                                                    const Tensor& modulation, const RopeTables& rope, const Geometry& g,
                                                    int64_t frames_per_block, const std::function<void()>& after_block,
                                                    std::vector<std::vector<Tensor>>& fresh_k,
                                                    std::vector<std::vector<Tensor>>& fresh_v,
                                                    TransformerCallStats& stats) const {
  const int64_t layers = static_cast<int64_t>(blocks.size()), bt = frames_per_block * g.tokens_per_frame;
  const size_t nc = plan.computed.size();
  const bool all = nc == plan.decisions.size();
  std::vector<int64_t> frame_index, token_index;
  for (int64_t j : plan.computed) {
    for (int64_t f = 0; f < frames_per_block; ++f) frame_index.push_back(j * frames_per_block + f);
    for (int64_t t = 0; t < bt; ++t) token_index.push_back(j * bt + t);
  }
  const Tensor frames = at::tensor(frame_index, at::TensorOptions().dtype(at::kLong)).to(device);
  const Tensor tokens = at::tensor(token_index, at::TensorOptions().dtype(at::kLong)).to(device);
  Tensor xc = all ? block0_out.clone() : block0_out.index_select(1, tokens);  // the blocks write in place
  const Tensor mod_c = all || modulation.size(1) == 1 ? modulation : modulation.index_select(1, frames);
  const RopeTables rope_c =
      all ? rope : RopeTables{rope.cos.index_select(1, tokens), rope.signed_sin.index_select(1, tokens)};
  BlockSparseAttention sparse;
  sparse.block_tokens = bt;
  sparse.computed = plan.computed;
  sparse.stale = plan.stale;
  for (int64_t j : plan.stale) {
    sparse.stale_rope.push_back({rope.cos.narrow(1, j * bt, bt), rope.signed_sin.narrow(1, j * bt, bt)});
  }
  Geometry sub = g;
  sub.frames = sub.ppf = static_cast<int64_t>(nc) * frames_per_block;
  sub.tokens = static_cast<int64_t>(nc) * bt;
  for (int64_t l = 1; l < layers; ++l) {
    sparse.stale_k.clear();
    sparse.stale_v.clear();
    for (BlockEntry* e : plan.stale_entries) {
      sparse.stale_k.push_back(&e->k[static_cast<size_t>(l - 1)]);
      sparse.stale_v.push_back(&e->v[static_cast<size_t>(l - 1)]);
    }
    sparse.fresh_k = &fresh_k[static_cast<size_t>(l)];
    sparse.fresh_v = &fresh_v[static_cast<size_t>(l)];
    xc = block_forward(blocks[static_cast<size_t>(l)], std::move(xc), context, mod_c, rope_c, sub, bt, nullptr,
                       &sparse);
    stats.token_blocks_computed += g.batch * sub.tokens;
    if (after_block) after_block();
  }
  if (all) return xc;
  out.index_copy_(1, tokens, xc);
  return out;
}

at::Tensor SkyReelsV2Transformer::forward(const TransformerForwardArgs& args) const {
  const Impl& m = *impl_;
  const TransformerConfig& c = m.config;
  const Geometry g = m.check_inputs(args);
  const Savings savings = check_savings(args, c, g);
  // The call's adapters on a copy of the layers; without any, the model's own layers (the path of no adapters).
  std::optional<AdaptedLayers> adapted;
  if (!args.adapters.empty()) adapted.emplace(m.base_layers, c, args.adapters);
  const Layers& call_layers = adapted ? adapted->layers() : m.base_layers;
  c10::NoGradGuard no_grad;  // c10::, not at::: LibTorch 2.x no longer aliases it through ATen/ATen.h

  // Frames [reuse, F) are computed; with FirstBlockCache block 0 runs on every frame (its residual is compared
  // over the whole call, as diffusers does).
  const int64_t reuse = savings.reuse;
  const bool first_block = savings.threshold.has_value();
  Tensor x = m.patchify(args.hidden_states, g, first_block ? 0 : reuse);

  // Conditioning. Fm = F for per-frame timesteps [B, F] (diffusion forcing), else 1.
  const Tensor timestep = args.timestep.to(m.device);
  const Tensor ts = timestep.dim() == 1 ? timestep.unsqueeze(1) : timestep;  // [B, Fm]
  const int64_t fm = ts.size(1);
  const Tensor sinusoid = detail::timestep_sinusoid(ts, c.freq_dim).to(at::kFloat);
  const Tensor temb =
      call_layers.time_2(at::silu(call_layers.time_1(sinusoid))).to(m.dtype);  // fp32 MLP, then the compute dtype
  Tensor modulation = call_layers.time_proj(at::silu(temb)).view({g.batch, fm, 6, g.dim});
  if (c.inject_sample_info) {
    // Each batch item adds its own fps vector to all of its frames (diffusers only manages B = 1 in DF mode).
    const Tensor fps_emb = at::index_select(m.fps_embedding, 0, args.fps->to(m.device, at::kLong));
    const Tensor fps_proj = call_layers.fps_2(at::silu(call_layers.fps_1(fps_emb)));
    modulation = modulation + fps_proj.view({g.batch, 1, 6, g.dim});
  }
  modulation = modulation.to(at::kFloat);
  CrossContext context;
  context.text =
      call_layers.text_2(at::gelu(call_layers.text_1(args.encoder_hidden_states.to(m.device, m.dtype)), "tanh"));
  if (c.image_dim) context.image = m.embed_image(call_layers, args.encoder_hidden_states_image);

  // RoPE: diffusers uses cos[..., 0::2] and sin[..., 1::2] of its tables, each angle repeated over its pair.
  const auto [cos_full, sin_full] = rope_tables(g.ppf, g.pph, g.ppw);
  const Tensor sin_half = sin_full.slice(-1, 1, c.attention_head_dim, 2);
  const RopeTables rope{cos_full, at::stack({sin_half.neg(), sin_half}, -1).view(cos_full.sizes())};

  // The call's tensors restricted to frames [first, F).
  auto per_frame = [&](const Tensor& t, int64_t first) { return fm == 1 ? t : t.narrow(1, first, fm - first); };
  auto rope_from = [&](int64_t first) {
    const int64_t begin = first * g.tokens_per_frame, n = g.tokens - begin;
    return RopeTables{rope.cos.narrow(1, begin, n), rope.signed_sin.narrow(1, begin, n)};
  };
  auto tokens_from = [&](const Tensor& t, int64_t first) {
    return first == 0 ? t : t.narrow(1, first * g.tokens_per_frame, g.tokens - first * g.tokens_per_frame).contiguous();
  };

  TransformerCallState::Impl* state = savings.state;
  if (state && savings.keep > 0 && reuse == 0) {  // a fresh set of kept keys, for this call's geometry
    state->reset_kv();
    state->tokens_per_frame = g.tokens_per_frame;
    state->batch = g.batch;
  }
  const bool keeps = state && savings.keep > 0;
  if (keeps) {
    state->k.resize(call_layers.blocks.size());
    state->v.resize(call_layers.blocks.size());
  }

  const int64_t layers = static_cast<int64_t>(call_layers.blocks.size());
  TransformerCallStats stats;
  stats.token_blocks_full = g.batch * g.tokens * layers;
  const int64_t causal_block_tokens = args.num_frame_per_block > 1 ? args.num_frame_per_block * g.tokens_per_frame : 0;
  if (args.per_block_cache != nullptr) {
    x = m.per_block_layers(call_layers.blocks, std::move(x), *args.per_block_cache, *state, context, modulation, rope,
                           g, args.num_frame_per_block, args.after_block, stats);
    if (args.stats) *args.stats = stats;
    return m.head(call_layers.proj_out, x, temb, g);
  }
  Tensor block0_out;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t first = first_block && l == 0 ? 0 : reuse;
    const Geometry sub = frames_from(g, first);
    KvSlot slot;
    const bool kept_layer = keeps && !(first_block && l == 0);  // FirstBlockCache runs block 0 whole
    if (kept_layer) {
      slot = {&state->k[static_cast<size_t>(l)], &state->v[static_cast<size_t>(l)], reuse * g.tokens_per_frame,
              savings.keep * g.tokens_per_frame};
    }
    // FirstBlockCache's residual needs block 0's input (block_forward never writes it in place); elsewhere the
    // input is released inside the block as usual.
    const Tensor block_in = first_block && l == 0 ? x : Tensor();
    x = m.block_forward(call_layers.blocks[static_cast<size_t>(l)], std::move(x), context, per_frame(modulation, first),
                        rope_from(first), sub, causal_block_tokens, kept_layer ? &slot : nullptr);
    stats.token_blocks_computed += g.batch * sub.tokens;
    if (args.after_block) args.after_block();
    if (first_block && l == 0) {
      const Tensor residual = x - block_in;
      stats.first_block_rel = first_block_rel(residual, state->prev_residual);
      if (stats.first_block_rel && *stats.first_block_rel <= *savings.threshold) {
        stats.skipped = true;
        stats.token_blocks_cached = g.batch * frames_from(g, reuse).tokens * (layers - 1);
        x = tokens_from(state->tail_residual + x, reuse);
        break;
      }
      state->prev_residual = residual;
      block0_out = x;
      x = tokens_from(x, reuse);
    }
  }
  if (first_block && !stats.skipped) {
    // The tail residual of every token; the kept frames [0, reuse) are final, so no later call reads theirs.
    Tensor tail = at::zeros_like(block0_out);
    tail.narrow(1, reuse * g.tokens_per_frame, x.size(1)).copy_(x - tokens_from(block0_out, reuse));
    state->tail_residual = tail;
  }
  if (keeps && !stats.skipped) state->kept_frames = std::max(state->kept_frames, savings.keep);
  if (args.stats) *args.stats = stats;
  const Geometry out = frames_from(g, reuse);
  return m.head(call_layers.proj_out, x, per_frame(temb, reuse), out);
}

}  // namespace skyreels::model
