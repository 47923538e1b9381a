// The seam between the diffusion-forcing loop and its sampler: per-frame trajectories advanced a group of frames at a
// time. Diffusers keeps one scheduler per latent frame (a deepcopy each); a FrameSampler holds all of them for one
// chunk. Implementations: FlowUniPCFrames (model/sampler_flow_unipc.h, diffusers' UniPCMultistepScheduler) and
// FlowEulerFrames (model/sampler_flow_euler.h, diffusers' FlowMatchEulerDiscreteScheduler).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace skyreels::model {

class FrameSampler {
 public:
  virtual ~FrameSampler() = default;
  virtual int64_t num_frames() const = 0;
  // Calls of step() frame `frame` took so far: its next call uses step steps_taken(frame) of the schedule.
  virtual int64_t steps_taken(int64_t frame) const = 0;
  // The sigma of frame `frame`'s current sample (the schedule's sigma at steps_taken(frame)): flow matching's
  // clean-latent estimate is x0 = sample - sigma * velocity (previews).
  virtual float sigma(int64_t frame) const = 0;
  // One step for `frames`, all at the same step counter (else std::invalid_argument). model_output: [B, C, G, H, W]
  // velocity in the model's dtype; sample: [B, C, G, H, W] latents (fp32). Returns the next sample in sample's dtype.
  // No host synchronisation: every coefficient is a precomputed CPU scalar.
  virtual at::Tensor step(const std::vector<int64_t>& frames, const at::Tensor& model_output,
                          const at::Tensor& sample) = 0;
};

}  // namespace skyreels::model
