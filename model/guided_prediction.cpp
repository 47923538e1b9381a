// guided_prediction (guided_prediction.h).
#include "model/guided_prediction.h"

#include <ATen/ATen.h>

#include "model/guidance.h"
#include "model/rank_group.h"

namespace skyreels::model {

at::Tensor guided_prediction(const std::function<at::Tensor(bool unconditional)>& pass, double guidance_scale,
                             RankGroup* guidance_ranks) {
  if (!guided(guidance_scale)) return pass(false);
  at::Tensor cond, uncond;
  if (guidance_ranks != nullptr && guidance_ranks->size() == 2) {
    const at::Tensor both = guidance_ranks->all_gather(pass(guidance_ranks->rank() == 1));  // [cond, uncond]
    cond = both[0];
    uncond = both[1];
  } else {
    cond = pass(false);
    uncond = pass(true);
  }
  return uncond + guidance_scale * (cond - uncond);
}

}  // namespace skyreels::model
