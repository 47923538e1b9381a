// One denoising row's prediction with classifier-free guidance, for every loop (diffusion forcing, T2V / I2V): the
// conditional and the unconditional pass one after the other, or on a guidance-parallel pair of ranks (cfg=2) each
// rank its own pass, the two exchanged so that both ranks combine the same numbers.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace skyreels::model {

class RankGroup;

// pass(unconditional) runs one transformer pass. Unguided (guidance_scale <= 1): pass(false) alone, on every rank.
// Guided: uncond + scale * (cond - uncond) in the passes' dtype, as diffusers combines them.
at::Tensor guided_prediction(const std::function<at::Tensor(bool unconditional)>& pass, double guidance_scale,
                             RankGroup* guidance_ranks);

}  // namespace skyreels::model
