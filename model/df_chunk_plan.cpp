// The chunk plan of diffusion-forcing generation: every request field validated against the model config (errors
// that start with the field's name, the valid frame counts near a refused one), the geometry of a long video
// (base length, overlap, chunk lengths), the latent frames the pixel conditioning pins, and the ChunkPlan itself.
// Separate from the loop because it runs before any tensor exists: a server plans (and refuses) a request without a
// model.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/video_shape.h"

namespace skyreels::model {

namespace {

std::string join(const std::vector<int64_t>& values) {
  std::ostringstream os;
  for (size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
  return os.str();
}

}  // namespace

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
  if (!is_4k_plus_1(n)) return false;
  if (n > p.base_num_frames && !p.overlap_history) return false;  // would need overlap_history
  const Geometry g = geometry_of(n, p);
  if (g.long_video && g.overlap >= g.base) return false;
  return aligned(g, block);
}

// Pixel frame counts 4k+1 near `num_frames` (two below, two above) whose every chunk is a multiple of `block`.
std::vector<int64_t> valid_num_frames_near(int64_t num_frames, const GenerationParams& p, int64_t block) {
  std::vector<int64_t> below, above;
  const int64_t reach = kVaeTemporalFactor * block * (latent_frames_of(std::max(p.base_num_frames, int64_t{1})) + 2);
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
  const std::string multiple = "a positive multiple of " + std::to_string(kPixelMultiple);
  require(p.height > 0 && p.height % kPixelMultiple == 0,
          "height: must be " + multiple + ", got " + std::to_string(p.height));
  require(p.width > 0 && p.width % kPixelMultiple == 0, "width: must be " + multiple + ", got " + std::to_string(p.width));
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
  check_sampler(p);
  require(p.kv_cache_max_bytes >= 0, "kv_cache_max_bytes: must be >= 0");
  if (p.cache.kind == StepCacheKind::kTaylorSeer || p.cache.kind == StepCacheKind::kMagCache) {
    require(p.ar_step == 0,
            "cache: taylorseer and magcache need ar_step 0 on diffusion forcing (with ar_step > 0 the frames of one "
            "call sit at different noise levels and a chunk has more rows than steps; use first-block-per-block)");
    require(p.cache.scope == StepCacheScope::kChunk,
            "cache_scope: taylorseer and magcache keep their state per chunk only (use cache_scope chunk)");
  }
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
      const int64_t frames = pixel_frames_of(m * block);
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

ChunkPlan plan_chunks(const GenerationParams& params, int64_t model_num_frame_per_block) {
  const int64_t block = params.causal_block_size.value_or(model_num_frame_per_block);
  validate_basic(params, block);

  ChunkPlan plan;
  int64_t num_frames = params.num_frames;
  if (!is_4k_plus_1(num_frames)) {
    num_frames = four_k_plus_one_below(num_frames);
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
  plan.latent_height = latent_size_of(params.height);
  plan.latent_width = latent_size_of(params.width);
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

}  // namespace skyreels::model
