// Where a generation parameter goes, from the request to the model (its row below drives each step):
//   read        gRPC: request_from_proto (durable_request.cpp) -> request_params_from_proto
//               (generation_params_proto.cpp: protobuf reflection, the row's path names the field). HTTP: read_params
//               (http/openai_videos.cpp: JSON into the proto by its descriptor), then gRPC. CLI:
//               generation_request_from_flags (cli/command.cpp: the row's flag through parse_param_value). Each gives a
//               JobRequest member, as asked (unset: empty).
//   defaulted   resolve_generation_params (generation_params.cpp): the row's default or DefaultRule -> ResolvedParams.
//   checked     validate_generation_params (the row's bounds, one_of, rules) and check_pipeline_params, both called by
//               ModelJob::create (replica/model_job.cpp); what needs the model's geometry: plan_chunks
//               (model/df_chunk_plan.cpp; the samplers' rules: model/sampler_table.h).
//   fingerprint fingerprint_generation_params (generation_params.cpp), in request_fingerprint (fingerprint.cpp).
//   fingerprint fingerprint_generation_params (generation_params.cpp), in request_fingerprint (job/fingerprint.cpp).
//               the CLI's `generate`, cli/cmd_generate.cpp). Back to clients: resolved_params_to_proto (Job.params).
//
// Every generation parameter of a job, one row each, in the table's order (the idempotency fingerprint's: never
// reorder, new rows go at the end). A row declares the parameter's JobRequest member (as asked: unset is an empty
// optional, a list is empty), its ResolvedParams member (as in effect) and its table entry (generation_params.h:
// default, bounds, rules, flag, fingerprint), so that adding a parameter is its proto field, one row here and where
// the model uses it (generation_params_model.cpp).
//
//   PARAM(member, "proto path", request type, resolved type, resolved initial value, .table().entry()...)
//
// The table entries are read only by generation_params.cpp, which has their helpers (limit, value_of, the rules).
// Comments inside the list are /* */: a // comment would swallow the line continuation.
#pragma once

#include "model/video_shape.h"  // the fps default

// clang-format off
#define SKYREELS_GENERATION_PARAMS(PARAM) \
  PARAM(num_frames, "num_frames", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{97}) \
        .within(1, max_frames, "--max-frames") \
        .rule(four_k_plus_one) \
        .flag("num-frames", "pixel frames of the whole video, 4k+1")) \
  PARAM(height, "height", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{544}) \
        .within(16, limit(&ServerLimits::max_height), "--max-height") \
        .rule(multiple_of_16) \
        .flag("height", "pixels, a multiple of 16")) \
  PARAM(width, "width", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{960}) \
        .within(16, limit(&ServerLimits::max_width), "--max-width") \
        .rule(multiple_of_16) \
        .flag("width", "pixels, a multiple of 16")) \
  PARAM(num_inference_steps, "num_inference_steps", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{50}) \
        .within(1, limit(&ServerLimits::max_steps), "--max-steps") \
        .flag("num-inference-steps", "denoising steps")) \
  PARAM(base_num_frames, "base_num_frames", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{97}) \
        .within(1, max_frames, "--max-frames") \
        .rule(four_k_plus_one) \
        .diffusion_forcing_only() \
        .flag("base-num-frames", "pixel frames per chunk of a long video, 4k+1")) \
  PARAM(overlap_history, "overlap_history", std::optional<int64_t>, std::optional<int64_t>, {}, \
        .defaults(DefaultRule::kUnset) \
        .within(1, value_of(&R::base_num_frames)) \
        .diffusion_forcing_only() \
        .flag("overlap-history", "frames each chunk continues from the previous one (long videos)")) \
  /* Each unit of ar_step adds a row per block to every chunk; beyond the step count it only adds cost. */ \
  PARAM(ar_step, "ar_step", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{0}) \
        .within(0, value_of(&R::num_inference_steps), "at most num_inference_steps") \
        .diffusion_forcing_only() \
        .flag("ar-step", "0: synchronous; N: each block N steps behind the previous one")) \
  PARAM(causal_block_size, "causal_block_size", std::optional<int64_t>, int64_t, 0, \
        .defaults(DefaultRule::kModelBlockSize) \
        .within(1, 1000) \
        .diffusion_forcing_only() \
        .flag("causal-block-size", "latent frames per causal block")) \
  PARAM(fps, "fps", std::optional<int64_t>, int64_t, 0, \
        .defaults(model::kDefaultFps) \
        .within(1, 240) \
        .flag("fps", "the fps the model is told")) \
  PARAM(guidance_scale, "guidance_scale", std::optional<double>, double, 0, \
        .defaults(6.0) \
        .finite_within(0.0, 100.0) \
        .flag("guidance-scale", "> 1: classifier-free guidance (needs a negative prompt)")) \
  PARAM(flow_shift, "flow_shift", std::optional<double>, double, 0, \
        .defaults(8.0) \
        .finite_within(1e-3, 1000.0) \
        .flag("flow-shift", "the sigma schedule's shift; --scheduler-config's value when given")) \
  PARAM(addnoise_condition, "addnoise_condition", std::optional<double>, double, 0, \
        .defaults(0.0) \
        .finite_within(0.0, 999.0) \
        .diffusion_forcing_only() \
        .flag("addnoise-condition", "noise added to the frames a long video continues from")) \
  PARAM(seed, "seed", std::optional<uint64_t>, uint64_t, 0, \
        .defaults(DefaultRule::kRandomSeed) \
        .flag("seed", "noise as torch.Generator('cpu').manual_seed(N) draws it (addnoise_condition's: seed N+1)")) \
  PARAM(num_train_timesteps, "scheduler.num_train_timesteps", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{1000}) \
        .within(1, 100000) \
        .flag("num-train-timesteps", "the sampler's training timesteps")) \
  PARAM(solver_order, "scheduler.solver_order", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{2}) \
        .one_of({int64_t{1}, int64_t{2}}) \
        .flag("solver-order", "UniPC order")) \
  PARAM(lower_order_final, "scheduler.lower_order_final", std::optional<bool>, bool, true, \
        .defaults(true) \
        .flag("lower-order-final", "first order for the last steps")) \
  PARAM(solver_type, "scheduler.solver_type", std::optional<std::string>, std::string, {}, \
        .defaults(std::string("bh2")) \
        .one_of({std::string("bh1"), std::string("bh2")}) \
        .flag("solver-type", "UniPC's B(h)")) \
  PARAM(final_sigmas_type, "scheduler.final_sigmas_type", std::optional<std::string>, std::string, {}, \
        .defaults(std::string("zero")) \
        .one_of({std::string("zero")}) \
        .flag("final-sigmas-type", "the last sigma")) \
  PARAM(disable_corrector, "scheduler.disable_corrector", std::vector<int64_t>, std::vector<int64_t>, {}, \
        .within(0, value_of(&R::num_inference_steps, -1), "a step index") \
        .rule(at_most_one_entry_per_step) \
        .flag("disable-corrector", "step indices whose UniPC corrector is skipped")) \
  /* Fewer transformer passes (issue 21). Unset, they leave the fingerprint of older jobs as it was. */ \
  PARAM(exact_savings, "exact_savings", std::optional<bool>, bool, true, \
        .defaults(true) \
        .fingerprint_when_set() \
        .flag("exact-savings", "false (or --no-exact-savings): every frame of every row, as diffusers computes")) \
  PARAM(cache, "cache", std::optional<std::string>, std::string, {}, \
        .defaults(std::string("none")) \
        .one_of({std::string("none"), std::string("first-block"), std::string("first-block-per-block"), \
                 std::string("taylorseer"), std::string("magcache")}) \
        .fingerprint_when_set() \
        .flag("cache", "step cache: first-block = diffusers' FirstBlockCache (lossy, --cache-threshold); " \
                  "first-block-per-block = one decision per causal block (--cache-max-skips), both df; " \
                  "taylorseer / magcache = diffusers' TaylorSeer / MagCache (t2v, i2v, df with ar_step 0; --taylorseer-*, " \
                  "--magcache-*)")) \
  PARAM(cache_threshold, "cache_threshold", std::optional<double>, double, 0, \
        .defaults(0.0) \
        .finite_within(0.0, 10.0) \
        .fingerprint_when_set() \
        .diffusion_forcing_only() \
        .flag("cache-threshold", "skip blocks 1..L-1 when block 0's relative residual change is at most this")) \
  PARAM(cache_scope, "cache_scope", std::optional<std::string>, std::string, {}, \
        .defaults(std::string("chunk")) \
        .one_of({std::string("chunk"), std::string("request")}) \
        .fingerprint_when_set() \
        .diffusion_forcing_only() \
        .flag("cache-scope", "chunk: cache state reset per chunk; request: kept across chunks as stock diffusers " \
                  "(equal chunk lengths; skyreels generate only)")) \
  PARAM(cache_max_skips, "cache_max_skips", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{3}) \
        .within(1, 1000, "skips in a row") \
        .fingerprint_when_set() \
        .diffusion_forcing_only() \
        .flag("cache-max-skips", "first-block-per-block: at most this many skips in a row per causal block")) \
  /* Samplers (issue 32): model/sampler_table.h's rows. Unset, they leave the fingerprint of older jobs as it was. */ \
  PARAM(sampler, "scheduler.type", std::optional<std::string>, std::string, {}, \
        .defaults(sampler_names().front()) \
        .one_of(sampler_names()) \
        .fingerprint_when_set() \
        .flag("sampler", sampler_help())) \
  /* Checked before the other rows: num_inference_steps derives from its length. */ \
  PARAM(timesteps, "scheduler.timesteps", std::vector<int64_t>, std::vector<int64_t>, {}, \
        .within(1, value_of(&R::num_train_timesteps), "num_train_timesteps") \
        .rule(timestep_list) \
        .fingerprint_when_set() \
        .checked_first() \
        .flag("timesteps", model::timestep_list_samplers() + ": timesteps before the shift, strictly decreasing, " \
                  "e.g. 1000,750,500,250; num_inference_steps becomes its length")) \
  /* Previews (issue 35) never change the video: a retry with another value is the same job (not fingerprinted). */ \
  PARAM(preview_every, "preview_every", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{0}) \
        .within(0, value_of(&R::num_inference_steps), "at most num_inference_steps") \
        .not_fingerprinted() \
        .diffusion_forcing_only() \
        .flag("preview-every", "0: no previews; N: a preview of the running chunk after every N-th timestep row " \
                  "and after its last")) \
  /* The pipeline (issue 34). Unset, it leaves the fingerprint of older jobs as it was. */ \
  PARAM(pipeline, "pipeline", std::optional<std::string>, std::string, "df", \
        .defaults(DefaultRule::kModelPipeline) \
        .one_of({std::string("df"), std::string("t2v"), std::string("i2v")}) \
        .fingerprint_when_set() \
        .flag("pipeline", "df: diffusion forcing; t2v: SkyReelsV2Pipeline (one timestep for every frame); i2v: " \
                  "SkyReelsV2ImageToVideoPipeline (an I2V checkpoint, an image)")) \
  /* diffusers' TaylorSeer and MagCache (issue 45): TaylorSeerCacheConfig's and MagCacheConfig's fields. */ \
  PARAM(taylorseer_cache_interval, "taylorseer_cache_interval", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{5}) \
        .within(1, 1000) \
        .fingerprint_when_set() \
        .flag("taylorseer-cache-interval", "taylorseer: a computed call every N calls after the warm-up")) \
  PARAM(taylorseer_disable_cache_before_step, "taylorseer_disable_cache_before_step", std::optional<int64_t>, \
        int64_t, 0, \
        .defaults(int64_t{3}) \
        .within(1, 100000, "calls before it compute; diffusers cannot predict call 0") \
        .fingerprint_when_set() \
        .flag("taylorseer-disable-cache-before-step", "taylorseer: calls before this one always compute")) \
  PARAM(taylorseer_disable_cache_after_step, "taylorseer_disable_cache_after_step", std::optional<int64_t>, \
        std::optional<int64_t>, {}, \
        .defaults(DefaultRule::kUnset) \
        .within(0, 100000) \
        .fingerprint_when_set() \
        .flag("taylorseer-disable-cache-after-step", "taylorseer: from this call on every call computes")) \
  PARAM(taylorseer_max_order, "taylorseer_max_order", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{1}) \
        .within(0, 8) \
        .fingerprint_when_set() \
        .flag("taylorseer-max-order", "taylorseer: order of the Taylor series")) \
  PARAM(taylorseer_factors_dtype, "taylorseer_factors_dtype", std::optional<std::string>, std::string, {}, \
        .defaults(std::string("bfloat16")) \
        .one_of({std::string("bfloat16"), std::string("float32"), std::string("float16")}) \
        .fingerprint_when_set() \
        .flag("taylorseer-factors-dtype", "taylorseer: dtype the Taylor factors are kept in (diffusers' default)")) \
  PARAM(taylorseer_cache_modules, "taylorseer_cache_modules", std::optional<std::string>, std::string, {}, \
        .defaults(std::string(R"(blocks\.\d+\.attn1,blocks\.\d+\.attn2)")) \
        .rule(module_patterns) \
        .fingerprint_when_set() \
        .flag("taylorseer-cache-modules", "taylorseer: comma-separated regexes of the modules predicted (diffusers' " \
                  "names, whole-name match; diffusers' own default hooks nothing on this model)")) \
  PARAM(taylorseer_skip_modules, "taylorseer_skip_modules", std::optional<std::string>, std::string, {}, \
        .defaults(std::string()) \
        .rule(module_patterns) \
        .fingerprint_when_set() \
        .flag("taylorseer-skip-modules", "taylorseer: comma-separated regexes of the modules that give zeros")) \
  PARAM(taylorseer_lite, "taylorseer_lite", std::optional<bool>, bool, false, \
        .defaults(false) \
        .fingerprint_when_set() \
        .flag("taylorseer-lite", "taylorseer: diffusers' lite mode (blocks skipped, proj_out predicted)")) \
  PARAM(magcache_threshold, "magcache_threshold", std::optional<double>, double, 0, \
        .defaults(0.06) \
        .finite_within(0.0, 100.0) \
        .fingerprint_when_set() \
        .flag("magcache-threshold", "magcache: skip the blocks while the accumulated error is at most this")) \
  PARAM(magcache_max_skip_steps, "magcache_max_skip_steps", std::optional<int64_t>, int64_t, 0, \
        .defaults(int64_t{3}) \
        .within(1, 1000, "skips in a row") \
        .fingerprint_when_set() \
        .flag("magcache-max-skip-steps", "magcache: at most this many skipped steps in a row")) \
  PARAM(magcache_retention_ratio, "magcache_retention_ratio", std::optional<double>, double, 0, \
        .defaults(0.2) \
        .finite_within(0.0, 1.0) \
        .fingerprint_when_set() \
        .flag("magcache-retention-ratio", "magcache: the first round(ratio * steps) steps always compute"))
// clang-format on
