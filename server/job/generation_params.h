// Every generation parameter of a job, declared once: its name (the field's path in the proto's GenerationParams),
// kind, default, bounds, CLI flag and help, where it lives in JobRequest and ResolvedParams, and whether it enters
// the idempotency fingerprint. Defaults, validation, the fingerprint, the proto mapping (reflection by name,
// generation_params_proto.h) and the `generate` / `submit` flags are all driven from this table. To add a parameter:
// its proto field, one row in generation_param_list.h (which declares its JobRequest and ResolvedParams members and
// its entry here), and where the model uses it (generation_params_model.cpp). Torch-free, gRPC-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "server/job/job_request.h"

namespace skyreels::server {

// A parameter's value. The alternatives are in ParamKind's order.
using ParamValue = std::variant<int64_t, double, std::string, bool, std::vector<int64_t>, uint64_t>;
enum class ParamKind { kInt, kDouble, kString, kBool, kIntList, kSeed };
ParamKind kind_of(const ParamValue& value);
const char* kind_name(ParamKind kind);  // "integer", "number", ...

// Where the value comes from when the request leaves a parameter unset.
enum class DefaultRule {
  kValue,           // GenerationParam::default_value (diffusers' default)
  kUnset,           // stays unset (overlap_history: only long videos need it)
  kModelBlockSize,  // the loaded model's num_frame_per_block (causal_block_size)
  kRandomSeed,      // a seed drawn for the job (seed)
  kModelPipeline,   // the loaded model's pipeline: i2v for an I2V checkpoint, else df (pipeline)
};

// SkyReelsV2ImageToVideoPipeline's default guidance_scale (the others' is the row's, 6.0).
constexpr double kImageToVideoGuidanceScale = 5.0;

// What a bound may depend on: the server's limits and the other parameters' values in effect.
struct CheckContext {
  const ServerLimits& limits;
  const ResolvedParams& params;
};

// A bound of an integer range: a constant, or computed from the context (a --max-* limit, another parameter).
struct IntBound {
  IntBound(int64_t value);  // NOLINT(google-explicit-constructor): rows read `within(1, 240)`
  IntBound(std::function<int64_t(const CheckContext&)> bound);  // NOLINT(google-explicit-constructor)
  std::function<int64_t(const CheckContext&)> of;
};

struct IntRange {
  IntBound lo, hi;
  std::string why;  // what sets the bound, e.g. "--max-frames"; in the error, in parentheses
};

struct DoubleRange {
  double lo, hi;  // finite values in [lo, hi]
};

struct GenerationParam {
  std::string name;  // path of the field in the proto's GenerationParams ("scheduler.solver_type"); errors start
                     // with it
  ParamKind kind = ParamKind::kInt;
  DefaultRule default_rule = DefaultRule::kValue;
  ParamValue default_value;
  std::optional<IntRange> range;          // kInt: the value; kIntList: each entry
  std::optional<DoubleRange> real_range;  // kDouble
  std::vector<ParamValue> allowed;        // kInt, kString: the values supported (empty: any)
  // Checks the declarative bounds cannot say (4k+1 frames, ...), run after them. Throw ValidationError.
  std::vector<std::function<void(const std::string& name, const ParamValue& value, const CheckContext&)>> rules;
  std::string flag;           // `skyreels generate` / `submit` flag, without the dashes
  std::string help;           // one line for the flag's help
  bool fingerprinted = true;  // part of what an idempotency key is checked against
  // false for parameters added after jobs were stored: unset, they add nothing (older fingerprints stay valid).
  bool fingerprint_absent = true;
  // Checked before every other row (a parameter another's value derives from: its errors name it, not the other).
  bool checked_first = false;
  // Read by the diffusion-forcing pipelines only: a t2v / i2v request that sets it is refused (check_pipeline_params).
  bool diffusion_forcing_only = false;

  // Where the parameter lives. JobRequest: nullopt when unset (a list is never unset: empty is its default).
  std::function<std::optional<ParamValue>(const JobRequest&)> requested;
  std::function<void(JobRequest&, const ParamValue&)> set_requested;
  std::function<std::optional<ParamValue>(const ResolvedParams&)> resolved;
  std::function<void(ResolvedParams&, const ParamValue&)> set_resolved;
};

// The table, in the order validation and the fingerprint visit it (never reorder: stored jobs keep their
// fingerprint).
const std::vector<GenerationParam>& generation_params();
const GenerationParam& generation_param(const std::string& name);  // throws std::out_of_range

struct ResolveContext {
  // The model's; unset (no model known yet): a causal_block_size the request leaves unset stays 0.
  std::optional<int64_t> num_frame_per_block;
  uint64_t random_seed = 0;  // the seed of a request without one
  std::string default_pipeline = "df";  // the model's (ModelDescription::default_pipeline)
};

// Every parameter the request leaves unset takes its default; num_inference_steps left unset with a
// scheduler.timesteps list takes the list's length; guidance_scale left unset on the i2v pipeline takes
// kImageToVideoGuidanceScale. Does not validate.
ResolvedParams resolve_generation_params(const JobRequest& request, const ResolveContext& context);

// Throws ValidationError (INVALID_ARGUMENT) naming the first parameter out of its bounds.
void validate_generation_params(const ResolvedParams& params, const ServerLimits& limits);

// A t2v / i2v request that sets a diffusion-forcing-only parameter, or a cache its pipeline does not run (first-block
// kinds on t2v / i2v, taylorseer / magcache on df): ValidationError naming it and the pipeline.
void check_pipeline_params(const JobRequest& request, const ResolvedParams& params);

// Feeds the request's fingerprinted parameters, as requested (unset stays distinct from the default), to `bytes`.
void fingerprint_generation_params(const JobRequest& request,
                                   const std::function<void(const void* data, size_t size)>& bytes);

// A flag's text as the parameter's value; throws std::invalid_argument saying what the flag expects.
ParamValue parse_param_value(const GenerationParam& param, const std::string& text);
std::string format_param_value(const ParamValue& value);  // as a flag takes it (lists: "0,3,5")

// "  --num-frames N  ... (default 97)" lines for every parameter, for the usage of `generate` and `submit`.
std::string generation_flags_help();

}  // namespace skyreels::server
