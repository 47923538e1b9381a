// diffusers' MagCache step cache (hooks/mag_cache.py) on the SkyReels-V2 transformer
// (TransformerForwardArgs::magcache): the decision of a call from the magnitude ratios, the block stack computed or
// replaced by its input plus the last computed residual, and calibration (the ratios of a run). Separate from the
// forward because it is a path through the layers only this cache takes.
#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/rank_group.h"
#include "model/transformer_impl.h"

namespace skyreels::model {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

}  // namespace

void check_magcache(const MagCache& c) {
  require(std::isfinite(c.threshold) && c.threshold >= 0 && c.threshold <= 100,
          "magcache_threshold: must be a finite value within [0, 100]");
  require(c.max_skip_steps >= 1 && c.max_skip_steps <= 1000,
          "magcache_max_skip_steps: " + std::to_string(c.max_skip_steps) + " must be within [1, 1000]");
  require(std::isfinite(c.retention_ratio) && c.retention_ratio >= 0 && c.retention_ratio <= 1,
          "magcache_retention_ratio: must be within [0, 1]");
  require(c.num_inference_steps >= 1, "magcache: num_inference_steps must be >= 1");
  require(c.calibrate || static_cast<int64_t>(c.mag_ratios.size()) == c.num_inference_steps,
          "magcache_ratios: " + std::to_string(c.mag_ratios.size()) + " ratios for " +
              std::to_string(c.num_inference_steps) + " steps (resample them with magcache_ratios_for_steps)");
}

namespace {

using MagState = TransformerCallState::Impl::MagCacheState;

// diffusers' MagCacheHeadHook: true when this call skips the block stack. `err` gets the accumulated error it
// compared (unset before the retention step).
bool decide_skip(const MagCache& c, MagState& s, std::optional<double>& err) {
  if (c.calibrate) return false;
  const int64_t step = s.step_index;
  const float scale = step < static_cast<int64_t>(c.mag_ratios.size()) ? c.mag_ratios[static_cast<size_t>(step)] : 1.0F;
  const auto retention = static_cast<int64_t>(c.retention_ratio * static_cast<double>(c.num_inference_steps) + 0.5);
  if (step < retention) return false;
  s.accumulated_ratio *= scale;
  s.accumulated_steps += 1;
  s.accumulated_err += std::fabs(1.0F - s.accumulated_ratio);
  err = s.accumulated_err;
  if (s.previous_residual.defined() && s.accumulated_err <= static_cast<float>(c.threshold) &&
      s.accumulated_steps <= c.max_skip_steps) {
    return true;
  }
  s.accumulated_ratio = 1.0F;
  s.accumulated_steps = 0;
  s.accumulated_err = 0.0F;
  return false;
}

// diffusers' MagCacheBlockHook._advance_step: after num_inference_steps calls the state starts over.
void advance(const MagCache& c, MagState& s) {
  s.step_index += 1;
  if (s.step_index >= c.num_inference_steps) s = MagState();
}

// Calibration: mean over the tokens of |r| / (|r_prev| + 1e-8) (2-norms over the features, fp32); 1.0 without r_prev.
double calibration_ratio(const Tensor& residual, const Tensor& previous) {
  if (!previous.defined()) return 1.0;
  const std::vector<int64_t> features{-1};
  const Tensor current = at::linalg_vector_norm(residual.to(at::kFloat), 2, at::IntArrayRef(features));
  const Tensor prev = at::linalg_vector_norm(previous.to(at::kFloat), 2, at::IntArrayRef(features));
  return (current / (prev + 1e-8)).mean().item<double>();
}

}  // namespace

std::vector<float> magcache_ratios_for_steps(const std::vector<float>& ratios, int64_t steps) {
  require(!ratios.empty() && steps >= 1, "magcache_ratios: need at least one ratio and one step");
  if (static_cast<int64_t>(ratios.size()) == steps) return ratios;
  if (steps == 1) return {ratios.back()};
  // nearest_interp: round(float32(i) * float32((n - 1) / (steps - 1))), halves to even.
  const auto scale = static_cast<float>(static_cast<double>(ratios.size() - 1) / static_cast<double>(steps - 1));
  std::vector<float> out;
  for (int64_t i = 0; i < steps; ++i) {
    const auto index = static_cast<size_t>(std::nearbyint(static_cast<float>(i) * scale));
    out.push_back(ratios[index]);
  }
  return out;
}

Tensor SkyReelsV2Transformer::Impl::magcache_forward(const Layers& layers, Tensor x, const CallConditioning& cond,
                                                     const RopeTables& rope, const Geometry& g,
                                                     const TransformerForwardArgs& args,
                                                     TransformerCallState::Impl& state,
                                                     TransformerCallStats& stats) const {
  const MagCache& c = *args.magcache;
  check_magcache(c);
  MagState& s = state.mag;
  const int64_t all_blocks = g.batch * g.tokens * static_cast<int64_t>(layers.blocks.size());
  // Ulysses: each rank runs the block stack on its share of the tokens and keeps its share of the residual; the
  // decision comes from the ratios alone, so every rank makes the same one.
  RankGroup* ranks = args.sequence_parallel != nullptr && args.sequence_parallel->size() > 1 ? args.sequence_parallel
                                                                                            : nullptr;
  const Geometry held = ranks ? split_across(g, *ranks) : g;
  if (ranks) x = take_share(x, held);
  if (decide_skip(c, s, stats.magcache_err)) {
    require(s.previous_residual.sizes() == x.sizes(),
            "magcache: this call has " + std::to_string(x.size(1)) + " tokens, the context's last computed call had " +
                std::to_string(s.previous_residual.size(1)) + " (cache state kept across calls of different shapes)");
    stats.skipped = true;
    stats.token_blocks_cached = all_blocks;
    x = x + s.previous_residual;
  } else {
    const Tensor block_in = x;  // block_forward never writes its input in place
    const RopeTables held_rope = share_rope(rope, held);
    for (size_t l = 0; l < layers.blocks.size(); ++l) {
      x = block_forward(ready(layers.blocks, l), std::move(x), cond.context, cond.modulation, held_rope, held, 0);
      if (args.after_block) args.after_block();
    }
    stats.token_blocks_computed = all_blocks;
    Tensor residual = x - block_in;
    if (c.calibrate) {  // over every token: the shares gathered
      stats.magcache_ratio =
          ranks ? calibration_ratio(gather_shares(residual, held),
                                    s.previous_residual.defined() ? gather_shares(s.previous_residual, held) : Tensor())
                : calibration_ratio(residual, s.previous_residual);
    }
    s.previous_residual = std::move(residual);
  }
  advance(c, s);
  if (ranks) x = gather_shares(x, held);  // the head runs on every token, on every rank
  return head(layers.proj_out, x, cond.temb, g);
}

}  // namespace skyreels::model
