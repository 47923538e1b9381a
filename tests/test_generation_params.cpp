// The table of generation parameters (server/generation_params.h) as the one declaration of each parameter: every
// proto field is a row and every row a proto field of its kind; defaults are diffusers'; every bound refuses what
// lies past it, naming the field; the fingerprint follows exactly the fingerprinted parameters (and never changes
// for a stored job); the wire and the CLI carry every row.
#include <google/protobuf/descriptor.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/sampler_table.h"
#include "server/job/generation_params.h"
#include "server/job/generation_params_model.h"
#include "server/job/generation_params_proto.h"
#include "server/replica/model_job.h"
#include "tests/test_util.h"
#include "tests/job_requests.h"

namespace skyreels::server {
namespace {

namespace gpb = google::protobuf;

// ---- the table and the proto --------------------------------------------------------------------------------------

// The proto type a parameter of each kind must have: the spec the table is checked against.
gpb::FieldDescriptor::Type proto_type_of(ParamKind kind) {
  switch (kind) {
    case ParamKind::kInt:
    case ParamKind::kIntList:
      return gpb::FieldDescriptor::TYPE_INT64;
    case ParamKind::kDouble:
      return gpb::FieldDescriptor::TYPE_DOUBLE;
    case ParamKind::kString:
      return gpb::FieldDescriptor::TYPE_STRING;
    case ParamKind::kBool:
      return gpb::FieldDescriptor::TYPE_BOOL;
    case ParamKind::kSeed:
      return gpb::FieldDescriptor::TYPE_UINT64;
  }
  return gpb::FieldDescriptor::TYPE_GROUP;
}

// Every leaf field of GenerationParams by path ("scheduler.solver_type"); message fields are descended into.
void leaf_fields(const gpb::Descriptor& message, const std::string& prefix,
                 std::map<std::string, const gpb::FieldDescriptor*>& out) {
  for (int i = 0; i < message.field_count(); ++i) {
    const gpb::FieldDescriptor* field = message.field(i);
    if (field->message_type() != nullptr) {
      leaf_fields(*field->message_type(), prefix + field->name() + ".", out);
    } else {
      out[prefix + field->name()] = field;
    }
  }
}

std::map<std::string, const gpb::FieldDescriptor*> proto_leaves() {
  std::map<std::string, const gpb::FieldDescriptor*> leaves;
  leaf_fields(*v1::GenerationParams::descriptor(), "", leaves);
  return leaves;
}

// The one list of records, mapped beside the rows (generation_params_proto.cpp) and checked against the server's
// adapter catalogue: GenerationParams.loras.
bool is_record_list(const std::string& path) { return path.rfind("loras.", 0) == 0; }

TEST(GenerationParams, EveryProtoFieldIsARowSoNoParameterIsHalfDeclared) {
  const auto leaves = proto_leaves();
  ASSERT_GE(leaves.size(), 19u);
  for (const auto& [path, field] : leaves) {
    if (is_record_list(path)) continue;
    EXPECT_NO_THROW(generation_param(path)) << "GenerationParams." << path << " has no row in the table";
  }
}

TEST(GenerationParams, TheAdapterListTravelsBesideTheRowsInOrderWithScaleAndDigest) {
  v1::GenerationParams proto;
  auto* a = proto.add_loras();
  a->set_name("style");
  a->set_scale(0.8);
  auto* b = proto.add_loras();
  b->set_name("causvid");
  b->set_sha256(std::string(64, 'a'));
  JobRequest request;
  request_params_from_proto(proto, request);
  ASSERT_EQ(request.loras.size(), 2u);
  EXPECT_EQ(request.loras[0].name, "style");
  EXPECT_EQ(request.loras[0].scale, std::optional<double>(0.8));
  EXPECT_FALSE(request.loras[1].scale.has_value()) << "unset stays unset (1.0 is the server's default)";
  EXPECT_EQ(request.loras[1].sha256, std::string(64, 'a'));
  v1::GenerationParams back;
  request_params_to_proto(request, &back);
  EXPECT_EQ(back.SerializeAsString(), proto.SerializeAsString());
}

TEST(GenerationParams, EveryRowIsAProtoFieldOfItsKind) {
  const auto leaves = proto_leaves();
  for (const GenerationParam& p : generation_params()) {
    const auto it = leaves.find(p.name);
    ASSERT_NE(it, leaves.end()) << p.name << " is not a field of GenerationParams";
    const gpb::FieldDescriptor& field = *it->second;
    EXPECT_EQ(field.type(), proto_type_of(p.kind)) << p.name << " is a " << field.type_name();
    EXPECT_EQ(field.is_repeated(), p.kind == ParamKind::kIntList) << p.name;
    if (!field.is_repeated()) {
      EXPECT_TRUE(field.has_presence()) << p.name << ": unset must differ from the default";
    }
    EXPECT_EQ(&proto_field(p), &field) << p.name << ": the mapping uses another field";
  }
}

TEST(GenerationParams, EveryRowHasItsOwnNameFlagAndHelp) {
  std::set<std::string> names;
  std::set<std::string> flags;
  for (const GenerationParam& p : generation_params()) {
    EXPECT_TRUE(names.insert(p.name).second) << p.name << " twice";
    EXPECT_TRUE(flags.insert(p.flag).second) << "--" << p.flag << " twice";
    EXPECT_FALSE(p.flag.empty()) << p.name;
    EXPECT_FALSE(p.help.empty()) << p.name;
    if (p.default_rule == DefaultRule::kValue) {
      EXPECT_EQ(kind_of(p.default_value), p.kind) << p.name;
    }
  }
}

// ---- defaults -----------------------------------------------------------------------------------------------------

TEST(GenerationParams, AnEmptyRequestTakesDiffusersDefaults) {
  const ResolvedParams r = resolve_generation_params(JobRequest{}, ResolveContext{5, 77});
  EXPECT_EQ(r.num_frames, 97);
  EXPECT_EQ(r.height, 544);
  EXPECT_EQ(r.width, 960);
  EXPECT_EQ(r.num_inference_steps, 50);
  EXPECT_EQ(r.base_num_frames, 97);
  EXPECT_FALSE(r.overlap_history.has_value()) << "only a long video needs one";
  EXPECT_EQ(r.ar_step, 0);
  EXPECT_EQ(r.causal_block_size, 5) << "the model's num_frame_per_block";
  EXPECT_EQ(r.fps, 24);
  EXPECT_EQ(r.guidance_scale, 6.0);
  EXPECT_EQ(r.flow_shift, 8.0);
  EXPECT_EQ(r.addnoise_condition, 0.0);
  EXPECT_EQ(r.seed, 77u) << "the seed drawn for the job";
  EXPECT_EQ(r.num_train_timesteps, 1000);
  EXPECT_EQ(r.solver_order, 2);
  EXPECT_TRUE(r.lower_order_final);
  EXPECT_EQ(r.solver_type, "bh2");
  EXPECT_EQ(r.final_sigmas_type, "zero");
  EXPECT_TRUE(r.disable_corrector.empty());
  EXPECT_EQ(r.sampler, "unipc");
  EXPECT_TRUE(r.timesteps.empty());
}

TEST(GenerationParams, TheTableDefaultsAreTheModelsOwn) {
  const model::GenerationParams expected;  // diffusers' defaults, as the model declares them
  const model::GenerationParams p = model_params(resolve_generation_params(JobRequest{}, ResolveContext{}));
  EXPECT_EQ(p.num_frames, expected.num_frames);
  EXPECT_EQ(p.height, expected.height);
  EXPECT_EQ(p.width, expected.width);
  EXPECT_EQ(p.num_inference_steps, expected.num_inference_steps);
  EXPECT_EQ(p.base_num_frames, expected.base_num_frames);
  EXPECT_EQ(p.overlap_history, expected.overlap_history);
  EXPECT_EQ(p.ar_step, expected.ar_step);
  EXPECT_EQ(p.causal_block_size, expected.causal_block_size) << "no model known: plan_chunks takes the model's";
  EXPECT_EQ(p.fps, expected.fps);
  EXPECT_EQ(p.guidance_scale, expected.guidance_scale);
  EXPECT_EQ(p.flow_shift, expected.flow_shift);
  EXPECT_EQ(p.addnoise_condition, expected.addnoise_condition);
  EXPECT_EQ(p.scheduler.num_train_timesteps, expected.scheduler.num_train_timesteps);
  EXPECT_EQ(p.scheduler.solver_order, expected.scheduler.solver_order);
  EXPECT_EQ(p.scheduler.lower_order_final, expected.scheduler.lower_order_final);
  EXPECT_EQ(p.scheduler.solver_type, expected.scheduler.solver_type);
  EXPECT_EQ(p.scheduler.final_sigmas_type, expected.scheduler.final_sigmas_type);
  EXPECT_EQ(p.scheduler.disable_corrector, expected.scheduler.disable_corrector);
  EXPECT_EQ(p.sampler, expected.sampler);
  EXPECT_EQ(p.timesteps, expected.timesteps);
  EXPECT_EQ(p.exact_savings, expected.exact_savings);
  EXPECT_EQ(p.cache.kind, expected.cache.kind);
  EXPECT_EQ(p.cache.threshold, expected.cache.threshold);
  EXPECT_EQ(p.cache.scope, expected.cache.scope);
}

// ---- validation ---------------------------------------------------------------------------------------------------

struct Probe {
  ParamValue value;
  bool valid;
};

// Values at and past each declared bound of `p`, judged against the defaults of every other parameter.
std::vector<Probe> probes(const GenerationParam& p, const ServerLimits& limits, const ResolvedParams& defaults) {
  std::vector<Probe> out;
  const CheckContext context{limits, defaults};
  if (p.range) {
    const int64_t lo = p.range->lo.of(context);
    const int64_t hi = p.range->hi.of(context);
    auto value = [&](int64_t v) {
      return p.kind == ParamKind::kIntList ? ParamValue(std::vector<int64_t>{v}) : ParamValue(v);
    };
    out.push_back({value(lo), true});
    out.push_back({value(hi), true});
    out.push_back({value(lo - 1), false});
    out.push_back({value(hi + 1), false});
  }
  if (p.real_range) {
    out.push_back({p.real_range->lo, true});
    out.push_back({p.real_range->hi, true});
    out.push_back({p.real_range->lo - 1.0, false});
    out.push_back({p.real_range->hi * 2 + 1.0, false});
    out.push_back({std::nan(""), false});
    out.push_back({std::numeric_limits<double>::infinity(), false});
  }
  for (const ParamValue& allowed : p.allowed) out.push_back({allowed, true});
  if (!p.allowed.empty()) {
    out.push_back({p.kind == ParamKind::kString ? ParamValue(std::string("not-") + std::get<std::string>(p.allowed[0]))
                                                : ParamValue(std::get<int64_t>(p.allowed.back()) + 1),
                   false});
  }
  return out;
}

// --scheduler-config as request values: a FlowMatchEuler config sets num_train_timesteps and flow_shift (its shift)
// and leaves UniPC's solver settings unset; a UniPC config sets its own.
TEST(GenerationParams, ASchedulerConfigIsRequestedAsItsValues) {
  model::FlowEulerConfig euler;
  euler.shift = 5.0;
  euler.num_train_timesteps = 500;
  JobRequest request;
  request_scheduler_config(model::SchedulerConfig(euler), request);
  EXPECT_EQ(request.flow_shift, 5.0);
  EXPECT_EQ(request.num_train_timesteps, 500);
  EXPECT_FALSE(request.solver_order);
  EXPECT_FALSE(request.solver_type);
  EXPECT_FALSE(request.sampler) << "the sampler is --sampler's; the config was checked to be its";
  request.sampler = "euler";
  const model::GenerationParams p = model_params(resolve_generation_params(request, ResolveContext{}));
  EXPECT_EQ(p.flow_shift, 5.0);
  EXPECT_EQ(p.scheduler.num_train_timesteps, 500);  // what the Euler schedule reads
  EXPECT_EQ(p.sampler, model::SamplerKind::kEuler);

  model::FlowUniPCConfig unipc;
  unipc.flow_shift = 8.0;
  unipc.solver_order = 1;
  JobRequest unipc_request;
  request_scheduler_config(model::SchedulerConfig(unipc), unipc_request);
  EXPECT_EQ(unipc_request.flow_shift, 8.0);
  EXPECT_EQ(unipc_request.solver_order, 1);
}

TEST(GenerationParams, EachBoundAdmitsItsEndsAndRefusesPastThemNamingTheField) {
  const ServerLimits limits;
  const ResolveContext context{1, 7};
  const ResolvedParams defaults = resolve_generation_params(JobRequest{}, context);
  int bounded = 0;
  for (const GenerationParam& p : generation_params()) {
    const std::vector<Probe> cases = probes(p, limits, defaults);
    bounded += !cases.empty();
    for (const Probe& probe : cases) {
      JobRequest request;
      p.set_requested(request, probe.value);
      if (p.name == "scheduler.timesteps") request.sampler = "euler";  // a list is the Euler sampler's
      const ResolvedParams resolved = resolve_generation_params(request, context);
      const std::string shown = p.name + " = " + format_param_value(probe.value);
      if (probe.valid) {
        EXPECT_NO_THROW(validate_generation_params(resolved, limits)) << shown;
        continue;
      }
      try {
        validate_generation_params(resolved, limits);
        ADD_FAILURE() << shown << " accepted";
      } catch (const ValidationError& e) {
        EXPECT_EQ(std::string(e.what()).rfind(p.name + ": ", 0), 0u) << shown << ": " << e.what();
      }
    }
  }
  EXPECT_GE(bounded, 16) << "every parameter but seed and lower_order_final has bounds";
}

void expect_refused(const JobRequest& request, const ServerLimits& limits, const std::string& message) {
  try {
    validate_generation_params(resolve_generation_params(request, ResolveContext{1, 7}), limits);
    ADD_FAILURE() << "accepted; expected " << message;
  } catch (const ValidationError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(message, 0), 0u) << e.what();
  }
}

TEST(GenerationParams, RulesBeyondTheBoundsAndTheLimitsOfTheServer) {
  JobRequest frames;
  frames.num_frames = 36;
  expect_refused(frames, ServerLimits{}, "num_frames: 36 is not of the form 4k+1");
  JobRequest height;
  height.height = 40;
  expect_refused(height, ServerLimits{}, "height: 40 is not a multiple of 16");
  JobRequest correctors;
  correctors.num_inference_steps = 2;
  correctors.disable_corrector = {0, 1, 1};
  expect_refused(correctors, ServerLimits{}, "scheduler.disable_corrector: more entries than num_inference_steps");
  ServerLimits small;
  small.max_frames = 33;
  expect_refused(JobRequest{}, small, "num_frames: 97 is outside [1, 33] (--max-frames)");
  JobRequest ar;
  ar.num_inference_steps = 4;
  ar.ar_step = 5;
  expect_refused(ar, ServerLimits{}, "ar_step: 5 is outside [0, 4] (at most num_inference_steps)");
  JobRequest solver;
  solver.solver_type = "bh3";
  expect_refused(solver, ServerLimits{},
                 "scheduler.solver_type: \"bh3\" is not supported (supported: \"bh1\", \"bh2\")");
}

TEST(GenerationParams, SchedulerTypeIsTheSamplerTable) {
  const GenerationParam& type = generation_param("scheduler.type");
  ASSERT_EQ(type.allowed.size(), model::samplers().size());
  for (size_t i = 0; i < type.allowed.size(); ++i) {
    EXPECT_EQ(std::get<std::string>(type.allowed[i]), model::samplers()[i].name);
  }
  EXPECT_EQ(std::get<std::string>(type.default_value), "unipc");
  EXPECT_EQ(type.help, "unipc: flow UniPC; euler: flow-matching Euler (diffusers' FlowMatchEulerDiscreteScheduler, "
                       "shift = flow_shift)");
  EXPECT_EQ(generation_param("scheduler.timesteps").help,
            "euler: timesteps before the shift, strictly decreasing, e.g. 1000,750,500,250; num_inference_steps "
            "becomes its length");
}

TEST(GenerationParams, ATimestepListIsTheEulerSamplersAndDefinesTheSteps) {
  JobRequest ok;
  ok.sampler = std::string("euler");
  ok.timesteps = {1000, 750, 500, 250};
  const ResolvedParams resolved = resolve_generation_params(ok, ResolveContext{1, 7});
  EXPECT_EQ(resolved.num_inference_steps, 4) << "num_inference_steps left unset: the list's length";
  EXPECT_NO_THROW(validate_generation_params(resolved, ServerLimits{}));
  const model::GenerationParams p = model_params(resolved);
  EXPECT_EQ(p.sampler, model::SamplerKind::kEuler);
  EXPECT_EQ(p.timesteps, ok.timesteps);
  EXPECT_EQ(p.num_inference_steps, 4);
  JobRequest same_steps = ok;
  same_steps.num_inference_steps = 4;
  EXPECT_NO_THROW(validate_generation_params(resolve_generation_params(same_steps, ResolveContext{1, 7}), {}));

  const auto with_list = [](std::vector<int64_t> list) {
    JobRequest r;
    r.sampler = "euler";
    r.timesteps = std::move(list);
    return r;
  };
  std::vector<int64_t> ten_thousand(10000);
  for (size_t i = 0; i < ten_thousand.size(); ++i) ten_thousand[i] = 1000 - static_cast<int64_t>(i % 1000);
  expect_refused(with_list(ten_thousand), ServerLimits{},
                 "scheduler.timesteps: 10000 entries, more than 100 (--max-steps)");
  expect_refused(with_list({1000, 750, 750}), ServerLimits{},
                 "scheduler.timesteps: must be strictly decreasing, but entry 2 (750) follows 750");
  expect_refused(with_list({250, 500, 1000}), ServerLimits{},
                 "scheduler.timesteps: must be strictly decreasing, but entry 1 (500) follows 250");
  expect_refused(with_list({1000, 500, 0}), ServerLimits{},
                 "scheduler.timesteps: 0 is outside [1, 1000] (num_train_timesteps)");
  expect_refused(with_list({1001, 500}), ServerLimits{},
                 "scheduler.timesteps: 1001 is outside [1, 1000] (num_train_timesteps)");
  JobRequest unipc = with_list({1000, 750, 500, 250});
  unipc.sampler = "unipc";
  expect_refused(unipc, ServerLimits{}, "scheduler.timesteps: a timestep list needs scheduler.type \"euler\"");
  JobRequest unset_type = unipc;
  unset_type.sampler.reset();
  expect_refused(unset_type, ServerLimits{}, "scheduler.timesteps: a timestep list needs scheduler.type \"euler\"");
  JobRequest mismatch = with_list({1000, 750, 500, 250});
  mismatch.num_inference_steps = 30;
  expect_refused(mismatch, ServerLimits{}, "scheduler.timesteps: 4 entries, but num_inference_steps is 30");
  JobRequest sampler;
  sampler.sampler = "ddim";
  expect_refused(sampler, ServerLimits{}, "scheduler.type: \"ddim\" is not supported");

  // What the table cannot see, the plan refuses at submission (INVALID_ARGUMENT, the field first): a list whose first
  // timestep is not an integer after the shift (diffusers' pipelines fail on it).
  ModelDescription model;
  model.config.text_dim = 32;
  JobRequest not_integer = test_requests::long_video();
  not_integer.sampler = "euler";
  not_integer.timesteps = {999, 500};
  not_integer.num_inference_steps.reset();
  try {
    ModelJob::create(not_integer, model, ServerLimits{}, 1);
    ADD_FAILURE() << "accepted";
  } catch (const ValidationError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("scheduler.timesteps: the first timestep becomes", 0), 0u) << e.what();
  }
}

// ---- fingerprint --------------------------------------------------------------------------------------------------

std::string fingerprint_bytes(const JobRequest& request) {
  std::string bytes;
  fingerprint_generation_params(
      request, [&](const void* data, size_t size) { bytes.append(static_cast<const char*>(data), size); });
  return bytes;
}

// Two different values of a parameter's kind.
std::pair<ParamValue, ParamValue> two_values(ParamKind kind) {
  switch (kind) {
    case ParamKind::kInt:
      return {int64_t{1}, int64_t{2}};
    case ParamKind::kDouble:
      return {1.5, 2.5};
    case ParamKind::kString:
      return {std::string("a"), std::string("b")};
    case ParamKind::kBool:
      return {true, false};
    case ParamKind::kIntList:
      return {std::vector<int64_t>{1}, std::vector<int64_t>{1, 2}};
    case ParamKind::kSeed:
      return {uint64_t{1}, uint64_t{2}};
  }
  return {};
}

TEST(GenerationParams, TheFingerprintFollowsEachFingerprintedParameterAndNothingElse) {
  const std::string unset = fingerprint_bytes(JobRequest{});
  for (const GenerationParam& p : generation_params()) {
    const auto [a, b] = two_values(p.kind);
    JobRequest with_a;
    p.set_requested(with_a, a);
    JobRequest with_b;
    p.set_requested(with_b, b);
    if (p.fingerprinted) {
      EXPECT_NE(fingerprint_bytes(with_a), unset) << p.name;
      EXPECT_NE(fingerprint_bytes(with_b), unset) << p.name;
      EXPECT_NE(fingerprint_bytes(with_a), fingerprint_bytes(with_b)) << p.name;
    } else {
      EXPECT_EQ(fingerprint_bytes(with_a), unset) << p.name;
      EXPECT_EQ(fingerprint_bytes(with_b), unset) << p.name;
    }
  }
  JobRequest other_inputs;
  other_inputs.prompt = "a cat";
  other_inputs.image = PixelRequest{};
  EXPECT_EQ(fingerprint_bytes(other_inputs), unset) << "only the parameters enter this part";
}

using test_requests::embeddings;
using test_requests::long_video;

// The SQLite store keeps each job's fingerprint: a client resubmitting under its idempotency key after an upgrade
// must still match. The values were computed by the code before the table.
TEST(GenerationParams, TheFingerprintOfAStoredJobNeverChanges) {
  ModelDescription model;
  model.config.text_dim = 32;
  JobRequest every = long_video();
  every.guidance_scale = 5.0;
  every.flow_shift = 3.0;
  every.ar_step = 1;
  every.causal_block_size = 1;
  every.addnoise_condition = 20;
  every.fps = 16;
  every.num_train_timesteps = 1000;
  every.solver_order = 1;
  every.solver_type = "bh1";
  every.lower_order_final = false;
  every.final_sigmas_type = "zero";
  every.disable_corrector = {0, 2};
  EXPECT_EQ(ModelJob::create(every, model, ServerLimits{}, 1)->fingerprint(), 5741134027093904315ULL);
  EXPECT_EQ(ModelJob::create(long_video(), model, ServerLimits{}, 1)->fingerprint(), 804013515750891416ULL);
}

// ---- the wire -----------------------------------------------------------------------------------------------------

TEST(GenerationParams, EveryRowTravelsTheWireAndUnsetStaysUnset) {
  JobRequest sent;
  for (const GenerationParam& p : generation_params()) p.set_requested(sent, two_values(p.kind).second);
  v1::GenerationParams proto;
  request_params_to_proto(sent, &proto);
  JobRequest received;
  request_params_from_proto(proto, received);
  for (const GenerationParam& p : generation_params()) {
    EXPECT_EQ(p.requested(received), p.requested(sent)) << p.name;
  }

  v1::GenerationParams nothing;
  request_params_to_proto(JobRequest{}, &nothing);
  EXPECT_EQ(nothing.ByteSizeLong(), 0u) << "an empty request sets no field (the server applies the defaults)";
}

TEST(GenerationParams, AJobReportsEveryParameterInEffect) {
  const ResolvedParams resolved = resolve_generation_params(JobRequest{}, ResolveContext{1, 42});
  v1::GenerationParams proto;
  resolved_params_to_proto(resolved, &proto);
  JobRequest reported;
  request_params_from_proto(proto, reported);
  for (const GenerationParam& p : generation_params()) {
    EXPECT_EQ(p.requested(reported), p.resolved(resolved)) << p.name;
  }
  EXPECT_EQ(proto.seed(), 42u);
  EXPECT_FALSE(proto.has_overlap_history()) << "a short video has none";
}

// ---- the CLI ------------------------------------------------------------------------------------------------------

// Every table flag with a valid value, as `--flag='value'`.
std::string every_flag() {
  std::string flags;
  for (const GenerationParam& p : generation_params()) {
    ParamValue value = p.default_value;
    if (p.default_rule != DefaultRule::kValue && !p.allowed.empty()) {
      value = p.allowed.front();
    } else if (p.default_rule != DefaultRule::kValue) {
      value = p.kind == ParamKind::kSeed ? ParamValue(uint64_t{7}) : ParamValue(int64_t{1});
    }
    flags += " --" + p.flag + "='" + format_param_value(value) + "'";
  }
  return flags;
}

TEST(GenerationParams, SubmitAcceptsEveryTableFlag) {
  std::string log;
  // Nothing listens on port 1: the flags were all taken and parsed once the request reaches the connection.
  const int status =
      test::run_command(test::bin_path("skyreels") + " submit --server 127.0.0.1:1 --prompt cat" + every_flag(), &log);
  EXPECT_EQ(status, 1) << log;
  EXPECT_NE(log.find("UNAVAILABLE"), std::string::npos) << log;
  const int bad = test::run_command(test::bin_path("skyreels") + " submit --prompt cat --fps=often", &log);
  EXPECT_EQ(bad, 2) << log;
  EXPECT_NE(log.find("flag --fps expects an integer, got 'often'"), std::string::npos) << log;
}

TEST(GenerationParams, GenerateAcceptsEveryTableFlag) {
  std::string log;
  const std::string missing = test::temp_dir("params") + "/missing.safetensors";
  // The flags are all taken and parsed before the (missing) inputs are read.
  const int status = test::run_command(test::bin_path("skyreels") + " generate --model " + missing + " --inputs " +
                                           missing + " --out " + missing + every_flag(),
                                       &log);
  EXPECT_EQ(status, 1) << "a runtime error, not a usage error:\n" << log;
  EXPECT_NE(log.find(missing), std::string::npos) << log;
  std::string help;
  ASSERT_EQ(test::run_command(test::bin_path("skyreels") + " generate --help", &help), 0);
  for (const GenerationParam& p : generation_params()) {
    EXPECT_NE(help.find("--" + p.flag + " "), std::string::npos) << p.flag << " is not in the help";
  }
}

}  // namespace
}  // namespace skyreels::server
