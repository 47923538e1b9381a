// The flow-matching Euler sampler (`scheduler.type` euler, `scheduler.timesteps`) against diffusers'
// FlowMatchEulerDiscreteScheduler run through its own SkyReels-V2 DF pipelines (tests/data/euler, made by
// tests/data/euler/make_cases.py): the schedules, the update, the refusals, the loop with the tiny transformer from
// recorded noise and `skyreels generate` (text, async, long with addnoise_condition, image-to-video).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/pixel_conditioning.h"
#include "model/sampler_flow_euler.h"
#include "model/sampler_table.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::all_close;
using test::data_path;
using test::error_of;
using test::max_abs_diff;
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
  auto sampler = std::make_shared<const FlowEulerSampler>(make_flow_euler_schedule(1000, 5.0, 4, {1000, 750, 500, 250}));
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
  EXPECT_HAS(error_of([&] { plan_chunks(p, 1); }), "scheduler.timesteps: an explicit timestep list needs scheduler.type euler");
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
