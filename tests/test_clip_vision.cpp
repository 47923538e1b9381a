// The I2V pipeline's image side against transformers and Pillow (tests/data/golden/clip_vision): CLIPImageProcessor
// with Pillow 9.4's resampling (exact), the CLIP image encoder (every hidden state within 1e-4), the VAE side's
// LANCZOS resize (pipeline_i2v), `skyreels encode-image`, and hostile images and encoder folders.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "model/clip_vision.h"
#include "model/image_processor.h"
#include "model/safetensors.h"
#include "model/video_mp4.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

namespace fs = std::filesystem;
using test::all_close;
using test::golden_path;
using test::load_tensors;
using test::max_abs_diff;

const std::vector<std::string> kCases = {"clip_vision/c1_rgb_landscape", "clip_vision/c2_rgba_portrait_downscale"};

checkpoint::StateDict ckpt_place(const std::map<std::string, at::Tensor>& weights, const ClipVisionConfig& config) {
  return checkpoint::place_strict(weights, clip_vision_parameter_specs(config), {"cpu", at::kFloat}, "test weights");
}

struct ClipCase {
  std::string dir;
  nlohmann::json json;
  std::map<std::string, at::Tensor> inputs, preprocess, output;
  std::string encoder_dir, processor_dir;

  explicit ClipCase(const std::string& name) : dir(golden_path(name)) {
    json = nlohmann::json::parse(std::ifstream(dir + "/case.json"));
    inputs = load_tensors(dir + "/inputs.safetensors");
    preprocess = load_tensors(dir + "/preprocess.safetensors");
    output = load_tensors(dir + "/output.safetensors");
    encoder_dir = golden_path(json["weights"]["image_encoder"]["dir"].get<std::string>());
    processor_dir = golden_path(json["weights"]["image_processor"]["dir"].get<std::string>());
  }
  std::vector<at::Tensor> images() const {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < json["images"].size(); ++i) out.push_back(inputs.at(image_key("image", i)));
    return out;
  }
  ClipImageProcessorConfig processor() const {
    return ClipImageProcessorConfig::from_file(processor_dir + "/preprocessor_config.json");
  }
  static std::string image_key(const std::string& stem, size_t i) {
    char name[64];
    std::snprintf(name, sizeof name, "%s_%02zu", stem.c_str(), i);
    return name;
  }
};

// Equal, or one float32 ulp apart (the README's bound for pixel_values).
::testing::AssertionResult within_one_ulp(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  const at::Tensor next_up = at::nextafter(expected, at::full_like(expected, INFINITY));
  const at::Tensor next_down = at::nextafter(expected, at::full_like(expected, -INFINITY));
  const at::Tensor ok = actual.eq(expected) | actual.eq(next_up) | actual.eq(next_down);
  if (ok.all().item<bool>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << ok.logical_not().sum().item<int64_t>() << " of " << actual.numel()
                                       << " values more than 1 ulp away (max |diff| " << max_abs_diff(actual, expected)
                                       << ")";
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, ProcessorConfigIsTheCasesProcessor) {
  const ClipCase c(GetParam());
  const ClipImageProcessorConfig p = c.processor();
  const auto& want = c.json["processor"];
  EXPECT_EQ(p.shortest_edge, want["size"]["shortest_edge"].get<int64_t>());
  EXPECT_EQ(p.crop_height, want["crop_size"]["height"].get<int64_t>());
  EXPECT_EQ(p.crop_width, want["crop_size"]["width"].get<int64_t>());
  EXPECT_EQ(static_cast<int>(p.resample), want["resample"].get<int>());
  EXPECT_EQ(p.rescale_factor, want["rescale_factor"].get<double>());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(p.image_mean[static_cast<size_t>(i)], want["image_mean"][i].get<double>());
    EXPECT_EQ(p.image_std[static_cast<size_t>(i)], want["image_std"][i].get<double>());
  }
}

TEST_P(Golden, ConvertToRgbIsPillowsConvertRgb) {
  const ClipCase c(GetParam());
  for (size_t i = 0; i < c.images().size(); ++i) {
    const at::Tensor rgb = convert_to_rgb(c.images()[i]);
    const std::string key = ClipCase::image_key("converted_rgb", i);
    if (c.preprocess.count(key)) {
      EXPECT_TRUE(at::equal(rgb, c.preprocess.at(key)))
          << key << " max |diff| " << max_abs_diff(rgb, c.preprocess.at(key));
    } else {
      EXPECT_TRUE(at::equal(rgb, c.images()[i])) << "an RGB image is left as it is";
    }
  }
}

TEST_P(Golden, ResizeAndCropGiveTheCroppedPixelsExactly) {
  const ClipCase c(GetParam());
  const ClipPreprocessed pre = clip_preprocess(c.processor(), c.images());
  for (size_t i = 0; i < pre.cropped.size(); ++i) {
    const auto& geometry = c.json["geometry"][i];
    const auto size = clip_resize_size(c.processor(), c.images()[i].size(0), c.images()[i].size(1));
    EXPECT_EQ(size[0], geometry["resized_hw"][0].get<int64_t>());
    EXPECT_EQ(size[1], geometry["resized_hw"][1].get<int64_t>());
    const at::Tensor expected = c.preprocess.at(ClipCase::image_key("cropped", i));
    ASSERT_EQ(pre.cropped[i].sizes(), expected.sizes());
    EXPECT_EQ(pre.cropped[i].ne(expected).sum().item<int64_t>(), 0)
        << "pixels differ from Pillow's; max |diff| " << max_abs_diff(pre.cropped[i], expected);
  }
}

TEST_P(Golden, PixelValuesWithinOneUlp) {
  const ClipCase c(GetParam());
  const ClipPreprocessed pre = clip_preprocess(c.processor(), c.images());
  EXPECT_EQ(pre.pixel_values.scalar_type(), at::kFloat);
  EXPECT_TRUE(within_one_ulp(pre.pixel_values, c.preprocess.at("pixel_values")));
  std::cout << "[ pixel_values ] " << GetParam()
            << " max |diff| = " << max_abs_diff(pre.pixel_values, c.preprocess.at("pixel_values")) << "\n";
}

TEST_P(Golden, EncoderHiddenStatesAndImageEmbedsWithin1e4) {
  const ClipCase c(GetParam());
  const LoadedClipVision encoder = load_clip_vision_encoder(c.encoder_dir);
  const ClipVisionOutput out = encoder.model->forward(c.preprocess.at("pixel_values"), true, true);
  const int64_t layers = encoder.model->config().num_hidden_layers;
  ASSERT_EQ(static_cast<int64_t>(out.hidden_states.size()), layers + 1);
  for (int64_t l = 0; l <= layers; ++l) {
    const std::string key = ClipCase::image_key("hidden_states", static_cast<size_t>(l));
    EXPECT_TRUE(all_close(out.hidden_states[static_cast<size_t>(l)], c.output.at(key), 1e-4, 1e-4)) << key;
  }
  EXPECT_TRUE(all_close(out.penultimate, c.output.at("hidden_states_penultimate"), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(out.image_embeds, c.output.at("image_embeds"), 1e-4, 1e-4));
  std::cout << "[ image tokens ] " << GetParam()
            << " max |diff| = " << max_abs_diff(out.penultimate, c.output.at("hidden_states_penultimate"))
            << ", image_embeds " << max_abs_diff(out.image_embeds, c.output.at("image_embeds")) << "\n";
}

TEST_P(Golden, FromTheImageToTheTokensWithin1e4) {
  const ClipCase c(GetParam());
  const LoadedClipVision encoder = load_clip_vision_encoder(c.encoder_dir);
  const ClipVisionOutput out = encoder.model->forward(clip_preprocess(c.processor(), c.images()).pixel_values);
  EXPECT_FALSE(out.image_embeds.defined()) << "the pipeline does not ask for them";
  EXPECT_TRUE(all_close(out.penultimate, c.output.at("hidden_states_penultimate"), 1e-4, 1e-4));
}

TEST_P(Golden, Bf16EncoderStaysNearTheFp32Tokens) {
  const ClipCase c(GetParam());
  ClipVisionLoadOptions options;
  options.dtype = "bfloat16";
  const LoadedClipVision encoder = load_clip_vision_encoder(c.encoder_dir, options);
  EXPECT_EQ(encoder.model->compute_dtype(), at::kBFloat16);
  const ClipVisionOutput out = encoder.model->forward(c.preprocess.at("pixel_values"), true);
  EXPECT_EQ(out.penultimate.scalar_type(), at::kFloat);  // outputs are float32 whatever the compute dtype
  EXPECT_TRUE(all_close(out.penultimate, c.output.at("hidden_states_penultimate"), 0.05, 0.05));
}

INSTANTIATE_TEST_SUITE_P(Clip, Golden, ::testing::ValuesIn(kCases), [](const auto& test_info) {
  return test_info.param.substr(test_info.param.find('/') + 1, 2);
});

// ---- Pillow's resampling on its own ---------------------------------------------------------------------------------

TEST(ImageProcessor, VaeSideLanczosResizeIsDiffusersPreprocessExactly) {
  // pipeline_i2v i2: last_image 24x40 resized by Pillow LANCZOS to the call's 16 x 32 (w x h), then 2 * (u8/255) - 1.
  const std::string dir = golden_path("pipeline_i2v/i2_flf2v_last_image_cfg4");
  const auto inputs = load_tensors(dir + "/inputs.safetensors");
  const auto condition = load_tensors(dir + "/condition.safetensors");
  const at::Tensor expected = condition.at("last_image_vae_preprocessed");
  const at::Tensor unit = vae_image_preprocess(inputs.at("last_image_u8"), expected.size(2), expected.size(3));
  EXPECT_TRUE(at::equal(2.0f * unit - 1.0f, expected)) << "max |diff| " << max_abs_diff(2.0f * unit - 1.0f, expected);
}

TEST(ImageProcessor, SameSizeResizeIsACopyAndEveryFilterKeepsAConstantImage) {
  const at::Tensor image = at::randint(0, 256, {7, 9, 3}, at::kByte);
  const at::Tensor copy = pillow_resize(image, 7, 9, PillowFilter::kBicubic);
  EXPECT_TRUE(at::equal(copy, image));
  EXPECT_NE(copy.data_ptr(), image.data_ptr());
  const at::Tensor flat = at::full({5, 6, 3}, 77, at::kByte);
  for (PillowFilter f : {PillowFilter::kBox, PillowFilter::kBilinear, PillowFilter::kHamming, PillowFilter::kBicubic,
                         PillowFilter::kLanczos}) {
    for (auto [h, w] : {std::pair<int64_t, int64_t>{11, 13}, {2, 3}, {5, 17}}) {
      EXPECT_TRUE(at::equal(pillow_resize(flat, h, w, f), at::full({h, w, 3}, 77, at::kByte)))
          << pillow_filter_name(f) << " to " << h << "x" << w;
    }
  }
}

TEST(ImageProcessor, BicubicOvershootIsClippedToUint8) {
  // A hard 0 / 255 edge upscaled with a = -0.5 rings below 0 and above 255: Pillow clips, never wraps.
  at::Tensor edge = at::zeros({1, 4, 1}, at::kByte);
  edge.narrow(1, 2, 2).fill_(255);
  const at::Tensor up = pillow_resize(edge, 1, 16, PillowFilter::kBicubic);
  EXPECT_EQ(up.min().item<int64_t>(), 0);
  EXPECT_EQ(up.max().item<int64_t>(), 255);
  EXPECT_TRUE(at::equal(up.narrow(1, 0, 4), at::zeros({1, 4, 1}, at::kByte)));
}

TEST(ImageProcessor, ConvertToRgbReplicatesGrayAndDropsAlpha) {
  // transformers' convert_to_rgb is Pillow's convert("RGB"): no compositing (c2's converted_rgb_00 shows it too).
  const at::Tensor la = at::randint(0, 256, {2, 3, 2}, at::kByte);
  const at::Tensor gray = la.narrow(2, 0, 1).expand({2, 3, 3});
  EXPECT_TRUE(at::equal(convert_to_rgb(la), gray));
  EXPECT_TRUE(at::equal(convert_to_rgb(la.narrow(2, 0, 1).contiguous()), gray));
  const at::Tensor rgba = at::randint(0, 256, {2, 3, 4}, at::kByte);
  EXPECT_TRUE(at::equal(convert_to_rgb(rgba), rgba.narrow(2, 0, 3)));
}

TEST(ImageProcessor, CenterCropPadsASmallImageAsTransformers) {
  const at::Tensor image = at::full({2, 3, 1}, 9, at::kByte);
  const at::Tensor crop = center_crop(image, 4, 4);
  ASSERT_EQ(crop.sizes(), (std::vector<int64_t>{4, 4, 1}));
  // top_pad = ceil(2 / 2) = 1, left_pad = ceil(1 / 2) = 1
  EXPECT_EQ(crop.sum().item<int64_t>(), 6 * 9);
  EXPECT_EQ(crop[1][1][0].item<int64_t>(), 9);
  EXPECT_EQ(crop[0][0][0].item<int64_t>(), 0);
}

TEST(ClipEncoderFolder, TheViTH14HasThe632MParametersOfOperations) {
  int64_t n = 0;
  for (const auto& spec : clip_vision_parameter_specs(ClipVisionConfig::vit_h_14())) {
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    n += numel;
  }
  EXPECT_EQ(n, 632'076'800);
}

TEST(ImageProcessor, ConfigErrorsNameTheFieldAndFile) {
  EXPECT_HAS(test::error_of([] { ClipImageProcessorConfig::from_json(R"({"resample": 0})", "p.json"); }), "resample");
  EXPECT_HAS(test::error_of([] { ClipImageProcessorConfig::from_json(R"({"image_std": [1, 0, 1]})", "p.json"); }),
             "'p.json': field 'image_std'");
  EXPECT_HAS(test::error_of([] { ClipImageProcessorConfig::from_json(R"({"size": {"longest_edge": 3}})", "p.json"); }),
             "field 'size'");
  EXPECT_HAS(test::error_of([] { ClipImageProcessorConfig::from_file("/nonexistent/preprocessor_config.json"); }),
             "/nonexistent/preprocessor_config.json");
}

// ---- hostile inputs -----------------------------------------------------------------------------------------------

std::string write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// A PNG whose IHDR says width x height, with no image data after it.
std::vector<uint8_t> png_header(uint32_t width, uint32_t height) {
  std::vector<uint8_t> b = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
  for (uint32_t v : {width, height}) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  }
  for (uint8_t v : {8, 2, 0, 0, 0, 0, 0, 0, 0}) b.push_back(v);  // 8-bit RGB, then a (wrong) CRC
  return b;
}

TEST(ImageFiles, AHugePngHeaderIsRefusedBeforeDecodingNamingTheFile) {
  const std::string path = write_bytes(test::temp_dir("clip") + "/huge.png", png_header(20000, 20000));
  const std::string error = test::error_of([&] { read_image(path); });
  EXPECT_HAS(error, path);
  EXPECT_HAS(error, "20000x20000");
}

TEST(ImageFiles, ACmykJpegIsRefusedNamingTheFile) {
  // SOI, then a baseline frame header: 8-bit, 16x16, 4 components (CMYK / YCCK).
  std::vector<uint8_t> b = {0xFF, 0xD8, 0xFF, 0xC0, 0, 20, 8, 0, 16, 0, 16, 4};
  for (uint8_t id = 1; id <= 4; ++id) b.insert(b.end(), {id, 0x11, 0});
  const std::string path = write_bytes(test::temp_dir("clip") + "/cmyk.jpg", b);
  const std::string error = test::error_of([&] { read_image(path); });
  EXPECT_HAS(error, path);
  EXPECT_HAS(error, "CMYK");
}

TEST(ImageFiles, AOnePixelImageIsRefusedNamingTheFile) {
  const std::string path =
      write_bytes(test::temp_dir("clip") + "/dot.png", video::encode_png(at::full({1, 1, 3}, 200, at::kByte)));
  const std::string error = test::error_of([&] { read_image(path); });
  EXPECT_HAS(error, path);
  EXPECT_HAS(error, "1x1 pixels");
}

TEST(ImageFiles, PngsWithAlphaAreReadAsPillowsConvertRgb) {
  // diffusers' load_image: Image.open(path).convert("RGB"), alpha dropped (tests/data/images/README.md).
  const auto expected = load_tensors(test::data_path("images/expected_rgb.safetensors"));
  EXPECT_TRUE(at::equal(read_image(test::data_path("images/rgba.png")), expected.at("rgba_png_as_rgb")));
  EXPECT_TRUE(at::equal(read_image(test::data_path("images/la.png")), expected.at("la_png_as_rgb")));
}

TEST(ImageFiles, PngRoundTripsToTheSameRgbPixels) {
  const at::Tensor rgb = at::randint(0, 256, {5, 7, 3}, at::kByte);
  const std::string path = write_bytes(test::temp_dir("clip") + "/rgb.png", video::encode_png(rgb));
  EXPECT_TRUE(at::equal(read_image(path), rgb));
}

// The golden encoder's folder copied with its tensors edited.
std::string edited_encoder(const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  const ClipCase c(kCases[0]);
  const std::string dir = test::temp_dir("clip-encoder");
  fs::copy_file(c.encoder_dir + "/config.json", dir + "/config.json");
  auto tensors = load_tensors(c.encoder_dir + "/model.safetensors");
  edit(tensors);
  std::vector<std::pair<std::string, at::Tensor>> items(tensors.begin(), tensors.end());
  safetensors::save(dir + "/model.safetensors", items);
  return dir;
}

TEST(ClipEncoderFolder, AMissingTensorIsNamedWithTheFolder) {
  const std::string dir = edited_encoder([](auto& t) { t.erase("vision_model.encoder.layers.1.mlp.fc2.weight"); });
  const std::string error = test::error_of([&] { load_clip_vision_encoder(dir); });
  EXPECT_HAS(error, dir);
  EXPECT_HAS(error, "vision_model.encoder.layers.1.mlp.fc2.weight");
}

TEST(ClipEncoderFolder, AMisshapenTensorIsNamedWithBothShapes) {
  const std::string dir = edited_encoder([](auto& t) {
    t["vision_model.embeddings.position_embedding.weight"] = at::zeros({6, 8});
  });
  const std::string error = test::error_of([&] { load_clip_vision_encoder(dir); });
  EXPECT_HAS(error, dir);
  EXPECT_HAS(error, "vision_model.embeddings.position_embedding.weight");
  EXPECT_HAS(error, "[6, 8]");
}

TEST(ClipEncoderFolder, AMissingConfigAndAWrongImageSizeAreClearErrors) {
  const std::string dir = test::temp_dir("clip-noconfig");
  fs::copy_file(golden_path("clip_vision/c1_rgb_landscape/weights/transformers/model.safetensors"),
                dir + "/model.safetensors");
  EXPECT_HAS(test::error_of([&] { load_clip_vision_encoder(dir); }), "no config.json");
  const LoadedClipVision encoder =
      load_clip_vision_encoder(golden_path("clip_vision/c1_rgb_landscape/weights/transformers"));
  EXPECT_HAS(test::error_of([&] { encoder.model->forward(at::zeros({1, 3, 42, 42})); }), "image_size");
}

// ---- the original Wan / SkyReels-V2 layout ------------------------------------------------------------------------

// transformers-named tensors written as Wan's clip.py VisionTransformer names them (visual.*: fused to_qkv, [1, 1, H]
// cls and [1, T, H] positions, head = projection^T), with a text tower beside it as in the full XLMRobertaCLIP file.
std::vector<std::pair<std::string, at::Tensor>> as_original(const std::map<std::string, at::Tensor>& t,
                                                            int64_t layers) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const int64_t h = t.at("vision_model.embeddings.class_embedding").size(0);
  out.emplace_back("visual.patch_embedding.weight", t.at("vision_model.embeddings.patch_embedding.weight"));
  out.emplace_back("visual.cls_embedding", t.at("vision_model.embeddings.class_embedding").view({1, 1, h}));
  const at::Tensor& pos = t.at("vision_model.embeddings.position_embedding.weight");
  out.emplace_back("visual.pos_embedding", pos.view({1, pos.size(0), h}));
  for (const char* p : {"weight", "bias"}) {
    out.emplace_back(std::string("visual.pre_norm.") + p, t.at(std::string("vision_model.pre_layrnorm.") + p));
    out.emplace_back(std::string("visual.post_norm.") + p, t.at(std::string("vision_model.post_layernorm.") + p));
  }
  out.emplace_back("visual.head", t.at("visual_projection.weight").t().contiguous());
  for (int64_t i = 0; i < layers; ++i) {
    const std::string o = "visual.transformer." + std::to_string(i) + ".";
    const std::string n = "vision_model.encoder.layers." + std::to_string(i) + ".";
    for (const char* p : {"weight", "bias"}) {
      const std::string leaf = p;
      out.emplace_back(o + "attn.to_qkv." + leaf,
                       at::cat({t.at(n + "self_attn.q_proj." + leaf), t.at(n + "self_attn.k_proj." + leaf),
                                t.at(n + "self_attn.v_proj." + leaf)}));
      out.emplace_back(o + "attn.proj." + leaf, t.at(n + "self_attn.out_proj." + leaf));
      out.emplace_back(o + "norm1." + leaf, t.at(n + "layer_norm1." + leaf));
      out.emplace_back(o + "norm2." + leaf, t.at(n + "layer_norm2." + leaf));
      out.emplace_back(o + "mlp.0." + leaf, t.at(n + "mlp.fc1." + leaf));
      out.emplace_back(o + "mlp.2." + leaf, t.at(n + "mlp.fc2." + leaf));
    }
  }
  out.emplace_back("textual.head.0.weight", at::zeros({4, 4}));
  out.emplace_back("log_scale", at::zeros({}));
  return out;
}

TEST(ClipEncoderFolder, TheOriginalWanLayoutGivesTheSameTokensAsTransformers) {
  const ClipCase c(kCases[0]);
  const std::string dir = test::temp_dir("clip-original");
  fs::copy_file(c.encoder_dir + "/config.json", dir + "/config.json");  // 8 wide: the head split needs the config
  safetensors::save(dir + "/open-clip-xlm-roberta-large-vit-huge-14.safetensors",
                    as_original(load_tensors(c.encoder_dir + "/model.safetensors"), 3));
  const LoadedClipVision original = load_clip_vision_encoder(dir);
  EXPECT_EQ(original.layout, ClipVisionLayout::Original);
  const ClipVisionOutput out = original.model->forward(c.preprocess.at("pixel_values"), true);
  EXPECT_TRUE(all_close(out.penultimate, c.output.at("hidden_states_penultimate"), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(out.image_embeds, c.output.at("image_embeds"), 1e-4, 1e-4));
}

TEST(ClipEncoderFolder, TheOriginalLayoutWithoutConfigIsReadOffTheShapes) {
  // A 160-wide encoder (2 heads of 80, as the ViT-H/14's 16 heads of 80), random weights, both layouts.
  ClipVisionConfig config;
  config.hidden_size = 160;
  config.intermediate_size = 64;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.image_size = 28;
  config.projection_dim = 24;
  at::manual_seed(5);
  std::map<std::string, at::Tensor> weights;
  for (const auto& spec : clip_vision_parameter_specs(config)) weights[spec.name] = at::randn(spec.shape) * 0.2;
  const std::string dir = test::temp_dir("clip-original-noconfig");
  safetensors::save(dir + "/clip.safetensors", as_original(weights, config.num_hidden_layers));
  const LoadedClipVision loaded = load_clip_vision_encoder(dir + "/clip.safetensors");
  EXPECT_EQ(loaded.config_source, "inferred from the shapes");
  EXPECT_EQ(loaded.model->config().num_attention_heads, 2);
  EXPECT_EQ(loaded.model->config().image_size, 28);
  EXPECT_EQ(loaded.model->config().intermediate_size, 64);
  const ClipVisionEncoder reference(config, ckpt_place(weights, config), at::kCPU, at::kFloat);
  const at::Tensor pixels = at::randn({2, 3, 28, 28});
  EXPECT_TRUE(
      at::equal(loaded.model->forward(pixels, true).image_embeds, reference.forward(pixels, true).image_embeds));

  // A missing piece is named by its original key.
  auto items = as_original(weights, config.num_hidden_layers);
  items.erase(std::remove_if(items.begin(), items.end(),
                             [](const auto& kv) { return kv.first == "visual.transformer.1.mlp.2.weight"; }),
              items.end());
  safetensors::save(dir + "/broken.safetensors", items);
  EXPECT_HAS(test::error_of([&] { load_clip_vision_encoder(dir + "/broken.safetensors"); }),
             "visual.transformer.1.mlp.2.weight");
}

// ---- skyreels encode-image ----------------------------------------------------------------------------------------

TEST(EncodeImageCli, ReproducesBothGoldenCasesFromAPngAndATensorFile) {
  const std::string dir = test::temp_dir("encode-image");
  // c1 as the PNG a user would pass; c2 (RGBA) as its uint8 tensor, which the processor makes RGB.
  const ClipCase c1(kCases[0]), c2(kCases[1]);
  const std::string png = write_bytes(dir + "/c1.png", video::encode_png(c1.images()[0]));
  const std::string tensor = dir + "/c2.safetensors";
  safetensors::save(tensor, {{"image", c2.images()[0]}});
  const std::string out = dir + "/tokens.safetensors";
  std::string log;
  ASSERT_EQ(test::run_command(test::bin_path("skyreels") + " encode-image --image-encoder " + c1.encoder_dir +
                                  " --image-processor " + c1.processor_dir + " --image " + png + " --image " + tensor +
                                  " --out " + out + " 2>&1",
                              &log),
            0)
      << log;
  const auto got = load_tensors(out);
  const at::Tensor pixel_values = at::cat({c1.preprocess.at("pixel_values"), c2.preprocess.at("pixel_values")}, 0);
  const at::Tensor tokens =
      at::cat({c1.output.at("hidden_states_penultimate"), c2.output.at("hidden_states_penultimate")}, 0);
  EXPECT_TRUE(within_one_ulp(got.at("pixel_values"), pixel_values));
  EXPECT_TRUE(all_close(got.at("image_tokens"), tokens, 1e-4, 1e-4));
  std::cout << "[ encode-image ] max |diff| image_tokens = " << max_abs_diff(got.at("image_tokens"), tokens) << "\n";
}

TEST(EncodeImageCli, FindsThePipelinesImageProcessorBesideTheEncoder) {
  // diffusers' layout: <pipeline>/image_encoder and <pipeline>/image_processor.
  const ClipCase c(kCases[0]);
  const std::string pipeline = test::temp_dir("pipeline");
  fs::copy(c.encoder_dir, pipeline + "/image_encoder");
  fs::copy(c.processor_dir, pipeline + "/image_processor");
  const std::string tensor = pipeline + "/image.safetensors";
  safetensors::save(tensor, {{"image", c.images()[0]}});
  std::string log;
  ASSERT_EQ(test::run_command(test::bin_path("skyreels") + " encode-image --image-encoder " + pipeline +
                                  "/image_encoder --image " + tensor + " --out " + pipeline + "/out.safetensors 2>&1",
                              &log),
            0)
      << log;
  EXPECT_TRUE(all_close(load_tensors(pipeline + "/out.safetensors").at("image_tokens"),
                        c.output.at("hidden_states_penultimate"), 1e-4, 1e-4));
  EXPECT_NE(test::run_command(test::bin_path("skyreels") + " encode-image --image-encoder " + pipeline +
                                  "/image_encoder --out " + pipeline + "/x.safetensors 2>&1",
                              &log),
            0);
  EXPECT_HAS(log, "--image");
}

}  // namespace
}  // namespace skyreels::model
