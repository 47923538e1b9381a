// MagCache's magnitude ratios of one checkpoint (`skyreels calibrate-magcache` writes them, the server's
// --magcache-ratios and `skyreels generate --magcache-ratios` read them): a small JSON file naming the model it was
// calibrated on, the step count and one ratio per step for each guidance context. diffusers' MagCacheConfig takes
// one list for both contexts: the cond context's is the one used (its first printed list); uncond's is kept for
// inspection. A request with another step count resamples the list as diffusers does (nearest_interp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace skyreels::model {

class SkyReelsV2Transformer;
struct MappedTransformerCheckpoint;

struct MagCacheRatios {
  std::vector<float> cond, uncond;  // one per step (uncond: empty without guidance)
  int64_t num_inference_steps = 0;
  std::string model;     // magcache_model_signature of the checkpoint calibrated
  std::string settings;  // how the run was made (prompt source, size, steps, shift, guidance), for people
};

// What identifies a checkpoint to its ratios: the architecture and the fp64 sums of |w| of two parameter tensors
// (proj_out.weight, blocks.0.scale_shift_table; 4 digits, so that the same checkpoint loaded in another dtype
// matches), so that ratios of another model (even one of the same shape) are refused. Reads two small tensors.
std::string magcache_model_signature(const SkyReelsV2Transformer& model);
std::string magcache_model_signature(const MappedTransformerCheckpoint& checkpoint);  // the same, before loading

// Files larger than this are refused before they are read (a few thousand steps fit in a few hundred KiB).
constexpr int64_t kMaxMagCacheRatiosBytes = int64_t{1} << 20;

// Reads `path` for the model of `model_signature`; throws std::invalid_argument naming the file for a file too large,
// damaged JSON, another format, ratios that are missing, not finite or not positive, a step count that is not the
// list's length, or ratios calibrated on another model (its signature).
MagCacheRatios load_magcache_ratios(const std::string& path, const std::string& model_signature);
void save_magcache_ratios(const std::string& path, const MagCacheRatios& ratios);

}  // namespace skyreels::model
