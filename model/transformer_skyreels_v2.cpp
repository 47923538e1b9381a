#include "model/transformer_skyreels_v2.h"
// The SkyReels-V2 transformer's construction and state: the weights checked against the config and bound to the
// layers, the RoPE tables, the accessors, and the call state's memory. The rest of the model lives beside it: its
// config (transformer_config.cpp), the attention kernels (transformer_attention.cpp), the layers and adapters per
// call (transformer_layers.h), the forward (transformer_forward.cpp) and the cache per causal block
// (transformer_block_cache.cpp).

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/transformer_impl.h"

namespace skyreels::model {

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

}  // namespace skyreels::model
