// SkyReels-V2 diffusion-forcing generation (diffusers' SkyReelsV2DiffusionForcingPipeline, output_type="latent"):
// timestep matrix, chunk plan for long videos, and a chunk-level entry point so a server can run chunk k on any
// device given chunk k-1's latents. Running the chunks one by one equals running the whole video.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/active_adapter.h"
#include "model/preview.h"
#include "model/sampler_flow_unipc.h"
#include "model/sampler_table.h"
#include "model/step_caches.h"
#include "model/video_shape.h"

namespace skyreels::model {

class SkyReelsV2Transformer;
class RankGroup;
struct RankGroups;

// What the video is conditioned on besides the prompt: diffusers' text-to-video, image-to-video
// (SkyReelsV2DiffusionForcingImageToVideoPipeline) and video-to-video (...VideoToVideoPipeline) pipelines.
enum class ConditioningMode { kText, kImage, kVideo };

// A step cache (fewer transformer passes at a small loss; exact savings are separate and lossless).
enum class StepCacheKind {
  kNone,
  kFirstBlock,          // diffusers' FirstBlockCache, one decision per call and guidance context
  kFirstBlockPerBlock,  // one decision per causal block (beyond diffusers; model/transformer PerBlockCache)
  kTaylorSeer,          // diffusers' TaylorSeer (model/step_caches.h; t2v / i2v, and df with ar_step 0)
  kMagCache,            // diffusers' MagCache (model/step_caches.h; t2v / i2v, and df with ar_step 0; needs ratios)
};
enum class StepCacheScope {
  kChunk,    // state reset at every chunk start: a chunk's output depends on that chunk alone
  kRequest,  // stock diffusers: state kept across the chunks of one request (chunks of equal length only)
};
struct StepCacheConfig {
  StepCacheKind kind = StepCacheKind::kNone;
  double threshold = 0.0;  // skip when rel <= threshold
  StepCacheScope scope = StepCacheScope::kChunk;
  int64_t max_skips = 3;  // kFirstBlockPerBlock: at most this many skips in a row per causal block
  TaylorSeerCache taylorseer;  // kTaylorSeer
  // kMagCache: its mag_ratios as calibrated (any length: resampled to the call's steps as diffusers does) and
  // num_inference_steps (the request's own steps are used).
  MagCache magcache;
};

// Memory the kept keys / values of final frames may take per chunk loop (both guidance contexts together) unless a
// request says otherwise; frames beyond it are computed again each row (still exact).
constexpr int64_t kDefaultKvCacheBytes = int64_t{4} << 30;

// diffusers' __call__ arguments (pixel-space frame counts, like the pipeline), with its defaults.
struct GenerationParams {
  int64_t num_frames = 97;
  int64_t height = 544;
  int64_t width = 960;
  int64_t num_inference_steps = 50;
  double guidance_scale = 6.0;
  double flow_shift = 8.0;
  int64_t base_num_frames = 97;
  std::optional<int64_t> overlap_history;
  int64_t ar_step = 0;
  std::optional<int64_t> causal_block_size;  // unset: the model config's num_frame_per_block
  double addnoise_condition = 0.0;
  int64_t fps = kDefaultFps;
  std::optional<uint64_t> seed;
  // The other settings of a diffusers scheduler_config.json (solver order/type, lower_order_final, ...).
  // Its flow_shift is ignored here: `flow_shift` above is the one used. The Euler sampler reads its
  // num_train_timesteps only.
  FlowUniPCConfig scheduler;
  // scheduler.type: a row of model/sampler_table.h.
  SamplerKind sampler = SamplerKind::kUniPC;
  // scheduler.timesteps (a sampler that takes one): the timestep list before the shift, strictly decreasing in
  // (0, num_train_timesteps]; it replaces num_inference_steps' spacing (num_inference_steps must equal its length).
  std::vector<int64_t> timesteps;
  // Pixel conditioning, as far as the chunk plan depends on it (the pixels themselves go to encode_conditioning).
  ConditioningMode mode = ConditioningMode::kText;
  bool last_image = false;   // kImage: a last frame, appended as an extra latent frame to the last chunk
  int64_t video_frames = 0;  // kVideo: pixel frames of the input video (its last overlap_history are encoded)
  // kImage with causal_block_size > 1: diffusers does not mark the 1-frame image prefix ready and denoises it like
  // noise (kept by default, so results compare). true: the image frame stays pinned (timestep 0, never updated)
  // while the rest of its block is denoised.
  bool pin_image_prefix = false;
  // Exact savings under the block-causal mask (causal_block_size > 1): trailing blocks that have not started are
  // not forwarded, and the keys / values of final blocks are kept per layer instead of recomputed. Same output
  // within 1e-6 (bit-identical where the same kernels run); false runs every frame of every row, as diffusers.
  bool exact_savings = true;
  int64_t kv_cache_max_bytes = kDefaultKvCacheBytes;
  StepCacheConfig cache;
  // Previews (StepHooks::on_preview): after every N-th timestep row of a chunk and after its last row; 0: none.
  // They read the loop's tensors and never change them: the latents are the same with previews on or off.
  int64_t preview_every =
      0;  // Adapters of this request, applied unmerged in every transformer call (AdapterBank::activate); empty: none.
  std::vector<ActiveAdapter> adapters;
};

// The sampler `params` asks for, for one chunk of `num_frames` latent frames: its per-frame trajectories and the
// model timesteps of its schedule (the timestep matrix's step template). Throws std::invalid_argument naming the field.
struct ChunkSampler {
  std::vector<int64_t> step_template;
  std::unique_ptr<FrameSampler> frames;
};
ChunkSampler make_chunk_sampler(const GenerationParams& params, int64_t num_frames);
// What the plan checks of the sampler before any chunk: a timestep list only where its row takes one, and the
// schedule's own checks (Euler's; UniPC's config is checked by scheduler.validate()). std::invalid_argument.
void check_sampler(const GenerationParams& params);

// Latent frames the conditioning pins at the start of chunk 0: 1 for an image (never cut to the block size, as in
// diffusers: with causal_block_size > 1 it is then not pre-ready and gets denoised), the encoded tail of the video
// cut to a multiple of the block size for a video, 0 for text.
int64_t condition_prefix_frames(const GenerationParams& params, int64_t causal_block_size);

// diffusers' generate_timestep_matrix, unchanged (also for frames that are not a multiple of the block size, whose
// tail gets no columns: #13609 is refused in plan_chunks instead).
struct TimestepMatrix {
  at::Tensor step_matrix;  // int64 [R, C]: model timestep per row and frame (999 not started, 0 finished)
  at::Tensor step_index;   // int64 [R, C]: index into [999, step_template..., 0]
  at::Tensor update_mask;  // bool  [R, C]: frames the scheduler advances in that row
  std::vector<std::pair<int64_t, int64_t>> valid_interval;  // [start, end) frames fed to the model per row
  int64_t rows() const { return static_cast<int64_t>(valid_interval.size()); }
};
// Throws std::invalid_argument("ar_step: ...") where diffusers raises (ar_step too small for a sliding window).
TimestepMatrix generate_timestep_matrix(int64_t num_latent_frames, const std::vector<int64_t>& step_template,
                                        int64_t base_num_latent_frames, int64_t ar_step, int64_t num_pre_ready,
                                        int64_t causal_block_size);

// One chunk of a (possibly long) video, in latent frames.
struct ChunkSpec {
  int64_t index = 0;
  int64_t num_latent_frames = 0;  // this chunk's length Fk (prefix included)
  int64_t prefix_frames = 0;      // P: frames copied from the previous chunk's end (0 for chunk 0)
  int64_t output_begin = 0;       // where this chunk's new frames land in the final latent video
  int64_t output_end = 0;         // (exclusive); new frames are chunk frames [keep_from, Fk)
  int64_t keep_from = 0;          // 0 for chunk 0, else O (diffusers cuts at the overlap, not at P)
  int64_t timestep_rows = 0;      // rows of this chunk's timestep matrix (= model calls per guidance branch)
  int64_t suffix_frames = 0;      // frames appended after the Fk (the last_image latent, last chunk only; never
                                  // updated, part of the output)
  bool pin_prefix = false;        // prefix frames pinned like the suffix (GenerationParams::pin_image_prefix)
  // The first pixel frame of the output video this chunk generates (0 for chunk 0): where its prompt is looked up.
  int64_t first_new_pixel_frame() const { return pixel_frames_of(output_begin); }  // those before it
};

struct ChunkPlan {
  int64_t total_latent_frames = 0;    // Ftot
  int64_t base_latent_frames = 0;     // Fb
  int64_t overlap_latent_frames = 0;  // O (0 when not a long video; always set for video extension)
  int64_t latent_height = 0;
  int64_t latent_width = 0;
  int64_t causal_block_size = 1;
  std::vector<ChunkSpec> chunks;
  std::vector<std::string> warnings;  // e.g. overlap not a multiple of the block size: frames dropped
};

// This chunk's timestep matrix as diffusers builds it (prefix frames pre-ready; a last_image suffix column pinned at
// timestep 0 and never updated). Also used by plan_chunks to count rows.
TimestepMatrix chunk_timestep_matrix(const ChunkSpec& chunk, const std::vector<int64_t>& step_template, int64_t ar_step,
                                     int64_t causal_block_size);

// Validates `params` against the model config (throws std::invalid_argument whose message starts with the
// offending field name, e.g. "num_frames: ...") and computes the chunk geometry.
ChunkPlan plan_chunks(const GenerationParams& params, int64_t model_num_frame_per_block);

// A prompt that takes over from a pixel frame of the output video on ("prompt travel"): every chunk whose first new
// frame is at or after `from_frame` uses it, until the next one.
struct PromptChange {
  int64_t from_frame = 0;
  at::Tensor prompt_embeds;                          // [B, T, text_dim]
  std::optional<at::Tensor> negative_prompt_embeds;  // unset: the base negative prompt
};

struct Conditioning {
  at::Tensor prompt_embeds;                          // [B, T, text_dim]
  std::optional<at::Tensor> negative_prompt_embeds;  // required when guidance_scale > 1
  std::vector<PromptChange> prompt_changes;          // ascending from_frame; empty: one prompt for the whole video
  // Pixel conditioning as normalised VAE latents (encode_conditioning): chunk 0's prefix [B or 1, 16, >= P, h, w]
  // (its first P = condition_prefix_frames frames are used) and the last_image latent [B or 1, 16, 1, h, w].
  at::Tensor prefix_latents;
  at::Tensor last_image_latents;
};

// The prompt (and negative prompt) chunk `chunk` uses: the last change at or before its first new frame.
Conditioning prompt_for_chunk(const Conditioning& conditioning, const ChunkSpec& chunk);

// Where random tensors come from, in diffusers' draw order.
class NoiseSource {
 public:
  virtual ~NoiseSource() = default;
  // Initial latent noise for one chunk (fp32, CPU then moved), diffusers' prepare_latents draw.
  virtual at::Tensor latent_noise(int64_t chunk_index, at::IntArrayRef shape) = 0;
  // addnoise_condition noise for one timestep row of one chunk (diffusers: randn_like on the global RNG).
  virtual at::Tensor condition_noise(int64_t chunk_index, int64_t row, at::IntArrayRef shape) = 0;
  // Called by run_chunk before the first draw of a chunk, so that a source reproducing one random stream can skip
  // the draws of earlier chunks it never served (chunks run on different replicas). Default: nothing.
  virtual void begin_chunk(const ChunkPlan& /*plan*/, int64_t /*chunk_index*/) {}
  // An independent copy of the source's current state, or nullptr when it cannot be copied. A server keeps one
  // source per job: each chunk draws from a copy, and the copy replaces the kept source only when the chunk succeeds,
  // so chunk k costs one chunk of draws and a retried (or handed-off) chunk draws the same values again.
  virtual std::unique_ptr<NoiseSource> clone() const { return nullptr; }
  // Random values drawn so far (diagnostics: shows that a kept source never redraws earlier chunks).
  virtual int64_t values_drawn() const { return 0; }
};

// Seeded: latent noise as torch.Generator("cpu").manual_seed(seed) draws it, chunk after chunk; condition noise
// from a second generator seeded with seed + 1 (documented in the README). Chunk k can be drawn without chunk k-1
// (a fresh source per chunk is fine): run_chunk calls begin_chunk, which gives the source the earlier chunks' shapes.
// Skipping ahead re-draws the earlier chunks; a source kept between chunks (clone()) does not.
std::unique_ptr<NoiseSource> make_seeded_noise(uint64_t seed);
// Recorded: tensors noise_000, noise_001, ... consumed in order (the fixtures' noise.safetensors).
std::unique_ptr<NoiseSource> make_recorded_noise(std::vector<at::Tensor> draws_in_order);

// What one transformer call of the loop did (StepHooks::on_call): the work of the uncached plan, what ran, and
// the step cache's decision. Token-blocks: tokens x transformer blocks.
struct TransformerCallReport {
  int64_t chunk = 0, row = 0;
  bool unconditional = false;
  int64_t token_blocks_full = 0, token_blocks_computed = 0;
  int64_t token_blocks_saved_exact = 0, token_blocks_saved_cache = 0;
  bool step_cache = false;                                 // a step cache was on for this call
  std::optional<double> rel;                               // FirstBlockCache's rel (unset on a context's first call)
  bool skipped = false;                                    // the tail residual was reused
  std::optional<std::pair<int64_t, int64_t>> source;      // [chunk, row] of the call whose residual was reused
  // kFirstBlockPerBlock: one decision per causal block of the call (block counted from the chunk's frame 0);
  // source: [chunk, row] of the block's own last computed call, when it skipped.
  struct BlockDecision {
    int64_t block = 0;
    bool updated = false;
    std::optional<double> rel;
    bool skipped = false;
    std::optional<std::pair<int64_t, int64_t>> source;
    bool reused = false;  // final and unchanged: its kept keys / values stood in (exact, not a skip)
  };
  std::vector<BlockDecision> blocks;
  // kTaylorSeer / kMagCache (t2v / i2v: chunk 0, row = step; df: one row per step): the cache and its decision (TaylorSeer
  // predicted its hooked modules; MagCache: `skipped`), MagCache's accumulated error and calibration ratio.
  StepCacheKind cache_kind = StepCacheKind::kNone;
  bool predicted = false;
  std::optional<double> accumulated_err, calibration_ratio;
};

struct StepHooks {
  std::function<void(int64_t chunk, int64_t row, int64_t rows)> on_step;  // after each timestep row
  std::function<bool()> cancelled;  // polled before each row and, with the transformer, after each of its blocks;
                                    // true aborts with GenerationCancelled
  std::function<void(const TransformerCallReport&)> on_call;  // after each transformer call (with the transformer)
  // After the rows GenerationParams::preview_every selects (after on_step); nothing is computed for previews
  // without it.
  std::function<void(const ChunkPreview&)> on_preview;
};

// The transformer-call state of one request's loop: per guidance context, the kept keys / values of the running
// chunk and the step cache's state. Made per chunk by run_chunk; kept across chunks only for StepCacheScope::kRequest
// by a caller that runs every chunk of the request in one process (skyreels generate).
class DenoiseCache;
std::shared_ptr<DenoiseCache> make_denoise_cache();

// The step-cache decisions among `calls` as JSON, in the format of the pipeline_df_cache fixtures' decisions.json
// (`skyreels generate --cache-log`).
std::string step_cache_decisions_json(const std::vector<TransformerCallReport>& calls);

struct GenerationCancelled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs chunk `chunk_index` of `plan`. `previous_latents` is the accumulated latent video so far (fp32
// [B,16,F_so_far,h,w], any device; its last overlap_latent_frames frames are all that is read, so that tail alone
// also works) and is ignored for chunk 0. Returns the chunk's own latents, fp32 [B, 16, Fk, h, w] on the model's
// device. The scheduler config comes from params.scheduler with params.flow_shift.
// `cache`: the request's DenoiseCache when the step cache's scope is kRequest (required then for chunks after the
// first); a fresh one per call otherwise.
// `ranks`: this rank's groups when the chunk runs on a replica of several devices (rank_group.h's run_on_ranks: every
// rank makes this call with its own groups and noise source, and every rank returns the same latents).
at::Tensor run_chunk(const SkyReelsV2Transformer& model, const GenerationParams& params, const ChunkPlan& plan,
                     int64_t chunk_index, const Conditioning& conditioning, const at::Tensor& previous_latents,
                     NoiseSource& noise, const StepHooks& hooks = {}, std::shared_ptr<DenoiseCache> cache = nullptr,
                     const RankGroups* ranks = nullptr);

// Appends chunk latents to the accumulated video as diffusers does (drops the first keep_from frames).
at::Tensor accumulate(const at::Tensor& accumulated, const at::Tensor& chunk_latents, const ChunkSpec& chunk);

// ---- the loop without the transformer (tests, traces, other backends) -------------------------------------------

// One model evaluation of the denoising loop.
struct DenoiseCall {
  at::Tensor latent_model_input;     // [B, C, F, h, w] in the compute dtype (prefix already noised by addnoise)
  at::Tensor timestep;               // int64 [B, F]
  at::Tensor encoder_hidden_states;  // prompt (or negative prompt) embeddings, compute dtype
  bool unconditional = false;        // the negative-prompt pass of classifier-free guidance
  int64_t chunk = 0;
  int64_t row = 0;
  int64_t num_frame_per_block = 1;  // this request's causal block size (the block-causal mask when > 1)
  int64_t first_frame = 0;          // the call's window starts at this latent frame of the chunk
  // Per frame of the call (exact savings): its prediction is used in this row (the update mask), and it is final
  // (latents and timestep stay as they are for the rest of the chunk, and addnoise_condition does not re-noise it).
  std::vector<uint8_t> updated, final_frames;
};

// Returns the velocity prediction [B, C, F, h, w] (compute dtype).
using Denoiser = std::function<at::Tensor(const DenoiseCall&)>;

struct DenoiserInfo {
  c10::Device device = c10::kCPU;
  at::ScalarType dtype = at::kFloat;  // compute dtype (inputs are cast to it, as diffusers casts to transformer.dtype)
  int64_t latent_channels = 16;
  int64_t num_frame_per_block = 1;  // the model config's default causal block size
  // cfg=2 (model/rank_group.h): this rank's guidance-parallel pair; each rank runs one pass of a guided row.
  RankGroup* guidance_ranks = nullptr;
};

// The transformer as a Denoiser (per-request block size from the call, fps from `params`). With `cancelled`, the
// forward also polls it after every transformer block and throws GenerationCancelled when it turns true.
// `ranks`: this rank's groups on a replica of several devices (the Ulysses ranks every call's tokens are split across,
// and the replica's ranks a sharded model gathers its blocks from).
Denoiser transformer_denoiser(const SkyReelsV2Transformer& model, const GenerationParams& params,
                              std::function<bool()> cancelled = {},
                              std::function<void(const TransformerCallReport&)> on_call = {},
                              std::shared_ptr<DenoiseCache> cache = nullptr, const RankGroups* ranks = nullptr);
DenoiserInfo denoiser_info(const SkyReelsV2Transformer& model);

at::Tensor run_chunk(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                     const ChunkPlan& plan, int64_t chunk_index, const Conditioning& conditioning,
                     const at::Tensor& previous_latents, NoiseSource& noise, const StepHooks& hooks = {});

at::Tensor generate(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks = {},
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk = {});

// The whole video: every chunk in order. Returns fp32 latents [B, 16, Ftot, h, w]; per-chunk outputs are passed to
// `on_chunk` when set (chunk index, that chunk's latents).
at::Tensor generate(const SkyReelsV2Transformer& model, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks = {},
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk = {},
                    const RankGroups* ranks = nullptr);

}  // namespace skyreels::model
