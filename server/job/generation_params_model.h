// Where the generation parameters meet the model: ResolvedParams as model::GenerationParams (what a chunk runs
// with), and a diffusers scheduler_config.json as request values (`--scheduler-config`). The one place besides the
// table (server/generation_params.h) a new parameter the model uses is written.
#pragma once

#include "model/diffusion_forcing.h"
#include "model/scheduler_config.h"
#include "server/job/job_request.h"

namespace skyreels::server {

// Pixel conditioning (mode, last_image, ...) is left to model::describe_conditioning. A causal_block_size of 0 (no
// model known yet) stays unset: plan_chunks then takes the model's.
model::GenerationParams model_params(const ResolvedParams& params);

// The config's sampler settings and its shift, as if each were requested: a UniPC config's solver settings,
// num_train_timesteps and flow_shift; a FlowMatchEuler config's num_train_timesteps and shift (as flow_shift). The
// sampler itself (scheduler.type) is not set: model::read_scheduler_config checked the config is the sampler's.
void request_scheduler_config(const model::FlowUniPCConfig& config, JobRequest& request);
void request_scheduler_config(const model::FlowEulerConfig& config, JobRequest& request);
void request_scheduler_config(const model::SchedulerConfig& config, JobRequest& request);

}  // namespace skyreels::server
