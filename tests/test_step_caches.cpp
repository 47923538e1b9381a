// diffusers' TaylorSeer and MagCache step caches (issue 45) against diffusers' own hooks on SkyReelsV2Pipeline
// (tests/data/step_caches, made by its make_cases.py): the latents within 1e-4 and every call's decision equal, the
// modules TaylorSeer hooks, MagCache's calibration ratios and ratio resampling, and the settings each cache refuses.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using Json = nlohmann::json;
using test::data_path;
using test::golden_path;
using test::load_tensors;
using test::max_abs_diff;

constexpr double kTolerance = 1e-4;
constexpr double kBf16Tolerance = 1e-2;
const char* const kBase = "pipeline_t2v/t1_cfg6_shift8";
const char* const kI2vBase = "pipeline_i2v/i1_image_cfg5_shift5";

Json read_json(const std::string& path) { return Json::parse(std::ifstream(path)); }

// A base case's model, prompts, noise and scheduler, as make_cases.py loads them: the T2V case, or the I2V case with
// its recorded CLIP tokens and VAE condition (the prompt rows zero-padded to 512, as the I2V pipeline takes them).
struct Base {
  std::string name;
  Json json;
  std::unique_ptr<SkyReelsV2Transformer> model;
  VideoConditioning conditioning;
  at::Tensor noise;
  FlowUniPCConfig scheduler;
  PipelineKind kind = PipelineKind::kTextToVideo;

  explicit Base(const std::string& base) : name(base), json(read_json(golden_path(base + "/case.json"))) {
    const Json& w = json.at("weights").at("transformer");
    const TransformerConfig config =
        parse_transformer_config(golden_path(w.at("dir").get<std::string>()) + "/config.json").config;
    std::map<std::string, at::Tensor> tensors;
    for (const auto& file : w.at("safetensors")) {
      for (auto& [key, t] : load_tensors(golden_path(file.get<std::string>()))) tensors[key] = t;
    }
    auto placed = checkpoint::place_strict(tensors, transformer_parameter_specs(config), {}, name);
    model = std::make_unique<SkyReelsV2Transformer>(config, std::move(placed), at::kCPU, at::kFloat);
    auto inputs = load_tensors(golden_path(name + "/inputs.safetensors"));
    if (json.at("kind") == "pipeline_i2v") {
      kind = PipelineKind::kImageToVideo;
      auto padded = [](const at::Tensor& rows) {
        at::Tensor out = at::zeros({rows.size(0), 512, rows.size(2)});
        out.narrow(1, 0, rows.size(1)).copy_(rows);
        return out;
      };
      conditioning.prompt_embeds = padded(inputs.at("prompt_embeds_rows"));
      conditioning.negative_prompt_embeds = padded(inputs.at("negative_prompt_embeds_rows"));
      const at::Tensor tokens = load_tensors(golden_path(name + "/image_encoder.safetensors")).at("image_embeds");
      conditioning.image_tokens = tokens.reshape({1, -1, tokens.size(2)});
      conditioning.condition = load_tensors(golden_path(name + "/condition.safetensors")).at("condition");
    } else {
      conditioning.prompt_embeds = inputs.at("prompt_embeds");
      conditioning.negative_prompt_embeds = inputs.at("negative_prompt_embeds");
    }
    noise = load_tensors(golden_path(name + "/noise.safetensors")).at("noise_000");
    scheduler = FlowUniPCConfig::from_file(golden_path(name + "/scheduler/scheduler_config.json"));
  }

  GenerationParams params(int64_t steps) const {
    const Json& k = json.at("call_kwargs");
    GenerationParams p;
    p.num_frames = k.at("num_frames").get<int64_t>();
    p.height = k.at("height").get<int64_t>();
    p.width = k.at("width").get<int64_t>();
    p.guidance_scale = k.at("guidance_scale").get<double>();
    p.num_inference_steps = steps;
    p.scheduler = scheduler;
    p.flow_shift = scheduler.flow_shift;
    return p;
  }
};

const Base& base() {
  static const Base b(kBase);
  return b;
}

const Base& i2v_base() {
  static const Base b(kI2vBase);
  return b;
}

// The base a fixture names (case.json: pipeline).
const Base& base_of(const Json& c) { return c.at("pipeline") == "i2v" ? i2v_base() : base(); }

std::vector<std::string> strings(const Json& j, const char* key) {
  std::vector<std::string> out;
  if (j.contains(key) && !j.at(key).is_null()) {
    for (const auto& s : j.at(key)) out.push_back(s.get<std::string>());
  }
  return out;
}

TaylorFactorsDtype dtype_named(const std::string& name) {
  if (name == "float32") return TaylorFactorsDtype::kFloat32;
  if (name == "bfloat16") return TaylorFactorsDtype::kBFloat16;
  return TaylorFactorsDtype::kFloat16;
}

// The fixture's TaylorSeerCacheConfig / MagCacheConfig as the step cache config.
StepCacheConfig cache_of(const Json& c) {
  StepCacheConfig out;
  if (c.at("kind") == "taylorseer") {
    out.kind = StepCacheKind::kTaylorSeer;
    TaylorSeerCache& t = out.taylorseer;
    t.cache_interval = c.value("cache_interval", int64_t{5});
    t.disable_cache_before_step = c.value("disable_cache_before_step", int64_t{3});
    if (c.contains("disable_cache_after_step")) t.disable_cache_after_step = c.at("disable_cache_after_step");
    t.max_order = c.value("max_order", int64_t{1});
    t.factors_dtype = dtype_named(c.value("taylor_factors_dtype", std::string("bfloat16")));
    t.cache_modules = strings(c, "cache_identifiers");
    t.skip_modules = strings(c, "skip_predict_identifiers");
    t.lite = c.value("use_lite_mode", false);
  } else {
    out.kind = StepCacheKind::kMagCache;
    MagCache& m = out.magcache;
    m.threshold = c.value("threshold", 0.06);
    m.max_skip_steps = c.value("max_skip_steps", int64_t{3});
    m.retention_ratio = c.value("retention_ratio", 0.2);
    m.calibrate = c.value("calibrate", false);
    if (c.contains("mag_ratios")) m.mag_ratios = c.at("mag_ratios").get<std::vector<float>>();
  }
  return out;
}

struct CacheRun {
  at::Tensor latents;
  std::vector<TransformerCallReport> calls;
};

CacheRun run(const GenerationParams& params, const Base& b = base()) {
  CacheRun r;
  VideoHooks hooks;
  hooks.on_call = [&r](const TransformerCallReport& c) { r.calls.push_back(c); };
  auto noise = make_recorded_noise({b.noise});
  r.latents = generate_video(*b.model, b.kind, params, b.conditioning, *noise, 1, hooks);
  return r;
}

class Fixture : public ::testing::TestWithParam<std::string> {};

// ts1, mc2, i2v_ts1, ...: the case's short name.
std::string fixture_label(const ::testing::TestParamInfo<std::string>& info) {
  const std::string& p = info.param;
  return p.rfind("i2v_", 0) == 0 ? "i2v_" + p.substr(4, 3) : p.substr(0, 3);
}

TEST_P(Fixture, LatentsAndDecisionsAreDiffusers) {
  const std::string dir = data_path("step_caches/" + GetParam());
  const Json c = read_json(dir + "/case.json");
  const Json decisions = read_json(dir + "/decisions.json");
  const Base& b = base_of(c);
  GenerationParams params = b.params(c.at("num_inference_steps").get<int64_t>());
  params.cache = cache_of(c.at("cache"));
  const CacheRun r = run(params, b);

  const at::Tensor want = load_tensors(dir + "/output.safetensors").at("latents");
  const double diff = max_abs_diff(r.latents, want);
  std::cout << GetParam() << ": max |latents - diffusers| = " << diff << "\n";
  // diffusers' default bf16 factors: fp32 values ~1e-6 apart may round to neighbouring bf16 values (one ulp is
  // 2^-8 relative), so that case is held to bf16's resolution; fp32 factors to 1e-4.
  const bool bf16 = c.at("cache").value("taylor_factors_dtype", std::string("bfloat16")) == "bfloat16" &&
                    c.at("cache").at("kind") == "taylorseer";
  EXPECT_LE(diff, bf16 ? kBf16Tolerance : kTolerance);
  const Json got = Json::parse(step_cache_decisions_json(r.calls));
  ASSERT_EQ(got.size(), decisions.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const Json& w = decisions[i];
    EXPECT_EQ(got[i].at("step"), w.at("step")) << i;
    EXPECT_EQ(got[i].at("context"), w.at("context")) << i;
    EXPECT_EQ(got[i].at("decision"), w.at("decision")) << "call " << i;
    if (w.contains("accumulated_err") && !w.at("accumulated_err").is_null()) {
      EXPECT_NEAR(got[i].at("accumulated_err").get<double>(), w.at("accumulated_err").get<double>(), 1e-6) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(StepCaches, Fixture,
                         ::testing::Values("ts1_attn_order2_fp32", "ts2_lite_after9", "ts3_block_skip_ffn",
                                           "ts4_attn_bf16_default_dtype", "mc1_threshold", "mc2_interpolated_9",
                                           "i2v_ts1_attn_fp32", "i2v_mc1_threshold"),
                         fixture_label);

// Synchronous diffusion forcing (ar_step 0): diffusers' hooks on SkyReelsV2DiffusionForcingPipeline with the state
// reset at every chunk start; one chunk and three chunks of pipeline_df_cache's fixtures.
class DiffusionForcing : public ::testing::TestWithParam<std::string> {};

TEST_P(DiffusionForcing, LatentsAndDecisionsAreDiffusers) {
  const std::string dir = data_path("step_caches/" + GetParam());
  const Json c = read_json(dir + "/case.json");
  const test::PipelineCase base_case =
      test::load_pipeline_case(GetParam(), dir + "/" + c.at("base").get<std::string>());
  const auto model = test::load_fixture_transformer(base_case.dir + "/weights/diffusers");
  GenerationParams params = base_case.params;
  params.cache = cache_of(c.at("cache"));
  std::vector<TransformerCallReport> calls;
  StepHooks hooks;
  hooks.on_call = [&calls](const TransformerCallReport& call) { calls.push_back(call); };
  auto noise = make_recorded_noise(base_case.noise);
  const at::Tensor latents = generate(*model, params, base_case.conditioning, *noise, hooks);

  const at::Tensor want = load_tensors(dir + "/output.safetensors").at("latents");
  const double diff = max_abs_diff(latents, want);
  std::cout << GetParam() << ": max |latents - diffusers| = " << diff << "\n";
  EXPECT_LE(diff, kTolerance);
  const Json got = Json::parse(step_cache_decisions_json(calls));
  const Json decisions = read_json(dir + "/decisions.json");
  ASSERT_EQ(got.size(), decisions.size());
  int64_t saved = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    for (const char* key : {"chunk", "step", "context", "decision"}) {
      EXPECT_EQ(got[i].at(key), decisions[i].at(key)) << "call " << i << " " << key;
    }
    saved += calls[i].token_blocks_saved_cache;
  }
  EXPECT_GT(saved, 0);
}

INSTANTIATE_TEST_SUITE_P(StepCaches, DiffusionForcing,
                         ::testing::Values("df_ts1_sync_attn", "df_mc1_sync", "df_ts2_long_sync_3chunks",
                                           "df_mc2_long_sync_3chunks"));

TEST(DiffusionForcing, AsyncRowsAreRefused) {
  GenerationParams params;
  params.num_frames = 17;
  params.base_num_frames = 17;
  params.ar_step = 2;
  params.causal_block_size = 1;
  params.cache.kind = StepCacheKind::kTaylorSeer;
  EXPECT_NE(test::error_of([&] { plan_chunks(params, 1); }).find("need ar_step 0"), std::string::npos);
}

TEST(TaylorSeer, HooksTheModulesDiffusersHooks) {
  for (const char* name :
       {"ts1_attn_order2_fp32", "ts2_lite_after9", "ts3_block_skip_ffn", "ts4_attn_bf16_default_dtype"}) {
    const Json c = read_json(data_path(std::string("step_caches/") + name + "/case.json"));
    std::vector<std::string> hooked;
    for (const auto& [module, role] :
         taylorseer_hooked_modules(cache_of(c.at("cache")).taylorseer, base().model->config())) {
      hooked.push_back(module);
    }
    EXPECT_EQ(hooked, strings(c, "hooked_modules")) << name;
  }
}

TEST(TaylorSeer, RefusesPatternsThatHookNothingOrTheWrongModules) {
  const TransformerConfig& config = base().model->config();
  TaylorSeerCache stock;  // diffusers' default patterns: nothing on this model
  stock.cache_modules = {"^blocks.*attn"};
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(stock, config); }).find("hook no module"),
            std::string::npos);
  TaylorSeerCache inner;
  inner.cache_modules = {R"(blocks\.0\.attn1\.to_q)"};
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(inner, config); }).find("cannot hook"), std::string::npos);
  TaylorSeerCache nested;
  nested.cache_modules = {R"(blocks\.0)", R"(blocks\.0\.attn1)"};
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(nested, config); }).find("inside 'blocks.0'"),
            std::string::npos);
  TaylorSeerCache bad;
  bad.cache_modules = {"blocks\\.(", "x"};
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(bad, config); }).find("taylorseer_cache_modules"),
            std::string::npos);
  TaylorSeerCache interval;
  interval.cache_modules = {R"(blocks\.\d+\.attn1)"};
  interval.cache_interval = 0;
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(interval, config); }).find("taylorseer_cache_interval"),
            std::string::npos);
  interval.cache_interval = 2;
  interval.disable_cache_before_step = 0;
  EXPECT_NE(
      test::error_of([&] { taylorseer_hooked_modules(interval, config); }).find("taylorseer_disable_cache_before_step"),
      std::string::npos);
  interval.disable_cache_before_step = 1;
  interval.max_order = 9;
  EXPECT_NE(test::error_of([&] { taylorseer_hooked_modules(interval, config); }).find("taylorseer_max_order"),
            std::string::npos);
}

class Calibration : public ::testing::TestWithParam<std::string> {};

TEST_P(Calibration, RecordsDiffusersRatios) {
  const Json c = read_json(data_path("step_caches/" + GetParam() + "/case.json"));
  const Base& b = base_of(c);
  GenerationParams params = b.params(c.at("num_inference_steps").get<int64_t>());
  params.cache = cache_of(c.at("cache"));
  const CacheRun r = run(params, b);
  std::map<std::string, std::vector<double>> got;
  for (const auto& call : r.calls) {
    ASSERT_TRUE(call.calibration_ratio.has_value());
    EXPECT_FALSE(call.skipped);
    got[call.unconditional ? "uncond" : "cond"].push_back(*call.calibration_ratio);
  }
  for (const char* context : {"cond", "uncond"}) {
    const auto want = c.at("calibration").at(context).get<std::vector<double>>();
    ASSERT_EQ(got[context].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[context][i], want[i], 1e-4 * std::abs(want[i])) << i;
  }
  // Calibrating changes nothing: the uncached run's latents.
  GenerationParams plain = b.params(c.at("num_inference_steps").get<int64_t>());
  EXPECT_LE(max_abs_diff(run(plain, b).latents, r.latents), 0.0);
}

INSTANTIATE_TEST_SUITE_P(MagCache, Calibration, ::testing::Values("mc0_calibrate", "i2v_mc0_calibrate"), fixture_label);

TEST(MagCache, ResamplesRatiosAsDiffusersNearestInterp) {
  const std::vector<float> twelve{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  // torch.round(arange(9) * (11 / 8)) = [0, 1, 3, 4, 6, 7, 8, 10, 11] (5.5 rounds to 6, 8.25 to 8).
  EXPECT_EQ(magcache_ratios_for_steps(twelve, 9), (std::vector<float>{0, 1, 3, 4, 6, 7, 8, 10, 11}));
  EXPECT_EQ(magcache_ratios_for_steps(twelve, 1), (std::vector<float>{11}));
  EXPECT_EQ(magcache_ratios_for_steps(twelve, 12), twelve);
}

TEST(MagCache, RefusesWithoutRatiosAndBadSettings) {
  GenerationParams params = base().params(4);
  params.cache.kind = StepCacheKind::kMagCache;
  EXPECT_NE(test::error_of([&] { run(params); }).find("--magcache-ratios"), std::string::npos);
  params.cache.magcache.mag_ratios = {1.0F, 1.1F, 0.9F, 1.0F};
  params.cache.magcache.max_skip_steps = 0;
  EXPECT_NE(test::error_of([&] { run(params); }).find("magcache_max_skip_steps"), std::string::npos);
  params.cache.magcache.max_skip_steps = 2;
  params.cache.magcache.threshold = std::nan("");
  EXPECT_NE(test::error_of([&] { run(params); }).find("magcache_threshold"), std::string::npos);
}

TEST(StepCaches, TokenBlocksCountWhatWasSkipped) {
  const std::string dir = data_path("step_caches/mc1_threshold");
  const Json c = read_json(dir + "/case.json");
  GenerationParams params = base().params(c.at("num_inference_steps").get<int64_t>());
  params.cache = cache_of(c.at("cache"));
  const CacheRun r = run(params);
  const int64_t per_call = r.calls.front().token_blocks_full;
  for (const auto& call : r.calls) {
    EXPECT_EQ(call.token_blocks_full, per_call);
    EXPECT_EQ(call.token_blocks_computed + call.token_blocks_saved_cache, per_call);
    EXPECT_EQ(call.token_blocks_saved_cache, call.skipped ? per_call : 0);
  }
}

// The same through the command line: `skyreels calibrate-magcache` records diffusers' ratios, and `skyreels generate
// --cache taylorseer|magcache` reproduces the fixtures' latents and --cache-log their decisions.
TEST(StepCachesCli, CalibrateAndGenerateReproduceTheFixtures) {
  const Json& k = base().json.at("call_kwargs");
  const std::string dir = test::temp_dir("step-caches-cli");
  const std::string common =
      " --model " + golden_path(base().json.at("weights").at("transformer").at("dir").get<std::string>()) +
      " --inputs " + golden_path(std::string(kBase) + "/inputs.safetensors") + " --noise " +
      golden_path(std::string(kBase) + "/noise.safetensors") + " --scheduler-config " +
      golden_path(std::string(kBase) + "/scheduler/scheduler_config.json") + " --num-frames " +
      std::to_string(k.at("num_frames").get<int64_t>()) + " --height " + std::to_string(k.at("height").get<int64_t>()) +
      " --width " + std::to_string(k.at("width").get<int64_t>()) + " --guidance-scale 6 --num-inference-steps 12 ";
  auto run_cli = [&](const std::string& command, const std::string& flags) {
    std::string log;
    const std::string line = test::bin_path("skyreels") + " " + command + common + flags + " 2>&1";
    EXPECT_EQ(test::run_command(line, &log), 0) << line << "\n" << log;
  };
  run_cli("calibrate-magcache", "--out " + dir + "/ratios.json");
  const Json ratios = read_json(dir + "/ratios.json");
  const Json calibration = read_json(data_path("step_caches/mc0_calibrate/case.json")).at("calibration");
  for (const auto& [key, context] : {std::pair{"ratios_cond", "cond"}, std::pair{"ratios_uncond", "uncond"}}) {
    const auto got = ratios.at(key).get<std::vector<double>>();
    const auto want = calibration.at(context).get<std::vector<double>>();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-4 * want[i]) << key << " " << i;
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"mc1_threshold",
       "--cache magcache --magcache-threshold 0.25 --magcache-max-skip-steps 2 "
       "--magcache-retention-ratio 0.2 --magcache-ratios " +
           dir + "/ratios.json"},
      {"ts1_attn_order2_fp32",
       "--cache taylorseer --taylorseer-cache-interval 3 "
       "--taylorseer-disable-cache-before-step 2 --taylorseer-max-order 2 "
       "--taylorseer-factors-dtype float32"}};
  for (const auto& [name, flags] : cases) {
    run_cli("generate",
            "--pipeline t2v " + flags + " --cache-log " + dir + "/log.json --out " + dir + "/out.safetensors");
    const at::Tensor got = load_tensors(dir + "/out.safetensors").at("latents");
    const at::Tensor want = load_tensors(data_path("step_caches/" + name + "/output.safetensors")).at("latents");
    EXPECT_LE(max_abs_diff(got, want), kTolerance) << name;
    const Json log = read_json(dir + "/log.json"),
               decisions = read_json(data_path("step_caches/" + name + "/decisions.json"));
    ASSERT_EQ(log.size(), decisions.size()) << name;
    for (size_t i = 0; i < log.size(); ++i) EXPECT_EQ(log[i].at("decision"), decisions[i].at("decision")) << name << i;
  }
}

}  // namespace
}  // namespace skyreels::model
