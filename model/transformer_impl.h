// Internal to the SkyReels-V2 transformer (transformer_skyreels_v2.cpp, transformer_forward.cpp,
// transformer_block_cache.cpp): the state of the model (SkyReelsV2Transformer::Impl) and of a call context
// (TransformerCallState::Impl), the token geometry of a call, and the elementwise helpers of the forward (norms,
// modulation, gated residuals, RoPE). Separate so that construction, the forward and the cache per causal block can
// live in files of their own and still share one definition of each. Not a public header: only the transformer's
// files include it; it names its types unqualified in skyreels::model for them.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/rank_group.h"
#include "model/transformer_layers.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

// ---- the model ------------------------------------------------------------------------------------------------
// Dtype rules (spec 3.4-3.9): linears, attention, the text/fps paths and the cross-attention residual run in the
// compute dtype; the time embedder, every modulation sum, the LayerNorms and the gated residual adds run in fp32.

namespace transformer_impl {

// Token geometry of one call. Modulation tensors are per frame ([B, Fm, 1, D], Fm = F in diffusion forcing, else 1)
// and broadcast over the S = pph * ppw tokens of each frame through the [B, F, S, D] view of the tokens.
struct Geometry {
  int64_t batch = 0, frames = 0, height = 0, width = 0;  // input latent shape
  int64_t ppf = 0, pph = 0, ppw = 0;                     // post-patch grid
  int64_t tokens_per_frame = 0, tokens = 0, dim = 0;
  // Ulysses: the ranks the tokens are split across (null: every token is here). Each holds local_tokens of the
  // tokens padded to a multiple of their count, from local_begin on; the padding rows past `tokens` are computed
  // and never read.
  RankGroup* ranks = nullptr;
  int64_t local_begin = 0, local_tokens = 0;
  int64_t held_tokens() const { return ranks ? local_tokens : tokens; }
  std::vector<int64_t> flat() const { return {batch, held_tokens(), dim}; }
};

// The tokens a geometry holds as runs that are whole frames or a part of one frame: rows [offset, offset + frames *
// per_frame) of the held tokens, viewed [B, frames, per_frame, D], take the per-frame modulation rows [frame, frame +
// frames). All held tokens are one run of every frame when the call is not split.
struct FrameRun {
  int64_t offset = 0, frame = 0, frames = 0, per_frame = 0;
};
inline std::vector<FrameRun> frame_runs(const Geometry& g) {
  const int64_t s = g.tokens_per_frame, begin = g.ranks ? g.local_begin : 0;
  const int64_t end = g.ranks ? std::min(g.local_begin + g.local_tokens, g.tokens) : g.tokens;
  std::vector<FrameRun> runs;
  for (int64_t t = begin; t < end;) {
    const int64_t frame = t / s, into = t % s;
    if (into == 0 && end - t >= s) {
      const int64_t whole = (end - t) / s;
      runs.push_back({t - begin, frame, whole, s});
      t += whole * s;
    } else {
      const int64_t n = std::min(s - into, end - t);
      runs.push_back({t - begin, frame, 1, n});
      t += n;
    }
  }
  return runs;
}
// x [B, held tokens, D] -> the run's [B, frames, per_frame, D] (a view).
inline Tensor run_view(const Tensor& x, const FrameRun& r) {
  return x.narrow(1, r.offset, r.frames * r.per_frame).view({x.size(0), r.frames, r.per_frame, x.size(2)});
}
// Per-frame modulation [B, Fm, 1, D] -> the run's frames (all of them when Fm = 1: one row for every frame).
inline Tensor run_rows(const Tensor& m, const FrameRun& r) {
  return m.size(1) == 1 ? m : m.narrow(1, r.frame, r.frames);
}

// What every block's cross-attention attends to: the projected text rows and, in I2V models, the embedded image
// tokens (undefined otherwise), each attended on its own and the two outputs added.
struct CrossContext {
  Tensor text;   // [B, T, D]
  Tensor image;  // [B, N, D]
};

// A call's conditioning: the timestep embedding [B, Fm, D] in the compute dtype (the head's modulation), every
// block's modulation [B, Fm, 6, D] in fp32 and the cross-attention context. Fm = F for per-frame timesteps [B, F]
// (diffusion forcing), else 1.
struct CallConditioning {
  Tensor temb, modulation;
  int64_t fm = 1;
  CrossContext context;
};

// LayerNorm over the last dim computed in fp32 (diffusers' FP32LayerNorm); returns fp32.
inline Tensor layer_norm_fp32(const Tensor& x, double eps, const Tensor& weight = {}, const Tensor& bias = {}) {
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight, bias, eps);
}

// CPU performance notes for the elementwise helpers below:
// - mixed-dtype ops (bf16 with fp32) take a scalar casting path in LibTorch 1.13, 10-20x slower than converting
//   first, so they convert explicitly (same numbers: the mixed op upcasts the same way);
// - every fresh large tensor costs page faults, so helpers that consume a temporary (`x` passed by value, owned
//   by the caller's expression) work in place on it or on its fp32 copy.

// torch.nn.RMSNorm over the whole projection (all heads at once): fp32 statistics and weight multiply, one rounding.
// Consumes x.
inline Tensor rms_norm_across_heads(Tensor x, const Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  Tensor xf = x.to(at::kFloat);  // x itself in fp32
  const Tensor inv = at::rsqrt(xf.pow(2).mean(-1, true).add_(eps));
  xf.mul_(inv).mul_(weight.to(at::kFloat));
  return xf.to(dtype);
}

// diffusers' own RMSNorm class (attention's norm_added_k): fp32 statistics, the normalised value rounded to the
// weight's dtype when that is half precision, then multiplied by the weight in it (torch.nn.RMSNorm above multiplies
// in fp32 and rounds once; the same numbers in fp32).
inline Tensor rms_norm_diffusers(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor xf = x.to(at::kFloat);
  const Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true).add_(eps));
  if (weight.scalar_type() == at::kFloat) return (normed * weight).to(x.scalar_type());
  return normed.to(weight.scalar_type()) * weight;
}

// (LN(x) * (1 + scale) + shift) in fp32, rounded to `dtype`. x [B, L, D]; scale/shift [B, Fm, 1, D] fp32.
inline Tensor modulated_norm(const Tensor& x, const Tensor& scale, const Tensor& shift, const Geometry& g, double eps,
                             at::ScalarType dtype) {
  Tensor n = layer_norm_fp32(x, eps);
  for (const FrameRun& r : frame_runs(g)) run_view(n, r).mul_(1 + run_rows(scale, r)).add_(run_rows(shift, r));
  return n.to(dtype);
}

// (x.float() + y * gate) rounded to x's dtype: the fp32 residual of self-attention and the FFN. Consumes y.
inline Tensor gated_residual(const Tensor& x, Tensor y, const Tensor& gate, const Geometry& g) {
  Tensor sum = y.to(at::kFloat);  // y itself in fp32
  const Tensor xf = x.to(at::kFloat);
  for (const FrameRun& r : frame_runs(g)) run_view(sum, r).mul_(run_rows(gate, r)).add_(run_view(xf, r));
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
inline Tensor apply_rope(Tensor x, const RopeTables& rope, int64_t heads) {
  const int64_t b = x.size(0), l = x.size(1), dh = x.size(2) / heads;
  const at::ScalarType dtype = x.scalar_type();
  Tensor xf = x.to(at::kFloat).view({b, l, heads, dh});  // x itself in fp32
  const Tensor pairs = xf.view({b, l, heads, dh / 2, 2});
  Tensor swapped = at::stack({pairs.select(-1, 1), pairs.select(-1, 0)}, -1).view({b, l, heads, dh});
  xf.mul_(rope.cos).add_(swapped.mul_(rope.signed_sin));
  return xf.to(dtype).view({b, l, heads * dh});
}

// [B, L, D] -> [B, Nh, L, Dh] (a view).
inline Tensor split_heads(const Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, x.size(2) / heads}).transpose(1, 2);
}

// The change both step caches decide on (diffusers' FBCHeadBlockHook): rel = mean|r - r_prev| / mean|r_prev| in the
// hidden states' dtype, still on the device.
inline Tensor relative_change(const Tensor& residual, const Tensor& previous) {
  return (residual - previous).abs().mean() / previous.abs().mean();
}

}  // namespace transformer_impl

using namespace transformer_impl;  // NOLINT: internal header, included by the transformer's files only

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
  // TaylorSeer (transformer_taylorseer.cpp): the call counter of this context, the last computed call, and per
  // hooked module (by its place in taylorseer_hooked_modules) its Taylor factors (order 0..) or, for a skipped module,
  // its last output's shape.
  struct TaylorSeerState {
    int64_t current_step = -1;
    std::optional<int64_t> last_update_step;
    std::map<size_t, std::vector<Tensor>> factors;
    std::map<size_t, std::vector<int64_t>> shapes;
  } taylor;
  // MagCache (transformer_magcache.cpp): diffusers' MagCacheState (the accumulators are fp32, as there).
  struct MagCacheState {
    Tensor previous_residual;
    float accumulated_ratio = 1.0F, accumulated_err = 0.0F;
    int64_t accumulated_steps = 0, step_index = 0;
  } mag;

  void reset_kv() {
    k.clear();
    v.clear();
    kept_frames = tokens_per_frame = batch = 0;
  }
};

namespace transformer_impl {

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
inline Geometry frames_from(const Geometry& g, int64_t first) {
  Geometry s = g;
  s.frames = g.frames - first;
  s.ppf = g.ppf - first;
  s.tokens = s.ppf * g.tokens_per_frame;
  s.ranks = nullptr;
  return s;
}

// g's tokens split across `ranks` (Ulysses): this rank's share of the tokens padded to a multiple of the ranks.
inline Geometry split_across(const Geometry& g, RankGroup& ranks) {
  Geometry s = g;
  s.ranks = &ranks;
  s.local_tokens = (g.tokens + ranks.size() - 1) / ranks.size();
  s.local_begin = ranks.rank() * s.local_tokens;
  return s;
}

// Full tokens [B, tokens, D] -> this rank's share (zero rows past the end).
inline Tensor take_share(const Tensor& x, const Geometry& share) {
  const int64_t n = std::clamp<int64_t>(share.tokens - share.local_begin, 0, share.local_tokens);
  if (n == share.local_tokens) return x.narrow(1, share.local_begin, n).contiguous();
  Tensor out = at::zeros({x.size(0), share.local_tokens, x.size(2)}, x.options());
  if (n > 0) out.narrow(1, 0, n).copy_(x.narrow(1, share.local_begin, n));
  return out;
}

// Every rank's share [B, local, D] -> the full tokens [B, tokens, D], the same on every rank.
inline Tensor gather_shares(const Tensor& x, const Geometry& share) {
  const Tensor all = share.ranks->all_gather(x);  // [ranks, B, local, D]
  return all.permute({1, 0, 2, 3})
      .reshape({x.size(0), all.size(0) * share.local_tokens, x.size(2)})
      .narrow(1, 0, share.tokens)
      .contiguous();
}

// The RoPE rows of a share: a view of the call's tables, or a copy with zero rows for the padding.
inline RopeTables share_rope(const RopeTables& rope, const Geometry& share) {
  if (share.ranks == nullptr) return rope;
  auto rows = [&](const Tensor& t) {
    const int64_t n = std::clamp<int64_t>(share.tokens - share.local_begin, 0, share.local_tokens);
    if (n == share.local_tokens) return t.narrow(1, share.local_begin, n);
    Tensor out = at::zeros({t.size(0), share.local_tokens, t.size(2), t.size(3)}, t.options());
    if (n > 0) out.narrow(1, 0, n).copy_(t.narrow(1, share.local_begin, n));
    return out;
  };
  return RopeTables{rows(rope.cos), rows(rope.signed_sin)};
}

}  // namespace transformer_impl

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

  // Weights sharded across a replica's ranks (SkyReelsV2Transformer::shard_blocks): every block's tensors of one
  // dtype are one flat buffer of `numel` elements, of which this rank keeps `per_rank` (its slice of the buffer padded
  // to a multiple of the ranks). Block l's tensors are views of slot l % 2, filled by a gather just before it runs.
  // One call at a time: the slots are the model's state while a call runs.
  struct BlockShards {
    int64_t rank = 0, ranks = 1;
    struct Group {
      at::ScalarType dtype = at::kFloat;
      int64_t numel = 0, per_rank = 0;
      std::vector<Tensor> shards;  // per block: this rank's slice [per_rank]
      Tensor slots[2];             // [numel]
    };
    std::vector<Group> groups;
    int64_t filled[2] = {-1, -1};  // the block each slot holds
    RankGroup* gather = nullptr;    // the running call's group of every rank of the replica
    // The next block's gather, started while the current block computes (one per dtype group).
    int64_t prefetching = -1;
    std::vector<std::function<Tensor()>> prefetch;
    std::vector<std::function<Tensor()>> start_gather(size_t block);  // one gather per dtype group
    void finish_gather(std::vector<std::function<Tensor()>>& pending, size_t block);  // into the block's slot
  };
  mutable std::optional<BlockShards> shards;
  // blocks[l], gathered into its slot first when the weights are sharded (the gather of blocks[l + 1] then starts).
  const BlockWeights& ready(const std::vector<BlockWeights>& blocks, size_t l) const;
  // Ends a sharded call: a prefetch no block used is finished (every rank does the same), the slots stay valid.
  void end_gathers() const;

  const Tensor& w(const std::string& name) const { return weights.at(name); }
  Linear linear(const std::string& prefix) const { return {w(prefix + ".weight"), w(prefix + ".bias")}; }

  void check_weights() const;
  void bind_weights();
  void build_rope();

  Geometry check_inputs(const TransformerForwardArgs& args) const;
  CallConditioning condition(const Layers& l, const TransformerForwardArgs& args, const Geometry& g) const;
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
  // The blocks and the head under diffusers' TaylorSeer or MagCache (TransformerForwardArgs::taylorseer / magcache):
  // the call's sample. transformer_taylorseer.cpp, transformer_magcache.cpp.
  Tensor taylorseer_forward(const Layers& layers, Tensor x, const CallConditioning& cond, const RopeTables& rope,
                            const Geometry& g, const TransformerForwardArgs& args, TransformerCallState::Impl& state,
                            TransformerCallStats& stats) const;
  Tensor magcache_forward(const Layers& layers, Tensor x, const CallConditioning& cond, const RopeTables& rope,
                          const Geometry& g, const TransformerForwardArgs& args, TransformerCallState::Impl& state,
                          TransformerCallStats& stats) const;
  // The head's output [B, L, pt*ph*pw*C] back to the sample [B, C, F, H, W].
  Tensor unpatchify(const Tensor& out, const Geometry& g) const;
};

}  // namespace skyreels::model
