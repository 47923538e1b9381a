// Flow UniPC sampler against diffusers' UniPCMultistepScheduler traces (tests/data/golden/unipc).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "model/sampler_flow_unipc.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::all_close;
using test::golden_path;
using test::load_tensors;

std::string step_key(int64_t k, const char* what) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "step%03lld_%s", static_cast<long long>(k), what);
  return buf;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

class UniPCTrace : public ::testing::TestWithParam<std::string> {};

TEST_P(UniPCTrace, ScheduleMatchesDiffusersExactly) {
  const std::string dir = golden_path("unipc/" + GetParam());
  const auto config = FlowUniPCConfig::from_file(dir + "/scheduler_config.json");
  const auto golden = load_tensors(dir + "/schedule.safetensors");
  const FlowSchedule schedule = make_flow_schedule(config, golden.at("timesteps").numel());
  EXPECT_TRUE(at::equal(at::tensor(schedule.timesteps, at::kLong), golden.at("timesteps")));
  EXPECT_TRUE(at::equal(at::tensor(schedule.sigmas, at::kFloat), golden.at("sigmas")));  // bitwise
}

// Chained steps as the trace protocol does; every intermediate is compared, so a wrong step is pinpointed.
TEST_P(UniPCTrace, ChainedStepsMatchDiffusersWithin1e6) {
  const std::string dir = golden_path("unipc/" + GetParam());
  const auto config = FlowUniPCConfig::from_file(dir + "/scheduler_config.json");
  const auto trace = load_tensors(dir + "/trace.safetensors");
  const auto calls = read_json(dir + "/case.json").at("calls");
  const int64_t n = static_cast<int64_t>(calls.size());
  auto sampler = std::make_shared<const FlowUniPCSampler>(config, n);
  FlowUniPCFrames frames(sampler, 1);

  at::Tensor sample = trace.at(step_key(0, "sample")).unsqueeze(2);
  double worst = 0.0;
  for (int64_t k = 0; k < n; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    const auto& call = calls[static_cast<size_t>(k)];
    EXPECT_EQ(sampler->schedule().timesteps[static_cast<size_t>(k)], trace.at(step_key(k, "timestep")).item<int64_t>());
    EXPECT_EQ(sampler->uses_corrector(k), call.at("corrector_applied").get<bool>());
    EXPECT_EQ(sampler->predictor_order(k), call.at("predictor_order").get<int64_t>());
    EXPECT_TRUE(all_close(sample.squeeze(2), trace.at(step_key(k, "sample")), 1e-6));

    sample = frames.step({0}, trace.at(step_key(k, "model_output")).unsqueeze(2), sample);

    EXPECT_TRUE(all_close(frames.last_x0(0).squeeze(2), trace.at(step_key(k, "x0_pred")), 1e-6));
    if (call.at("corrector_applied").get<bool>()) {
      EXPECT_TRUE(
          all_close(frames.last_corrected_sample(0).squeeze(2), trace.at(step_key(k, "corrected_sample")), 1e-6));
    }
    EXPECT_TRUE(all_close(sample.squeeze(2), trace.at(step_key(k, "prev_sample")), 1e-6));
    worst = std::max(worst, test::max_abs_diff(sample.squeeze(2), trace.at(step_key(k, "prev_sample"))));
  }
  EXPECT_EQ(frames.steps_taken(0), n);
  std::printf("[ %s ] max |diff| over %lld steps = %.3g\n", GetParam().c_str(), static_cast<long long>(n), worst);
}

INSTANTIATE_TEST_SUITE_P(Golden, UniPCTrace, ::testing::Values("u1_n30_shift8", "u2_n10_shift5", "u3_n7_shift1"));

TEST(FlowSchedule, StepTemplatesOfEveryTimestepMatrixCaseMatchDiffusers) {
  struct Case {
    const char* name;
    int64_t steps;
    double shift;
  };
  for (const Case& c :
       {Case{"m1_sync_ar0", 10, 8.0}, Case{"m2_async_ar5_cbs5_f25", 30, 8.0}, Case{"m4_ar2_cbs2", 10, 5.0},
        Case{"m7_pre_ready_not_multiple_of_cbs", 8, 5.0}, Case{"m8_sync_pre_ready5", 6, 8.0}}) {
    FlowUniPCConfig config;
    config.flow_shift = c.shift;
    const auto golden = load_tensors(golden_path(std::string("timestep_matrix/") + c.name + "/matrix.safetensors"));
    EXPECT_TRUE(
        at::equal(at::tensor(make_flow_schedule(config, c.steps).timesteps, at::kLong), golden.at("step_template")))
        << c.name;
  }
}

TEST(FlowSchedule, ThirtyStepsAtShift8IsTheDiffusersHeadGridNotTheOldOne) {
  FlowUniPCConfig config;
  config.flow_shift = 8.0;
  const auto t = make_flow_schedule(config, 30).timesteps;
  // >= v0.37 values (spec §5.2); <= v0.36 would give 980 at index 4 and 216 at the end.
  EXPECT_EQ(t[4], 981);
  EXPECT_EQ(t.back(), 221);
  EXPECT_EQ(make_flow_schedule(config, 30).sigmas.back(), 0.0f);
}

// diffusers looks the first timestep up in the schedule and takes the *second* match when it repeats, which runs
// off the end of the sigmas on the last step (IndexError). Our counters never search, so this completes.
TEST(FlowUniPC, HundredStepsAtShift12WithRepeatedTimestepsRunsToTheEnd) {
  FlowUniPCConfig config;
  config.flow_shift = 12.0;
  auto sampler = std::make_shared<const FlowUniPCSampler>(config, 100);
  const auto& t = sampler->schedule().timesteps;
  const std::set<int64_t> distinct(t.begin(), t.end());
  ASSERT_LT(distinct.size(), t.size()) << "premise: the schedule must repeat an integer timestep";
  ASSERT_EQ(t[0], t[1]) << "premise: the first timestep repeats (the case that crashes diffusers)";

  at::Tensor sample = at::randn({1, 4, 1, 3, 5}, at::kFloat);
  FlowUniPCFrames frames(sampler, 1);
  for (int64_t k = 0; k < 100; ++k) {
    const at::Tensor velocity = at::randn_like(sample);
    sample = frames.step({0}, velocity, sample);
  }
  EXPECT_TRUE(sample.isfinite().all().item<bool>());
  // Last step: order 1 towards sigma 0, which returns the last x0 prediction exactly.
  EXPECT_TRUE(at::equal(sample, frames.last_x0(0)));
  EXPECT_THROW(frames.step({0}, sample, sample), std::invalid_argument);  // no 101st step
}

TEST(FlowUniPC, FramesSharingAStepAreUpdatedTogetherExactlyAsOneByOne) {
  FlowUniPCConfig config;
  config.flow_shift = 5.0;
  auto sampler = std::make_shared<const FlowUniPCSampler>(config, 6);
  at::manual_seed(11);
  at::Tensor x = at::randn({2, 3, 3, 4, 4});
  FlowUniPCFrames together(sampler, 3);
  std::vector<std::unique_ptr<FlowUniPCFrames>> alone;
  std::vector<at::Tensor> xs;
  for (int64_t f = 0; f < 3; ++f) {
    alone.push_back(std::make_unique<FlowUniPCFrames>(sampler, 1));
    xs.push_back(x.narrow(2, f, 1));
  }
  for (int64_t k = 0; k < 6; ++k) {
    const at::Tensor v = at::randn_like(x);
    x = together.step({0, 1, 2}, v, x);
    for (int64_t f = 0; f < 3; ++f)
      xs[static_cast<size_t>(f)] =
          alone[static_cast<size_t>(f)]->step({0}, v.narrow(2, f, 1), xs[static_cast<size_t>(f)]);
  }
  EXPECT_TRUE(at::equal(x, at::cat(xs, 2)));
}

TEST(FlowUniPC, EachFrameKeepsItsOwnStepCounterAndHistory) {
  FlowUniPCConfig config;
  config.flow_shift = 8.0;
  auto sampler = std::make_shared<const FlowUniPCSampler>(config, 4);
  at::manual_seed(12);
  const at::Tensor x0 = at::randn({1, 2, 1, 2, 2});
  const at::Tensor x1 = at::randn({1, 2, 1, 2, 2});
  std::vector<at::Tensor> v;
  for (int i = 0; i < 4; ++i) v.push_back(at::randn({1, 2, 1, 2, 2}));

  FlowUniPCFrames frames(sampler, 2);
  at::Tensor a = frames.step({0}, v[0], x0);  // frame 0 starts first (async diffusion forcing)
  a = frames.step({0}, v[1], a);
  at::Tensor b = frames.step({1}, v[0], x1);  // frame 1 starts two steps later
  EXPECT_EQ(frames.steps_taken(0), 2);
  EXPECT_EQ(frames.steps_taken(1), 1);
  EXPECT_THROW(frames.step({0, 1}, at::cat({v[2], v[1]}, 2), at::cat({a, b}, 2)), std::invalid_argument);

  FlowUniPCFrames reference(sampler, 1);
  at::Tensor r = reference.step({0}, v[0], x1);
  EXPECT_TRUE(at::equal(b, r));
  b = frames.step({1}, v[1], b);
  r = reference.step({0}, v[1], r);
  EXPECT_TRUE(at::equal(b, r));
}

TEST(FlowUniPC, Bf16VelocityIsScaledInBf16BeforeTheFp32Subtraction) {
  FlowUniPCConfig config;
  config.flow_shift = 8.0;
  auto sampler = std::make_shared<const FlowUniPCSampler>(config, 3);
  at::manual_seed(13);
  const at::Tensor x = at::randn({1, 2, 1, 3, 3});
  const at::Tensor v = at::randn({1, 2, 1, 3, 3}).to(at::kBFloat16);
  FlowUniPCFrames frames(sampler, 1);
  const at::Tensor out = frames.step({0}, v, x);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  const float sigma = sampler->schedule().sigmas[0];
  const at::Tensor expected_x0 = x - (v * at::scalar_tensor(sigma, at::kFloat)).to(at::kBFloat16).to(at::kFloat);
  EXPECT_TRUE(at::equal(frames.last_x0(0), expected_x0));
}

TEST(FlowUniPCConfig, ParsesTheFixtureSchedulerConfig) {
  const auto c = FlowUniPCConfig::from_file(golden_path("pipeline_df/p1_sync_short/scheduler/scheduler_config.json"));
  EXPECT_EQ(c.flow_shift, 8.0);
  EXPECT_EQ(c.solver_order, 2);
  EXPECT_EQ(c.solver_type, "bh2");
  EXPECT_TRUE(c.lower_order_final);
  EXPECT_EQ(c.num_train_timesteps, 1000);
}

TEST(FlowUniPCConfig, RefusesUnsupportedSettingsNamingTheKey) {
  auto message_of = [](const std::string& json) {
    try {
      FlowUniPCConfig::from_json(json, "cfg.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message_of(R"({"prediction_type": "epsilon"})").rfind("prediction_type:", 0), 0u);
  EXPECT_EQ(message_of(R"({"use_flow_sigmas": false})").rfind("use_flow_sigmas:", 0), 0u);
  EXPECT_EQ(message_of(R"({"use_karras_sigmas": true})").rfind("use_karras_sigmas:", 0), 0u);
  EXPECT_EQ(message_of(R"({"solver_order": 3})").rfind("solver_order:", 0), 0u);
  EXPECT_EQ(message_of(R"({"solver_type": "midpoint"})").rfind("solver_type:", 0), 0u);
  EXPECT_EQ(message_of(R"({"_class_name": "FlowMatchEulerDiscreteScheduler"})").rfind("_class_name:", 0), 0u);
  EXPECT_EQ(message_of(R"({"flow_shift": "eight"})").rfind("flow_shift:", 0), 0u);
  EXPECT_NE(message_of("{not json").find("cfg.json"), std::string::npos);
  EXPECT_NE(message_of(R"({"solver_order": 3})").find("cfg.json"), std::string::npos);
  EXPECT_THROW(FlowUniPCConfig::from_file("/nonexistent/scheduler_config.json"), std::invalid_argument);
}

TEST(FlowSchedule, RefusesZeroSteps) { EXPECT_THROW(make_flow_schedule(FlowUniPCConfig{}, 0), std::invalid_argument); }

}  // namespace
}  // namespace skyreels::model
