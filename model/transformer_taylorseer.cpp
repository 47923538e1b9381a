// diffusers' TaylorSeer step cache (hooks/taylorseer_cache.py) on the SkyReels-V2 transformer
// (TransformerForwardArgs::taylorseer): which modules a config hooks, when a call computes, and the blocks and head
// with each hooked module either computed (and its Taylor factors updated) or predicted / zeroed. Separate from the
// forward because it is a path through the layers only this cache takes.
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/rank_group.h"
#include "model/transformer_impl.h"

namespace skyreels::model {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Every module name diffusers' SkyReelsV2Transformer3DModel has for this config (named_modules() order where it
// matters: the blocks, then proj_out), and whether TaylorSeer can hook it here.
std::vector<std::string> module_names(const TransformerConfig& c) {
  std::vector<std::string> names = {"",
                                    "rope",
                                    "patch_embedding",
                                    "condition_embedder",
                                    "condition_embedder.timesteps_proj",
                                    "condition_embedder.time_embedder",
                                    "condition_embedder.time_embedder.linear_1",
                                    "condition_embedder.time_embedder.act",
                                    "condition_embedder.time_embedder.linear_2",
                                    "condition_embedder.act_fn",
                                    "condition_embedder.time_proj",
                                    "condition_embedder.text_embedder",
                                    "condition_embedder.text_embedder.linear_1",
                                    "condition_embedder.text_embedder.act_1",
                                    "condition_embedder.text_embedder.linear_2"};
  if (c.image_dim) {
    for (const char* n :
         {"", ".norm1", ".ff", ".ff.net", ".ff.net.0", ".ff.net.0.proj", ".ff.net.1", ".ff.net.2", ".norm2"}) {
      names.push_back(std::string("condition_embedder.image_embedder") + n);
    }
  }
  names.push_back("blocks");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blocks." + std::to_string(l);
    names.push_back(p);
    names.push_back(p + ".norm1");
    for (const char* attn : {".attn1", ".attn2"}) {
      names.push_back(p + attn);
      for (const char* n : {".to_q", ".to_k", ".to_v", ".to_out", ".to_out.0", ".to_out.1", ".norm_q", ".norm_k"}) {
        names.push_back(p + attn + n);
      }
      if (c.image_dim && std::string(attn) == ".attn2") {
        for (const char* n : {".add_k_proj", ".add_v_proj", ".norm_added_k"}) names.push_back(p + attn + n);
      }
    }
    for (const char* n :
         {".norm2", ".ffn", ".ffn.net", ".ffn.net.0", ".ffn.net.0.proj", ".ffn.net.1", ".ffn.net.2", ".norm3"}) {
      names.push_back(p + n);
    }
  }
  names.push_back("norm_out");
  names.push_back("proj_out");
  if (c.inject_sample_info) {
    for (const char* n : {"fps_embedding", "fps_projection", "fps_projection.net", "fps_projection.net.0",
                          "fps_projection.net.0.proj", "fps_projection.net.1", "fps_projection.net.2"}) {
      names.push_back(n);
    }
  }
  return names;
}

bool hookable(const std::string& name) {
  static const std::regex kHookable(R"(blocks\.\d+(\.(attn1|attn2|ffn))?|proj_out)");
  return std::regex_match(name, kHookable);
}

std::vector<std::regex> compile(const std::vector<std::string>& patterns, const std::string& field) {
  std::vector<std::regex> out;
  for (const std::string& p : patterns) {
    try {
      out.emplace_back(p, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw std::invalid_argument(field + ": '" + p + "' is not a regular expression (" + e.what() + ")");
    }
  }
  return out;
}

bool matches(const std::vector<std::regex>& patterns, const std::string& name) {
  for (const std::regex& r : patterns) {
    if (std::regex_match(name, r)) return true;
  }
  return false;
}

void check_config(const TaylorSeerCache& c) {
  require(c.cache_interval >= 1 && c.cache_interval <= 1000,
          "taylorseer_cache_interval: " + std::to_string(c.cache_interval) + " must be within [1, 1000]");
  require(c.disable_cache_before_step >= 1 && c.disable_cache_before_step <= 100000,
          "taylorseer_disable_cache_before_step: " + std::to_string(c.disable_cache_before_step) +
              " must be within [1, 100000] (diffusers cannot predict the first call)");
  require(!c.disable_cache_after_step || (*c.disable_cache_after_step >= 0 && *c.disable_cache_after_step <= 100000),
          "taylorseer_disable_cache_after_step: must be within [0, 100000]");
  require(c.max_order >= 0 && c.max_order <= 8,
          "taylorseer_max_order: " + std::to_string(c.max_order) + " must be within [0, 8]");
}

}  // namespace

std::vector<std::pair<std::string, std::string>> taylorseer_hooked_modules(const TaylorSeerCache& cache,
                                                                           const TransformerConfig& config) {
  check_config(cache);
  // diffusers' lite mode: ^[^.]*block[^.]*\.[^.]+$ skipped (blocks.N here), ^proj_out$ cached.
  const std::vector<std::regex> skip = cache.lite ? compile({R"(^[^.]*block[^.]*\.[^.]+$)"}, "taylorseer_lite")
                                                  : compile(cache.skip_modules, "taylorseer_skip_modules");
  const std::vector<std::regex> keep = cache.lite ? compile({"^proj_out$"}, "taylorseer_lite")
                                                  : compile(cache.cache_modules, "taylorseer_cache_modules");
  std::vector<std::pair<std::string, std::string>> hooked;
  for (const std::string& name : module_names(config)) {
    const bool is_skip = matches(skip, name), is_cache = matches(keep, name);
    if (!is_skip && !is_cache) continue;
    const std::string field = is_skip ? "taylorseer_skip_modules" : "taylorseer_cache_modules";
    require(hookable(name), field + ": matches module '" + name +
                                "', which TaylorSeer cannot hook here (blocks.N, blocks.N.attn1, blocks.N.attn2, "
                                "blocks.N.ffn and proj_out can be hooked)");
    for (const auto& [outer, role] : hooked) {
      require(name.rfind(outer + ".", 0) != 0, field + ": hooks '" + name + "' inside '" + outer +
                                                   "', which is hooked too (nested hooks would count " +
                                                   "calls apart)");
    }
    hooked.emplace_back(name, is_skip ? "skip" : "cache");  // diffusers: a module matching both is skipped
  }
  require(!hooked.empty(),
          "taylorseer_cache_modules: the patterns hook no module of this model (diffusers' default '^blocks.*attn' "
          "never matches blocks.N.attn1 under re.fullmatch and equals the uncached run); name modules such as "
          "blocks\\.\\d+\\.attn1 or use lite mode");
  return hooked;
}

namespace {

enum class Role : uint8_t { kNone, kCache, kSkip };

at::ScalarType scalar_type(TaylorFactorsDtype d) {
  switch (d) {
    case TaylorFactorsDtype::kFloat32:
      return at::kFloat;
    case TaylorFactorsDtype::kFloat16:
      return at::kHalf;
    case TaylorFactorsDtype::kBFloat16:
      break;
  }
  return at::kBFloat16;
}

// The hooks of one call: each module's role and slot (its place in taylorseer_hooked_modules), whether the call
// computes, and the state it reads and updates.
class TaylorCall {
 public:
  TaylorCall(const TaylorSeerCache& cache, const TransformerConfig& config, TransformerCallState::Impl& state,
             at::TensorOptions outputs)
      : cache_(cache), state_(state.taylor), outputs_(outputs) {
    const auto hooked = taylorseer_hooked_modules(cache, config);
    for (size_t i = 0; i < hooked.size(); ++i)
      slots_[hooked[i].first] = {hooked[i].second == "skip" ? Role::kSkip : Role::kCache, i};
    state_.current_step += 1;
    const int64_t step = state_.current_step, before = cache.disable_cache_before_step;
    const int64_t since = step - before - 1;
    const bool interval = ((since % cache.cache_interval) + cache.cache_interval) % cache.cache_interval == 0;
    const bool cooldown = cache.disable_cache_after_step && step >= *cache.disable_cache_after_step;
    compute_ = step < before || interval || cooldown;
    require(compute_ || state_.last_update_step.has_value(), "taylorseer: cannot predict before a computed call");
  }

  bool computes() const { return compute_; }
  // Whether the module `name` runs in this call (not hooked, or hooked and computing).
  bool runs(const std::string& name) const { return compute_ || slots_.find(name) == slots_.end(); }

  // The module's output: compute() when it runs (and its factors or shape updated when hooked), else its prediction.
  template <class Fn>
  Tensor module(const std::string& name, Fn&& compute) {
    auto found = slots_.find(name);
    if (found == slots_.end()) return compute();
    const auto [role, slot] = found->second;
    if (!compute_) return predict(role, slot);
    Tensor out = compute();
    update(role, slot, out);
    return out;
  }

  void finish() {
    if (compute_) state_.last_update_step = state_.current_step;
  }

 private:
  void update(Role role, size_t slot, const Tensor& out) {
    if (role == Role::kSkip) {
      state_.shapes[slot] = out.sizes().vec();
      return;
    }
    std::vector<Tensor> fresh{out};
    if (state_.last_update_step) {
      const int64_t delta = state_.current_step - *state_.last_update_step;
      const std::vector<Tensor>& prev = state_.factors[slot];
      for (int64_t j = 0; j < cache_.max_order && j < static_cast<int64_t>(prev.size()); ++j) {
        fresh.push_back((fresh[static_cast<size_t>(j)] - prev[static_cast<size_t>(j)].to(out.scalar_type())) / delta);
      }
    }
    std::vector<Tensor> stored;
    const at::ScalarType kept = scalar_type(cache_.factors_dtype);
    for (const Tensor& f : fresh) stored.push_back(f.to(f.options().dtype(kept), false, true));
    state_.factors[slot] = std::move(stored);
  }

  Tensor predict(Role role, size_t slot) const {
    if (role == Role::kSkip) return at::zeros(state_.shapes.at(slot), outputs_);
    const std::vector<Tensor>& factors = state_.factors.at(slot);
    const int64_t offset = state_.current_step - *state_.last_update_step;
    const at::ScalarType dtype = outputs_.dtype().toScalarType();
    Tensor out = at::zeros_like(factors[0], factors[0].options().dtype(dtype));
    double factorial = 1.0;
    for (size_t order = 0; order < factors.size(); ++order) {
      if (order > 0) factorial *= static_cast<double>(order);
      const double coeff = std::pow(static_cast<double>(offset), static_cast<double>(order)) / factorial;
      out = out + factors[order].to(dtype) * coeff;
    }
    return out;
  }

 private:
  const TaylorSeerCache& cache_;
  TransformerCallState::Impl::TaylorSeerState& state_;
  at::TensorOptions outputs_;  // the hooked modules' outputs: the compute dtype, the model's device
  std::map<std::string, std::pair<Role, size_t>> slots_;
  bool compute_ = true;
};

}  // namespace

Tensor SkyReelsV2Transformer::Impl::taylorseer_forward(const Layers& layers, Tensor x, const CallConditioning& cond,
                                                       const RopeTables& rope, const Geometry& g,
                                                       const TransformerForwardArgs& args,
                                                       TransformerCallState::Impl& state,
                                                       TransformerCallStats& stats) const {
  TaylorCall call(*args.taylorseer, config, state, at::TensorOptions().dtype(dtype).device(device));
  stats.predicted = !call.computes();
  const Tensor& modulation = cond.modulation;
  // Ulysses: each rank runs (or predicts) the hooked modules on its share of the tokens, and keeps its shares' Taylor
  // factors; whether a call computes depends on its index alone, so every rank decides the same.
  RankGroup* ranks = args.sequence_parallel != nullptr && args.sequence_parallel->size() > 1 ? args.sequence_parallel
                                                                                            : nullptr;
  const Geometry held = ranks ? split_across(g, *ranks) : g;
  const RopeTables held_rope = share_rope(rope, held);
  if (ranks) x = take_share(x, held);
  for (size_t l = 0; l < layers.blocks.size(); ++l) {
    const BlockWeights& b = ready(layers.blocks, l);  // gathered first when the weights are sharded
    const std::string name = "blocks." + std::to_string(l);
    const bool attention_runs = call.runs(name) && call.runs(name + ".attn1");
    (attention_runs ? stats.token_blocks_computed : stats.token_blocks_cached) += g.batch * g.tokens;
    x = call.module(name, [&] {
      // block_forward with the hooks of its attention and feed-forward modules.
      const Tensor e = b.scale_shift_table.view({1, 1, 6, g.dim}) + modulation;
      auto row = [&](int64_t i) { return e.select(2, i).unsqueeze(2); };
      Tensor attn = call.module(name + ".attn1", [&] {
        return self_attention(b.attn1, modulated_norm(x, row(1), row(0), held, config.eps, dtype), held_rope, held, 0,
                              nullptr, nullptr);
      });
      Tensor h = gated_residual(x, std::move(attn), row(2), held);
      h.add_(call.module(name + ".attn2", [&] {
        const Tensor n =
            config.cross_attn_norm ? layer_norm_fp32(h, config.eps, b.norm2_weight, b.norm2_bias).to(dtype) : h;
        return cross_attention(b, n, cond.context);
      }));
      Tensor ff = call.module(
          name + ".ffn", [&] { return feed_forward(b, modulated_norm(h, row(4), row(3), held, config.eps, dtype)); });
      return gated_residual(h, std::move(ff), row(5), held);
    });
    if (args.after_block) args.after_block();
  }
  Tensor out = call.module("proj_out", [&] {
    const Tensor e = head_table.view({1, 1, 2, g.dim}) + cond.temb.unsqueeze(2);
    return layers.proj_out(
        modulated_norm(x, e.select(2, 1).unsqueeze(2), e.select(2, 0).unsqueeze(2), held, config.eps, dtype));
  });
  call.finish();
  if (ranks) out = gather_shares(out, held);  // every token's output, on every rank
  return unpatchify(out, g);
}

}  // namespace skyreels::model
