// The SkyReels-V2 transformer: diffusers' golden forward passes (t1..t6), bf16 with fp32 islands, the shapes and
// batch forms the fixtures miss, the block-causal attention, and every bad input named in a clear error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"
#include "tests/test_util.h"

namespace {

namespace ckpt = skyreels::checkpoint;
namespace detail = skyreels::model::transformer_detail;
using skyreels::model::SkyReelsV2Transformer;
using skyreels::model::TransformerConfig;
using skyreels::model::TransformerForwardArgs;
using skyreels::test::all_close;
using skyreels::test::max_abs_diff;

const std::vector<std::string> kCases = {"t1_tiny_df_fps",     "t2_head128_rope",     "t3_block_causal_nfpb2",
                                         "t4_batch2_df_nofps", "t5_nondf_timestep_B", "t6_bf16_checkpoint"};

std::string case_dir(const std::string& name) { return skyreels::test::golden_path("transformer_forward/" + name); }

// A golden case: model weights from weights/diffusers (keys are the internal names), inputs and expected outputs.
struct GoldenCase {
  TransformerConfig config;
  std::map<std::string, at::Tensor> checkpoint;  // as stored (F32, or BF16 for t6)
  std::map<std::string, at::Tensor> inputs, output, intermediates;

  explicit GoldenCase(const std::string& name) {
    const std::string dir = case_dir(name);
    config = skyreels::model::parse_transformer_config(dir + "/weights/diffusers/config.json").config;
    const auto source = ckpt::Source::open(dir + "/weights/diffusers");
    for (const auto& key : source.keys()) checkpoint[key] = source.tensor(key);
    inputs = skyreels::test::load_tensors(dir + "/inputs.safetensors");
    output = skyreels::test::load_tensors(dir + "/output.safetensors");
    intermediates = skyreels::test::load_tensors(dir + "/intermediates.safetensors");
  }

  std::unique_ptr<SkyReelsV2Transformer> model(at::ScalarType dtype) const {
    auto weights = ckpt::place_strict(checkpoint, skyreels::model::transformer_parameter_specs(config), {"cpu", dtype},
                                      "golden weights");
    return std::make_unique<SkyReelsV2Transformer>(config, std::move(weights), at::kCPU, dtype);
  }

  TransformerForwardArgs args() const {
    TransformerForwardArgs a;
    a.hidden_states = inputs.at("hidden_states");
    a.timestep = inputs.at("timestep");
    a.encoder_hidden_states = inputs.at("encoder_hidden_states");
    if (inputs.count("fps")) a.fps = inputs.at("fps");
    a.num_frame_per_block = config.num_frame_per_block;  // the fixtures were run with the config's value
    return a;
  }
};

// Random weights for a config (islands fp32, the rest `dtype`), for the tests the fixtures do not cover.
ckpt::StateDict random_weights(const TransformerConfig& config, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  ckpt::StateDict out;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(config)) {
    out[spec.name] = (at::randn(spec.shape) * 0.2).to(spec.keep_fp32 ? at::kFloat : dtype);
  }
  return out;
}

TransformerConfig tiny_config(bool fps) {
  TransformerConfig c;
  c.num_attention_heads = 2;
  c.attention_head_dim = 12;
  c.text_dim = 32;
  c.ffn_dim = 32;
  c.num_layers = 2;
  c.inject_sample_info = fps;
  return c;
}

at::Tensor longs(std::vector<int64_t> values, std::vector<int64_t> shape = {}) {
  at::Tensor t = at::tensor(values);
  return shape.empty() ? t : t.view(shape);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument thrown)";
}

class GoldenForward : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenForward, Fp32ReproducesTheDiffusersSampleWithin1e4) {
  const GoldenCase golden(GetParam());
  const auto model = golden.model(at::kFloat);
  const at::Tensor sample = model->forward(golden.args());
  EXPECT_EQ(sample.scalar_type(), at::kFloat);
  EXPECT_TRUE(all_close(sample, golden.output.at("sample"), 1e-4));
  std::cout << "[ fp32 ] " << GetParam() << " max |diff| = " << max_abs_diff(sample, golden.output.at("sample"))
            << "\n";
}

TEST_P(GoldenForward, Bf16WithFp32IslandsStaysNearTheFp32Sample) {
  const GoldenCase golden(GetParam());
  const auto model = golden.model(at::kBFloat16);
  const at::Tensor sample = model->forward(golden.args());
  EXPECT_EQ(sample.scalar_type(), at::kBFloat16);
  const at::Tensor expected = golden.output.at("sample");
  // A smoke bound (case.json: bf16_port atol 0.05, rtol 0.05) on outputs of magnitude up to ~5.
  EXPECT_TRUE(all_close(sample, expected, 0.05, 0.05));
  std::cout << "[ bf16 ] " << GetParam() << " max |diff| = " << max_abs_diff(sample, expected)
            << " (output max |x| = " << expected.abs().max().item<double>() << ")\n";
}

INSTANTIATE_TEST_SUITE_P(Transformer, GoldenForward, ::testing::ValuesIn(kCases),
                         [](const auto& test_info) { return test_info.param.substr(0, 2); });

TEST(Transformer, RopeTablesEqualDiffusersIntermediates) {
  for (const std::string name : {"t1_tiny_df_fps", "t2_head128_rope"}) {
    const GoldenCase golden(name);
    const auto model = golden.model(at::kFloat);
    const auto& x = golden.inputs.at("hidden_states");
    const auto [cos, sin] = model->rope_tables(x.size(2), x.size(3) / 2, x.size(4) / 2);
    EXPECT_EQ(cos.scalar_type(), at::kFloat);
    EXPECT_TRUE(all_close(cos, golden.intermediates.at("rope_cos"), 1e-7)) << name;
    EXPECT_TRUE(all_close(sin, golden.intermediates.at("rope_sin"), 1e-7)) << name;
  }
}

TEST(Transformer, TimestepSinusoidIsDiffusersFloat64CosThenSin) {
  for (const std::string name : {"t1_tiny_df_fps", "t5_nondf_timestep_B"}) {
    const GoldenCase golden(name);
    const at::Tensor s = detail::timestep_sinusoid(golden.inputs.at("timestep"), 256);
    EXPECT_EQ(s.scalar_type(), at::kDouble);
    EXPECT_TRUE(all_close(s, golden.intermediates.at("timestep_sinusoid"), 1e-12)) << name;
  }
}

TEST(Transformer, RopeSplitFollowsTheGeneralRule) {
  auto split = [](int64_t dh) {
    const auto s = detail::rope_split(dh);
    return std::vector<int64_t>{s.t, s.h, s.w};
  };
  EXPECT_EQ(split(128), (std::vector<int64_t>{44, 42, 42}));
  EXPECT_EQ(split(12), (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(split(64), (std::vector<int64_t>{24, 20, 20}));
  EXPECT_EQ(split(4), (std::vector<int64_t>{4, 0, 0}));
}

TEST(Transformer, RopeTablesForHeadDim128UseOneDenominatorPerAxisAndRestartAtZero) {
  TransformerConfig c = tiny_config(false);
  c.attention_head_dim = 128;
  c.num_attention_heads = 1;
  SkyReelsV2Transformer model(c, random_weights(c, at::kFloat, 1), at::kCPU, at::kFloat);
  const auto [cos, sin] = model.rope_tables(4, 3, 5);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{1, 60, 1, 128}));
  // Token (f=3, h=2, w=4); axis columns t [0,44), h [44,86), w [86,128); pairs repeat each angle.
  const int64_t token = 3 * 15 + 2 * 5 + 4;
  auto expected_angle = [](int64_t pos, int64_t j, int64_t d) { return pos * std::pow(10000.0, -2.0 * j / d); };
  const at::Tensor c_row = cos[0][token][0], s_row = sin[0][token][0];
  for (auto [offset, d, pos] : {std::tuple<int64_t, int64_t, int64_t>{0, 44, 3}, {44, 42, 2}, {86, 42, 4}}) {
    for (int64_t j = 0; j < d / 2; ++j) {
      const double angle = expected_angle(pos, j, d);
      for (int64_t k : {offset + 2 * j, offset + 2 * j + 1}) {
        EXPECT_NEAR(c_row[k].item<double>(), std::cos(angle), 1e-6) << "column " << k;
        EXPECT_NEAR(s_row[k].item<double>(), std::sin(angle), 1e-6) << "column " << k;
      }
    }
  }
  // Token 0 sits at position 0 on every axis: no rotation.
  EXPECT_TRUE(at::equal(cos[0][0][0], at::ones({128})));
  EXPECT_TRUE(at::equal(sin[0][0][0], at::zeros({128})));
  EXPECT_THROW(model.rope_tables(1025, 1, 1), std::invalid_argument);
}

TEST(Transformer, PerFrameTimestepsOfOneValueEqualTheBatchForm) {
  const GoldenCase golden("t5_nondf_timestep_B");  // B = 2, fps [0, 1]
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs batch_form = golden.args();
  TransformerForwardArgs frame_form = batch_form;
  const int64_t frames = batch_form.hidden_states.size(2);
  frame_form.timestep = batch_form.timestep.unsqueeze(1).expand({-1, frames}).contiguous();
  const at::Tensor a = model->forward(batch_form);
  const at::Tensor b = model->forward(frame_form);
  EXPECT_TRUE(all_close(b, a, 1e-5));
}

TEST(Transformer, FpsWithBatchInDiffusionForcingEqualsRunningEachItemAlone) {
  const GoldenCase golden("t1_tiny_df_fps");
  const auto model = golden.model(at::kFloat);
  const TransformerForwardArgs one = golden.args();
  TransformerForwardArgs two;
  two.hidden_states = at::cat({one.hidden_states, one.hidden_states.flip(2) * 0.5});
  two.timestep = at::cat({one.timestep, (one.timestep.flip(1) * 3) % 1000});
  two.encoder_hidden_states = at::cat({one.encoder_hidden_states, one.encoder_hidden_states.roll(3, 1)});
  two.fps = longs({0, 1});
  const at::Tensor batched = model->forward(two);
  for (int64_t i = 0; i < 2; ++i) {
    TransformerForwardArgs item;
    item.hidden_states = two.hidden_states.slice(0, i, i + 1);
    item.timestep = two.timestep.slice(0, i, i + 1);
    item.encoder_hidden_states = two.encoder_hidden_states.slice(0, i, i + 1);
    item.fps = two.fps->slice(0, i, i + 1);
    EXPECT_TRUE(all_close(batched[i], model->forward(item)[0], 1e-5)) << "item " << i;
  }
  // The two fps values really select different embeddings.
  TransformerForwardArgs swapped = two;
  swapped.fps = longs({1, 0});
  EXPECT_GT(max_abs_diff(model->forward(swapped), batched), 1e-3);
}

TEST(Transformer, TokenChunkedFeedForwardIsExactAcrossChunkAndBatchBoundaries) {
  // ffn_dim 65536 makes the CPU FFN run in chunks of 64 tokens: 90 tokens per item, so the batched call cuts its
  // chunks at different tokens (and across the two items) than the per-item calls.
  TransformerConfig c = tiny_config(false);
  c.ffn_dim = 65536;
  SkyReelsV2Transformer model(c, random_weights(c, at::kFloat, 9), at::kCPU, at::kFloat);
  at::manual_seed(10);
  TransformerForwardArgs two;
  two.hidden_states = at::randn({2, 16, 3, 10, 12});
  two.timestep = longs({999, 500, 10, 3, 250, 700}, {2, 3});
  two.encoder_hidden_states = at::randn({2, 6, 32});
  const at::Tensor batched = model.forward(two);
  for (int64_t i = 0; i < 2; ++i) {
    TransformerForwardArgs item = two;
    item.hidden_states = two.hidden_states.slice(0, i, i + 1);
    item.timestep = two.timestep.slice(0, i, i + 1);
    item.encoder_hidden_states = two.encoder_hidden_states.slice(0, i, i + 1);
    EXPECT_TRUE(all_close(batched[i], model.forward(item)[0], 1e-5, 1e-5)) << "item " << i;
  }
}

TEST(Transformer, InputsMayBeStridedViewsOfLargerTensors) {
  // A chunk of a longer latent video is a frame slice: not contiguous.
  const GoldenCase golden("t1_tiny_df_fps");
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs args = golden.args();
  const at::Tensor x = args.hidden_states;
  const at::Tensor longer = at::cat({at::randn_like(x), x, at::randn_like(x)}, 2);
  args.hidden_states = longer.slice(2, x.size(2), 2 * x.size(2));
  const at::Tensor text = args.encoder_hidden_states;
  args.encoder_hidden_states = at::cat({text, text}, 2).slice(2, 0, text.size(2));
  ASSERT_FALSE(args.hidden_states.is_contiguous());
  ASSERT_FALSE(args.encoder_hidden_states.is_contiguous());
  EXPECT_TRUE(all_close(model->forward(args), golden.output.at("sample"), 1e-4));
}

TEST(Transformer, AFpsModelCalledWithoutFpsIsAnInvalidArgumentNamingFps) {
  const GoldenCase golden("t1_tiny_df_fps");
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs args = golden.args();
  args.fps.reset();
  EXPECT_NE(error_of([&] { model->forward(args); }).find("fps"), std::string::npos);
  args.fps = longs({2});
  EXPECT_NE(error_of([&] { model->forward(args); }).find("fps"), std::string::npos);
}

TEST(Transformer, FpsGivenToAModelWithoutTheEmbeddingIsIgnoredAsInDiffusers) {
  const GoldenCase golden("t4_batch2_df_nofps");
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs args = golden.args();
  args.fps = longs({1, 0});
  EXPECT_TRUE(all_close(model->forward(args), golden.output.at("sample"), 1e-4));
}

TEST(Transformer, FramesNotAMultipleOfNumFramePerBlockIsAClearInvalidArgument) {
  const GoldenCase golden("t3_block_causal_nfpb2");  // F = 6, num_frame_per_block = 2
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs args = golden.args();
  args.hidden_states = args.hidden_states.slice(2, 0, 5);
  args.timestep = args.timestep.slice(1, 0, 5);
  const std::string message = error_of([&] { model->forward(args); });
  EXPECT_NE(message.find("num_frame_per_block"), std::string::npos) << message;
  EXPECT_NE(message.find("5 latent frames"), std::string::npos) << message;
}

TEST(Transformer, BlockCausalMaskChangesTheOutputOnlyWhenRequested) {
  const GoldenCase golden("t3_block_causal_nfpb2");
  const auto model = golden.model(at::kFloat);
  TransformerForwardArgs args = golden.args();
  args.num_frame_per_block = 1;  // no mask at all: must differ from the masked golden
  const at::Tensor unmasked = model->forward(args);
  EXPECT_GT(max_abs_diff(unmasked, golden.output.at("sample")), 1e-2);
  args.num_frame_per_block = 6;  // one block spanning every frame: the mask allows everything
  EXPECT_TRUE(all_close(model->forward(args), unmasked, 1e-5));
}

// softmax(q k^T / sqrt(d) + mask) v with an explicit L x L block-causal mask: the reference of spec 3.7.
at::Tensor dense_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block) {
  const int64_t l = q.size(2);
  const at::Tensor block_id = at::div(at::arange(l), block, "floor");
  const at::Tensor allowed = block_id.unsqueeze(0) <= block_id.unsqueeze(1);  // [query, key]
  at::Tensor scores = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) / std::sqrt(q.size(3));
  scores = scores.masked_fill(allowed.logical_not(), -INFINITY);
  return at::matmul(at::softmax(scores, -1), v.to(at::kDouble)).transpose(1, 2);  // [B, L, Nh, Dh]
}

TEST(Transformer, BlockCausalAttentionEqualsADenseMaskedReference) {
  at::manual_seed(7);
  const at::Tensor q = at::randn({2, 3, 24, 8}), k = at::randn({2, 3, 24, 8}), v = at::randn({2, 3, 24, 8});
  for (int64_t block : {4, 8, 12, 5}) {  // 5: a ragged last block
    const at::Tensor expected = dense_masked_attention(q, k, v, block);
    EXPECT_TRUE(all_close(detail::attention(q, k, v, block), expected, 1e-5)) << "block " << block;
    // Tiny score budget: one query row per chunk.
    EXPECT_TRUE(all_close(detail::attention(q, k, v, block, 1), expected, 1e-5)) << "chunked, block " << block;
  }
  const at::Tensor full = dense_masked_attention(q, k, v, 24);
  EXPECT_TRUE(all_close(detail::attention(q, k, v), full, 1e-5));
  EXPECT_TRUE(all_close(detail::attention(q, k, v, 0, 3 * 24 * 4 * 2 * 5), full, 1e-5));  // 5-row chunks
}

TEST(Transformer, CrossAttentionShapesWithMoreQueriesThanKeys) {
  at::manual_seed(8);
  const at::Tensor q = at::randn({1, 2, 40, 6}), k = at::randn({1, 2, 7, 6}), v = at::randn({1, 2, 7, 6});
  const at::Tensor out = detail::attention(q, k, v, 0, 1);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 40, 2, 6}));
  const at::Tensor expected =
      at::matmul(at::softmax(at::matmul(q, k.transpose(-2, -1)) / std::sqrt(6.0), -1), v).transpose(1, 2);
  EXPECT_TRUE(all_close(out, expected, 1e-5));
}

TEST(Transformer, NamedTensorsOfABf16ModelKeepIslandsInFp32AndLiveOnTheModelDevice) {
  const TransformerConfig c = tiny_config(true);
  SkyReelsV2Transformer model(c, random_weights(c, at::kBFloat16, 2), at::kCPU, at::kBFloat16);
  EXPECT_EQ(model.compute_dtype(), at::kBFloat16);
  std::map<std::string, bool> island;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(c)) island[spec.name] = spec.keep_fp32;
  int64_t fp32 = 0, bf16 = 0;
  bool saw_rope = false;
  for (const auto& [name, t] : model.named_tensors()) {
    EXPECT_EQ(t.device(), model.device()) << name;
    const bool is_rope = name.rfind("rope.", 0) == 0;
    saw_rope |= is_rope;
    const bool want_fp32 = is_rope || island.at(name);
    EXPECT_EQ(t.scalar_type(), want_fp32 ? at::kFloat : at::kBFloat16) << name;
    (want_fp32 ? fp32 : bf16) += 1;
  }
  EXPECT_TRUE(saw_rope);
  EXPECT_EQ(fp32, 4 + 2 * 3 + 1 + 2);  // time_embedder, 2 x (table, norm2 w/b), head table, rope cos/sin
  EXPECT_GT(bf16, 0);
}

TEST(Transformer, Bf16ModelOutputsTheComputeDtypeForBothTimestepForms) {
  const TransformerConfig c = tiny_config(true);
  SkyReelsV2Transformer model(c, random_weights(c, at::kBFloat16, 3), at::kCPU, at::kBFloat16);
  TransformerForwardArgs args;
  args.hidden_states = at::randn({1, 16, 4, 4, 6});
  args.encoder_hidden_states = at::randn({1, 8, 32});
  args.fps = longs({1});
  for (const at::Tensor& t : {longs({500}), longs({999, 700, 300, 0}, {1, 4})}) {
    args.timestep = t;
    const at::Tensor out = model.forward(args);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    EXPECT_EQ(out.sizes(), args.hidden_states.sizes());
    EXPECT_TRUE(out.isfinite().all().item<bool>());
  }
}

TEST(Transformer, ConstructorNamesEveryMismatchedWeight) {
  const TransformerConfig c = tiny_config(false);
  auto check = [&](const std::function<void(ckpt::StateDict&)>& damage, const std::string& needle) {
    ckpt::StateDict w = random_weights(c, at::kBFloat16, 4);
    damage(w);
    const std::string message = error_of([&] { SkyReelsV2Transformer(c, std::move(w), at::kCPU, at::kBFloat16); });
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  };
  check([](ckpt::StateDict& w) { w.erase("blocks.1.attn2.to_k.bias"); }, "blocks.1.attn2.to_k.bias: missing");
  check(
      [](ckpt::StateDict& w) {
        w["proj_out.weight"] = at::zeros({64, 25}, at::kBFloat16);
      },
      "proj_out.weight: shape [64, 25], expected [64, 24]");
  check([](ckpt::StateDict& w) { w["blocks.0.scale_shift_table"] = w["blocks.0.scale_shift_table"].to(at::kBFloat16); },
        "blocks.0.scale_shift_table: dtype BFloat16, expected Float (fp32 island)");
  check(
      [](ckpt::StateDict& w) {
        w["fps_embedding.weight"] = at::zeros({2, 24}, at::kBFloat16);
      },
      "fps_embedding.weight: unexpected");
}

TEST(Transformer, BadInputShapesAreInvalidArgumentsNamingTheInput) {
  const TransformerConfig c = tiny_config(false);
  SkyReelsV2Transformer model(c, random_weights(c, at::kFloat, 5), at::kCPU, at::kFloat);
  TransformerForwardArgs good;
  good.hidden_states = at::randn({1, 16, 3, 4, 4});
  good.timestep = longs({1, 2, 3}, {1, 3});
  good.encoder_hidden_states = at::randn({1, 5, 32});
  EXPECT_EQ(model.forward(good).sizes(), good.hidden_states.sizes());
  auto message_for = [&](const std::function<void(TransformerForwardArgs&)>& damage) {
    TransformerForwardArgs a = good;
    damage(a);
    return error_of([&] { model.forward(a); });
  };
  EXPECT_NE(message_for([](auto& a) {
              a.hidden_states = at::randn({1, 15, 3, 4, 4});
            }).find("hidden_states"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& a) {
              a.hidden_states = at::randn({1, 16, 3, 5, 4});
            }).find("height 5"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& a) { a.timestep = longs({1, 2}, {1, 2}); }).find("timestep"), std::string::npos);
  EXPECT_NE(message_for([](auto& a) {
              a.encoder_hidden_states = at::randn({1, 5, 31});
            }).find("encoder_hidden_states"),
            std::string::npos);
  EXPECT_NE(message_for([](auto& a) { a.num_frame_per_block = 0; }).find("num_frame_per_block"), std::string::npos);
}

// ---- image-to-video (I2V) models: pipeline_i2v's first transformer calls -------------------------------------------

// An I2V case of pipeline_i2v: its transformer (config.json, the union of case.json's safetensors files: the FLF2V
// case adds a pos_embed to the I2V model of i1), and the inputs of step 0 (latents = noise_000, cat with the
// condition; prompt rows zero-padded to 512; the CLIP image tokens).
struct I2vCase {
  TransformerConfig config;
  std::map<std::string, at::Tensor> checkpoint;
  std::map<std::string, at::Tensor> inputs, image_encoder, condition, noise, trace;

  explicit I2vCase(const std::string& name) {
    const std::string dir = skyreels::test::golden_path("pipeline_i2v/" + name);
    const auto json = nlohmann::json::parse(std::ifstream(dir + "/case.json"));
    const auto& w = json["weights"]["transformer"];
    config = skyreels::model::parse_transformer_config(
                 skyreels::test::golden_path(w["dir"].get<std::string>() + "/config.json"))
                 .config;
    for (const auto& file : w["safetensors"]) {
      for (auto& [k, t] : skyreels::test::load_tensors(skyreels::test::golden_path(file.get<std::string>()))) {
        checkpoint[k] = t;
      }
    }
    inputs = skyreels::test::load_tensors(dir + "/inputs.safetensors");
    image_encoder = skyreels::test::load_tensors(dir + "/image_encoder.safetensors");
    condition = skyreels::test::load_tensors(dir + "/condition.safetensors");
    noise = skyreels::test::load_tensors(dir + "/noise.safetensors");
    trace = skyreels::test::load_tensors(dir + "/trace.safetensors");
  }

  std::unique_ptr<SkyReelsV2Transformer> model(at::ScalarType dtype = at::kFloat) const {
    return model_of(config, checkpoint, dtype);
  }
  static std::unique_ptr<SkyReelsV2Transformer> model_of(const TransformerConfig& config,
                                                         const std::map<std::string, at::Tensor>& weights,
                                                         at::ScalarType dtype = at::kFloat) {
    auto placed = ckpt::place_strict(weights, skyreels::model::transformer_parameter_specs(config), {"cpu", dtype},
                                     "pipeline_i2v weights");
    return std::make_unique<SkyReelsV2Transformer>(config, std::move(placed), at::kCPU, dtype);
  }

  static at::Tensor padded(const at::Tensor& rows, int64_t total) {
    at::Tensor out = at::zeros({rows.size(0), total, rows.size(2)});
    out.narrow(1, 0, rows.size(1)).copy_(rows);
    return out;
  }

  // Step 0's call; `negative`: the unconditional one. Image tokens [2, n, d] of FLF2V viewed as [1, 2n, d].
  TransformerForwardArgs step0(bool negative, int64_t text_rows = 512) const {
    TransformerForwardArgs a;
    a.hidden_states = at::cat({noise.at("noise_000"), condition.at("condition")}, 1);
    a.timestep = trace.at("timesteps").narrow(0, 0, 1).expand({1}).contiguous();
    a.encoder_hidden_states =
        padded(inputs.at(negative ? "negative_prompt_embeds_rows" : "prompt_embeds_rows"), text_rows);
    const at::Tensor tokens = image_encoder.at("image_embeds");
    a.encoder_hidden_states_image = tokens.reshape({1, -1, tokens.size(2)});
    return a;
  }
};

const std::vector<std::string> kI2vCases = {"i1_image_cfg5_shift5", "i2_flf2v_last_image_cfg4"};

class I2vForward : public ::testing::TestWithParam<std::string> {};

TEST_P(I2vForward, Fp32ReproducesDiffusersStep0CondAndUncondWithin1e4) {
  const I2vCase c(GetParam());
  const auto model = c.model();
  EXPECT_EQ(model->config().in_channels, 36);
  for (const bool negative : {false, true}) {
    const at::Tensor sample = model->forward(c.step0(negative));
    const at::Tensor expected = c.trace.at(negative ? "s000_noise_pred_uncond" : "s000_noise_pred_cond");
    EXPECT_TRUE(all_close(sample, expected, 1e-4, 1e-4)) << (negative ? "uncond" : "cond");
    std::cout << "[ i2v fp32 ] " << GetParam() << (negative ? " uncond" : " cond")
              << " max |diff| = " << max_abs_diff(sample, expected) << "\n";
  }
}

TEST_P(I2vForward, Bf16WithFp32IslandsStaysNearTheFp32Sample) {
  const I2vCase c(GetParam());
  const auto model = c.model(at::kBFloat16);
  for (const auto& [name, t] : model->named_tensors()) {
    if (name.find("image_embedder.norm") != std::string::npos) {
      EXPECT_EQ(t.scalar_type(), at::kFloat) << name << " is an fp32 island (diffusers' norm1 / norm2)";
    }
  }
  const at::Tensor sample = model->forward(c.step0(false));
  EXPECT_EQ(sample.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(all_close(sample, c.trace.at("s000_noise_pred_cond"), 0.05, 0.05));
}

INSTANTIATE_TEST_SUITE_P(Transformer, I2vForward, ::testing::ValuesIn(kI2vCases),
                         [](const auto& test_info) { return test_info.param.substr(0, 2); });

// diffusers splits image tokens from text at `total - 512`, so any other text length mixes them (with 16 rows the
// image branch gets nothing and the image tokens are attended as text). Here the image tokens are their own
// context: with the image values zeroed, the image branch adds exactly nothing, whatever the text length, and the
// output is that of the same model without its image branch; the image tokens cannot leak into the text attention.
TEST(TransformerI2v, ImageTokensAreSplitByTheirOwnCountForAnyTextLength) {
  const I2vCase c("i1_image_cfg5_shift5");
  auto weights = c.checkpoint;
  for (int64_t i = 0; i < c.config.num_layers; ++i) {
    for (const char* leaf : {"weight", "bias"}) {
      auto& t = weights.at("blocks." + std::to_string(i) + ".attn2.add_v_proj." + leaf);
      t = at::zeros_like(t);
    }
  }
  const auto i2v = I2vCase::model_of(c.config, weights);
  TransformerConfig text_only = c.config;
  text_only.image_dim.reset();
  text_only.added_kv_proj_dim.reset();
  std::map<std::string, at::Tensor> text_weights;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(text_only)) {
    text_weights[spec.name] = weights.at(spec.name);
  }
  const auto t2v = I2vCase::model_of(text_only, text_weights);
  for (const int64_t rows : {11, 16, 512, 600}) {
    TransformerForwardArgs a = c.step0(false, rows);
    const at::Tensor with_image = i2v->forward(a);
    a.encoder_hidden_states_image = at::randn_like(a.encoder_hidden_states_image) * 3;
    EXPECT_TRUE(at::equal(i2v->forward(a), with_image)) << rows << " text rows: the image tokens leaked into the text";
    a.encoder_hidden_states_image = at::Tensor();
    EXPECT_TRUE(at::equal(t2v->forward(a), with_image)) << rows << " text rows";
  }
  // With the real weights the image tokens matter at every text length.
  const auto model = c.model();
  for (const int64_t rows : {16, 512}) {
    TransformerForwardArgs a = c.step0(false, rows);
    const at::Tensor base = model->forward(a);
    a.encoder_hidden_states_image = at::randn_like(a.encoder_hidden_states_image);
    EXPECT_GT(max_abs_diff(model->forward(a), base), 1e-3) << rows << " text rows";
  }
}

TEST(TransformerI2v, MissingOrMisshapenImageTokensAndTokensForATextModelAreNamed) {
  const I2vCase i1("i1_image_cfg5_shift5"), i2("i2_flf2v_last_image_cfg4");
  const auto model = i1.model();
  TransformerForwardArgs a = i1.step0(false);
  a.encoder_hidden_states_image = at::Tensor();
  EXPECT_HAS(error_of([&] { model->forward(a); }), "encoder_hidden_states_image: this image-to-video model needs");
  a.encoder_hidden_states_image = at::zeros({1, 5, 9});
  EXPECT_HAS(error_of([&] { model->forward(a); }), "image_dim=8, got [1, 5, 9]");
  // FLF2V: both images' tokens, N = pos_embed_seq_len.
  TransformerForwardArgs b = i2.step0(false);
  b.encoder_hidden_states_image = b.encoder_hidden_states_image.narrow(1, 0, 5);
  EXPECT_HAS(error_of([&] { i2.model()->forward(b); }), "N=10 (pos_embed_seq_len");
  // A text model refuses image tokens rather than ignoring them.
  const GoldenCase golden("t4_batch2_df_nofps");
  TransformerForwardArgs t = golden.args();
  t.encoder_hidden_states_image = at::zeros({2, 5, 8});
  EXPECT_HAS(error_of([&] { golden.model(at::kFloat)->forward(t); }), "this model has no image branch");
}

TEST(TransformerI2v, ParameterCountsOfThePublishedConfigsAreThoseInOperations) {
  auto count = [](const TransformerConfig& c) {
    int64_t n = 0;
    for (const auto& spec : skyreels::model::transformer_parameter_specs(c)) {
      int64_t numel = 1;
      for (int64_t d : spec.shape) numel *= d;
      n += numel;
    }
    return n;
  };
  EXPECT_EQ(count(TransformerConfig::df_1_3b()), 1'435'525'696);
  EXPECT_EQ(count(TransformerConfig::i2v_1_3b()), 1'564'428'608);
  EXPECT_EQ(count(TransformerConfig::df_14b()), 14'288'491'584);
  EXPECT_EQ(count(TransformerConfig::i2v_14b()), 16'394'878'784);
}

TEST(TransformerI2v, ConfigsOfTheImageBranchAreChecked) {
  TransformerConfig c = TransformerConfig::i2v_1_3b();
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(*c.added_kv_proj_dim, 1536);
  EXPECT_EQ(*TransformerConfig::i2v_14b().added_kv_proj_dim, 5120);
  c.added_kv_proj_dim = 1280;
  EXPECT_HAS(error_of([&] { c.validate(); }), "added_kv_proj_dim: 1280 must equal the inner dim 1536");
  c = TransformerConfig::df_14b();
  c.pos_embed_seq_len = 514;
  EXPECT_HAS(error_of([&] { c.validate(); }), "pos_embed_seq_len: needs image_dim");
  c = TransformerConfig::i2v_14b();
  c.added_kv_proj_dim.reset();
  EXPECT_HAS(error_of([&] { c.validate(); }), "needs both (or neither)");
  const nlohmann::json j = nlohmann::json::parse(TransformerConfig::i2v_14b().to_diffusers_json());
  EXPECT_EQ(j["image_dim"], 1280);
  EXPECT_EQ(j["in_channels"], 36);
  EXPECT_TRUE(j["pos_embed_seq_len"].is_null());
}

// ---- the CLI -----------------------------------------------------------------------------------------------------

TEST(ForwardCli, ReproducesGoldensThroughTheLoader) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(std::filesystem::exists(bin)) << bin << " is not built";
  // t3: diffusers layout whose config asks for the block-causal mask (num_frame_per_block 2, no flag needed);
  // t1: the original SkyReels/Wan layout, mapped by the loader.
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"t3_block_causal_nfpb2", "diffusers"}, {"t1_tiny_df_fps", "original"}}) {
    const std::string dir = case_dir(name);
    const std::string out = skyreels::test::temp_dir("forward") + "/sample.safetensors";
    std::string log;
    ASSERT_EQ(skyreels::test::run_command(bin + " forward --model " + dir + "/weights/" + layout + " --inputs " + dir +
                                              "/inputs.safetensors --out " + out,
                                          &log),
              0)
        << log;
    const auto tensors = skyreels::test::load_tensors(out);
    ASSERT_TRUE(tensors.count("sample")) << log;
    const auto golden = skyreels::test::load_tensors(dir + "/output.safetensors");
    EXPECT_TRUE(all_close(tensors.at("sample"), golden.at("sample"), 1e-4)) << name;
  }
}

TEST(ForwardCli, MissingInputTensorAndMissingFlagAreNamed) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(std::filesystem::exists(bin)) << bin << " is not built";
  const std::string dir = case_dir("t1_tiny_df_fps");
  std::string log;
  EXPECT_EQ(skyreels::test::run_command(bin + " forward --model " + dir + "/weights/diffusers --out /dev/null", &log),
            2)
      << log;
  EXPECT_NE(log.find("--inputs"), std::string::npos) << log;
  // output.safetensors holds only `sample`: every required input is missing, the first is named.
  EXPECT_EQ(skyreels::test::run_command(bin + " forward --model " + dir + "/weights/diffusers --inputs " + dir +
                                            "/output.safetensors --out /dev/null",
                                        &log),
            1)
      << log;
  EXPECT_NE(log.find("hidden_states"), std::string::npos) << log;
}

}  // namespace
