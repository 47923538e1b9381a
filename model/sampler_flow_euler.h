// Flow-matching Euler sampler: diffusers' FlowMatchEulerDiscreteScheduler (shift = flow_shift, no dynamic shifting,
// deterministic), as the diffusion-forcing pipelines run it: one trajectory per latent frame, x_next = x + (sigma_next
// - sigma) * v with float32 sigmas, the transformer told the timesteps truncated to integers (the step matrix is
// .long()).
//
// Two schedules, as set_timesteps makes them:
//  * spaced (no list): num_inference_steps timesteps linspace(sigma_max * T, sigma_min * T) in float64, where
//    sigma_max / sigma_min are the scheduler's own shifted training sigmas; the shift is applied again, so the last
//    sigma is shifted twice (shift 5, 6 steps: 0.0244);
//  * an explicit list (`scheduler.timesteps`, e.g. 1000,750,500,250: the timesteps before the shift), shifted in
//    float32: s * sigma / (1 + (s - 1) * sigma). 1000,750,500,250 with shift 5 is LightX2V's 4-step recipe:
//    timesteps 1000, 937.5, 833.3, 625, sigmas 1, .9375, .8333, .625, 0.
// Either way the last step goes to sigma 0.
//
// The DF pipelines hand step() the int64 step-matrix value; diffusers' scheduler finds its first step index by
// comparing that value with its float timesteps, so a schedule whose first shifted timestep is not an integer (the
// list 999,... with shift 5) makes diffusers fail. Such schedules are refused here (std::invalid_argument naming
// scheduler.timesteps), as are lists that are empty, not strictly decreasing (before or after the shift), or outside
// (0, num_train_timesteps].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/sampler.h"

namespace skyreels::model {

// The scheduler_config.json of diffusers' FlowMatchEulerDiscreteScheduler (what a few-step model's pipeline folder
// ships in scheduler/), as far as this sampler honours it: `shift` (the request's flow_shift) and num_train_timesteps.
// The options it does not implement are refused by from_json naming the key when they are on: use_dynamic_shifting,
// use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas, stochastic_sampling, invert_sigmas, shift_terminal.
// The settings only dynamic shifting reads (base_shift, max_shift, base/max_image_seq_len, time_shift_type) are
// ignored.
struct FlowEulerConfig {
  int64_t num_train_timesteps = 1000;
  double shift = 1.0;  // diffusers' default; GenerationParams::flow_shift is what the generation loop uses

  // Parses the text (its _class_name, when given, the euler row's config_class in model/sampler_table.h); `origin`
  // (a file name) is used in error messages, each "key: what (in origin)".
  static FlowEulerConfig from_json(const std::string& text, const std::string& origin = "scheduler_config.json");
  static FlowEulerConfig from_file(const std::string& path);
};

// Longest explicit timestep list accepted (the server's --max-steps bounds it further).
constexpr int64_t kMaxEulerTimesteps = 1000;

struct FlowEulerSchedule {
  std::vector<float> timesteps;          // float32, N values (sigma * T, as diffusers' scheduler.timesteps)
  std::vector<int64_t> model_timesteps;  // what the transformer sees: timesteps truncated (the step matrix's .long())
  std::vector<float> sigmas;             // float32, N + 1 values, last 0
};

// set_timesteps(num_inference_steps) when `timesteps` is empty, set_timesteps(timesteps=...) otherwise (then
// num_inference_steps must equal its length). Throws std::invalid_argument naming the field.
FlowEulerSchedule make_flow_euler_schedule(int64_t num_train_timesteps, double shift, int64_t num_inference_steps,
                                           const std::vector<int64_t>& timesteps);

// The list's own checks (no shift): non-empty, at most kMaxEulerTimesteps, each in (0, num_train_timesteps], strictly
// decreasing. Throws std::invalid_argument("scheduler.timesteps: ...").
void check_timestep_list(const std::vector<int64_t>& timesteps, int64_t num_train_timesteps);

class FlowEulerSampler {
 public:
  explicit FlowEulerSampler(FlowEulerSchedule schedule);
  const FlowEulerSchedule& schedule() const { return schedule_; }
  int64_t num_steps() const { return static_cast<int64_t>(schedule_.timesteps.size()); }
  const at::Tensor& dt(int64_t step) const;  // 0-dim fp32 CPU: sigmas[k + 1] - sigmas[k], as diffusers computes it

 private:
  FlowEulerSchedule schedule_;
  std::vector<at::Tensor> dt_;
};

class FlowEulerFrames : public FrameSampler {
 public:
  FlowEulerFrames(std::shared_ptr<const FlowEulerSampler> sampler, int64_t num_frames);
  int64_t num_frames() const override { return static_cast<int64_t>(steps_.size()); }
  int64_t steps_taken(int64_t frame) const override;
  float sigma(int64_t frame) const override;
  // prev = sample.float() + dt * model_output (dt * v in v's dtype), then cast to v's dtype and back to sample's.
  at::Tensor step(const std::vector<int64_t>& frames, const at::Tensor& model_output,
                  const at::Tensor& sample) override;

 private:
  std::shared_ptr<const FlowEulerSampler> sampler_;
  std::vector<int64_t> steps_;
};

}  // namespace skyreels::model
