// The SkyReels-V2 transformer as the diffusion-forcing loop's Denoiser: the per-request DenoiseCache (kept keys /
// values of the running chunk and the step cache's state per guidance context), the exact savings' plan of each call
// (frames not started left out, final blocks' keys / values kept), the step cache's decisions and their JSON log, and
// run_chunk / generate with the model. Separate from the loop because the loop runs any Denoiser (tests and traces
// run it without a transformer); everything that knows the transformer's call state is here.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/rank_group.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

class DenoiseCache {
 public:
  // Starts chunk `chunk` of `frames` latent frames: kept keys / values never cross chunks; the step cache's state
  // does only with scope request.
  void begin(int64_t chunk, const GenerationParams& p) {
    if (chunk == chunk_) return;
    const bool keep_step_cache = p.cache.scope == StepCacheScope::kRequest && chunk_ >= 0;
    for (Context& c : contexts_) {
      if (keep_step_cache) {
        c.state.reset_kv();
      } else {
        c.state.reset();
        c.source.reset();
        c.block_sources.clear();
      }
    }
    chunk_ = chunk;
  }
  struct Context {
    TransformerCallState state;
    std::optional<std::pair<int64_t, int64_t>> source;  // the last computed call (FirstBlockCache)
    std::map<int64_t, std::pair<int64_t, int64_t>> block_sources;  // per causal block: its last computed call
  };
  Context& context(bool unconditional) { return contexts_[unconditional ? 1 : 0]; }

 private:
  int64_t chunk_ = -1;
  Context contexts_[2];
};

std::shared_ptr<DenoiseCache> make_denoise_cache() { return std::make_shared<DenoiseCache>(); }

namespace {

nlohmann::json step_cache_decision_json(const TransformerCallReport& c) {
  const char* decision = c.skipped ? "skipped" : c.predicted ? "predicted" : "computed";
  nlohmann::json entry = {
      {"chunk", c.chunk}, {"step", c.row}, {"context", c.unconditional ? "uncond" : "cond"}, {"decision", decision}};
  if (c.cache_kind == StepCacheKind::kMagCache) {
    entry["accumulated_err"] = c.accumulated_err ? nlohmann::json(*c.accumulated_err) : nlohmann::json();
    if (c.calibration_ratio) entry["calibration_ratio"] = *c.calibration_ratio;
  }
  return entry;
}

}  // namespace

std::string step_cache_decisions_json(const std::vector<TransformerCallReport>& calls) {
  nlohmann::json out = nlohmann::json::array();
  for (const TransformerCallReport& c : calls) {
    if (!c.step_cache) continue;
    if (c.cache_kind == StepCacheKind::kTaylorSeer || c.cache_kind == StepCacheKind::kMagCache) {
      out.push_back(step_cache_decision_json(c));  // the step_caches fixtures' format
      continue;
    }
    auto pair_json = [](const std::optional<std::pair<int64_t, int64_t>>& p) {
      return p ? nlohmann::json::array({p->first, p->second}) : nlohmann::json();
    };
    nlohmann::json entry = {{"chunk", c.chunk},
                            {"row", c.row},
                            {"context", c.unconditional ? "uncond" : "cond"},
                            {"rel", c.rel ? nlohmann::json(*c.rel) : nlohmann::json()},
                            {"skipped", c.skipped},
                            {"source", pair_json(c.source)}};
    if (!c.blocks.empty()) {
      nlohmann::json blocks = nlohmann::json::array();
      for (const auto& b : c.blocks) {
        blocks.push_back({{"block", b.block},
                          {"updated", b.updated},
                          {"rel", b.rel ? nlohmann::json(*b.rel) : nlohmann::json()},
                          {"skipped", b.skipped},
                          {"reused", b.reused},
                          {"source", pair_json(b.source)}});
      }
      entry["blocks"] = std::move(blocks);
    }
    out.push_back(std::move(entry));
  }
  return out.dump(1) + "\n";
}

namespace {

// Frames of a call the exact savings leave out: [end, F) have not started (nothing before them attends to them
// under the block-causal mask), [0, keep) are final whole blocks whose keys / values are kept (within the memory
// budget), of which [0, reuse) are already kept.
int64_t tokens_per_frame(const at::Tensor& latents, const TransformerConfig& config) {
  return (latents.size(3) / config.patch_size[1]) * (latents.size(4) / config.patch_size[2]);
}

struct CallSavings {
  int64_t end = 0, keep = 0, reuse = 0;
};

CallSavings plan_call_savings(const DenoiseCall& call, const GenerationParams& p, const TransformerConfig& config,
                              int64_t element_bytes, const TransformerCallState& state) {
  const int64_t frames = call.latent_model_input.size(2), block = call.num_frame_per_block;
  CallSavings s{frames, 0, 0};
  // TaylorSeer and MagCache keep per-token state of whole calls (diffusers' hooks): every frame of every row runs.
  if (p.cache.kind == StepCacheKind::kTaylorSeer || p.cache.kind == StepCacheKind::kMagCache) return s;
  const bool first_block = p.cache.kind == StepCacheKind::kFirstBlock;
  if (!p.exact_savings || block <= 1 || config.patch_size[0] != 1 || frames % block != 0 ||
      call.updated.size() != static_cast<size_t>(frames)) {
    return s;
  }
  auto whole_blocks = [&](int64_t n) { return n / block * block; };
  const bool per_block = p.cache.kind == StepCacheKind::kFirstBlockPerBlock;
  if (!first_block) {  // FirstBlockCache compares block 0 over every frame and reuses residuals of any frame
    int64_t last = -1;
    for (int64_t f = 0; f < frames; ++f) {
      if (call.updated[static_cast<size_t>(f)]) last = f;
    }
    s.end = last < 0 ? 0 : whole_blocks(last + block);
  }
  // With scope request a later chunk may reuse any token's tail residual: every token is computed. The cache per
  // causal block keeps its own keys / values (of every block it computes), not the final frames'.
  if ((first_block && p.cache.scope == StepCacheScope::kRequest) || per_block) return s;
  int64_t settled = 0;
  while (settled < s.end && call.final_frames[static_cast<size_t>(settled)]) ++settled;
  const int64_t layers = config.num_layers - (first_block ? 1 : 0);
  const int64_t frame_bytes = 2 * layers * call.latent_model_input.size(0) *
                              tokens_per_frame(call.latent_model_input, config) * config.inner_dim() * element_bytes;
  const int64_t budget_frames = frame_bytes > 0 ? p.kv_cache_max_bytes / 2 / frame_bytes : 0;  // 2 contexts
  s.keep = whole_blocks(std::min({settled, budget_frames, s.end - block}));
  s.keep = std::max<int64_t>(s.keep, 0);
  s.reuse = std::min(s.keep, state.kept_frames());
  return s;
}

// The cache per causal block's view of a call computing its first `computed` frames: which blocks the row updates
// and which are final.
PerBlockCache per_block_cache_of(const DenoiseCall& call, const GenerationParams& params, int64_t computed) {
  const int64_t block = call.num_frame_per_block;
  if (block <= 1 || computed % block != 0 || call.first_frame % block != 0) {
    throw std::invalid_argument("cache first-block-per-block: needs causal_block_size > 1 (the block-causal mask); "
                                "this request has " + std::to_string(block));
  }
  PerBlockCache c;
  c.threshold = params.cache.threshold;
  c.max_skips = params.cache.max_skips;
  c.first_block = call.first_frame / block;
  c.max_kv_bytes = params.kv_cache_max_bytes / 2;  // two guidance contexts
  for (int64_t f = 0; f < computed; f += block) {
    bool updated = false, final = true;
    for (int64_t i = f; i < f + block; ++i) {
      updated = updated || call.updated[static_cast<size_t>(i)] != 0;
      final = final && call.final_frames[static_cast<size_t>(i)] != 0;
    }
    c.updated_blocks.push_back(updated ? 1 : 0);
    c.final_blocks.push_back(final ? 1 : 0);
  }
  return c;
}

// TaylorSeer / MagCache of a DF request, as the transformer takes them: MagCache's ratios resampled to the steps (one
// row per step: ar_step 0, checked by plan_chunks); the settings checked against the model before the first row.
struct WholeCallCache {
  TaylorSeerCache taylorseer;
  MagCache magcache;
};

std::shared_ptr<const WholeCallCache> whole_call_cache(const SkyReelsV2Transformer& model, const GenerationParams& p) {
  auto c = std::make_shared<WholeCallCache>();
  c->taylorseer = p.cache.taylorseer;
  c->magcache = p.cache.magcache;
  if (p.cache.kind == StepCacheKind::kTaylorSeer) taylorseer_hooked_modules(c->taylorseer, model.config());
  if (p.cache.kind == StepCacheKind::kMagCache) {
    c->magcache.num_inference_steps = p.num_inference_steps;
    if (!c->magcache.calibrate) {
      if (c->magcache.mag_ratios.empty()) {
        throw std::invalid_argument("cache: magcache needs the model's magnitude ratios (the server's "
                                    "--magcache-ratios FILE, made by `skyreels calibrate-magcache`)");
      }
      c->magcache.mag_ratios = magcache_ratios_for_steps(c->magcache.mag_ratios, p.num_inference_steps);
    }
    check_magcache(c->magcache);
  }
  return c;
}

}  // namespace

Denoiser transformer_denoiser(const SkyReelsV2Transformer& model, const GenerationParams& params,
                              std::function<bool()> cancelled, std::function<void(const TransformerCallReport&)> on_call,
                              std::shared_ptr<DenoiseCache> cache, const RankGroups* ranks) {
  const int64_t fps_index = params.fps == 16 ? 0 : 1;  // diffusers: [0 if fps == 16 else 1] per batch item
  if (!cache) cache = make_denoise_cache();
  std::shared_ptr<const WholeCallCache> whole_call = whole_call_cache(model, params);
  return [&model, params, fps_index, cancelled = std::move(cancelled), on_call = std::move(on_call),
          cache = std::move(cache), whole_call = std::move(whole_call),
          sequence_ranks = ranks ? ranks->ulysses : nullptr,
          weight_ranks = ranks ? ranks->all : nullptr](const DenoiseCall& call) {
    const at::Tensor& input = call.latent_model_input;
    TransformerForwardArgs args;
    args.timestep = call.timestep;
    args.encoder_hidden_states = call.encoder_hidden_states;
    if (model.config().inject_sample_info) {
      args.fps = at::full({input.size(0)}, fps_index, at::TensorOptions().dtype(at::kLong).device(input.device()));
    }
    args.num_frame_per_block = call.num_frame_per_block;  // per request; the model config is never written
    args.adapters = params.adapters;
    args.sequence_parallel = sequence_ranks;
    args.weight_ranks = weight_ranks;
    if (cancelled) {
      args.after_block = [&cancelled, &call] {
        if (cancelled()) {
          throw GenerationCancelled("generation cancelled inside a forward (chunk " + std::to_string(call.chunk) +
                                    ", row " + std::to_string(call.row) + ")");
        }
      };
    }
    cache->begin(call.chunk, params);
    DenoiseCache::Context& context = cache->context(call.unconditional);
    const CallSavings savings =
        plan_call_savings(call, params, model.config(), at::elementSize(model.compute_dtype()), context.state);
    const bool first_block = params.cache.kind == StepCacheKind::kFirstBlock;
    const bool per_block_cache = params.cache.kind == StepCacheKind::kFirstBlockPerBlock;
    const int64_t frames = input.size(2);
    TransformerCallStats stats;
    at::Tensor prediction;
    if (savings.end == 0) {  // no frame of this row is updated: nothing to compute
      prediction = at::zeros_like(input);
    } else {
      args.hidden_states = savings.end == frames ? input : input.narrow(2, 0, savings.end);
      if (savings.end != frames) args.timestep = call.timestep.narrow(1, 0, savings.end);
      if (first_block || savings.keep > 0) args.state = &context.state;
      args.reuse_frames = savings.reuse;
      args.keep_frames = savings.keep;
      if (first_block) args.first_block_threshold = params.cache.threshold;
      if (params.cache.kind == StepCacheKind::kTaylorSeer) args.taylorseer = &whole_call->taylorseer;
      if (params.cache.kind == StepCacheKind::kMagCache) args.magcache = &whole_call->magcache;
      if (args.taylorseer || args.magcache) args.state = &context.state;
      PerBlockCache per_block;
      if (per_block_cache) {
        per_block = per_block_cache_of(call, params, args.hidden_states.size(2));
        args.state = &context.state;
        args.per_block_cache = &per_block;
      }
      args.stats = &stats;
      prediction = model.forward(args);
      if (prediction.size(2) != frames) {  // the frames left out are never read (their update mask is false)
        at::Tensor full = at::zeros_like(input, prediction.options());
        full.narrow(2, savings.reuse, prediction.size(2)).copy_(prediction);
        prediction = full;
      }
    }
    if (on_call) {
      TransformerCallReport report;
      report.chunk = call.chunk;
      report.row = call.row;
      report.unconditional = call.unconditional;
      report.token_blocks_full =
          input.size(0) * frames * tokens_per_frame(input, model.config()) * model.config().num_layers;
      report.token_blocks_computed = stats.token_blocks_computed;
      report.token_blocks_saved_cache = stats.token_blocks_cached;
      report.token_blocks_saved_exact =
          report.token_blocks_full - report.token_blocks_computed - report.token_blocks_saved_cache;
      report.step_cache = params.cache.kind != StepCacheKind::kNone;
      report.cache_kind = params.cache.kind;
      report.predicted = stats.predicted;
      report.accumulated_err = stats.magcache_err;
      report.calibration_ratio = stats.magcache_ratio;
      report.rel = stats.first_block_rel;
      report.skipped = stats.skipped;
      if (stats.skipped && first_block) report.source = context.source;
      for (const auto& b : stats.blocks) {
        TransformerCallReport::BlockDecision d{b.block, b.updated, b.rel, b.skipped, std::nullopt, b.reused};
        if (b.skipped) d.source = context.block_sources.at(b.block);
        report.blocks.push_back(d);
      }
      on_call(report);
    }
    if (first_block && !stats.skipped && savings.end > 0) context.source = std::make_pair(call.chunk, call.row);
    for (const auto& b : stats.blocks) {
      if (!b.skipped && !b.reused) context.block_sources[b.block] = std::make_pair(call.chunk, call.row);
    }
    return prediction;
  };
}

DenoiserInfo denoiser_info(const SkyReelsV2Transformer& model) {
  DenoiserInfo info;
  info.device = model.device();
  info.dtype = model.compute_dtype();
  info.latent_channels = model.config().in_channels;
  info.num_frame_per_block = model.config().num_frame_per_block;
  return info;
}

at::Tensor run_chunk(const SkyReelsV2Transformer& model, const GenerationParams& params, const ChunkPlan& plan,
                     int64_t chunk_index, const Conditioning& conditioning, const at::Tensor& previous_latents,
                     NoiseSource& noise, const StepHooks& hooks, std::shared_ptr<DenoiseCache> cache,
                     const RankGroups* ranks) {
  if (!cache && chunk_index > 0 && params.cache.kind != StepCacheKind::kNone &&
      params.cache.scope == StepCacheScope::kRequest) {
    throw std::invalid_argument("cache_scope: request keeps the step cache from chunk to chunk, so chunk " +
                                std::to_string(chunk_index) +
                                " needs the request's DenoiseCache (every chunk in one loop); use cache_scope chunk");
  }
  DenoiserInfo info = denoiser_info(model);
  if (ranks) info.guidance_ranks = ranks->cfg;
  return run_chunk(transformer_denoiser(model, params, hooks.cancelled, hooks.on_call, std::move(cache), ranks),
                   info, params, plan, chunk_index, conditioning, previous_latents, noise, hooks);
}

at::Tensor generate(const SkyReelsV2Transformer& model, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks,
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk, const RankGroups* ranks) {
  DenoiserInfo info = denoiser_info(model);
  if (ranks) info.guidance_ranks = ranks->cfg;
  return generate(transformer_denoiser(model, params, hooks.cancelled, hooks.on_call, nullptr, ranks),
                  info, params, conditioning, noise, hooks, on_chunk);
}

}  // namespace skyreels::model
