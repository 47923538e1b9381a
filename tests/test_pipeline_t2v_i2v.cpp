// The text-to-video and image-to-video pipelines against diffusers' own SkyReelsV2Pipeline and
// SkyReelsV2ImageToVideoPipeline (tests/data/golden/pipeline_t2v, pipeline_i2v): every step's latents from the
// recorded noise and from the seed, the I2V condition (VAE side, frame mask) and image tokens (CLIP side) on their
// own, several videos per prompt (which diffusers gets wrong), `skyreels generate --pipeline t2v|i2v`, and the
// requests each pipeline refuses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/checkpoint.h"
#include "model/clip_vision.h"
#include "model/image_processor.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/rank_group.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

namespace fs = std::filesystem;
using test::all_close;
using test::golden_path;
using test::load_tensors;
using test::max_abs_diff;
using Json = nlohmann::json;

constexpr double kTolerance = 1e-4;

// A pipeline_t2v / pipeline_i2v case: its call, its models (case.json: weights, relative to the golden root) and
// tensors.
struct VideoCase {
  std::string name, dir;
  Json json;
  GenerationParams params;
  int64_t videos_per_prompt = 1;
  PipelineKind kind = PipelineKind::kTextToVideo;
  std::map<std::string, at::Tensor> inputs, noise, output, trace, image_encoder, condition;

  explicit VideoCase(const std::string& case_name) : name(case_name), dir(golden_path(case_name)) {
    json = Json::parse(std::ifstream(dir + "/case.json"));
    kind = json.at("kind") == "pipeline_i2v" ? PipelineKind::kImageToVideo : PipelineKind::kTextToVideo;
    const Json& k = json.at("call_kwargs");
    params.num_frames = k.at("num_frames").get<int64_t>();
    params.height = k.at("height").get<int64_t>();
    params.width = k.at("width").get<int64_t>();
    params.num_inference_steps = k.at("num_inference_steps").get<int64_t>();
    params.guidance_scale = k.at("guidance_scale").get<double>();
    videos_per_prompt = k.at("num_videos_per_prompt").get<int64_t>();
    params.scheduler = FlowUniPCConfig::from_file(dir + "/scheduler/scheduler_config.json");
    params.flow_shift = params.scheduler.flow_shift;
    const std::string generator = k.at("generator").get<std::string>();
    if (generator.rfind("torch.Generator().manual_seed(", 0) == 0) params.seed = std::stoull(generator.substr(30));
    inputs = load_tensors(dir + "/inputs.safetensors");
    noise = load_tensors(dir + "/noise.safetensors");
    output = load_tensors(dir + "/output.safetensors");
    trace = load_tensors(dir + "/trace.safetensors");
    if (is_i2v()) {
      image_encoder = load_tensors(dir + "/image_encoder.safetensors");
      condition = load_tensors(dir + "/condition.safetensors");
    }
  }
  bool is_i2v() const { return kind == PipelineKind::kImageToVideo; }
  bool has_last_image() const { return inputs.count("last_image_u8") != 0; }
  std::string weights_dir(const char* model) const {
    return golden_path(json.at("weights").at(model).at("dir").get<std::string>());
  }

  // The transformer: config.json of its folder and the union of its safetensors files (i2 adds a pos_embed).
  std::unique_ptr<SkyReelsV2Transformer> transformer() const {
    const Json& w = json.at("weights").at("transformer");
    TransformerConfig config = parse_transformer_config(weights_dir("transformer") + "/config.json").config;
    std::map<std::string, at::Tensor> tensors;
    for (const auto& file : w.at("safetensors")) {
      for (auto& [key, t] : load_tensors(golden_path(file.get<std::string>()))) tensors[key] = t;
    }
    auto placed = checkpoint::place_strict(tensors, transformer_parameter_specs(config), {}, name);
    return std::make_unique<SkyReelsV2Transformer>(config, std::move(placed), at::kCPU, at::kFloat);
  }

  // The prompt rows as the pipeline got them: I2V zero-pads them to 512 rows (its attention needs exactly that
  // many); T2V takes them as stored.
  at::Tensor text(const char* key) const {
    const at::Tensor rows = inputs.at(key);
    if (!is_i2v()) return rows;
    at::Tensor out = at::zeros({rows.size(0), 512, rows.size(2)});
    out.narrow(1, 0, rows.size(1)).copy_(rows);
    return out;
  }
  std::string rows_key(const char* stem) const { return std::string(stem) + (is_i2v() ? "_embeds_rows" : "_embeds"); }

  // Conditioning from the stored intermediates (image tokens and condition as diffusers computed them).
  VideoConditioning recorded_conditioning() const {
    VideoConditioning c;
    c.prompt_embeds = text(rows_key("prompt").c_str());
    if (params.guidance_scale > 1.0) c.negative_prompt_embeds = text(rows_key("negative_prompt").c_str());
    if (is_i2v()) {
      const at::Tensor tokens = image_encoder.at("image_embeds");  // [1 or 2, n, d]: image (and last image)
      c.image_tokens = tokens.reshape({1, -1, tokens.size(2)});
      c.condition = condition.at("condition");
    }
    return c;
  }

  // Per step: the latents after the sampler step, against sNNN_latents_after.
  VideoHooks step_checks(double* worst) const {
    VideoHooks hooks;
    hooks.on_step = [this, worst](int64_t step, int64_t, const at::Tensor& latents) {
      char key[32];
      std::snprintf(key, sizeof key, "s%03lld_latents_after", static_cast<long long>(step));
      EXPECT_TRUE(all_close(latents, trace.at(key), kTolerance, kTolerance)) << name << " " << key;
      *worst = std::max(*worst, max_abs_diff(latents, trace.at(key)));
    };
    return hooks;
  }
};

const std::vector<std::string> kAllCases = {
    "pipeline_t2v/t1_cfg6_shift8", "pipeline_t2v/t2_b2_nocfg_shift5_genlist_frames_rounded",
    "pipeline_i2v/i1_image_cfg5_shift5", "pipeline_i2v/i2_flf2v_last_image_cfg4"};
// One torch.Generator(seed): the seed alone gives the noise (t2 draws from a generator list).
const std::vector<std::string> kSeedCases = {"pipeline_t2v/t1_cfg6_shift8", "pipeline_i2v/i1_image_cfg5_shift5",
                                             "pipeline_i2v/i2_flf2v_last_image_cfg4"};
const std::vector<std::string> kI2vCases = {"pipeline_i2v/i1_image_cfg5_shift5",
                                            "pipeline_i2v/i2_flf2v_last_image_cfg4"};

std::string label(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.substr(info.param.find('/') + 1, 2);
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, TimestepsAreDiffusers) {
  const VideoCase c(GetParam());
  GenerationParams p = c.params;
  const ChunkSampler sampler = make_chunk_sampler(p, 1);
  const at::Tensor expected = c.trace.at("timesteps");
  ASSERT_EQ(static_cast<int64_t>(sampler.step_template.size()), expected.size(0));
  for (int64_t i = 0; i < expected.size(0); ++i) {
    EXPECT_EQ(sampler.step_template[static_cast<size_t>(i)], expected[i].item<int64_t>()) << "step " << i;
  }
}

TEST_P(Golden, EveryStepFromTheRecordedNoiseWithin1e4) {
  const VideoCase c(GetParam());
  auto noise = make_recorded_noise({c.noise.at("noise_000")});
  double worst = 0;
  const at::Tensor latents = generate_video(*c.transformer(), c.kind, c.params, c.recorded_conditioning(), *noise,
                                            c.videos_per_prompt, c.step_checks(&worst));
  EXPECT_TRUE(all_close(latents, c.output.at("latents"), kTolerance, kTolerance));
  std::cout << "[ " << pipeline_kind_name(c.kind) << " ] " << c.name << " max |diff| over the steps = " << worst
            << ", latents " << max_abs_diff(latents, c.output.at("latents")) << "\n";
}

TEST_P(Golden, OnGuidanceParallelAndUlyssesRanksEqualsOneDeviceWithin1e5) {
  // One video on several devices (issue 43): cfg=2 (a guided row's passes on the two halves), ulysses=2 (tokens split)
  // and both, each rank a thread joined by c10d Gloo, against the same call on one device.
  const VideoCase c(GetParam());
  const auto transformer = c.transformer();
  const auto& model = *transformer;
  auto run = [&](const RankGroups* ranks) {
    auto noise = make_recorded_noise({c.noise.at("noise_000")});
    return generate_video(model, c.kind, c.params, c.recorded_conditioning(), *noise, c.videos_per_prompt, {}, ranks);
  };
  at::set_num_threads(1);
  const at::Tensor one = run(nullptr);
  for (const ParallelLayout layout : {ParallelLayout{2, 1}, ParallelLayout{1, 2}, ParallelLayout{2, 2}}) {
    std::vector<at::Tensor> out(static_cast<size_t>(layout.ranks()));
    run_on_ranks(layout, std::chrono::milliseconds(60000), [&](int64_t rank, const RankGroups& groups) {
      at::set_num_threads(1);
      out[static_cast<size_t>(rank)] = run(&groups);
    });
    for (const at::Tensor& rank_latents : out) EXPECT_TRUE(at::equal(rank_latents, out[0])) << layout.text();
    EXPECT_LE(max_abs_diff(out[0], one), 1e-5) << layout.text();
    std::cout << "[ " << c.name << " " << layout.text() << " ] max |diff| to one device = " << max_abs_diff(out[0], one)
              << "\n";
  }
  // --shard-weights on cfg=2,ulysses=2: every rank its own instance holding a quarter of the blocks.
  std::vector<std::unique_ptr<SkyReelsV2Transformer>> shards;
  for (int64_t r = 0; r < 4; ++r) {
    shards.push_back(c.transformer());
    shards.back()->shard_blocks(r, 4);
  }
  at::Tensor sharded;
  run_on_ranks(ParallelLayout{2, 2}, std::chrono::milliseconds(60000), [&](int64_t rank, const RankGroups& groups) {
    at::set_num_threads(1);
    auto noise = make_recorded_noise({c.noise.at("noise_000")});
    const at::Tensor mine = generate_video(*shards[static_cast<size_t>(rank)], c.kind, c.params,
                                           c.recorded_conditioning(), *noise, c.videos_per_prompt, {}, &groups);
    if (rank == 0) sharded = mine;
  });
  EXPECT_LE(max_abs_diff(sharded, one), 1e-5) << "sharded weights";
}

INSTANTIATE_TEST_SUITE_P(T2vI2v, Golden, ::testing::ValuesIn(kAllCases), label);

class SeedGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(SeedGolden, TheSeedDrawsTheRecordedNoiseAndTheSameVideo) {
  const VideoCase c(GetParam());
  ASSERT_TRUE(c.params.seed.has_value());
  const at::Tensor recorded = c.noise.at("noise_000");
  EXPECT_TRUE(at::equal(make_seeded_noise(*c.params.seed)->latent_noise(0, recorded.sizes()), recorded));
  auto noise = make_seeded_noise(*c.params.seed);
  const at::Tensor latents =
      generate_video(*c.transformer(), c.kind, c.params, c.recorded_conditioning(), *noise, c.videos_per_prompt);
  EXPECT_TRUE(all_close(latents, c.output.at("latents"), kTolerance, kTolerance));
}

INSTANTIATE_TEST_SUITE_P(T2vI2v, SeedGolden, ::testing::ValuesIn(kSeedCases), label);

TEST(VideoPipelines, Bf16WithFp32IslandsStaysNearTheFp32Videos) {
  // A smoke bound: bf16 keeps 8 bits of mantissa, and guidance multiplies the difference of two predictions by its
  // scale (t1: CFG 6 over 3 steps moves the latents by 0.2); a wrong dtype path would be off by O(1).
  for (const std::string& name : kAllCases) {
    const VideoCase c(name);
    const TransformerConfig config = parse_transformer_config(c.weights_dir("transformer") + "/config.json").config;
    std::map<std::string, at::Tensor> tensors;
    for (const auto& file : c.json.at("weights").at("transformer").at("safetensors")) {
      for (auto& [key, t] : load_tensors(golden_path(file.get<std::string>()))) tensors[key] = t;
    }
    auto placed = checkpoint::place_strict(tensors, transformer_parameter_specs(config), {"cpu", at::kBFloat16}, name);
    const SkyReelsV2Transformer model(config, std::move(placed), at::kCPU, at::kBFloat16);
    auto noise = make_recorded_noise({c.noise.at("noise_000")});
    const at::Tensor latents =
        generate_video(model, c.kind, c.params, c.recorded_conditioning(), *noise, c.videos_per_prompt);
    EXPECT_EQ(latents.scalar_type(), at::kFloat);
    const double atol = 0.05 * std::max(1.0, c.params.guidance_scale);
    EXPECT_TRUE(all_close(latents, c.output.at("latents"), atol, 0.05)) << name;
    std::cout << "[ bf16 ] " << name << " max |diff| = " << max_abs_diff(latents, c.output.at("latents")) << "\n";
  }
}

// ---- the I2V inputs on their own ------------------------------------------------------------------------------------

class I2vGolden : public ::testing::TestWithParam<std::string> {};

// The images as the pipeline's two processors see them: the VAE side resized to the call's size with Pillow LANCZOS
// (a copy when it already is), the CLIP side by CLIPImageProcessor.
at::Tensor vae_side(const VideoCase& c, const char* key) {
  return vae_image_preprocess(c.inputs.at(key), c.params.height, c.params.width);
}

TEST_P(I2vGolden, ConditionFromThePixelsMatchesDiffusersWithin1e4) {
  const VideoCase c(GetParam());
  const WanVae vae = WanVae::load(c.weights_dir("vae"));
  const at::Tensor last = c.has_last_image() ? vae_side(c, "last_image_u8") : at::Tensor();
  if (c.condition.count("last_image_vae_preprocessed")) {
    EXPECT_TRUE(at::equal(2 * last - 1, c.condition.at("last_image_vae_preprocessed")));
  }
  const I2vCondition got = prepare_i2v_condition(vae, vae_side(c, "image_u8"), last, c.params.num_frames);
  EXPECT_TRUE(all_close(got.posterior_mode, c.condition.at("vae_encode_mode_00"), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(got.condition, c.condition.at("condition"), 1e-4, 1e-4));
  const at::Tensor mask = got.condition.narrow(1, 0, 4);
  EXPECT_TRUE(at::equal(mask, c.condition.at("condition").narrow(1, 0, 4))) << "the frame mask is exact";
  std::cout << "[ i2v condition ] " << c.name
            << " max |diff| = " << max_abs_diff(got.condition, c.condition.at("condition")) << "\n";
}

TEST_P(I2vGolden, ImageTokensFromThePixelsMatchDiffusersWithin1e4) {
  const VideoCase c(GetParam());
  const auto processor =
      ClipImageProcessorConfig::from_file(c.weights_dir("image_processor") + "/preprocessor_config.json");
  std::vector<at::Tensor> images{c.inputs.at("image_u8")};
  if (c.has_last_image()) images.push_back(c.inputs.at("last_image_u8"));
  const ClipPreprocessed pre = clip_preprocess(processor, images);
  EXPECT_TRUE(at::equal(pre.pixel_values, c.image_encoder.at("pixel_values")));
  const auto encoder = load_clip_vision_encoder(c.weights_dir("image_encoder"));
  const at::Tensor tokens = encoder.model->forward(pre.pixel_values).penultimate;
  EXPECT_TRUE(all_close(tokens, c.image_encoder.at("image_embeds"), 1e-4, 1e-4));
  const auto transformer = c.transformer();
  const at::Tensor ready = prepare_image_tokens(transformer->config(), tokens.narrow(0, 0, 1),
                                                c.has_last_image() ? tokens.narrow(0, 1, 1) : at::Tensor());
  EXPECT_EQ(ready.size(1), transformer->config().pos_embed_seq_len.value_or(tokens.size(1)));
}

TEST_P(I2vGolden, FromThePixelsToTheVideoWithin1e4) {
  // Nothing recorded but the noise: image tokens from the CLIP encoder, the condition from the VAE.
  const VideoCase c(GetParam());
  const auto processor =
      ClipImageProcessorConfig::from_file(c.weights_dir("image_processor") + "/preprocessor_config.json");
  const auto encoder = load_clip_vision_encoder(c.weights_dir("image_encoder"));
  auto tokens_of = [&](const char* key) {
    return encoder.model->forward(clip_preprocess(processor, {c.inputs.at(key)}).pixel_values).penultimate;
  };
  const auto transformer = c.transformer();
  VideoConditioning conditioning = c.recorded_conditioning();
  conditioning.image_tokens = prepare_image_tokens(transformer->config(), tokens_of("image_u8"),
                                                   c.has_last_image() ? tokens_of("last_image_u8") : at::Tensor());
  const WanVae vae = WanVae::load(c.weights_dir("vae"));
  conditioning.condition =
      prepare_i2v_condition(vae, vae_side(c, "image_u8"),
                            c.has_last_image() ? vae_side(c, "last_image_u8") : at::Tensor(), c.params.num_frames)
          .condition;
  auto noise = make_recorded_noise({c.noise.at("noise_000")});
  double worst = 0;
  const at::Tensor latents =
      generate_video(*transformer, c.kind, c.params, conditioning, *noise, 1, c.step_checks(&worst));
  EXPECT_TRUE(all_close(latents, c.output.at("latents"), kTolerance, kTolerance));
  std::cout << "[ i2v from pixels ] " << c.name << " max |diff| over the steps = " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(I2v, I2vGolden, ::testing::ValuesIn(kI2vCases), label);

TEST(I2vPipeline, FrameMaskMarksThePixelFramesOfTheImages) {
  const at::Tensor first = i2v_frame_mask(9, 1, 1, false);  // 3 latent frames
  ASSERT_EQ(first.sizes(), (std::vector<int64_t>{1, 4, 3, 1, 1}));
  EXPECT_TRUE(at::equal(first.select(2, 0).flatten(), at::ones({4})));
  EXPECT_EQ(first.narrow(2, 1, 2).sum().item<double>(), 0.0);
  const at::Tensor both = i2v_frame_mask(9, 1, 1, true);
  // Pixel frame 8 is channel 3 of latent frame 2 (frames 1..8 fill latent frames 1, 2 four at a time).
  EXPECT_EQ(both[0][3][2][0][0].item<double>(), 1.0);
  EXPECT_EQ(both.narrow(2, 1, 2).sum().item<double>(), 1.0);
}

// ---- several videos per prompt: what diffusers gets wrong ----------------------------------------------------------

// Video v of prompt b must be the video of that prompt alone with that row of the noise: diffusers repeats neither
// passed-in prompt embeddings nor image embeddings, so two prompts with two videos each raise there.
void expect_each_video_is_its_prompt_alone(const std::string& case_name) {
  const VideoCase c(case_name);
  const auto transformer = c.transformer();
  const VideoConditioning one = c.recorded_conditioning();
  VideoConditioning two = one;  // a second prompt: the first one's rows reversed
  two.prompt_embeds = at::cat({one.prompt_embeds, one.prompt_embeds.flip(1)});
  if (one.negative_prompt_embeds)
    two.negative_prompt_embeds = at::cat({*one.negative_prompt_embeds, *one.negative_prompt_embeds});
  GenerationParams p = c.params;
  p.num_inference_steps = 2;
  const at::Tensor base = c.noise.at("noise_000");
  const at::Tensor noise4 = at::cat({base, base * 0.5, base.flip(2), base * -1});  // [prompt][video]
  auto recorded = make_recorded_noise({noise4});
  const at::Tensor all = generate_video(*transformer, c.kind, p, two, *recorded, 2);
  ASSERT_EQ(all.size(0), 4);
  for (int64_t b = 0; b < 2; ++b) {
    VideoConditioning alone = one;
    alone.prompt_embeds = two.prompt_embeds.narrow(0, b, 1);
    for (int64_t v = 0; v < 2; ++v) {
      auto single = make_recorded_noise({noise4.narrow(0, 2 * b + v, 1)});
      const at::Tensor video = generate_video(*transformer, c.kind, p, alone, *single, 1);
      EXPECT_TRUE(all_close(all.narrow(0, 2 * b + v, 1), video, 1e-5)) << "prompt " << b << " video " << v;
    }
  }
}

TEST(VideosPerPrompt, TwoPromptsWithTwoVideosEachT2v) {
  expect_each_video_is_its_prompt_alone("pipeline_t2v/t1_cfg6_shift8");
}

TEST(VideosPerPrompt, TwoPromptsWithTwoVideosEachI2vAndFlf2v) {
  expect_each_video_is_its_prompt_alone("pipeline_i2v/i1_image_cfg5_shift5");
  expect_each_video_is_its_prompt_alone("pipeline_i2v/i2_flf2v_last_image_cfg4");
}

TEST(VideosPerPrompt, OnePromptTwoVideosGivesTheGoldenVideoFirst) {
  // diffusers' one working case (B = 1: the attention broadcasts the embeddings): row 0 with noise_000 is the golden.
  const VideoCase c("pipeline_i2v/i1_image_cfg5_shift5");
  const at::Tensor base = c.noise.at("noise_000");
  auto noise = make_recorded_noise({at::cat({base, base * 0.5})});
  const at::Tensor both = generate_video(*c.transformer(), c.kind, c.params, c.recorded_conditioning(), *noise, 2);
  EXPECT_TRUE(all_close(both.narrow(0, 0, 1), c.output.at("latents"), kTolerance, kTolerance));
}

// ---- requests the pipelines refuse --------------------------------------------------------------------------------

TEST(VideoPipelines, MismatchedModelsAndMissingInputsAreNamed) {
  const VideoCase t2v("pipeline_t2v/t1_cfg6_shift8"), i2v("pipeline_i2v/i1_image_cfg5_shift5"),
      flf("pipeline_i2v/i2_flf2v_last_image_cfg4");
  auto noise = [](const VideoCase& c) { return make_recorded_noise({c.noise.at("noise_000")}); };
  const auto t2v_model = t2v.transformer();
  const auto i2v_model = i2v.transformer();
  auto error = [](const std::function<void()>& f) { return test::error_of(f); };
  EXPECT_HAS(error([&] {
               generate_video(*t2v_model, PipelineKind::kImageToVideo, t2v.params, t2v.recorded_conditioning(),
                              *noise(t2v));
             }),
             "pipeline i2v: this checkpoint has no image branch");
  EXPECT_HAS(error([&] {
               generate_video(*i2v_model, PipelineKind::kTextToVideo, i2v.params, i2v.recorded_conditioning(),
                              *noise(i2v));
             }),
             "pipeline t2v: this checkpoint is an image-to-video model");
  VideoConditioning no_image = i2v.recorded_conditioning();
  no_image.image_tokens = at::Tensor();
  EXPECT_HAS(error([&] { generate_video(*i2v_model, PipelineKind::kImageToVideo, i2v.params, no_image, *noise(i2v)); }),
             "image: the i2v pipeline needs an image");
  VideoConditioning no_negative = t2v.recorded_conditioning();
  no_negative.negative_prompt_embeds.reset();
  EXPECT_HAS(
      error([&] { generate_video(*t2v_model, PipelineKind::kTextToVideo, t2v.params, no_negative, *noise(t2v)); }),
      "negative_prompt_embeds: required when guidance_scale > 1");
  GenerationParams odd = t2v.params;
  odd.height = 24;
  EXPECT_HAS(error([&] {
               generate_video(*t2v_model, PipelineKind::kTextToVideo, odd, t2v.recorded_conditioning(), *noise(t2v));
             }),
             "multiples of 16");
  // A last image needs the first-last-frame model, and that model needs one.
  const at::Tensor tokens = at::zeros({1, 5, 8});
  EXPECT_HAS(error([&] { prepare_image_tokens(i2v_model->config(), tokens, tokens); }),
             "no first-last-frame position embedding");
  EXPECT_HAS(error([&] { prepare_image_tokens(flf.transformer()->config(), tokens, at::Tensor()); }),
             "needs a last image");
  EXPECT_HAS(error([] { pipeline_kind_from_name("v2v"); }), "pipeline: 'v2v'");
}

TEST(VideoPipelines, NumFramesAreRoundedAsDiffusersAndTheDefaultPipelineFollowsTheModel) {
  EXPECT_EQ(round_num_frames(6), 5);
  EXPECT_EQ(round_num_frames(97), 97);
  EXPECT_EQ(round_num_frames(3), 1);
  EXPECT_EQ(default_pipeline(TransformerConfig::i2v_14b()), PipelineKind::kImageToVideo);
  EXPECT_EQ(default_pipeline(TransformerConfig::df_14b()), PipelineKind::kDiffusionForcing);
  EXPECT_NO_THROW(check_pipeline_fits(PipelineKind::kTextToVideo, TransformerConfig::df_14b()));
  EXPECT_NO_THROW(check_pipeline_fits(PipelineKind::kDiffusionForcing, TransformerConfig::df_1_3b()));
}

TEST(VideoPipelines, AModelWithTheFpsEmbeddingRunsTheT2vPipelineWithTheRequestsFps) {
  // diffusers' T2V pipeline passes no fps and raises on such a model (DF-1.3B); here fps goes in as in DF.
  const auto dir = golden_path("transformer_forward/t1_tiny_df_fps/weights/diffusers");
  const auto loaded = load_transformer(dir);
  ASSERT_TRUE(loaded.model->config().inject_sample_info);
  VideoConditioning c;
  c.prompt_embeds = at::randn({1, 7, loaded.model->config().text_dim});
  GenerationParams p;
  p.num_frames = 5;
  p.height = p.width = 16;
  p.num_inference_steps = 2;
  p.guidance_scale = 1.0;
  std::vector<at::Tensor> videos;
  for (const int64_t fps : {16, 24}) {
    p.fps = fps;
    auto noise = make_seeded_noise(3);
    videos.push_back(generate_video(*loaded.model, PipelineKind::kTextToVideo, p, c, *noise));
  }
  EXPECT_EQ(videos[0].sizes(), (std::vector<int64_t>{1, 16, 2, 2, 2}));
  EXPECT_FALSE(at::equal(videos[0], videos[1])) << "the fps embedding takes part";
}

// ---- skyreels generate --pipeline t2v | i2v ------------------------------------------------------------------------

// The case's call as `skyreels generate` flags: the model folder (a merged one for i2, whose pos_embed lives in a
// file of its own), the prompt rows as the pipeline got them, recorded noise or the seed, and the images as PNGs.
std::string generate_flags(const VideoCase& c, const std::string& dir, bool seeded) {
  std::string model = c.weights_dir("transformer");
  const auto& files = c.json.at("weights").at("transformer").at("safetensors");
  if (files.size() > 1) {
    model = dir + "/transformer";
    fs::create_directories(model);
    fs::copy_file(c.weights_dir("transformer") + "/config.json", model + "/config.json");
    std::vector<std::pair<std::string, at::Tensor>> all;
    for (const auto& file : files) {
      for (auto& kv : load_tensors(golden_path(file.get<std::string>()))) all.push_back(kv);
    }
    safetensors::save(model + "/diffusion_pytorch_model.safetensors", all);
  }
  std::vector<std::pair<std::string, at::Tensor>> inputs{{"prompt_embeds", c.text(c.rows_key("prompt").c_str())}};
  if (c.params.guidance_scale > 1.0) {
    inputs.emplace_back("negative_prompt_embeds", c.text(c.rows_key("negative_prompt").c_str()));
  }
  safetensors::save(dir + "/inputs.safetensors", inputs);
  std::ostringstream os;
  os << " generate --model " << model << " --inputs " << dir << "/inputs.safetensors --num-frames "
     << c.params.num_frames << " --height " << c.params.height << " --width " << c.params.width
     << " --num-inference-steps " << c.params.num_inference_steps << " --guidance-scale " << c.params.guidance_scale
     << " --scheduler-config " << c.dir << "/scheduler/scheduler_config.json --out " << dir << "/out.safetensors";
  if (seeded) {
    os << " --seed " << *c.params.seed;
  } else {
    os << " --noise " << c.dir << "/noise.safetensors";
  }
  if (c.is_i2v()) {
    auto png = [&](const char* key) {
      const std::string path = dir + "/" + key + ".png";
      const auto bytes = video::encode_png(c.inputs.at(key));
      std::ofstream(path, std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      return path;
    };
    os << " --vae " << c.weights_dir("vae") << " --image-encoder " << c.weights_dir("image_encoder")
       << " --image-processor " << c.weights_dir("image_processor") << " --image " << png("image_u8");
    if (c.has_last_image()) os << " --last-image " << png("last_image_u8");
  }
  return os.str();
}

double expect_generate_matches(const VideoCase& c, const std::string& extra, bool seeded) {
  const std::string dir = test::temp_dir("generate-video");
  std::string log;
  const int status =
      test::run_command(test::bin_path("skyreels") + generate_flags(c, dir, seeded) + extra + " 2>&1", &log);
  EXPECT_EQ(status, 0) << log;
  if (status != 0) return -1;
  const at::Tensor latents = load_tensors(dir + "/out.safetensors").at("latents");
  EXPECT_TRUE(all_close(latents, c.output.at("latents"), kTolerance, kTolerance)) << c.name;
  return max_abs_diff(latents, c.output.at("latents"));
}

class GenerateCommand : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateCommand, ReproducesTheCaseFromRecordedNoise) {
  // The pipeline is named for T2V (a T2V checkpoint defaults to df); I2V checkpoints default to i2v.
  const VideoCase c(GetParam());
  const double diff = expect_generate_matches(c, c.is_i2v() ? "" : " --pipeline t2v", false);
  std::cout << "[ generate ] " << c.name << " max |diff| = " << diff << "\n";
}

INSTANTIATE_TEST_SUITE_P(T2vI2v, GenerateCommand, ::testing::ValuesIn(kAllCases), label);

TEST(GenerateCommandVideo, ReproducesI2vFromTheSeed) {
  const VideoCase c("pipeline_i2v/i2_flf2v_last_image_cfg4");
  std::cout << "[ generate --seed ] max |diff| = " << expect_generate_matches(c, " --pipeline i2v", true) << "\n";
}

TEST(GenerateCommandVideo, InspectShowsTheImageBranchAndItsPipeline) {
  const VideoCase c("pipeline_i2v/i1_image_cfg5_shift5");
  std::string log;
  ASSERT_EQ(test::run_command(test::bin_path("skyreels") + " inspect " + c.weights_dir("transformer") + " 2>&1", &log),
            0)
      << log;
  EXPECT_HAS(log, "in/out channels 36/16");
  EXPECT_HAS(log, "image branch: image_dim 8, added_kv_proj_dim 12 (pipeline i2v)");
  EXPECT_HAS(log, "problems    none");
}

TEST(GenerateCommandVideo, WrongCombinationsAreUsageErrors) {
  const VideoCase t2v("pipeline_t2v/t1_cfg6_shift8"), i2v("pipeline_i2v/i1_image_cfg5_shift5");
  const std::string dir = test::temp_dir("generate-errors");
  const std::string bin = test::bin_path("skyreels");
  std::string log;
  EXPECT_NE(test::run_command(bin + generate_flags(t2v, dir, false) + " --pipeline t2v --image x.png 2>&1", &log), 0);
  EXPECT_HAS(log, "--image: the t2v pipeline takes no image");
  EXPECT_NE(test::run_command(bin + generate_flags(t2v, dir, false) + " --pipeline t2v --ar-step 2 2>&1", &log), 0);
  EXPECT_HAS(log, "--ar-step is a diffusion-forcing flag");
  EXPECT_NE(test::run_command(bin + generate_flags(t2v, dir, false) + " --pipeline i2v 2>&1", &log), 0);
  EXPECT_HAS(log, "--pipeline i2v needs --image");
  EXPECT_NE(test::run_command(bin + generate_flags(t2v, dir, false) + " --pipeline x2v 2>&1", &log), 0);
  EXPECT_HAS(log, "pipeline: 'x2v'");
  // An I2V checkpoint run as diffusion forcing is named, not run into a shape error.
  EXPECT_NE(test::run_command(bin + " generate --pipeline df --model " + i2v.weights_dir("transformer") + " --inputs " +
                                  dir + "/inputs.safetensors --num-frames 9 --height 16 --width 32 --seed 1 --out " +
                                  dir + "/df.safetensors 2>&1",
                              &log),
            0);
  EXPECT_HAS(log, "pipeline df: this checkpoint is an image-to-video model");
}

}  // namespace
}  // namespace skyreels::model
