#include "model/diffusion_forcing.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/sampler_flow_euler.h"
#include "model/shape_text.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

namespace {

constexpr int64_t kTemporalFactor = 4;  // Wan VAE: 4 pixel frames per latent frame (plus the first)
constexpr int64_t kSpatialFactor = 8;

int64_t latent_frames_of(int64_t pixel_frames) { return (pixel_frames - 1) / kTemporalFactor + 1; }

std::string join(const std::vector<int64_t>& values) {
  std::ostringstream os;
  for (size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
  return os.str();
}

}  // namespace

// ---- timestep matrix -------------------------------------------------------------------------------------------

TimestepMatrix generate_timestep_matrix(int64_t num_latent_frames, const std::vector<int64_t>& step_template,
                                        int64_t base_num_latent_frames, int64_t ar_step, int64_t num_pre_ready,
                                        int64_t causal_block_size) {
  if (causal_block_size < 1) {
    throw std::invalid_argument("causal_block_size: must be >= 1, got " + std::to_string(causal_block_size));
  }
  if (step_template.empty()) throw std::invalid_argument("step_template: must not be empty");
  if (ar_step < 0) throw std::invalid_argument("ar_step: must be >= 0, got " + std::to_string(ar_step));
  const int64_t steps = static_cast<int64_t>(step_template.size());
  const int64_t iterations = steps + 1;  // counter 0 = not started, steps + 1 = clean
  const int64_t blocks = num_latent_frames / causal_block_size;
  const int64_t base_blocks = base_num_latent_frames / causal_block_size;
  if (blocks < 1 || base_blocks < 1) {
    throw std::invalid_argument("num_latent_frames: " + std::to_string(num_latent_frames) + " (base " +
                                std::to_string(base_num_latent_frames) + ") holds no whole causal block of " +
                                std::to_string(causal_block_size));
  }
  if (base_blocks < blocks) {  // sliding window: the window must move fast enough
    const double min_ar_step = static_cast<double>(steps) / static_cast<double>(base_blocks);
    if (static_cast<double>(ar_step) < min_ar_step) {
      throw std::invalid_argument("ar_step: should be at least " +
                                  std::to_string(static_cast<int64_t>(std::ceil(min_ar_step))) + " in your setting (" +
                                  std::to_string(steps) + " steps over " + std::to_string(base_blocks) +
                                  " base blocks)");
    }
  }
  std::vector<int64_t> padded_template;  // [999, template..., 0]
  padded_template.push_back(999);
  padded_template.insert(padded_template.end(), step_template.begin(), step_template.end());
  padded_template.push_back(0);

  std::vector<int64_t> previous(static_cast<size_t>(blocks), 0);
  for (int64_t b = 0; b < std::min(blocks, num_pre_ready / causal_block_size); ++b) {
    previous[static_cast<size_t>(b)] = iterations;
  }
  std::vector<std::vector<int64_t>> index_rows;
  std::vector<std::vector<bool>> mask_rows;
  auto all_done = [&](const std::vector<int64_t>& row) {
    return std::all_of(row.begin(), row.end(), [&](int64_t v) { return v >= iterations - 1; });
  };
  while (!all_done(previous)) {
    std::vector<int64_t> next(static_cast<size_t>(blocks));
    for (size_t i = 0; i < next.size(); ++i) {
      if (i == 0 || previous[i - 1] >= iterations - 1) {
        next[i] = previous[i] + 1;
      } else {
        next[i] = next[i - 1] - ar_step;
      }
    }
    std::vector<bool> mask(next.size());
    for (size_t i = 0; i < next.size(); ++i) {
      next[i] = std::clamp<int64_t>(next[i], 0, iterations);
      mask[i] = next[i] != previous[i] && next[i] != iterations;
    }
    index_rows.push_back(next);
    mask_rows.push_back(mask);
    previous = next;
  }

  TimestepMatrix out;
  int64_t terminal = base_blocks;
  for (const auto& mask : mask_rows) {
    if (terminal < blocks && mask[static_cast<size_t>(terminal)]) ++terminal;
    out.valid_interval.emplace_back(std::max<int64_t>(terminal - base_blocks, 0) * causal_block_size,
                                    terminal * causal_block_size);
  }
  // Expand each block column to causal_block_size identical frame columns.
  const auto rows = static_cast<int64_t>(index_rows.size());
  const int64_t columns = blocks * causal_block_size;
  out.step_matrix = at::empty({rows, columns}, at::kLong);
  out.step_index = at::empty({rows, columns}, at::kLong);
  out.update_mask = at::empty({rows, columns}, at::kBool);
  auto sm = out.step_matrix.accessor<int64_t, 2>();
  auto si = out.step_index.accessor<int64_t, 2>();
  auto um = out.update_mask.accessor<bool, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      const auto block = static_cast<size_t>(c / causal_block_size);
      const int64_t index = index_rows[static_cast<size_t>(r)][block];
      si[r][c] = index;
      sm[r][c] = padded_template[static_cast<size_t>(index)];
      um[r][c] = mask_rows[static_cast<size_t>(r)][block];
    }
  }
  return out;
}

// ---- chunk plan ------------------------------------------------------------------------------------------------

namespace {

struct Geometry {
  bool long_video = false;
  int64_t total = 0;             // Ftot
  int64_t base = 0;              // Fb (= Ftot for a short video)
  int64_t overlap = 0;           // O
  std::vector<int64_t> lengths;  // latent frames per chunk
};

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }

// diffusers' chunking, for an already rounded pixel frame count. Text and image: chunks only when num_frames
// exceeds base_num_frames (and overlap_history is set). Video extension: always the long-video formula, whose first
// chunk is min(total, base) frames (a single chunk when the video fits in one).
Geometry geometry_of(int64_t num_frames, const GenerationParams& p) {
  Geometry g;
  g.total = latent_frames_of(num_frames);
  const bool video = p.mode == ConditioningMode::kVideo;
  if (video && p.overlap_history) g.overlap = latent_frames_of(*p.overlap_history);
  g.long_video = p.overlap_history.has_value() && num_frames > p.base_num_frames;
  if (!g.long_video) {
    g.base = g.total;
    g.lengths = {g.total};
    return g;
  }
  g.base = latent_frames_of(p.base_num_frames);
  g.overlap = latent_frames_of(*p.overlap_history);
  const int64_t stride = g.base - g.overlap;
  g.lengths.push_back(g.base);
  if (stride <= 0) return g;  // refused by plan_chunks (overlap_history must be shorter than a chunk)
  const int64_t iterations = 1 + floor_div(g.total - g.base - 1, stride) + 1;
  for (int64_t k = 1; k < iterations; ++k) {
    const int64_t finished = k * stride + g.overlap;
    g.lengths.push_back(std::min(g.total - finished + g.overlap, g.base));
  }
  return g;
}

bool aligned(const Geometry& g, int64_t block) {
  return std::all_of(g.lengths.begin(), g.lengths.end(), [&](int64_t f) { return f % block == 0; });
}

bool valid_candidate(int64_t n, const GenerationParams& p, int64_t block) {
  if ((n - 1) % kTemporalFactor != 0) return false;
  if (n > p.base_num_frames && !p.overlap_history) return false;  // would need overlap_history
  const Geometry g = geometry_of(n, p);
  if (g.long_video && g.overlap >= g.base) return false;
  return aligned(g, block);
}

// Pixel frame counts 4k+1 near `num_frames` (two below, two above) whose every chunk is a multiple of `block`.
std::vector<int64_t> valid_num_frames_near(int64_t num_frames, const GenerationParams& p, int64_t block) {
  std::vector<int64_t> below, above;
  const int64_t reach = kTemporalFactor * block * (latent_frames_of(std::max(p.base_num_frames, int64_t{1})) + 2);
  for (int64_t n = num_frames - 1; n >= 1 && n >= num_frames - reach && below.size() < 2; --n) {
    if (valid_candidate(n, p, block)) {
      below.push_back(n);
    }
  }
  for (int64_t n = num_frames + 1; n <= num_frames + reach && above.size() < 2; ++n) {
    if (valid_candidate(n, p, block)) {
      above.push_back(n);
    }
  }
  std::vector<int64_t> out(below.rbegin(), below.rend());
  out.insert(out.end(), above.begin(), above.end());
  return out;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void validate_basic(const GenerationParams& p, int64_t block) {
  require(p.num_frames >= 1, "num_frames: must be >= 1, got " + std::to_string(p.num_frames));
  require(p.height > 0 && p.height % 16 == 0,
          "height: must be a positive multiple of 16, got " + std::to_string(p.height));
  require(p.width > 0 && p.width % 16 == 0, "width: must be a positive multiple of 16, got " + std::to_string(p.width));
  require(p.num_inference_steps >= 1,
          "num_inference_steps: must be >= 1, got " + std::to_string(p.num_inference_steps));
  require(std::isfinite(p.guidance_scale), "guidance_scale: must be a finite number");
  require(std::isfinite(p.flow_shift) && p.flow_shift > 0.0,
          "flow_shift: must be a positive number, got " + std::to_string(p.flow_shift));
  require(p.base_num_frames >= 1, "base_num_frames: must be >= 1, got " + std::to_string(p.base_num_frames));
  require(!p.overlap_history || *p.overlap_history >= 1,
          "overlap_history: must be >= 1 when set, got " + std::to_string(p.overlap_history.value_or(0)));
  require(p.ar_step >= 0, "ar_step: must be >= 0, got " + std::to_string(p.ar_step));
  require(block >= 1, "causal_block_size: must be >= 1, got " + std::to_string(block));
  require(std::isfinite(p.addnoise_condition) && p.addnoise_condition >= 0.0,
          "addnoise_condition: must be >= 0, got " + std::to_string(p.addnoise_condition));
  require(p.fps >= 1, "fps: must be >= 1, got " + std::to_string(p.fps));
  // diffusers' check_inputs compares the unrounded frame count.
  require(p.num_frames <= p.base_num_frames || p.overlap_history.has_value(),
          "overlap_history: required when num_frames (" + std::to_string(p.num_frames) + ") exceeds base_num_frames (" +
              std::to_string(p.base_num_frames) + "); recommended values are 17 or 37");
  p.scheduler.validate();
  if (p.sampler == SamplerKind::kUniPC) {
    require(p.timesteps.empty(), "scheduler.timesteps: an explicit timestep list needs scheduler.type euler (UniPC "
                                 "spaces num_inference_steps itself)");
  } else {
    make_flow_euler_schedule(p.scheduler.num_train_timesteps, p.flow_shift, p.num_inference_steps, p.timesteps);
  }
  require(p.kv_cache_max_bytes >= 0, "kv_cache_max_bytes: must be >= 0");
  if (p.cache.kind != StepCacheKind::kNone) {
    require(std::isfinite(p.cache.threshold) && p.cache.threshold >= 0.0,
            "cache_threshold: must be a finite number >= 0, got " + std::to_string(p.cache.threshold));
  }
  if (p.cache.kind == StepCacheKind::kFirstBlockPerBlock) {
    require(p.cache.max_skips >= 1, "cache_max_skips: must be >= 1, got " + std::to_string(p.cache.max_skips));
    require(p.cache.scope == StepCacheScope::kChunk,
            "cache_scope: the cache per causal block keeps its state per chunk only (use cache_scope chunk)");
    require(block > 1, "cache: first-block-per-block needs causal_block_size > 1 (the block-causal mask); this "
                       "request has " + std::to_string(block));
  }
}

// Stock FirstBlockCache compares a call with the last call of another chunk: chunks of another length crash it.
void refuse_request_scope_over_unequal_chunks(const GenerationParams& p, const ChunkPlan& plan) {
  if (p.cache.kind == StepCacheKind::kNone || p.cache.scope != StepCacheScope::kRequest) return;
  const int64_t first = plan.chunks.front().num_latent_frames + plan.chunks.front().suffix_frames;
  for (const ChunkSpec& c : plan.chunks) {
    const int64_t frames = c.num_latent_frames + c.suffix_frames;
    require(frames == first, "cache_scope: request keeps the step cache across chunks, which needs chunks of one "
                             "length; chunk " + std::to_string(c.index) + " has " + std::to_string(frames) +
                                 " latent frames, chunk 0 has " + std::to_string(first) + " (use cache_scope chunk)");
  }
}

// #13609: diffusers leaves the frames past the last whole block as pure noise; refuse such requests instead.
void refuse_unaligned(const GenerationParams& p, int64_t num_frames, const Geometry& g, int64_t block) {
  if (g.long_video && g.base % block != 0) {
    std::vector<int64_t> valid;
    for (int64_t m = 1; valid.size() < 4 && m <= 1024; ++m) {
      const int64_t frames = (m * block - 1) * kTemporalFactor + 1;
      if (m * block > g.overlap) valid.push_back(frames);  // a chunk must be longer than its overlap
    }
    throw std::invalid_argument(
        "base_num_frames: " + std::to_string(p.base_num_frames) + " gives " + std::to_string(g.base) +
        " latent frames per chunk, not a multiple of causal_block_size " + std::to_string(block) +
        "; the tail frames would never be denoised (diffusers #13609). Valid base_num_frames: " + join(valid) +
        ", ...");
  }
  if (aligned(g, block)) return;
  std::ostringstream os;
  os << "num_frames: " << num_frames << " gives ";
  if (g.long_video) {
    os << "chunks of [" << join(g.lengths) << "] latent frames (base_num_frames " << p.base_num_frames
       << ", overlap_history " << *p.overlap_history << ")";
  } else {
    os << g.total << " latent frames";
  }
  os << ", not all multiples of causal_block_size " << block
     << "; the tail frames would never be denoised (diffusers #13609). Valid num_frames near " << num_frames << ": "
     << join(valid_num_frames_near(num_frames, p, block));
  throw std::invalid_argument(os.str());
}

// Requests diffusers crashes on, or silently mishandles, with pixel conditioning: refused naming the field.
void validate_pixel_conditioning(const GenerationParams& p, const Geometry& g, int64_t block) {
  if (p.mode == ConditioningMode::kText) {
    require(!p.last_image && p.video_frames == 0, "conditioning: last_image / video frames given in text mode");
    return;
  }
  const int64_t prefix = condition_prefix_frames(p, block);
  if (p.mode == ConditioningMode::kImage) {
    require(p.video_frames == 0, "video: an image and a video cannot both condition one video");
    // diffusers would pin the last_image column over a generated frame and never denoise the last one.
    require(!p.last_image || block == 1,
            "last_image: needs causal_block_size 1 (got " + std::to_string(block) +
                "); the appended frame would break the causal blocks (diffusers leaves the last frame as noise)");
  } else {
    require(!p.last_image, "last_image: only with an image (image-to-video), not with a video");
    require(p.overlap_history.has_value(),
            "overlap_history: required to extend a video (how many of its last frames to continue from; 17 or 37 "
            "are usual)");
    require(p.video_frames >= 1, "video: needs at least 1 frame, got " + std::to_string(p.video_frames));
    require(prefix >= 1, "video: its last " + std::to_string(std::min(p.video_frames, *p.overlap_history)) +
                             " frame(s) encode to fewer latent frames than causal_block_size " + std::to_string(block) +
                             "; give more frames or a larger overlap_history");
  }
  require(g.lengths.front() > prefix,
          "num_frames: " + std::to_string(p.num_frames) + " gives " + std::to_string(g.lengths.front()) +
              " latent frame(s) in the first chunk, no more than the " + std::to_string(prefix) +
              " conditioning latent frame(s); nothing would be generated" +
              (p.mode == ConditioningMode::kVideo ? " (num_frames counts the continued video's last frames too)" : ""));
}

}  // namespace

int64_t condition_prefix_frames(const GenerationParams& params, int64_t causal_block_size) {
  switch (params.mode) {
    case ConditioningMode::kText:
      return 0;
    case ConditioningMode::kImage:
      return 1;
    case ConditioningMode::kVideo: {
      if (!params.overlap_history || params.video_frames < 1 || causal_block_size < 1) return 0;
      const int64_t encoded = latent_frames_of(std::min(params.video_frames, *params.overlap_history));
      return encoded - encoded % causal_block_size;
    }
  }
  return 0;
}

TimestepMatrix chunk_timestep_matrix(const ChunkSpec& chunk, const std::vector<int64_t>& step_template, int64_t ar_step,
                                     int64_t causal_block_size) {
  // The chunk's own length as the base: diffusers' I2V passes base_num_frames, which crashes on a shorter last chunk.
  const int64_t frames = chunk.num_latent_frames + chunk.suffix_frames;
  TimestepMatrix m =
      generate_timestep_matrix(frames, step_template, frames, ar_step, chunk.prefix_frames, causal_block_size);
  if (chunk.suffix_frames > 0 && m.step_matrix.size(1) == frames) {
    m.step_matrix.narrow(1, chunk.num_latent_frames, chunk.suffix_frames).fill_(0);
    m.update_mask.narrow(1, chunk.num_latent_frames, chunk.suffix_frames).fill_(false);
  }
  if (chunk.pin_prefix && chunk.prefix_frames > 0) {
    m.step_matrix.narrow(1, 0, chunk.prefix_frames).fill_(0);
    m.update_mask.narrow(1, 0, chunk.prefix_frames).fill_(false);
  }
  return m;
}

ChunkPlan plan_chunks(const GenerationParams& params, int64_t model_num_frame_per_block) {
  const int64_t block = params.causal_block_size.value_or(model_num_frame_per_block);
  validate_basic(params, block);

  ChunkPlan plan;
  int64_t num_frames = params.num_frames;
  if ((num_frames - 1) % kTemporalFactor != 0) {
    num_frames = (num_frames - 1) / kTemporalFactor * kTemporalFactor + 1;
    plan.warnings.push_back("num_frames: " + std::to_string(params.num_frames) + " is not 4k+1; rounded down to " +
                            std::to_string(num_frames) + " as diffusers does");
  }
  const Geometry g = geometry_of(num_frames, params);
  if (g.long_video) {
    require(g.overlap < g.base, "overlap_history: " + std::to_string(*params.overlap_history) + " frames (" +
                                    std::to_string(g.overlap) + " latent) must be fewer than base_num_frames " +
                                    std::to_string(params.base_num_frames) + " (" + std::to_string(g.base) +
                                    " latent)");
  }
  refuse_unaligned(params, num_frames, g, block);
  validate_pixel_conditioning(params, g, block);

  plan.total_latent_frames = g.total;
  plan.base_latent_frames = g.base;
  plan.overlap_latent_frames = g.overlap;
  plan.latent_height = params.height / kSpatialFactor;
  plan.latent_width = params.width / kSpatialFactor;
  plan.causal_block_size = block;

  // Prefixes are cut at their end to a multiple of the block; the accumulation still cuts at O (diffusers).
  const int64_t prefix = g.overlap - g.overlap % block;
  const std::vector<int64_t> dummy_template(static_cast<size_t>(params.num_inference_steps), 0);
  const int64_t suffix = params.mode == ConditioningMode::kImage && params.last_image ? 1 : 0;
  int64_t produced = 0;
  for (size_t k = 0; k < g.lengths.size(); ++k) {
    ChunkSpec c;
    c.index = static_cast<int64_t>(k);
    c.num_latent_frames = g.lengths[k];
    c.prefix_frames = k == 0 ? condition_prefix_frames(params, block) : prefix;
    c.keep_from = k == 0 ? 0 : g.overlap;
    c.suffix_frames = k + 1 == g.lengths.size() ? suffix : 0;
    c.pin_prefix = k == 0 && params.mode == ConditioningMode::kImage && params.pin_image_prefix;
    c.output_begin = produced;
    c.output_end = produced + c.num_latent_frames + c.suffix_frames - c.keep_from;
    produced = c.output_end;
    c.timestep_rows = chunk_timestep_matrix(c, dummy_template, params.ar_step, block).rows();
    plan.chunks.push_back(c);
  }
  plan.total_latent_frames += suffix;  // the last_image latent stays in the output, as in diffusers
  refuse_request_scope_over_unequal_chunks(params, plan);
  if (produced != plan.total_latent_frames) {
    throw std::logic_error("plan_chunks: chunks cover " + std::to_string(produced) + " latent frames, expected " +
                           std::to_string(plan.total_latent_frames));
  }

  if (g.long_video && g.overlap % block != 0) {
    const int64_t dropped = g.overlap - prefix;
    const int64_t total_dropped = dropped * static_cast<int64_t>(plan.chunks.size() - 1);
    plan.warnings.push_back(
        "overlap_history: " + std::to_string(*params.overlap_history) + " frames = " + std::to_string(g.overlap) +
        " latent frames is not a multiple of causal_block_size " + std::to_string(block) + "; as in diffusers, each " +
        "later chunk keeps a " + std::to_string(prefix) + "-frame prefix, and " + std::to_string(dropped) +
        " generated latent frame(s) per chunk are dropped (" + std::to_string(total_dropped) + " in total over " +
        std::to_string(plan.chunks.size() - 1) + " chunks)");
  }
  for (const auto& w : plan.warnings) spdlog::warn("{}", w);
  return plan;
}

// ---- noise -----------------------------------------------------------------------------------------------------

namespace {

at::Tensor draw(at::Generator& generator, at::IntArrayRef shape) {
  return at::randn(shape, generator, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
}

std::vector<int64_t> with_frames(at::IntArrayRef shape, int64_t frames) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out.at(2) = frames;
  return out;
}

// Latent noise: torch.Generator("cpu").manual_seed(seed) drawing every chunk's latents in order, as diffusers'
// prepare_latents does. Condition noise (addnoise_condition): diffusers draws it with torch.randn_like from the
// global (device) RNG, which no seed of ours can reproduce; here it comes from a second CPU generator seeded with
// seed + 1, consumed in the same order (every row of every chunk that has a prefix). Either stream is positioned on
// chunk k by re-drawing (and discarding) the draws of the chunks before it, so any chunk can run first, anywhere.
class SeededNoise final : public NoiseSource {
 public:
  explicit SeededNoise(uint64_t seed) : seed_(seed) {
    reset_latent();
    reset_condition();
  }

  void begin_chunk(const ChunkPlan& plan, int64_t /*chunk_index*/) override { plan_ = plan; }

  // The generators' whole state (mt19937 and the cached normal samples) is copied: the copy continues bit for bit.
  std::unique_ptr<NoiseSource> clone() const override {
    std::unique_ptr<SeededNoise> copy(new SeededNoise(*this));
    copy->latent_ = latent_.clone();
    copy->condition_ = condition_.clone();
    return copy;
  }
  int64_t values_drawn() const override { return drawn_; }

  at::Tensor latent_noise(int64_t chunk_index, at::IntArrayRef shape) override {
    if (chunk_index < latent_next_) reset_latent();
    while (latent_next_ < chunk_index) {
      take(latent_, with_frames(shape, chunk(latent_next_).num_latent_frames));
      ++latent_next_;
    }
    ++latent_next_;
    return take(latent_, shape);
  }

  at::Tensor condition_noise(int64_t chunk_index, int64_t row, at::IntArrayRef shape) override {
    if (std::make_pair(chunk_index, row) < std::make_pair(cond_chunk_, cond_row_)) reset_condition();
    while (cond_chunk_ < chunk_index) {  // skip the rest of an earlier chunk
      const ChunkSpec& c = chunk(cond_chunk_);
      if (c.prefix_frames > 0) {
        for (; cond_row_ < c.timestep_rows; ++cond_row_) take(condition_, with_frames(shape, c.prefix_frames));
      }
      ++cond_chunk_;
      cond_row_ = 0;
    }
    for (; cond_row_ < row; ++cond_row_) take(condition_, shape);
    ++cond_row_;
    return take(condition_, shape);
  }

 private:
  SeededNoise(const SeededNoise&) = default;  // clone() only: the generators are then cloned, not shared
  at::Tensor take(at::Generator& generator, at::IntArrayRef shape) {
    at::Tensor t = draw(generator, shape);
    drawn_ += t.numel();
    return t;
  }

  void reset_latent() {
    latent_ = at::make_generator<at::CPUGeneratorImpl>(seed_);
    latent_next_ = 0;
  }
  void reset_condition() {
    condition_ = at::make_generator<at::CPUGeneratorImpl>(seed_ + 1);
    cond_chunk_ = 0;
    cond_row_ = 0;
  }
  const ChunkSpec& chunk(int64_t index) const {
    if (!plan_ || index >= static_cast<int64_t>(plan_->chunks.size())) {
      throw std::logic_error("seeded noise: chunk " + std::to_string(index) +
                             " requested without its plan (call begin_chunk first)");
    }
    return plan_->chunks[static_cast<size_t>(index)];
  }

  uint64_t seed_;
  std::optional<ChunkPlan> plan_;
  at::Generator latent_;
  int64_t latent_next_ = 0;
  at::Generator condition_;
  int64_t cond_chunk_ = 0;
  int64_t cond_row_ = 0;
  int64_t drawn_ = 0;
};

class RecordedNoise final : public NoiseSource {
 public:
  explicit RecordedNoise(std::vector<at::Tensor> draws) : draws_(std::move(draws)) {}

  at::Tensor latent_noise(int64_t chunk_index, at::IntArrayRef shape) override {
    return next(shape, "latent noise of chunk " + std::to_string(chunk_index));
  }
  at::Tensor condition_noise(int64_t chunk_index, int64_t row, at::IntArrayRef shape) override {
    return next(shape, "condition noise of chunk " + std::to_string(chunk_index) + " row " + std::to_string(row));
  }

 private:
  at::Tensor next(at::IntArrayRef shape, const std::string& what) {
    char name[32];
    std::snprintf(name, sizeof(name), "noise_%03zu", next_);
    if (next_ >= draws_.size()) {
      throw std::invalid_argument(std::string("recorded noise: ") + name + " is missing (needed as " + what + ", " +
                                  std::to_string(draws_.size()) + " draws given)");
    }
    const at::Tensor& t = draws_[next_++];
    if (t.sizes() != shape) {
      throw std::invalid_argument(std::string("recorded noise: ") + name + " has shape " + shape_text(t.sizes()) +
                                  " but " + what + " needs " + shape_text(shape));
    }
    return t.to(at::kFloat).clone();  // a copy: the loop writes its latents in place, the recording stays as given
  }

  std::vector<at::Tensor> draws_;
  size_t next_ = 0;
};

}  // namespace

std::unique_ptr<NoiseSource> make_seeded_noise(uint64_t seed) { return std::make_unique<SeededNoise>(seed); }

std::unique_ptr<NoiseSource> make_recorded_noise(std::vector<at::Tensor> draws_in_order) {
  return std::make_unique<RecordedNoise>(std::move(draws_in_order));
}

// ---- the denoising loop of one chunk ---------------------------------------------------------------------------

namespace {

struct ChunkInputs {
  at::Tensor prompt;    // compute dtype, device
  at::Tensor negative;  // undefined without CFG
  bool guidance = false;
};

ChunkInputs prepare_conditioning(const Conditioning& c, const GenerationParams& p, const DenoiserInfo& info) {
  if (!c.prompt_embeds.defined() || c.prompt_embeds.dim() != 3) {
    throw std::invalid_argument("prompt_embeds: expected [B, T, text_dim], got " +
                                (c.prompt_embeds.defined() ? shape_text(c.prompt_embeds.sizes()) : "nothing"));
  }
  ChunkInputs in;
  in.guidance = p.guidance_scale > 1.0;  // diffusers' do_classifier_free_guidance
  in.prompt = c.prompt_embeds.to(info.device, info.dtype);
  if (in.guidance) {
    if (!c.negative_prompt_embeds || !c.negative_prompt_embeds->defined()) {
      throw std::invalid_argument("negative_prompt_embeds: required when guidance_scale > 1 (got " +
                                  std::to_string(p.guidance_scale) + ")");
    }
    const at::Tensor& n = *c.negative_prompt_embeds;
    if (n.dim() != 3 || n.size(0) != c.prompt_embeds.size(0) || n.size(2) != c.prompt_embeds.size(2)) {
      throw std::invalid_argument("negative_prompt_embeds: shape " + shape_text(n.sizes()) +
                                  " does not match prompt_embeds " + shape_text(c.prompt_embeds.sizes()));
    }
    in.negative = n.to(info.device, info.dtype);
  }
  return in;
}

// Normalised condition latents for `batch` items (one per item, or one for all), checked against the chunk.
at::Tensor condition_frames(const at::Tensor& latents, const std::string& field, int64_t frames, int64_t batch,
                            const ChunkPlan& plan, const DenoiserInfo& info) {
  if (!latents.defined() || latents.dim() != 5 || (latents.size(0) != batch && latents.size(0) != 1) ||
      latents.size(1) != info.latent_channels || latents.size(2) < frames || latents.size(3) != plan.latent_height ||
      latents.size(4) != plan.latent_width) {
    throw std::invalid_argument(field + ": expected [" + std::to_string(batch) + " or 1, " +
                                std::to_string(info.latent_channels) + ", >= " + std::to_string(frames) + ", " +
                                std::to_string(plan.latent_height) + ", " + std::to_string(plan.latent_width) +
                                "] (encode_conditioning), got " +
                                (latents.defined() ? shape_text(latents.sizes()) : "nothing"));
  }
  return latents.narrow(2, 0, frames).expand({batch, -1, -1, -1, -1});
}

// The previous chunk's tail: diffusers' prefix = video[:, :, -O:] cut to P frames.
at::Tensor previous_tail(const ChunkPlan& plan, const ChunkSpec& chunk, const DenoiserInfo& info, int64_t batch,
                         const at::Tensor& previous) {
  const int64_t overlap = plan.overlap_latent_frames;
  if (!previous.defined() || previous.dim() != 5 || previous.size(2) < overlap || previous.size(0) != batch ||
      previous.size(1) != info.latent_channels || previous.size(3) != plan.latent_height ||
      previous.size(4) != plan.latent_width) {
    throw std::invalid_argument(
        "previous_latents: chunk " + std::to_string(chunk.index) + " needs the accumulated latents with at least " +
        std::to_string(overlap) + " frames of [" + std::to_string(batch) + ", " + std::to_string(info.latent_channels) +
        ", F, " + std::to_string(plan.latent_height) + ", " + std::to_string(plan.latent_width) + "], got " +
        (previous.defined() ? shape_text(previous.sizes()) : "nothing"));
  }
  return previous.narrow(2, previous.size(2) - overlap, chunk.prefix_frames);
}

// The chunk's starting latents: fresh fp32 noise with the prefix copied in (chunk 0: the image / video condition;
// later chunks: the previous chunk's tail), and the last_image latent appended to the last chunk. Both go through
// the transformer dtype first, as in diffusers (bf16 rounding).
at::Tensor initial_latents(const ChunkPlan& plan, const ChunkSpec& chunk, const DenoiserInfo& info, int64_t batch,
                           const Conditioning& conditioning, const at::Tensor& previous, NoiseSource& noise) {
  const std::vector<int64_t> shape = {batch, info.latent_channels, chunk.num_latent_frames, plan.latent_height,
                                      plan.latent_width};
  at::Tensor latents = noise.latent_noise(chunk.index, shape);
  if (latents.sizes() != at::IntArrayRef(shape)) {
    throw std::logic_error("noise source returned " + shape_text(latents.sizes()) + " for latent shape " +
                           shape_text(shape));
  }
  latents = latents.to(info.device, at::kFloat).contiguous();
  if (chunk.prefix_frames > 0) {
    const at::Tensor prefix = chunk.index == 0 ? condition_frames(conditioning.prefix_latents, "prefix_latents",
                                                                  chunk.prefix_frames, batch, plan, info)
                                               : previous_tail(plan, chunk, info, batch, previous);
    latents.narrow(2, 0, chunk.prefix_frames).copy_(prefix.to(info.device).to(info.dtype));
  }
  if (chunk.suffix_frames > 0) {
    const at::Tensor suffix =
        condition_frames(conditioning.last_image_latents, "last_image_latents", chunk.suffix_frames, batch, plan, info);
    latents = at::cat({latents, suffix.to(info.device).to(info.dtype).to(at::kFloat)}, 2);
  }
  return latents;
}

// addnoise_condition: lightly noise the clean prefix in the model input only, and tell the model its timestep.
void noise_condition(at::Tensor& model_input, at::Tensor& timestep, const GenerationParams& p, const ChunkSpec& chunk,
                     int64_t start, int64_t row, NoiseSource& noise) {
  if (!(p.addnoise_condition > 0.0) || start >= chunk.prefix_frames) return;
  const double factor = 0.001 * p.addnoise_condition;
  at::Tensor part = model_input.narrow(2, start, chunk.prefix_frames - start);
  const at::Tensor n = noise.condition_noise(chunk.index, row, part.sizes()).to(part.device()).to(part.scalar_type());
  part.copy_(part * (1.0 - factor) + n * factor);
  timestep.narrow(1, start, chunk.prefix_frames - start).fill_(p.addnoise_condition);  // int64: truncated
}

// Scheduler updates of one row: frames sharing a step counter are advanced together.
void update_frames(FrameSampler& schedulers, at::Tensor& latents, const at::Tensor& prediction,
                   const at::Tensor& row_mask, const at::Tensor& row_index, int64_t start, int64_t end) {
  const auto mask = row_mask.accessor<bool, 1>();
  const auto index = row_index.accessor<int64_t, 1>();
  std::map<int64_t, std::vector<int64_t>> groups;  // step counter -> frames
  for (int64_t f = start; f < end; ++f) {
    if (!mask[f]) continue;
    const int64_t k = schedulers.steps_taken(f);
    if (index[f] != k + 1) {
      throw std::logic_error("diffusion forcing: frame " + std::to_string(f) + " is at step " + std::to_string(k) +
                             " but the timestep matrix expects step " + std::to_string(index[f] - 1));
    }
    groups[k].push_back(f);
  }
  for (const auto& [k, frames] : groups) {
    const bool contiguous = frames.back() - frames.front() + 1 == static_cast<int64_t>(frames.size());
    const auto count = static_cast<int64_t>(frames.size());
    if (contiguous) {
      const at::Tensor out = schedulers.step(frames, prediction.narrow(2, frames.front() - start, count),
                                             latents.narrow(2, frames.front(), count));
      latents.narrow(2, frames.front(), count).copy_(out);
    } else {
      const at::Tensor idx = at::tensor(frames, at::kLong).to(latents.device());
      const at::Tensor out =
          schedulers.step(frames, prediction.index_select(2, idx - start), latents.index_select(2, idx));
      latents.index_copy_(2, idx, out);
    }
  }
}

// Which frames of row i's call are updated, and which are final: at timestep 0, not updated, and not re-noised by
// addnoise_condition. The timestep matrix only moves frames forward, so a final frame stays final.
void mark_frames(DenoiseCall& call, const TimestepMatrix& matrix, const GenerationParams& p, const ChunkSpec& chunk,
                 int64_t row, int64_t start, int64_t end) {
  const auto mask = matrix.update_mask.accessor<bool, 2>();
  const auto steps = matrix.step_matrix.accessor<int64_t, 2>();
  const int64_t renoised = p.addnoise_condition > 0.0 ? chunk.prefix_frames : 0;
  call.updated.assign(static_cast<size_t>(end - start), 0);
  call.final_frames.assign(static_cast<size_t>(end - start), 0);
  for (int64_t f = start; f < end; ++f) {
    const auto i = static_cast<size_t>(f - start);
    call.updated[i] = mask[row][f] ? 1 : 0;
    call.final_frames[i] = !mask[row][f] && steps[row][f] == 0 && f >= renoised ? 1 : 0;
  }
}

// The running chunk's clean-latent estimate for previews (made only when they are asked for): the first video of the
// batch, the chunk's new frames. It reads the loop's tensors and writes only its own.
class PreviewEstimate {
 public:
  PreviewEstimate(const at::Tensor& latents, const ChunkSpec& chunk)
      : from_(chunk.keep_from),
        x0_(latents.narrow(0, 0, 1).narrow(2, from_, chunk.num_latent_frames - from_).clone()),
        first_frame_(chunk.output_begin) {}

  static bool due(const GenerationParams& p, const StepHooks& hooks, int64_t row, int64_t rows) {
    return p.preview_every > 0 && hooks.on_preview && ((row + 1) % p.preview_every == 0 || row + 1 == rows);
  }

  // Before row `row`'s update: the frames it updates get x_t - sigma * v (their own sigma); frames already final
  // their latents; the others keep their last estimate.
  void record(const at::Tensor& latents, const at::Tensor& prediction, const FrameSampler& sampler,
              const TimestepMatrix& matrix, int64_t row, int64_t start, int64_t end) {
    const auto mask = matrix.update_mask.accessor<bool, 2>();
    const auto steps = matrix.step_matrix.accessor<int64_t, 2>();
    for (int64_t f = from_; f < from_ + x0_.size(2); ++f) {
      at::Tensor x0 = x0_.narrow(2, f - from_, 1);
      const at::Tensor x_t = latents.narrow(0, 0, 1).narrow(2, f, 1);
      if (f >= start && f < end && mask[row][f]) {
        const at::Tensor v = prediction.narrow(0, 0, 1).narrow(2, f - start, 1).to(at::kFloat);
        x0.copy_(x_t - v * static_cast<double>(sampler.sigma(f)));
      } else if (steps[row][f] == 0) {
        x0.copy_(x_t);
      }
    }
  }

  ChunkPreview preview(int64_t chunk, int64_t row, int64_t rows) const {
    return ChunkPreview{chunk, row, rows, first_frame_, x0_.clone()};
  }

 private:
  int64_t from_;
  at::Tensor x0_;  // fp32 [1, 16, F_new, h, w]
  int64_t first_frame_;
};

void check_plan(const ChunkPlan& plan, int64_t chunk_index, const GenerationParams& p) {
  if (p.preview_every < 0) {
    throw std::invalid_argument("preview_every: " + std::to_string(p.preview_every) + " is negative (0: no previews)");
  }
  if (chunk_index < 0 || chunk_index >= static_cast<int64_t>(plan.chunks.size())) {
    throw std::invalid_argument("chunk_index: " + std::to_string(chunk_index) + " outside the plan's " +
                                std::to_string(plan.chunks.size()) + " chunks");
  }
  if (plan.latent_height != p.height / kSpatialFactor || plan.latent_width != p.width / kSpatialFactor) {
    throw std::invalid_argument("plan: latent size " + std::to_string(plan.latent_height) + "x" +
                                std::to_string(plan.latent_width) + " does not match height/width of the params");
  }
}

}  // namespace

ChunkSampler make_chunk_sampler(const GenerationParams& params, int64_t num_frames) {
  ChunkSampler out;
  if (params.sampler == SamplerKind::kEuler) {
    auto sampler = std::make_shared<const FlowEulerSampler>(make_flow_euler_schedule(
        params.scheduler.num_train_timesteps, params.flow_shift, params.num_inference_steps, params.timesteps));
    out.step_template = sampler->schedule().model_timesteps;
    out.frames = std::make_unique<FlowEulerFrames>(std::move(sampler), num_frames);
    return out;
  }
  if (!params.timesteps.empty()) {
    throw std::invalid_argument("scheduler.timesteps: an explicit timestep list needs scheduler.type euler");
  }
  FlowUniPCConfig scheduler_config = params.scheduler;
  scheduler_config.flow_shift = params.flow_shift;
  auto sampler = std::make_shared<const FlowUniPCSampler>(scheduler_config, params.num_inference_steps);
  out.step_template = sampler->schedule().timesteps;
  out.frames = std::make_unique<FlowUniPCFrames>(std::move(sampler), num_frames);
  return out;
}

Conditioning prompt_for_chunk(const Conditioning& conditioning, const ChunkSpec& chunk) {
  Conditioning out;
  out.prompt_embeds = conditioning.prompt_embeds;
  out.negative_prompt_embeds = conditioning.negative_prompt_embeds;
  int64_t last_from = -1;
  for (const PromptChange& change : conditioning.prompt_changes) {
    if (change.from_frame <= last_from) {
      throw std::invalid_argument("prompt_changes: frames must be given in increasing order (" +
                                  std::to_string(change.from_frame) + " after " + std::to_string(last_from) + ")");
    }
    last_from = change.from_frame;
    const at::Tensor& e = change.prompt_embeds;
    if (!e.defined() || e.dim() != 3 || !out.prompt_embeds.defined() || e.size(0) != out.prompt_embeds.size(0) ||
        e.size(2) != out.prompt_embeds.size(2)) {
      throw std::invalid_argument("prompt_changes: the prompt from frame " + std::to_string(change.from_frame) +
                                  " has shape " + (e.defined() ? shape_text(e.sizes()) : "nothing") +
                                  ", not [B, T, text_dim] like prompt_embeds");
    }
    if (change.from_frame > chunk.first_new_pixel_frame()) continue;
    out.prompt_embeds = change.prompt_embeds;
    if (change.negative_prompt_embeds) out.negative_prompt_embeds = change.negative_prompt_embeds;
  }
  return out;
}

at::Tensor run_chunk(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                     const ChunkPlan& plan, int64_t chunk_index, const Conditioning& conditioning,
                     const at::Tensor& previous_latents, NoiseSource& noise, const StepHooks& hooks) {
  check_plan(plan, chunk_index, params);
  const ChunkSpec& chunk = plan.chunks[static_cast<size_t>(chunk_index)];
  const ChunkInputs inputs = prepare_conditioning(prompt_for_chunk(conditioning, chunk), params, info);
  const int64_t batch = conditioning.prompt_embeds.size(0);

  const int64_t frames = chunk.num_latent_frames + chunk.suffix_frames;
  ChunkSampler sampler = make_chunk_sampler(params, frames);
  const TimestepMatrix matrix = chunk_timestep_matrix(chunk, sampler.step_template, params.ar_step, plan.causal_block_size);
  if (matrix.step_matrix.size(1) != frames) {
    throw std::invalid_argument("causal_block_size: chunk " + std::to_string(chunk_index) + " has " +
                                std::to_string(frames) + " latent frames, not a multiple of " +
                                std::to_string(plan.causal_block_size) + " (use plan_chunks)");
  }

  noise.begin_chunk(plan, chunk_index);
  at::Tensor latents = initial_latents(plan, chunk, info, batch, conditioning, previous_latents, noise);
  FrameSampler& schedulers = *sampler.frames;
  spdlog::debug("chunk {}/{}: {} latent frames, prefix {}, {} rows", chunk_index + 1, plan.chunks.size(),
                chunk.num_latent_frames, chunk.prefix_frames, matrix.rows());

  const at::Tensor timestep_rows = matrix.step_matrix.to(info.device);
  std::optional<PreviewEstimate> estimate;
  if (params.preview_every > 0 && hooks.on_preview) estimate.emplace(latents, chunk);
  for (int64_t i = 0; i < matrix.rows(); ++i) {
    if (hooks.cancelled && hooks.cancelled()) {
      throw GenerationCancelled("generation cancelled at chunk " + std::to_string(chunk_index) + ", row " +
                                std::to_string(i));
    }
    const auto [start, end] = matrix.valid_interval[static_cast<size_t>(i)];
    DenoiseCall call;
    call.latent_model_input = latents.narrow(2, start, end - start).to(info.dtype).clone();
    call.timestep = timestep_rows.select(0, i).expand({batch, -1}).narrow(1, start, end - start).clone();
    noise_condition(call.latent_model_input, call.timestep, params, chunk, start, i, noise);
    call.chunk = chunk_index;
    call.row = i;
    call.num_frame_per_block = plan.causal_block_size;
    call.first_frame = start;
    mark_frames(call, matrix, params, chunk, i, start, end);
    call.encoder_hidden_states = inputs.prompt;
    at::Tensor prediction = denoiser(call);
    if (inputs.guidance) {
      call.encoder_hidden_states = inputs.negative;
      call.unconditional = true;
      const at::Tensor uncond = denoiser(call);
      prediction = uncond + params.guidance_scale * (prediction - uncond);  // in the model's dtype, as diffusers
    }
    if (prediction.sizes() != call.latent_model_input.sizes()) {
      throw std::logic_error("denoiser returned " + shape_text(prediction.sizes()) + " for input " +
                             shape_text(call.latent_model_input.sizes()));
    }
    const bool preview = PreviewEstimate::due(params, hooks, i, matrix.rows());
    if (preview) estimate->record(latents, prediction, schedulers, matrix, i, start, end);
    update_frames(schedulers, latents, prediction, matrix.update_mask.select(0, i), matrix.step_index.select(0, i),
                  start, end);
    if (hooks.on_step) hooks.on_step(chunk_index, i, matrix.rows());
    if (preview) hooks.on_preview(estimate->preview(chunk_index, i, matrix.rows()));
  }
  return latents;
}

at::Tensor accumulate(const at::Tensor& accumulated, const at::Tensor& chunk_latents, const ChunkSpec& chunk) {
  if (chunk.index == 0 || !accumulated.defined()) return chunk_latents;
  const at::Tensor fresh = chunk_latents.narrow(2, chunk.keep_from, chunk_latents.size(2) - chunk.keep_from);
  return at::cat({accumulated, fresh.to(accumulated.device())}, 2);
}

at::Tensor generate(const Denoiser& denoiser, const DenoiserInfo& info, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks,
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk) {
  const ChunkPlan plan = plan_chunks(params, info.num_frame_per_block);
  at::Tensor video;
  for (const ChunkSpec& chunk : plan.chunks) {
    const at::Tensor latents = run_chunk(denoiser, info, params, plan, chunk.index, conditioning, video, noise, hooks);
    if (on_chunk) on_chunk(chunk.index, latents);
    video = accumulate(video, latents, chunk);
  }
  return video;
}

// ---- with the transformer --------------------------------------------------------------------------------------

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

std::string step_cache_decisions_json(const std::vector<TransformerCallReport>& calls) {
  nlohmann::json out = nlohmann::json::array();
  for (const TransformerCallReport& c : calls) {
    if (!c.step_cache) continue;
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

}  // namespace

Denoiser transformer_denoiser(const SkyReelsV2Transformer& model, const GenerationParams& params,
                              std::function<bool()> cancelled, std::function<void(const TransformerCallReport&)> on_call,
                              std::shared_ptr<DenoiseCache> cache) {
  const int64_t fps_index = params.fps == 16 ? 0 : 1;  // diffusers: [0 if fps == 16 else 1] per batch item
  if (!cache) cache = make_denoise_cache();
  return [&model, params, fps_index, cancelled = std::move(cancelled), on_call = std::move(on_call),
          cache = std::move(cache)](const DenoiseCall& call) {
    const at::Tensor& input = call.latent_model_input;
    TransformerForwardArgs args;
    args.timestep = call.timestep;
    args.encoder_hidden_states = call.encoder_hidden_states;
    if (model.config().inject_sample_info) {
      args.fps = at::full({input.size(0)}, fps_index, at::TensorOptions().dtype(at::kLong).device(input.device()));
    }
    args.num_frame_per_block = call.num_frame_per_block;  // per request; the model config is never written
    args.adapters = params.adapters;
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
      report.step_cache = first_block || per_block_cache;
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
                     NoiseSource& noise, const StepHooks& hooks, std::shared_ptr<DenoiseCache> cache) {
  if (!cache && chunk_index > 0 && params.cache.kind != StepCacheKind::kNone &&
      params.cache.scope == StepCacheScope::kRequest) {
    throw std::invalid_argument("cache_scope: request keeps the step cache from chunk to chunk, so chunk " +
                                std::to_string(chunk_index) +
                                " needs the request's DenoiseCache (every chunk in one loop); use cache_scope chunk");
  }
  return run_chunk(transformer_denoiser(model, params, hooks.cancelled, hooks.on_call, std::move(cache)),
                   denoiser_info(model), params, plan, chunk_index, conditioning, previous_latents, noise, hooks);
}

at::Tensor generate(const SkyReelsV2Transformer& model, const GenerationParams& params,
                    const Conditioning& conditioning, NoiseSource& noise, const StepHooks& hooks,
                    const std::function<void(int64_t, const at::Tensor&)>& on_chunk) {
  return generate(transformer_denoiser(model, params, hooks.cancelled, hooks.on_call), denoiser_info(model), params,
                  conditioning, noise, hooks, on_chunk);
}

}  // namespace skyreels::model
