// Flow UniPC multistep sampler: diffusers' UniPCMultistepScheduler with use_flow_sigmas=True and
// prediction_type="flow_prediction" (diffusers >= v0.37 sigma grid), predictor UniP + corrector UniC (B(h) variants),
// solver order <= 2, lower order on the last step.
//
// Diffusion forcing keeps one scheduler per latent frame. Here one FlowUniPCFrames object holds the state of every
// frame of a chunk, and frames that sit at the same step are advanced together in one vectorised update (they share
// every scalar coefficient, and the math is elementwise, so this equals stepping them one by one).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/sampler.h"

namespace skyreels::model {

// The scheduler_config.json fields this sampler honours. Every other accepted key must hold the value SkyReels-V2
// uses (flow sigmas, flow prediction, predict_x0, no thresholding, no dynamic shifting...); anything else is refused
// by from_json with a message naming the key.
struct FlowUniPCConfig {
  int64_t num_train_timesteps = 1000;
  int64_t solver_order = 2;         // 1 or 2
  std::string solver_type = "bh2";  // "bh1" or "bh2"
  bool lower_order_final = true;
  std::vector<int64_t> disable_corrector;  // step indices whose corrector is skipped (diffusers semantics)
  std::string final_sigmas_type = "zero";  // "zero" or "sigma_min"
  // diffusers' default; the SkyReels-V2 docs override it with 8 (T2V) or 5 (I2V/V2V). GenerationParams::flow_shift
  // is what the generation loop uses.
  double flow_shift = 1.0;

  // Parses a diffusers scheduler_config.json text (its _class_name, when given, the unipc row's config_class in
  // model/sampler_table.h); `origin` (a file name) is used in error messages.
  static FlowUniPCConfig from_json(const std::string& text, const std::string& origin = "scheduler_config.json");
  static FlowUniPCConfig from_file(const std::string& path);
  // Throws std::invalid_argument naming the field.
  void validate() const;
};

// set_timesteps(N): N integer timesteps for the model and N+1 float sigmas for the solver.
struct FlowSchedule {
  std::vector<int64_t> timesteps;  // int64(sigma * T), computed in float64 and truncated (may repeat)
  std::vector<float> sigmas;       // fp32, N+1 values, last = 0 (final_sigmas_type "zero")
};
FlowSchedule make_flow_schedule(const FlowUniPCConfig& config, int64_t num_inference_steps);

// The schedule plus every per-step scalar coefficient, computed once (on CPU, fp32, with the same tensor operations
// diffusers uses, so the coefficients are bit-identical to its). Immutable and shareable between requests.
class FlowUniPCSampler {
 public:
  FlowUniPCSampler(FlowUniPCConfig config, int64_t num_inference_steps);
  ~FlowUniPCSampler();
  FlowUniPCSampler(const FlowUniPCSampler&) = delete;
  FlowUniPCSampler& operator=(const FlowUniPCSampler&) = delete;

  const FlowUniPCConfig& config() const;
  const FlowSchedule& schedule() const;
  int64_t num_steps() const;
  int64_t predictor_order(int64_t step) const;  // order of UniP at call `step` (1 on the first and last steps)
  bool uses_corrector(int64_t step) const;      // whether UniC runs at call `step`

  struct StepCoefficients;  // internal
  const StepCoefficients& coefficients(int64_t step) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Independent UniPC trajectories for `num_frames` latent frames (frame axis = dim 2 of [B, C, F, H, W]); each frame
// has its own step counter and history, exactly as diffusers' per-frame deepcopy'd schedulers do. A frame's k-th call
// uses step k of the schedule (its counter, never a search for the timestep value, so repeated integer timesteps
// are harmless).
class FlowUniPCFrames : public FrameSampler {
 public:
  FlowUniPCFrames(std::shared_ptr<const FlowUniPCSampler> sampler, int64_t num_frames);

  int64_t num_frames() const override { return static_cast<int64_t>(steps_.size()); }
  int64_t steps_taken(int64_t frame) const override;
  float sigma(int64_t frame) const override;

  // One scheduler step for `frames` (all at the same step counter, else std::invalid_argument).
  // model_output: [B, C, G, H, W] velocity (any float dtype; sigma*v is computed in that dtype as diffusers does),
  // sample: [B, C, G, H, W] (the latents, fp32). Returns the next sample [B, C, G, H, W] in sample's dtype.
  at::Tensor step(const std::vector<int64_t>& frames, const at::Tensor& model_output,
                  const at::Tensor& sample) override;

  // The x0 prediction and the corrected sample of the last step() of `frame` (for traces and tests).
  at::Tensor last_x0(int64_t frame) const;
  at::Tensor last_corrected_sample(int64_t frame) const;

 private:
  std::shared_ptr<const FlowUniPCSampler> sampler_;
  std::vector<int64_t> steps_;
  // Per frame, each [B, C, 1, H, W]: x0 predictions of the two previous calls, and the last (corrected) sample.
  std::vector<at::Tensor> x0_prev_;
  std::vector<at::Tensor> x0_cur_;
  std::vector<at::Tensor> last_sample_;
};

}  // namespace skyreels::model
