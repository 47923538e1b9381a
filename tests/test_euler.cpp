// The flow-matching Euler sampler (`scheduler.type` euler, `scheduler.timesteps`) against diffusers'
// FlowMatchEulerDiscreteScheduler run through its own SkyReels-V2 DF pipelines (tests/data/euler, made by
// tests/data/euler/make_cases.py): the schedules, the update, the refusals, the loop with the tiny transformer from
// recorded noise and `skyreels generate` (text, async, long with addnoise_condition, image-to-video).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/pixel_conditioning.h"
#include "model/sampler_flow_euler.h"
#include "model/sampler_table.h"
#include "model/scheduler_config.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::all_close;
using test::bin_path;
using test::data_path;
using test::error_of;
using test::max_abs_diff;
using test::run_command;
using Json = nlohmann::json;

const std::vector<std::string> kCases = {
    "e1_sync_list4_noguide",           "e2_async_list4_noguide",
    "e3_async_spaced6_cfg",            "e4_long_addnoise20_list4_noguide",
    "e5_long_addnoise20_spaced5_cfg_shift8", "e6_i2v_last_image_list4_noguide",
    "e7_i2v_long_async_addnoise20_list4_noguide"};

// A case of tests/data/euler; image cases get the pixels' description and the recorded condition latents.
test::PipelineCase load_case(const std::string& name) {
  test::PipelineCase c = test::load_pipeline_case(name, data_path("euler/" + name));
  test::use_recorded_conditioning(c);
  return c;
}

std::string label(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// ---- the schedule ------------------------------------------------------------------------------------------------

class EulerCase : public ::testing::TestWithParam<std::string> {};

TEST_P(EulerCase, ScheduleIsDiffusersBitForBit) {
  const test::PipelineCase c = load_case(GetParam());
  const FlowEulerSchedule s = make_flow_euler_schedule(c.params.scheduler.num_train_timesteps, c.params.flow_shift,
                                                       c.params.num_inference_steps, c.params.timesteps);
  const Json& expected = c.json.at("schedule");
  ASSERT_EQ(s.timesteps.size(), expected.at("timesteps").size());
  ASSERT_EQ(s.sigmas.size(), expected.at("sigmas").size());
  for (size_t i = 0; i < s.timesteps.size(); ++i) {
    EXPECT_EQ(s.timesteps[i], expected.at("timesteps")[i].get<float>()) << "timestep " << i;
    EXPECT_EQ(s.model_timesteps[i], static_cast<int64_t>(std::trunc(expected.at("timesteps")[i].get<double>())));
  }
  for (size_t i = 0; i < s.sigmas.size(); ++i) {
    EXPECT_EQ(s.sigmas[i], expected.at("sigmas")[i].get<float>()) << "sigma " << i;
  }
}

// ---- the loop with the tiny transformer, chunk after chunk, from the recorded noise -----------------------------

TEST_P(EulerCase, TransformerWithRecordedNoiseMatchesDiffusersWithin1e4) {
  const test::PipelineCase c = load_case(GetParam());
  const auto model = test::load_fixture_transformer(c.base_dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.noise);
  int calls = 0;
  const Denoiser counted = [&, inner = transformer_denoiser(*model, c.params)](const DenoiseCall& call) {
    ++calls;
    return inner(call);
  };
  const at::Tensor video = test::run_chunks(c, counted, denoiser_info(*model), *noise, 1e-4);
  EXPECT_TRUE(all_close(video, c.output.at("latents"), 1e-4));
  EXPECT_EQ(calls, c.json.at("stats").at("num_transformer_calls").get<int>());
  std::printf("[ %s ] recorded noise: max |diff| = %.3g, %d transformer passes\n", c.name.c_str(),
              max_abs_diff(video, c.output.at("latents")), calls);
}

// ---- skyreels generate -------------------------------------------------------------------------------------------

TEST_P(EulerCase, GenerateCommandReproducesTheFixture) {
  const test::PipelineCase c = load_case(GetParam());
  std::string flags = " --noise " + c.dir + "/noise.safetensors";
  if (c.inputs.count("image")) {
    flags += " --vae " + c.base_dir + "/weights/vae --image " + c.base_dir + "/inputs.safetensors";
    if (c.inputs.count("last_image")) flags += " --last-image " + c.base_dir + "/inputs.safetensors";
  }
  const double diff = test::expect_generate_matches(c, flags);
  EXPECT_LE(diff, 1e-4);
  std::printf("[ %s ] skyreels generate: max |diff| = %.3g\n", c.name.c_str(), diff);
}

INSTANTIATE_TEST_SUITE_P(Diffusers, EulerCase, ::testing::ValuesIn(kCases), label);

// ---- a FlowMatchEulerDiscreteScheduler scheduler_config.json (--scheduler-config) ---------------------------------

// tests/data/euler/scheduler: the file a few-step model's diffusers pipeline folder ships (every key diffusers 0.35
// writes, at its default but for shift 5).
const std::string kEulerConfig = "euler/scheduler/scheduler_config.json";
// A UniPC one: the golden DF fixtures'.
std::string unipc_config() { return test::golden_path("pipeline_df/p1_sync_short/scheduler/scheduler_config.json"); }

Json euler_config_json() {
  std::ifstream in(data_path(kEulerConfig));
  return Json::parse(in);
}

// The fixture's JSON with `key` set to `value`, written to a fresh file.
std::string euler_config_with(const std::string& key, const Json& value) {
  Json j = euler_config_json();
  j[key] = value;
  const std::string path = test::temp_dir("euler_config") + "/scheduler_config.json";
  std::ofstream(path) << j.dump(2);
  return path;
}

std::string euler_config_error(const std::string& key, const Json& value) {
  return error_of([&] { FlowEulerConfig::from_file(euler_config_with(key, value)); });
}

TEST(FlowEulerConfig, ReadsShiftAndTrainingTimestepsOfADiffusersFile) {
  const FlowEulerConfig c = FlowEulerConfig::from_file(data_path(kEulerConfig));
  EXPECT_EQ(c.shift, 5.0);
  EXPECT_EQ(c.num_train_timesteps, 1000);
  const FlowEulerConfig defaults = FlowEulerConfig::from_json(R"({"_class_name": "FlowMatchEulerDiscreteScheduler"})");
  EXPECT_EQ(defaults.shift, 1.0);  // diffusers' defaults
  EXPECT_EQ(defaults.num_train_timesteps, 1000);
  const FlowEulerConfig other = FlowEulerConfig::from_json(R"({"shift": 3, "num_train_timesteps": 500})");
  EXPECT_EQ(other.shift, 3.0);
  EXPECT_EQ(other.num_train_timesteps, 500);
  // Off is false, null or 0, as diffusers tests them for truth; the dynamic-shifting settings are not read.
  for (const char* off : {R"({"use_dynamic_shifting": null})", R"({"shift_terminal": 0})",
                          R"({"stochastic_sampling": false})", R"({"time_shift_type": "linear", "max_shift": 3})"}) {
    EXPECT_EQ(error_of([&] { FlowEulerConfig::from_json(off); }), "") << off;
  }
}

TEST(FlowEulerConfig, RefusesEachOptionItDoesNotImplementNamingIt) {
  for (const char* key : {"use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                          "stochastic_sampling", "invert_sigmas"}) {
    const std::string message = euler_config_error(key, true);
    EXPECT_EQ(message.rfind(std::string(key) + ": is not supported by the Euler sampler, got true (in ", 0), 0u)
        << message;
    EXPECT_HAS(message, "/scheduler_config.json)");
  }
  EXPECT_HAS(euler_config_error("shift_terminal", 0.02),
             "shift_terminal: is not supported by the Euler sampler, got 0.02");
  EXPECT_HAS(euler_config_error("shift", 0), "shift: must be a positive number, got 0 (in ");
  EXPECT_HAS(euler_config_error("shift", "five"), "shift: has the wrong type: \"five\"");
  EXPECT_HAS(euler_config_error("num_train_timesteps", 0), "num_train_timesteps: must be >= 1, got 0");
  EXPECT_HAS(euler_config_error("_class_name", "UniPCMultistepScheduler"),
             "_class_name: expected \"FlowMatchEulerDiscreteScheduler\", got \"UniPCMultistepScheduler\"");
  EXPECT_HAS(error_of([] { FlowEulerConfig::from_file("/nonexistent/scheduler_config.json"); }),
             "/nonexistent/scheduler_config.json: cannot open scheduler config");
}

TEST(SchedulerConfig, EachSamplerReadsItsOwnClassAndRefusesTheOtherNamingBoth) {
  const SchedulerConfig euler = read_scheduler_config(data_path(kEulerConfig), SamplerKind::kEuler);
  ASSERT_TRUE(std::holds_alternative<FlowEulerConfig>(euler));
  EXPECT_EQ(std::get<FlowEulerConfig>(euler).shift, 5.0);
  const SchedulerConfig unipc = read_scheduler_config(unipc_config(), SamplerKind::kUniPC);
  ASSERT_TRUE(std::holds_alternative<FlowUniPCConfig>(unipc));

  EXPECT_HAS(error_of([] { read_scheduler_config(data_path(kEulerConfig), SamplerKind::kUniPC); }),
             "_class_name: \"FlowMatchEulerDiscreteScheduler\" configures scheduler.type euler, but the sampler is "
             "unipc, which reads a \"UniPCMultistepScheduler\" config (in ");
  EXPECT_HAS(error_of([] { read_scheduler_config(unipc_config(), SamplerKind::kEuler); }),
             "_class_name: \"UniPCMultistepScheduler\" configures scheduler.type unipc, but the sampler is euler, "
             "which reads a \"FlowMatchEulerDiscreteScheduler\" config (in ");
  EXPECT_HAS(error_of([] { parse_scheduler_config(R"({"_class_name": "DDIMScheduler"})", SamplerKind::kEuler); }),
             "_class_name: \"DDIMScheduler\" configures no sampler, but the sampler is euler");
  // Without a class, the sampler's own config reads it.
  const SchedulerConfig bare = parse_scheduler_config(R"({"shift": 2})", SamplerKind::kEuler);
  EXPECT_EQ(std::get<FlowEulerConfig>(bare).shift, 2.0);
  EXPECT_HAS(
      error_of([] { parse_scheduler_config(R"({"shift": 2, "use_karras_sigmas": true})", SamplerKind::kEuler); }),
      "use_karras_sigmas: is not supported by the Euler sampler");
}

// `skyreels generate --sampler euler --scheduler-config F` runs as `--flow-shift` F's shift does: bit for bit, and
// within 1e-4 of diffusers (the fixture was made with FlowMatchEulerDiscreteScheduler(shift=5)).
TEST(SchedulerConfig, GenerateWithAFlowMatchEulerConfigEqualsTheRunWithItsShiftGiven) {
  const test::PipelineCase c = load_case("e3_async_spaced6_cfg");
  ASSERT_EQ(c.params.flow_shift, 5.0);
  const std::string with_shift = test::generate_flags(c) + " --noise " + c.dir + "/noise.safetensors";
  const std::string shift_flag = " --flow-shift 5";
  const size_t at = with_shift.find(shift_flag);
  ASSERT_NE(at, std::string::npos) << with_shift;
  std::string with_config = with_shift;
  with_config.replace(at, shift_flag.size(), " --scheduler-config " + data_path(kEulerConfig));

  const std::string dir = test::temp_dir("euler_scheduler_config");
  std::string log;
  ASSERT_EQ(
      run_command(bin_path("skyreels") + " generate" + with_config + " --out " + dir + "/config.safetensors", &log), 0)
      << log;
  ASSERT_EQ(run_command(bin_path("skyreels") + " generate" + with_shift + " --out " + dir + "/shift.safetensors", &log),
            0)
      << log;
  const at::Tensor by_config = test::load_tensors(dir + "/config.safetensors").at("latents");
  const at::Tensor by_shift = test::load_tensors(dir + "/shift.safetensors").at("latents");
  EXPECT_TRUE(by_config.equal(by_shift));
  EXPECT_TRUE(all_close(by_config, c.output.at("latents"), 1e-4));

  // The mismatches and an option the sampler does not implement stop the command before any model is loaded.
  const auto refusal = [&](const std::string& flags) {
    std::string output;
    EXPECT_NE(run_command(bin_path("skyreels") + " generate --model /nonexistent --inputs /nonexistent" + flags +
                              " --out " + dir + "/refused.safetensors",
                          &output),
              0)
        << flags;
    return output;
  };
  EXPECT_HAS(refusal(" --sampler unipc --scheduler-config " + data_path(kEulerConfig)),
             "\"FlowMatchEulerDiscreteScheduler\" configures scheduler.type euler, but the sampler is unipc");
  EXPECT_HAS(refusal(" --scheduler-config " + data_path(kEulerConfig)),  // unipc is the default
             "\"FlowMatchEulerDiscreteScheduler\" configures scheduler.type euler, but the sampler is unipc");
  EXPECT_HAS(refusal(" --sampler euler --scheduler-config " + unipc_config()),
             "\"UniPCMultistepScheduler\" configures scheduler.type unipc, but the sampler is euler");
  EXPECT_HAS(refusal(" --sampler euler --scheduler-config " + euler_config_with("use_dynamic_shifting", true)),
             "use_dynamic_shifting: is not supported by the Euler sampler, got true");
}

// ---- the schedule's properties -----------------------------------------------------------------------------------

TEST(EulerSchedule, LightX2vRecipeWithShift5) {
  const FlowEulerSchedule s = make_flow_euler_schedule(1000, 5.0, 4, {1000, 750, 500, 250});
  EXPECT_EQ(s.timesteps, (std::vector<float>{1000.0f, 937.5f, 833.33331f, 625.0f}));
  EXPECT_EQ(s.model_timesteps, (std::vector<int64_t>{1000, 937, 833, 625}));
  EXPECT_EQ(s.sigmas, (std::vector<float>{1.0f, 0.9375f, 5.0f * 0.5f / 3.0f, 0.625f, 0.0f}));
  // sigma' = s * sigma / (1 + (s - 1) * sigma)
  for (size_t i = 0; i < 4; ++i) {
    const double sigma = (1000.0 - 250.0 * static_cast<double>(i)) / 1000.0;
    EXPECT_NEAR(s.sigmas[i], 5.0 * sigma / (1.0 + 4.0 * sigma), 1e-7);
  }
}

TEST(EulerSchedule, StepIsXMinusSigmaVPlusNextSigmaV) {
  auto sampler =
      std::make_shared<const FlowEulerSampler>(make_flow_euler_schedule(1000, 5.0, 4, {1000, 750, 500, 250}));
  FlowEulerFrames frames(sampler, 2);
  at::Tensor x = at::randn({1, 4, 2, 3, 3}, at::kFloat);
  const std::vector<float>& sigma = sampler->schedule().sigmas;
  for (int64_t k = 0; k < 4; ++k) {
    const at::Tensor v = at::randn_like(x);
    const at::Tensor expected = x - sigma[k] * v + sigma[k + 1] * v;
    x = frames.step({0, 1}, v, x);
    EXPECT_TRUE(all_close(x, expected, 1e-6)) << "step " << k;
  }
  EXPECT_EQ(frames.steps_taken(0), 4);
  EXPECT_NE(error_of([&] { frames.step({0, 1}, x, x); }).find("already took all 4 steps"), std::string::npos);
}

TEST(EulerSchedule, SpacedScheduleShiftsTheSmallestSigmaTwice) {
  const FlowEulerSchedule s = make_flow_euler_schedule(1000, 5.0, 6, {});
  ASSERT_EQ(s.sigmas.size(), 7u);
  EXPECT_EQ(s.timesteps.front(), 1000.0f);
  EXPECT_NEAR(s.sigmas[5], 0.0244, 1e-4);  // 0.001 shifted (0.00498) and shifted again
  EXPECT_EQ(s.sigmas.back(), 0.0f);
}

TEST(EulerSchedule, RefusesBadListsNamingTheField) {
  const auto message = [](int64_t steps, const std::vector<int64_t>& list) {
    return error_of([&] { make_flow_euler_schedule(1000, 5.0, steps, list); });
  };
  EXPECT_HAS(message(3, {999, 750, 500}), "scheduler.timesteps: the first timestep becomes");  // diffusers fails
  EXPECT_HAS(message(3, {1000, 750, 750}), "scheduler.timesteps: must be strictly decreasing");
  EXPECT_HAS(message(3, {250, 500, 1000}), "scheduler.timesteps: must be strictly decreasing");
  EXPECT_HAS(message(3, {1000, 500, 0}), "scheduler.timesteps: entry 2 is 0, outside (0, 1000]");
  EXPECT_HAS(message(2, {1001, 500}), "scheduler.timesteps: entry 0 is 1001, outside (0, 1000]");
  EXPECT_HAS(message(3, {1000, 500}), "scheduler.timesteps: 2 entries, but num_inference_steps is 3");
  std::vector<int64_t> long_list(10000);
  for (size_t i = 0; i < long_list.size(); ++i) long_list[i] = 10000 - static_cast<int64_t>(i);
  EXPECT_HAS(error_of([&] { make_flow_euler_schedule(10000, 5.0, 10000, long_list); }),
             "scheduler.timesteps: 10000 entries, more than 1000");
}

TEST(EulerSchedule, PlanRefusesAListWithUniPCAndAMismatchedStepCount) {
  GenerationParams p;
  p.num_frames = 9;
  p.height = 32;
  p.width = 48;
  p.timesteps = {1000, 750, 500, 250};
  p.num_inference_steps = 4;
  EXPECT_HAS(error_of([&] { plan_chunks(p, 1); }),
             "scheduler.timesteps: an explicit timestep list needs scheduler.type euler");
  p.sampler = SamplerKind::kEuler;
  EXPECT_EQ(error_of([&] { plan_chunks(p, 1); }), "");
  p.num_inference_steps = 30;
  EXPECT_HAS(error_of([&] { plan_chunks(p, 1); }), "scheduler.timesteps: 4 entries, but num_inference_steps is 30");
  p.num_inference_steps = 4;
  p.timesteps = {999, 750, 500, 250};
  EXPECT_HAS(error_of([&] { plan_chunks(p, 1); }), "scheduler.timesteps: the first timestep becomes");
}

// Every row of model/sampler_table.h has a factory and a plan check in df_timesteps.cpp.
TEST(SamplerTable, EveryRowMakesItsSampler) {
  for (const SamplerRow& row : samplers()) {
    GenerationParams p;
    p.sampler = row.kind;
    p.num_inference_steps = 4;
    if (row.takes_timestep_list) p.timesteps = {1000, 750, 500, 250};
    EXPECT_EQ(error_of([&] { check_sampler(p); }), "") << row.name;
    const ChunkSampler sampler = make_chunk_sampler(p, 3);
    EXPECT_EQ(sampler.step_template.size(), 4u) << row.name;
    EXPECT_EQ(sampler.frames->num_frames(), 3) << row.name;
  }
}

}  // namespace
}  // namespace skyreels::model
