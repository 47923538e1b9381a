// SkyReelsV2Transformer3DModel (Wan 2.1 DiT with per-frame timesteps, fps embedding and a block-causal mask), as
// diffusers implements it. One model holding its own layers: transformer_skyreels_v2.cpp (construction) and the
// files beside it (config, attention kernels, forward, cache per causal block; internal headers transformer_impl.h and
// transformer_layers.h).
//
// Internal parameter names are diffusers' names. Checkpoint layouts (original SkyReels/Wan, PR #11850's
// norm_out.linear, sharded) are mapped onto them by the loader (transformer_loader.h), never here.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/active_adapter.h"
#include "model/checkpoint.h"
#include "model/step_caches.h"
#include "model/transformer_config.h"

namespace skyreels::model {

class RankGroup;

// Every parameter the model owns, with its shape and whether it is an fp32 island
// (diffusers' _keep_in_fp32_modules: time_embedder, scale_shift_table, norm1/2/3, which includes the image
// embedder's norm1 / norm2).
std::vector<checkpoint::ParamSpec> transformer_parameter_specs(const TransformerConfig& config);

// The linear layers (module names, e.g. "blocks.0.attn1.to_q") that adapters per call may change: every linear layer of
// the model except the patch embedding (a convolution).
std::vector<std::string> transformer_linear_modules(const TransformerConfig& config);

// What a denoising loop keeps between the transformer calls of one guidance context (cond / uncond) of one chunk:
// the keys and values of the frames that are final (exact savings) and diffusers' FirstBlockCache state. Opaque and
// move-only; empty until a call fills it. Never shared between contexts, chunks or threads.
class TransformerCallState {
 public:
  TransformerCallState();
  ~TransformerCallState();
  TransformerCallState(TransformerCallState&&) noexcept;
  TransformerCallState& operator=(TransformerCallState&&) noexcept;

  void reset();                        // everything (a new chunk)
  void reset_kv();                     // the kept keys/values only (FirstBlockCache state stays)
  int64_t kept_frames() const;         // leading frames whose keys/values every layer keeps
  int64_t kept_bytes() const;          // memory the kept keys/values take

  struct Impl;  // defined in transformer_skyreels_v2.cpp only
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// What one call did (filled when TransformerForwardArgs::stats is set). A token-block is one token through one
// transformer block: the unit of the work saved.
struct TransformerCallStats {
  int64_t token_blocks_full = 0;      // the whole call without savings: frames x tokens per frame x layers
  int64_t token_blocks_computed = 0;  // what ran
  int64_t token_blocks_cached = 0;    // not run because a step cache skipped or predicted them (TaylorSeer: the
                                      // blocks whose self-attention did not run)
  std::optional<double> first_block_rel;  // FirstBlockCache: rel of this call (unset on a context's first call)
  bool skipped = false;                   // FirstBlockCache reused the tail residual
  // The cache per causal block: one decision per block of the call, in order.
  struct BlockDecision {
    int64_t block = 0;          // PerBlockCache::first_block + its index in the call
    bool updated = false;       // eligible: the row updates it
    std::optional<double> rel;  // unset when the block has no computed state yet
    bool skipped = false;
    bool reused = false;        // final and unchanged: its kept keys / values stand in exactly (not a skip)
  };
  std::vector<BlockDecision> blocks;
  // TaylorSeer: this call predicted its hooked modules (computed otherwise). MagCache: `skipped` above; the
  // accumulated error it compared with the threshold (unset before the retention step and when calibrating) and,
  // calibrating, the call's magnitude ratio.
  bool predicted = false;
  std::optional<double> magcache_err;
  std::optional<double> magcache_ratio;
};

// The step cache per causal block (beyond diffusers): block 0 runs on every frame; each causal block compares its
// own block-0 residual with the one of its own last computed call (rel as FirstBlockCache's, over the block's
// tokens). A block the row updates, with a computed state, rel <= threshold and fewer than max_skips skips in a row
// skips blocks 1..L-1: its output is block 0's plus its own last tail residual, and the computed blocks after it
// attend to the keys / values it had then (kept before RoPE, so they follow it when the call's window moves).
// Blocks the row does not update are computed, except the leading run of final blocks (final_blocks, from the
// call's first block on) whose state was computed while they were final in a call with the same first block: their
// kept keys / values are exactly what computing them would give, so they stand in for them (exact savings within
// the cache). Needs the block-causal mask and per-frame timesteps.
struct PerBlockCache {
  double threshold = 0.0;
  int64_t max_skips = 1;
  int64_t first_block = 0;              // the call's first causal block, counted from the chunk's frame 0
  std::vector<uint8_t> updated_blocks;  // per causal block of the call
  std::vector<uint8_t> final_blocks;    // per causal block of the call: every frame final (DenoiseCall::final_frames)
  int64_t max_kv_bytes = 0;             // kept keys / values of this state; blocks beyond it are always computed
};

// The modules a TaylorSeer config hooks on a model of `config`, in diffusers' named_modules() order, each
// with "cache" or "skip". Throws std::invalid_argument naming the field (taylorseer_cache_modules,
// taylorseer_skip_modules, taylorseer_*) for bad values, a pattern that matches an unsupported module, nested hooks,
// or no module at all (diffusers' default patterns hook nothing on this model and would equal the uncached run).
std::vector<std::pair<std::string, std::string>> taylorseer_hooked_modules(const TaylorSeerCache& cache,
                                                                           const TransformerConfig& config);

// MagCache's settings in range (magcache_threshold, magcache_max_skip_steps, magcache_retention_ratio; ratios of
// num_inference_steps entries unless calibrating); std::invalid_argument naming the field.
void check_magcache(const MagCache& cache);

// diffusers' nearest_interp: `ratios` resampled to `steps` entries (round half to even of i * (n-1)/(steps-1) in fp32).
std::vector<float> magcache_ratios_for_steps(const std::vector<float>& ratios, int64_t steps);

struct TransformerForwardArgs {
  at::Tensor hidden_states;          // [B, in_channels, F, H, W], any float dtype (cast to the compute dtype)
  at::Tensor timestep;               // int64 [B] or [B, F] (diffusion forcing)
  at::Tensor encoder_hidden_states;  // [B, T, text_dim], zero-padded text rows
  // I2V models only (required there, refused elsewhere): image tokens [B, N, image_dim], CLIP's penultimate hidden
  // states; first-last-frame models take both images' tokens, N = pos_embed_seq_len (diffusers' [2B, n, d] viewed
  // as [B, 2n, d]). Kept apart from the text rows: diffusers concatenates them in front of the text and splits them
  // off again at `total - 512`, which is wrong for any other text length; here the split is never needed.
  at::Tensor encoder_hidden_states_image;
  std::optional<at::Tensor> fps;    // int64 [B] with values in {0, 1}; required iff inject_sample_info (a model
                                    // without the fps embedding ignores it, as diffusers does)
  int64_t num_frame_per_block = 1;  // > 1 turns on the block-causal self-attention mask (F must be a multiple)
  // Called after every transformer block; it may throw to abandon the forward (cancellation, deadlines, shutdown
  // act within one block instead of one whole forward).
  std::function<void()> after_block;

  // Exact savings (diffusion-forcing timesteps [B, F], block-causal mask, patch_size[0] == 1; model/README in
  // diffusion_forcing.h): frames [0, reuse_frames) take their keys and values from `state` (kept there by earlier
  // calls of the same context and window while those frames were final) and are not computed; frames
  // [0, keep_frames) are final from this call on, so every layer keeps their keys and values in `state`. Both are
  // whole causal blocks. With reuse_frames > 0 the returned sample holds frames [reuse_frames, F) only.
  TransformerCallState* state = nullptr;
  int64_t reuse_frames = 0;
  int64_t keep_frames = 0;
  // diffusers' FirstBlockCache (needs `state`, the cache context): block 0 runs on every frame; when
  // mean|r - r_prev| / mean|r_prev| <= threshold (r = block 0's output residual, r_prev the one of the last computed
  // call of this state) blocks 1..L-1 are skipped and the last computed call's tail residual is added instead.
  std::optional<double> first_block_threshold;
  // The cache per causal block (needs `state`; excludes reuse/keep and first_block_threshold).
  const PerBlockCache* per_block_cache = nullptr;
  // diffusers' TaylorSeer / MagCache (each needs `state`, the cache context; they exclude each other and every
  // other saving above).
  const TaylorSeerCache* taylorseer = nullptr;
  const MagCache* magcache = nullptr;
  TransformerCallStats* stats = nullptr;
  // Adapters of this call only, in order (their terms add up); empty: the weights alone, the path of no adapters.
  // Checked before anything runs (std::invalid_argument naming the adapter, its key and the layer).
  std::vector<ActiveAdapter> adapters;
  // Ulysses (model/rank_group.h; size() > 1): the ranks this call's tokens are split across. Every rank of the group
  // makes the same call; each computes its share of the tokens through every block (all-to-all over heads around
  // self-attention) and every rank returns the whole sample. Composes with the exact savings and FirstBlockCache;
  // with the cache per causal block every rank computes every token (the same sample, no speed-up yet).
  RankGroup* sequence_parallel = nullptr;
  // A model whose blocks are sharded (shard_blocks): every rank of its replica, in the order of their shards; each
  // block's weights are gathered from them just before it runs. Required then, ignored otherwise.
  RankGroup* weight_ranks = nullptr;
};

class SkyReelsV2Transformer {
 public:
  // Takes ownership of exactly the tensors named by transformer_parameter_specs(config), already on `device` in
  // the right dtypes (checkpoint::place_strict does that). Throws std::invalid_argument on any mismatch.
  SkyReelsV2Transformer(TransformerConfig config, checkpoint::StateDict weights, c10::Device device,
                        at::ScalarType compute_dtype);
  ~SkyReelsV2Transformer();
  SkyReelsV2Transformer(const SkyReelsV2Transformer&) = delete;
  SkyReelsV2Transformer& operator=(const SkyReelsV2Transformer&) = delete;

  // Returns `sample` [B, out_channels, F, H, W] in the compute dtype. Thread-compatible: concurrent calls on one
  // instance are allowed (no mutable state; a call's adapters live in the call). Throws std::invalid_argument on bad
  // shapes, a missing fps, or frames not divisible by num_frame_per_block.
  at::Tensor forward(const TransformerForwardArgs& args) const;

  // --shard-weights: keeps only slice `rank` of `ranks` of every transformer block's parameters (the embeddings, the
  // head and the rest stay whole) and gathers a block's whole weights from the replica's ranks
  // (TransformerForwardArgs::weight_ranks) into one of two block-sized buffers just before it runs. Every rank of
  // the replica shards its own instance the same way. The numbers are unchanged; from then on the model serves one
  // call at a time. Throws std::invalid_argument on a bad rank or a second call.
  void shard_blocks(int64_t rank, int64_t ranks);
  // Bytes of every parameter this instance holds on its device (shards and the two block buffers included).
  int64_t held_weight_bytes() const;

  const TransformerConfig& config() const;
  c10::Device device() const;
  at::ScalarType compute_dtype() const;
  // Every parameter and buffer (RoPE tables included), for device and dtype checks.
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;

  // The RoPE tables of one call on a post-patch grid of ppf x pph x ppw tokens: (cos, sin), each [1, L, 1, head_dim]
  // float32, exactly diffusers' `rope(hidden_states)` (positions start at 0). Throws std::invalid_argument past
  // rope_max_seq_len.
  std::pair<at::Tensor, at::Tensor> rope_tables(int64_t ppf, int64_t pph, int64_t ppw) const;

 private:
  struct Impl;
  Impl* impl_;
};

// Building blocks of the forward pass, exposed for unit tests and benchmarks.
namespace transformer_detail {

// Head-dim split of the 3-D RoPE: h = w = 2 * (head_dim / 6), t = head_dim - h - w (44/42/42 for 128).
struct RopeSplit {
  int64_t t = 0, h = 0, w = 0;
};
RopeSplit rope_split(int64_t head_dim);

// diffusers' SkyReelsV2Timesteps: float64 [cos(t*w_i) | sin(t*w_i)], w_i = 10000^(-i/(dim/2)); shape [..., dim].
at::Tensor timestep_sinusoid(const at::Tensor& timestep, int64_t dim);

// softmax(q k^T / sqrt(Dh)) v for q [B, Nh, Lq, Dh], k/v [B, Nh, Lk, Dh] in the compute dtype. Returns
// [B, Lq, Nh, Dh] (contiguous, ready to flatten heads). causal_block_tokens > 0 applies the block-causal mask of
// spec section 3.7 (Lk == query_offset + Lq; query block b sees keys of blocks 0..b) by attending each query block
// to its key prefix, never building an L x L mask; query_offset > 0 (whole blocks) makes the queries the last Lq of
// the Lk tokens (exact savings: the first keys are kept ones). Without SDPA (LibTorch 1.x) it runs per head, over
// chunks of query rows whose [rows, Lk] score matrix stays under max_score_bytes.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t causal_block_tokens = 0,
                     int64_t max_score_bytes = int64_t{16} << 20, int64_t query_offset = 0);

}  // namespace transformer_detail

}  // namespace skyreels::model
