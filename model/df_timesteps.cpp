// The timesteps of diffusion-forcing generation: the sampler a chunk uses and its step template (a factory per row of
// model/sampler_table.h), diffusers' generate_timestep_matrix (which frame is at which timestep in which row), and a
// chunk's own matrix with its pinned prefix / suffix columns. Separate from the plan and the loop because it is pure
// arithmetic on step counters that both of them read (the plan counts rows with it, the loop walks its rows).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/sampler_flow_euler.h"
#include "model/sampler_table.h"

namespace skyreels::model {

namespace {

ChunkSampler make_unipc(const GenerationParams& params, int64_t num_frames) {
  FlowUniPCConfig scheduler_config = params.scheduler;
  scheduler_config.flow_shift = params.flow_shift;
  auto sampler = std::make_shared<const FlowUniPCSampler>(scheduler_config, params.num_inference_steps);
  ChunkSampler out;
  out.step_template = sampler->schedule().timesteps;
  out.frames = std::make_unique<FlowUniPCFrames>(std::move(sampler), num_frames);
  return out;
}

FlowEulerSchedule euler_schedule(const GenerationParams& params) {
  return make_flow_euler_schedule(params.scheduler.num_train_timesteps, params.flow_shift, params.num_inference_steps,
                                  params.timesteps);
}

void check_euler(const GenerationParams& params) { euler_schedule(params); }

ChunkSampler make_euler(const GenerationParams& params, int64_t num_frames) {
  auto sampler = std::make_shared<const FlowEulerSampler>(euler_schedule(params));
  ChunkSampler out;
  out.step_template = sampler->schedule().model_timesteps;
  out.frames = std::make_unique<FlowEulerFrames>(std::move(sampler), num_frames);
  return out;
}

// The factory of each row of sampler_table.h, and the schedule checks the plan runs before any chunk (none: the
// sampler's own config checks only).
struct SamplerFactory {
  SamplerKind kind;
  ChunkSampler (*make)(const GenerationParams&, int64_t num_frames);
  void (*check)(const GenerationParams&);
};
constexpr SamplerFactory kFactories[] = {
    {SamplerKind::kUniPC, make_unipc, nullptr},
    {SamplerKind::kEuler, make_euler, check_euler},
};

const SamplerFactory& factory_of(SamplerKind kind) {
  for (const SamplerFactory& f : kFactories) {
    if (f.kind == kind) return f;
  }
  throw std::logic_error("sampler " + sampler_row(kind).name + " has no factory in df_timesteps.cpp");
}

void refuse_unwanted_timesteps(const GenerationParams& params) {
  const std::string refusal = timestep_list_refusal(params.sampler, !params.timesteps.empty());
  if (!refusal.empty()) throw std::invalid_argument(refusal);
}

}  // namespace

void check_sampler(const GenerationParams& params) {
  refuse_unwanted_timesteps(params);
  if (const auto check = factory_of(params.sampler).check) check(params);
}

ChunkSampler make_chunk_sampler(const GenerationParams& params, int64_t num_frames) {
  refuse_unwanted_timesteps(params);
  return factory_of(params.sampler).make(params, num_frames);
}

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

}  // namespace skyreels::model
