// Internal to diffusion-forcing generation, which is split by concept over df_timesteps.cpp (the sampler's step
// template and the timestep matrix), df_chunk_plan.cpp (validation and chunk geometry), df_noise.cpp (the noise
// sources), diffusion_forcing.cpp (the denoising loop of one chunk) and df_transformer_denoiser.cpp (the transformer
// as the loop's denoiser, with its kept keys / values and step cache): the Wan VAE factors both the plan and the loop
// read. Not a public header: only those files include it.
#pragma once

#include <cstdint>

namespace skyreels::model::df_detail {

inline constexpr int64_t kTemporalFactor = 4;  // Wan VAE: 4 pixel frames per latent frame (plus the first)
inline constexpr int64_t kSpatialFactor = 8;

}  // namespace skyreels::model::df_detail
