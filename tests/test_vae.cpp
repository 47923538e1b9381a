// The Wan 2.1 VAE against diffusers' own fp32 outputs (tests/data/golden/vae_decode/v1_tiny_decode), its loading
// rules, the decode session's chunking, and the `skyreels decode` / `skyreels encode` commands.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "model/safetensors.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using skyreels::model::WanVae;
using skyreels::model::WanVaeConfig;
using skyreels::model::WanVaeDecodeSession;
using skyreels::test::all_close;
using skyreels::test::golden_path;
using skyreels::test::load_tensors;

namespace {

const std::string kCase = "vae_decode/v1_tiny_decode";
constexpr double kTol = 1e-4;

std::string weights_dir() { return golden_path(kCase + "/weights/diffusers"); }

const WanVae& fixture_vae() {
  static const WanVae vae = WanVae::load(weights_dir());
  return vae;
}

const std::map<std::string, at::Tensor>& outputs() {
  static const auto out = load_tensors(golden_path(kCase + "/output.safetensors"));
  return out;
}

at::Tensor fixture_z() { return load_tensors(golden_path(kCase + "/inputs.safetensors")).at("z"); }

// The whole fixture decoded once, before the clamp (shared by the tests that only read it).
const at::Tensor& whole_unclamped() {
  static const at::Tensor out = [] {
    WanVaeDecodeSession session(fixture_vae());
    return session.decode(fixture_z(), /*clamp=*/false);
  }();
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A copy of the fixture's VAE folder with its tensors edited by `edit`.
std::string edited_copy(const std::string& tag,
                        const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
  const std::string dir = skyreels::test::temp_dir(tag);
  fs::copy_file(weights_dir() + "/config.json", dir + "/config.json");
  auto all = load_tensors(weights_dir() + "/diffusion_pytorch_model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors(all.begin(), all.end());
  edit(tensors);
  skyreels::safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tensors);
  return dir;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(WanVaeConfig, ReadsTheFixtureConfigAndDerivesTheScaleFactors) {
  const WanVaeConfig c = WanVaeConfig::from_json(read_text(weights_dir() + "/config.json"));
  EXPECT_EQ(c.base_dim, 8);
  EXPECT_EQ(c.z_dim, 16);
  EXPECT_EQ(c.dim_mult, (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(c.num_res_blocks, 1);
  EXPECT_EQ(c.temporal_factor(), 4);
  EXPECT_EQ(c.spatial_factor(), 8);
  EXPECT_EQ(c.pixel_frames(3), 9);
  ASSERT_EQ(c.latents_std.size(), 16u);
  EXPECT_DOUBLE_EQ(c.latents_std[15], 1.916);
}

TEST(WanVaeConfig, RejectsTheWan22VaeAndNamesTheField) {
  EXPECT_NE(error_of([] { WanVaeConfig::from_json(R"({"is_residual": true})"); }).find("is_residual"),
            std::string::npos);
  EXPECT_NE(error_of([] { WanVaeConfig::from_json(R"({"patch_size": 2})"); }).find("patch_size"), std::string::npos);
  EXPECT_NE(error_of([] { WanVaeConfig::from_json(R"({"z_dim": 8})"); }).find("latents_mean"), std::string::npos);
  EXPECT_NE(error_of([] { WanVaeConfig::from_json(R"({"_class_name": "AutoencoderKL"})"); }).find("_class_name"),
            std::string::npos);
}

TEST(WanVaeConfig, Wan21SpecsCountEveryParameterOfTheReleasedVae) {
  // Wan2.1_VAE: 194 tensors in diffusers' layout, about 127M parameters.
  const auto specs = skyreels::model::wan_vae_parameter_specs(WanVaeConfig::wan_2_1());
  int64_t params = 0;
  for (const auto& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    params += n;
  }
  EXPECT_EQ(specs.size(), 194u);
  EXPECT_NEAR(static_cast<double>(params) / 1e6, 126.9, 0.5);
}

TEST(WanVaeLoad, TakesEveryTensorOfTheFixtureFile) {
  const auto specs = skyreels::model::wan_vae_parameter_specs(fixture_vae().config());
  EXPECT_EQ(specs.size(), 146u);  // case.json: num_tensors
  EXPECT_EQ(fixture_vae().dtype(), at::kFloat);
}

TEST(WanVaeLoad, NamesAMissingTensor) {
  const std::string dir = edited_copy("vae-missing", [](auto& tensors) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                                 [](const auto& p) { return p.first == "decoder.norm_out.gamma"; }),
                  tensors.end());
  });
  const std::string message = error_of([&] { WanVae::load(dir); });
  EXPECT_NE(message.find("decoder.norm_out.gamma"), std::string::npos) << message;
}

TEST(WanVaeLoad, NamesAnUnexpectedTensor) {
  const std::string dir =
      edited_copy("vae-extra", [](auto& tensors) { tensors.emplace_back("decoder.extra.weight", at::zeros({2})); });
  const std::string message = error_of([&] { WanVae::load(dir); });
  EXPECT_NE(message.find("decoder.extra.weight"), std::string::npos) << message;
}

TEST(WanVaeLoad, NamesAMisshapenTensor) {
  const std::string dir = edited_copy("vae-shape", [](auto& tensors) {
    for (auto& [name, t] : tensors) {
      if (name == "post_quant_conv.bias") t = at::zeros({15});
    }
  });
  const std::string message = error_of([&] { WanVae::load(dir); });
  EXPECT_NE(message.find("post_quant_conv.bias"), std::string::npos) << message;
}

TEST(WanVaeDecode, PostQuantConvMatchesDiffusers) {
  EXPECT_TRUE(all_close(fixture_vae().post_quant_conv(fixture_z()), outputs().at("post_quant_conv_out"), kTol));
}

TEST(WanVaeDecode, EachDecoderCallMatchesDiffusersFrameByFrame) {
  const at::Tensor z = fixture_z();
  WanVaeDecodeSession session(fixture_vae());
  for (int64_t i = 0; i < z.size(2); ++i) {
    const at::Tensor out = session.decode(z.narrow(2, i, 1), /*clamp=*/false);
    char key[64];
    std::snprintf(key, sizeof(key), "decoder_call%02lld_out", static_cast<long long>(i));
    EXPECT_TRUE(all_close(out, outputs().at(key), kTol)) << key;
  }
}

TEST(WanVaeDecode, VideoMatchesDiffusersWithinTolerance) {
  const at::Tensor video = fixture_vae().decode(fixture_z());
  EXPECT_TRUE(all_close(video, outputs().at("video"), kTol));
  EXPECT_LE(video.max().item<double>(), 1.0);
  EXPECT_GE(video.min().item<double>(), -1.0);
}

TEST(WanVaeDecode, UnclampedSessionOutputIsDiffusersPreClampConcatenation) {
  EXPECT_TRUE(all_close(whole_unclamped(), outputs().at("decoder_out_preclamp"), kTol));
}

TEST(WanVaeDecode, ChunkedSessionEqualsWholeSequenceDecode) {
  const at::Tensor z = fixture_z();
  WanVaeDecodeSession session(fixture_vae());
  const at::Tensor first = session.decode(z.narrow(2, 0, 2), false);
  const at::Tensor rest = session.decode(z.narrow(2, 2, 1), false);
  EXPECT_EQ(first.size(2), 5);
  EXPECT_EQ(rest.size(2), 4);
  EXPECT_EQ(session.latent_frames_done(), 3);
  // Not bit-identical: post_quant_conv and the decoder see other batch shapes, so GEMM blocking differs.
  EXPECT_TRUE(all_close(at::cat({first, rest}, 2), whole_unclamped(), 1e-5));
}

// Several latent frames per decoder call (the first call included: its temporal upsamplers pass the first frame
// alone and let the next ones see zeros, diffusers' "Rep") equal diffusers' frame-by-frame order.
TEST(WanVaeDecode, SeveralFramesPerCallEqualFrameByFrame) {
  at::manual_seed(5);
  const at::Tensor z = at::randn({1, 16, 7, 4, 6});
  WanVaeDecodeSession by_frame(fixture_vae(), 1);
  const at::Tensor expected = by_frame.decode(z, false);
  ASSERT_EQ(expected.size(2), 25);
  for (int64_t per_call : {2, 3, 7}) {
    WanVaeDecodeSession session(fixture_vae(), per_call);
    EXPECT_EQ(session.frames_per_call(), per_call);
    // Uneven session calls too: the split into calls and into decoder calls must not matter.
    const at::Tensor a = session.decode(z.narrow(2, 0, 3), false);
    const at::Tensor b = session.decode(z.narrow(2, 3, 1), false);
    const at::Tensor c = session.decode(z.narrow(2, 4, 3), false);
    EXPECT_EQ(a.size(2), 9);
    EXPECT_EQ(session.latent_frames_done(), 7);
    EXPECT_TRUE(all_close(at::cat({a, b, c}, 2), expected, 1e-5)) << per_call << " frames per call";
  }
  EXPECT_TRUE(all_close(fixture_vae().decode(z, 4), at::clamp(expected, -1.0, 1.0), 1e-5));
}

TEST(WanVaeDecode, BatchedDecodeOfTheFixtureMatchesDiffusers) {
  EXPECT_TRUE(all_close(fixture_vae().decode(fixture_z(), 3), outputs().at("video"), kTol));
  EXPECT_TRUE(all_close(fixture_vae().decode(fixture_z(), 1), outputs().at("video"), kTol));
}

TEST(WanVaeDecode, FramesPerCallFollowTheMemoryBudgetNotTheVideoLength) {
  const WanVae& vae = fixture_vae();
  const int64_t per_frame = vae.decode_bytes_per_latent_frame(1, 8, 8);
  EXPECT_EQ(per_frame, vae.decode_bytes_per_latent_frame(1, 4, 16)) << "pixels count, not their shape";
  EXPECT_EQ(vae.decode_bytes_per_latent_frame(2, 8, 8), 2 * per_frame);
  EXPECT_EQ(vae.decode_frames_per_call(1, 8, 8, 5 * per_frame + 1), 5);
  EXPECT_EQ(vae.decode_frames_per_call(1, 8, 8, per_frame / 2), 1) << "at least one frame";
  EXPECT_EQ(vae.decode_frames_per_call(1, 16, 16, 8 * per_frame), 2) << "4x the pixels, a quarter of the frames";
  // The default session derives it at its first call, from that call's size, and keeps it.
  WanVaeDecodeSession session(vae);
  EXPECT_EQ(session.frames_per_call(), 0);
  session.decode(at::zeros({1, 16, 2, 4, 6}));
  EXPECT_EQ(session.frames_per_call(), vae.decode_frames_per_call(1, 4, 6));
  EXPECT_GE(session.frames_per_call(), 1);
}

TEST(WanVaeEncode, SeveralChunksPerCallEqualOneChunkPerCall) {
  at::manual_seed(6);
  const at::Tensor video = at::rand({1, 3, 17, 32, 48}) * 2 - 1;
  const auto expected = fixture_vae().encode(video, 1);
  ASSERT_EQ(expected.mean.size(2), 5);
  for (int64_t per_call : {2, 3, 4}) {
    const auto p = fixture_vae().encode(video, per_call);
    EXPECT_TRUE(all_close(p.mean, expected.mean, 1e-5)) << per_call;
    EXPECT_TRUE(all_close(p.logvar, expected.logvar, 1e-5)) << per_call;
  }
  const auto golden = fixture_vae().encode(outputs().at("video"), 2);
  EXPECT_TRUE(all_close(golden.mean, outputs().at("encode_mean"), kTol));
}

TEST(WanVaeDecode, SessionRejectsAChangedFrameSize) {
  WanVaeDecodeSession session(fixture_vae());
  session.decode(at::zeros({1, 16, 1, 4, 6}));
  EXPECT_THROW(session.decode(at::zeros({1, 16, 1, 4, 4})), std::invalid_argument);
}

TEST(WanVaeEncode, MeanAndLogvarMatchDiffusers) {
  const auto posterior = fixture_vae().encode(outputs().at("video"));
  EXPECT_TRUE(all_close(posterior.mean, outputs().at("encode_mean"), kTol));
  EXPECT_TRUE(all_close(posterior.logvar, outputs().at("encode_logvar"), kTol));
  EXPECT_TRUE(at::equal(posterior.mode(), posterior.mean));
}

TEST(WanVaeLatents, DenormalizeIsLatentsTimesStdPlusMeanAndNormalizeInvertsIt) {
  const at::Tensor latents = at::randn({1, 16, 2, 3, 3}, at::TensorOptions().dtype(at::kFloat));
  const WanVaeConfig& c = fixture_vae().config();
  const at::Tensor mean =
      at::tensor(std::vector<float>(c.latents_mean.begin(), c.latents_mean.end())).view({1, 16, 1, 1, 1});
  const at::Tensor std =
      at::tensor(std::vector<float>(c.latents_std.begin(), c.latents_std.end())).view({1, 16, 1, 1, 1});
  const at::Tensor z = fixture_vae().denormalize(latents);
  EXPECT_TRUE(all_close(z, latents * std + mean, 1e-5));
  EXPECT_TRUE(all_close(fixture_vae().normalize(z), latents, 1e-5));
}

// ---- the `skyreels` commands ------------------------------------------------------------------------------------

class VaeCommands : public ::testing::Test {
 protected:
  void SetUp() override {
    // The suite depends on the skyreels target (tests/CMakeLists.txt): a missing binary is a failure, not a skip.
    ASSERT_TRUE(fs::exists(skyreels::test::bin_path("skyreels"))) << "skyreels binary not built";
  }
  static int run(const std::string& args, std::string* output) {
    return skyreels::test::run_command(skyreels::test::bin_path("skyreels") + " " + args, output);
  }
};

TEST_F(VaeCommands, DecodeOfZWritesTheFixtureVideoAsSafetensors) {
  const std::string out = skyreels::test::temp_dir("cli-decode") + "/video.safetensors";
  std::string log;
  ASSERT_EQ(run("decode --vae " + weights_dir() + " --latents " + golden_path(kCase + "/inputs.safetensors") +
                    " --out " + out,
                &log),
            0)
      << log;
  EXPECT_TRUE(all_close(load_tensors(out).at("video"), outputs().at("video"), kTol));
}

TEST_F(VaeCommands, DecodeOfNormalisedLatentsDenormalisesFirst) {
  const std::string dir = skyreels::test::temp_dir("cli-decode-latents");
  // Normalised latents of a batch of two: the fixture's z and its negation.
  const at::Tensor z = fixture_z();
  skyreels::safetensors::save(dir + "/latents.safetensors",
                              {{"latents", fixture_vae().normalize(at::cat({z, -z}, 0))}});
  std::string log;
  ASSERT_EQ(run("decode --vae " + weights_dir() + " --latents " + dir + "/latents.safetensors --out " + dir +
                    "/video.safetensors",
                &log),
            0)
      << log;
  const at::Tensor video = load_tensors(dir + "/video.safetensors").at("video");
  ASSERT_EQ(video.size(0), 2);
  EXPECT_TRUE(all_close(video[0], outputs().at("video")[0], kTol));
  EXPECT_TRUE(all_close(video[1], fixture_vae().decode(-z)[0], kTol));
}

TEST_F(VaeCommands, DecodeToMp4WritesOneH264FilePerBatchItem) {
  const std::string dir = skyreels::test::temp_dir("cli-decode-mp4");
  const at::Tensor z = fixture_z();
  skyreels::safetensors::save(dir + "/z.safetensors", {{"z", at::cat({z, -z}, 0)}});
  std::string log;
  ASSERT_EQ(
      run("decode --vae " + weights_dir() + " --latents " + dir + "/z.safetensors --out " + dir + "/out.mp4 --fps 16",
          &log),
      0)
      << log;
  const at::Tensor first = skyreels::video::to_rgb_uint8(outputs().at("video")[0]);
  const at::Tensor second = skyreels::video::to_rgb_uint8(fixture_vae().decode(-z)[0]);
  for (const std::string name : {"out.mp4", "out_1.mp4"}) {
    const auto video = skyreels::video::read_video(dir + "/" + name);
    EXPECT_EQ(video.info.codec, "h264") << name;
    EXPECT_EQ(video.info.frames, 9) << name;
    EXPECT_EQ(video.info.width, 48) << name;
    EXPECT_EQ(video.info.height, 32) << name;
    EXPECT_DOUBLE_EQ(video.info.fps, 16.0) << name;
    // Random weights decode to noise that yuv420p cannot keep (so no absolute PSNR bar here; test_video has one
    // on smooth content), but each file must clearly be its own batch item.
    const double own = skyreels::video::psnr(video.frames, name == "out.mp4" ? first : second);
    const double other = skyreels::video::psnr(video.frames, name == "out.mp4" ? second : first);
    EXPECT_GT(own, other + 3.0) << name;
  }
}

TEST_F(VaeCommands, EncodeWritesNormalisedLatentsMeanAndLogvar) {
  const std::string dir = skyreels::test::temp_dir("cli-encode");
  skyreels::safetensors::save(dir + "/video.safetensors", {{"video", outputs().at("video")}});
  std::string log;
  ASSERT_EQ(run("encode --vae " + weights_dir() + " --video " + dir + "/video.safetensors --out " + dir +
                    "/latents.safetensors",
                &log),
            0)
      << log;
  const auto out = load_tensors(dir + "/latents.safetensors");
  EXPECT_TRUE(all_close(out.at("mean"), outputs().at("encode_mean"), kTol));
  EXPECT_TRUE(all_close(out.at("logvar"), outputs().at("encode_logvar"), kTol));
  EXPECT_TRUE(all_close(out.at("latents"), fixture_vae().normalize(outputs().at("encode_mean")), 1e-4));
}

TEST_F(VaeCommands, DecodeNamesTheMissingTensorOfTheInputFile) {
  const std::string dir = skyreels::test::temp_dir("cli-decode-bad");
  skyreels::safetensors::save(dir + "/x.safetensors", {{"noise", at::zeros({1})}});
  std::string log;
  EXPECT_EQ(run("decode --vae " + weights_dir() + " --latents " + dir + "/x.safetensors --out " + dir + "/o.mp4", &log),
            1);
  EXPECT_NE(log.find("latents"), std::string::npos) << log;
}
