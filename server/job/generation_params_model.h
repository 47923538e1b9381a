// Where the generation parameters meet the model: ResolvedParams as model::GenerationParams (what a chunk runs
// with), and a diffusers scheduler_config.json as request values (`--scheduler-config`). The one place besides the
// table (server/generation_params.h) a new parameter the model uses is written.
#pragma once

#include "model/diffusion_forcing.h"
#include "model/sampler_flow_unipc.h"
#include "server/job/job_request.h"

namespace skyreels::server {

// Pixel conditioning (mode, last_image, ...) is left to model::describe_conditioning. A causal_block_size of 0 (no
// model known yet) stays unset: plan_chunks then takes the model's.
model::GenerationParams model_params(const ResolvedParams& params);

// The config's sampler settings and its flow_shift, as if each were requested.
void request_scheduler_config(const model::FlowUniPCConfig& config, JobRequest& request);

}  // namespace skyreels::server
