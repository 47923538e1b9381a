#include "server/job/generation_params_model.h"

#include <variant>

#include "model/sampler_table.h"

namespace skyreels::server {

model::GenerationParams model_params(const ResolvedParams& r) {
  model::GenerationParams p;
  p.num_frames = r.num_frames;
  p.height = r.height;
  p.width = r.width;
  p.num_inference_steps = r.num_inference_steps;
  p.base_num_frames = r.base_num_frames;
  p.overlap_history = r.overlap_history;
  p.ar_step = r.ar_step;
  if (r.causal_block_size > 0) p.causal_block_size = r.causal_block_size;
  p.fps = r.fps;
  p.guidance_scale = r.guidance_scale;
  p.flow_shift = r.flow_shift;
  p.addnoise_condition = r.addnoise_condition;
  p.seed = r.seed;
  p.scheduler.num_train_timesteps = r.num_train_timesteps;
  p.scheduler.solver_order = r.solver_order;
  p.scheduler.lower_order_final = r.lower_order_final;
  p.scheduler.solver_type = r.solver_type;
  p.scheduler.final_sigmas_type = r.final_sigmas_type;
  p.scheduler.disable_corrector = r.disable_corrector;
  p.sampler = model::sampler_kind(r.sampler);
  p.timesteps = r.timesteps;
  p.exact_savings = r.exact_savings;
  if (r.cache == "first-block") p.cache.kind = model::StepCacheKind::kFirstBlock;
  if (r.cache == "first-block-per-block") p.cache.kind = model::StepCacheKind::kFirstBlockPerBlock;
  p.cache.max_skips = r.cache_max_skips;
  p.cache.threshold = r.cache_threshold;
  p.cache.scope = r.cache_scope == "request" ? model::StepCacheScope::kRequest : model::StepCacheScope::kChunk;
  if (r.cache == "taylorseer") p.cache.kind = model::StepCacheKind::kTaylorSeer;
  if (r.cache == "magcache") p.cache.kind = model::StepCacheKind::kMagCache;
  model::TaylorSeerCache& t = p.cache.taylorseer;
  t.cache_interval = r.taylorseer_cache_interval;
  t.disable_cache_before_step = r.taylorseer_disable_cache_before_step;
  t.disable_cache_after_step = r.taylorseer_disable_cache_after_step;
  t.max_order = r.taylorseer_max_order;
  t.factors_dtype = r.taylorseer_factors_dtype == "float32"   ? model::TaylorFactorsDtype::kFloat32
                    : r.taylorseer_factors_dtype == "float16" ? model::TaylorFactorsDtype::kFloat16
                                                              : model::TaylorFactorsDtype::kBFloat16;
  t.cache_modules = model::split_module_patterns(r.taylorseer_cache_modules);
  t.skip_modules = model::split_module_patterns(r.taylorseer_skip_modules);
  t.lite = r.taylorseer_lite;
  p.cache.magcache.threshold = r.magcache_threshold;
  p.cache.magcache.max_skip_steps = r.magcache_max_skip_steps;
  p.cache.magcache.retention_ratio = r.magcache_retention_ratio;
  p.preview_every = r.preview_every;
  return p;
}

void request_scheduler_config(const model::FlowUniPCConfig& config, JobRequest& request) {
  request.num_train_timesteps = config.num_train_timesteps;
  request.solver_order = config.solver_order;
  request.lower_order_final = config.lower_order_final;
  request.solver_type = config.solver_type;
  request.final_sigmas_type = config.final_sigmas_type;
  request.disable_corrector = config.disable_corrector;
  request.flow_shift = config.flow_shift;
}

void request_scheduler_config(const model::FlowEulerConfig& config, JobRequest& request) {
  request.num_train_timesteps = config.num_train_timesteps;
  request.flow_shift = config.shift;
}

void request_scheduler_config(const model::SchedulerConfig& config, JobRequest& request) {
  std::visit([&request](const auto& c) { request_scheduler_config(c, request); }, config);
}

}  // namespace skyreels::server
