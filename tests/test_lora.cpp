// LoRA adapters: random tiny adapters in each key format diffusers accepts for SkyReels-V2, converted by diffusers'
// own functions and merged with PEFT's formula in Python (tests/data/lora/make_lora_cases.py), give our merged
// weights within 1e-6 and a forward within 1e-4 of the model of those weights; two adapters stack; damaged adapters
// fail with errors that name the file and the key.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "model/lora.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
namespace st = skyreels::safetensors;
using namespace skyreels::model;
using skyreels::test::data_path;
using skyreels::test::error_of;
using skyreels::test::golden_path;
using skyreels::test::temp_dir;

namespace {

const std::string kT1 = "transformer_forward/t1_tiny_df_fps";

std::string base_dir() { return golden_path(kT1 + "/weights/diffusers"); }
std::string adapter(const std::string& name) { return data_path("lora/" + name + ".safetensors"); }
std::map<std::string, at::Tensor> expected(const std::string& name) {
  return skyreels::test::load_tensors(data_path("lora/expected_" + name + ".safetensors"));
}

std::map<std::string, at::Tensor> held(const LoadedTransformer& loaded) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : loaded.model->named_tensors()) out[name] = t;
  return out;
}

LoadedTransformer load_with(const std::vector<LoraSpec>& loras, const std::string& dtype = "float32",
                            const std::string& path = base_dir()) {
  TransformerLoadOptions options{"cpu", dtype};
  options.loras = loras;
  return load_transformer(path, options);
}

at::Tensor forward(const LoadedTransformer& loaded) {
  const auto inputs = skyreels::test::load_tensors(golden_path(kT1 + "/inputs.safetensors"));
  TransformerForwardArgs args;
  args.hidden_states = inputs.at("hidden_states");
  args.timestep = inputs.at("timestep");
  args.encoder_hidden_states = inputs.at("encoder_hidden_states");
  args.fps = inputs.at("fps");
  return loaded.model->forward(args);
}

// The base checkpoint with `merged` (Python's merge) written over it: the model diffusers' merge describes.
std::string merged_checkpoint(const std::map<std::string, at::Tensor>& merged) {
  const std::string dir = temp_dir("merged");
  auto tensors = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  for (const auto& [name, t] : merged) tensors[name] = t;
  st::save(dir + "/diffusion_pytorch_model.safetensors", {tensors.begin(), tensors.end()});
  fs::copy(base_dir() + "/config.json", dir + "/config.json");
  return dir;
}

// Every parameter the fixture lists is within 1e-6 of it; every other one is bit-identical to the base.
void expect_merged(const LoadedTransformer& loaded, const std::map<std::string, at::Tensor>& want) {
  const auto base = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  const auto got = held(loaded);
  for (const auto& [name, t] : base) {
    SCOPED_TRACE(name);
    auto it = want.find(name);
    if (it == want.end()) {
      EXPECT_TRUE(at::equal(got.at(name), t));
    } else {
      EXPECT_FALSE(at::equal(it->second, t));  // the fixture does change it
      EXPECT_TRUE(skyreels::test::all_close(got.at(name), it->second, 1e-6));
    }
  }
}

// A copy of a fixture adapter with its tensors edited.
std::string edited(const std::string& name, const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  const std::string path = temp_dir("lora") + "/" + name + ".safetensors";
  auto tensors = st::load_all(adapter(name));
  edit(tensors);
  st::save(path, {tensors.begin(), tensors.end()});
  return path;
}

std::string lora_error(const std::string& path) {
  return error_of([&] { load_with({{path, 1.0}}); });
}

}  // namespace

// ---- each format, as diffusers converts and PEFT merges it -------------------------------------------------------

TEST(Lora, EachKeyFormatMergesAsDiffusersConvertsAndPeftMergesIt) {
  const std::map<std::string, LoraFormat> formats = {{"diffusers_format", LoraFormat::Diffusers},
                                                     {"original_format", LoraFormat::Original},
                                                     {"musubi_format", LoraFormat::Musubi}};
  for (const auto& [name, format] : formats) {
    SCOPED_TRACE(name);
    EXPECT_EQ(read_lora({adapter(name), 1.0}).format, format);
    const auto loaded = load_with({{adapter(name), 1.0}});
    const auto want = expected(name);
    expect_merged(loaded, want);
    ASSERT_EQ(loaded.report.loras.size(), 1u);
    EXPECT_EQ(loaded.report.loras[0].format, lora_format_name(format));
    EXPECT_EQ(loaded.report.loras[0].parameters, static_cast<int64_t>(want.size()));
    EXPECT_EQ(loaded.report.loras[0].max_rank, 4);
    EXPECT_TRUE(skyreels::test::all_close(forward(loaded), forward(load_transformer(merged_checkpoint(want))), 1e-4));
  }
}

TEST(Lora, DiffusersDropsNormDiffsAndSoDoWeWithAWarning) {
  const LoraAdapter a = read_lora({adapter("original_format"), 1.0});
  EXPECT_EQ(a.ignored, (std::vector<std::string>{"diffusion_model.blocks.0.norm3.diff",
                                                 "diffusion_model.blocks.1.norm3.diff"}));
  EXPECT_TRUE(a.updates.count("blocks.1.ffn.net.2.bias"));  // diff_b is a bias delta
  EXPECT_TRUE(a.updates.count("condition_embedder.text_embedder.linear_1.weight"));
}

TEST(Lora, TwoAdaptersStackInOrderWithTheirScales) {
  const auto loaded = load_with({{adapter("original_format"), 0.7}, {adapter("musubi_format"), -0.5}});
  expect_merged(loaded, expected("stack"));
  EXPECT_EQ(loaded.report.loras.size(), 2u);
  EXPECT_EQ(describe_loras({{adapter("original_format"), 0.7}, {adapter("musubi_format"), -0.5}}),
            "original_format.safetensors:0.7,musubi_format.safetensors:-0.5");
}

TEST(Lora, MergesInFloat32ThenCastsToTheComputeDtype) {
  const auto want = expected("musubi_format");
  const auto f32 = held(load_with({{adapter("musubi_format"), 1.0}}));
  const auto bf16 = held(load_with({{adapter("musubi_format"), 1.0}}, "bfloat16"));
  for (const auto& [name, t] : want) {
    EXPECT_EQ(bf16.at(name).scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(bf16.at(name), f32.at(name).to(at::kBFloat16))) << name;
  }
}

TEST(Lora, MergesIntoAnFp8CheckpointAfterDecodingIt) {
  const std::string fp8_dir = temp_dir("fp8") + "/out";
  convert_transformer_checkpoint(base_dir(), fp8_dir, {"float8_e4m3fn", 5'000'000'000ull});
  const auto mapped = map_transformer_checkpoint(fp8_dir);
  const auto plain = held(load_with({}, "float32", fp8_dir));
  const auto adapted = held(load_with({{adapter("musubi_format"), 1.0}}, "float32", fp8_dir));
  const auto base = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  for (const auto& [name, want] : expected("musubi_format")) {
    // the same update on the decoded weight: merged - base (Python) == adapted - plain (ours)
    EXPECT_TRUE(skyreels::test::all_close(adapted.at(name) - plain.at(name), want - base.at(name), 1e-6)) << name;
  }
}

TEST(Lora, ParsesFileAndScale) {
  EXPECT_EQ(parse_lora_spec("a.safetensors").scale, 1.0);
  const LoraSpec s = parse_lora_spec("dir/a.safetensors:0.75");
  EXPECT_EQ(s.path, "dir/a.safetensors");
  EXPECT_EQ(s.scale, 0.75);
  EXPECT_EQ(parse_lora_spec("a.safetensors:-1e-1").scale, -0.1);
  EXPECT_HAS(error_of([] { parse_lora_spec("a.safetensors:inf"); }), "scale must be a finite number");
  EXPECT_HAS(error_of([] { parse_lora_spec("a.safetensors:strong"); }), "'strong' is not a scale");
  EXPECT_HAS(error_of([] { parse_lora_spec(":0.5"); }), "no file");
}

// ---- damaged adapters --------------------------------------------------------------------------------------------

TEST(LoraDamage, TruncatedFileIsNamed) {
  const std::string path = temp_dir("lora") + "/cut.safetensors";
  fs::copy(adapter("musubi_format"), path);
  fs::resize_file(path, fs::file_size(path) - 100);
  const std::string msg = lora_error(path);
  EXPECT_HAS(msg, "LoRA: safetensors file '" + path + "', tensor '");
  EXPECT_HAS(msg, "truncated?");
}

TEST(LoraDamage, ShapeThatDoesNotMatchTheModelNamesKeyAndBothShapes) {
  const std::string path = edited("diffusers_format", [](auto& t) {
    t["transformer.blocks.0.attn1.to_q.lora_B.weight"] = at::randn({30, 4});
  });
  EXPECT_HAS(lora_error(path), "key 'transformer.blocks.0.attn1.to_q.lora_A.weight': implies [30, 24] for "
                               "'blocks.0.attn1.to_q.weight', which is [24, 24] in this model");
}

TEST(LoraDamage, RanksOfAAndBThatDisagreeAreNamed) {
  const std::string path = edited("original_format", [](auto& t) {
    t["diffusion_model.blocks.1.ffn.0.lora_up.weight"] = at::randn({32, 3});
  });
  EXPECT_HAS(lora_error(path), "key 'diffusion_model.blocks.1.ffn.0.lora_up.weight': shape [32, 3] does not match "
                               "lora_down [4, 24] (ranks 3 and 4)");
}

TEST(LoraDamage, KeysThatMapToNothingAreNamed) {
  EXPECT_HAS(lora_error(edited("original_format",
                               [](auto& t) { t["diffusion_model.blocks.0.self_attn.z.lora_down.weight"] = at::ones({4, 24}); })),
             "key 'diffusion_model.blocks.0.self_attn.z.lora_down.weight': module 'blocks.0.self_attn.z' maps to no "
             "layer of the SkyReels-V2 transformer (original format)");
  EXPECT_HAS(lora_error(edited("diffusers_format",
                               [](auto& t) { t["transformer.blocks.0.attn1.to_q.lora_C.weight"] = at::ones({4}); })),
             "key 'transformer.blocks.0.attn1.to_q.lora_C.weight': is not a LoRA tensor this format has");
  EXPECT_HAS(lora_error(edited("diffusers_format", [](auto& t) {
               t["transformer.blocks.7.attn1.to_q.lora_A.weight"] = at::ones({4, 24});
               t["transformer.blocks.7.attn1.to_q.lora_B.weight"] = at::ones({24, 4});
             })),
             "targets 'blocks.7.attn1.to_q.weight', which this model does not have");
  EXPECT_HAS(lora_error(edited("musubi_format", [](auto& t) { t["unet.blocks_0_x.alpha"] = at::ones({}); })),
             "key 'unet.blocks_0_x.alpha': does not start with 'lora_unet_'");
  EXPECT_HAS(lora_error(edited("original_format", [](auto& t) {
               t["diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight"] = at::ones({4, 24});
             })),
             "adapts the image conditioning (an I2V adapter)");
}

TEST(LoraDamage, MissingRankOrAlphaIsNamed) {
  EXPECT_HAS(lora_error(edited("original_format",
                               [](auto& t) { t.erase("diffusion_model.blocks.0.self_attn.k.lora_up.weight"); })),
             "key 'diffusion_model.blocks.0.self_attn.k.lora_down.weight': has no matching lora_up for module "
             "'blocks.0.self_attn.k': the rank of the update is unknown");
  EXPECT_HAS(lora_error(edited("musubi_format", [](auto& t) { t.erase("lora_unet_blocks_1_ffn_2.alpha"); })),
             "key 'lora_unet_blocks_1_ffn_2.lora_down.weight': module 'blocks_1_ffn_2' has no '.alpha'");
}

TEST(LoraDamage, NanOrNonPositiveAlphaAndNanWeightsAreNamed) {
  EXPECT_HAS(lora_error(edited("musubi_format", [](auto& t) { t["lora_unet_blocks_0_self_attn_q.alpha"] = at::full({}, NAN); })),
             "key 'lora_unet_blocks_0_self_attn_q.alpha': alpha is nan; it must be a finite number > 0");
  EXPECT_HAS(lora_error(edited("musubi_format", [](auto& t) { t["lora_unet_blocks_0_self_attn_q.alpha"] = at::zeros({}); })),
             "alpha is 0; it must be a finite number > 0");
  EXPECT_HAS(lora_error(edited("diffusers_format", [](auto& t) { t["transformer.proj_out.lora_A.weight"][0][0] = INFINITY; })),
             "key 'transformer.proj_out.lora_A.weight': contains NaN or infinite values");
}

TEST(LoraDamage, AbsurdRanksAreNamed) {
  EXPECT_HAS(lora_error(edited("diffusers_format", [](auto& t) {
               t["transformer.blocks.0.attn1.to_k.lora_A.weight"] = at::ones({0, 24});
               t["transformer.blocks.0.attn1.to_k.lora_B.weight"] = at::ones({24, 0});
             })),
             "key 'transformer.blocks.0.attn1.to_k.lora_A.weight': rank 0 is absurd for a 24 x 24 weight");
  EXPECT_HAS(lora_error(edited("diffusers_format", [](auto& t) {
               t["transformer.blocks.0.attn1.to_k.lora_A.weight"] = at::ones({64, 24});
               t["transformer.blocks.0.attn1.to_k.lora_B.weight"] = at::ones({24, 64});
             })),
             "rank 64 is absurd for a 24 x 24 weight (expected 1 ... 24)");
}

TEST(LoraDamage, AFailedAdapterLeavesNothingHalfLoadedAndTheFileUntouched) {
  const std::string bad = edited("musubi_format", [](auto& t) { t.erase("lora_unet_blocks_1_ffn_2.alpha"); });
  EXPECT_NE(lora_error(bad), "");
  // the base checkpoint is still the base (merging never writes into the mapped file)
  const auto base = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  const auto plain = held(load_with({{adapter("musubi_format"), 1.0}}));
  const auto again = held(load_with({}));
  for (const auto& [name, t] : base) EXPECT_TRUE(at::equal(again.at(name), t)) << name;
  EXPECT_FALSE(at::equal(plain.at("blocks.0.attn1.to_q.weight"), base.at("blocks.0.attn1.to_q.weight")));
}

// diffusers' save_lora_weights stores PEFT's LoraConfig in the file's metadata; its lora_alpha scales every module
// without an .alpha tensor (alpha_pattern overrides it per module), as PEFT would when diffusers loads the file.
TEST(Lora, DiffusersFormatTakesLoraAlphaAndAlphaPatternFromTheFileMetadata) {
  const std::string path = temp_dir("lora") + "/meta.safetensors";
  auto tensors = st::load_all(adapter("diffusers_format"));
  st::save(path, {tensors.begin(), tensors.end()},
           {{"format", "pt"},
            {"lora_adapter_metadata",
             R"({"transformer.lora_alpha": 8, "transformer.r": 4, "transformer.alpha_pattern": {"blocks.1.ffn.net.2": 2}})"}});
  const auto base = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  const auto plain = held(load_with({{adapter("diffusers_format"), 1.0}}));
  const auto meta = held(load_with({{path, 1.0}}));
  auto delta = [&](const std::map<std::string, at::Tensor>& w, const std::string& n) { return w.at(n) - base.at(n); };
  for (const char* name : {"blocks.0.attn1.to_q.weight", "blocks.1.ffn.net.0.proj.weight"}) {  // alpha 8 / r 4
    EXPECT_TRUE(skyreels::test::all_close(delta(meta, name), 2 * delta(plain, name), 1e-6)) << name;
  }
  EXPECT_TRUE(skyreels::test::all_close(delta(meta, "blocks.1.ffn.net.2.weight"),  // alpha_pattern: 2 / 4
                                        0.5 * delta(plain, "blocks.1.ffn.net.2.weight"), 1e-6));
  EXPECT_TRUE(at::equal(meta.at("blocks.0.attn2.to_q.weight"), plain.at("blocks.0.attn2.to_q.weight")));  // .alpha
  st::save(path, {tensors.begin(), tensors.end()}, {{"lora_adapter_metadata", R"({"transformer.use_rslora": true})"}});
  EXPECT_HAS(lora_error(path), "use_rslora is true; only plain LoRA (scaling alpha / r) is supported");
}
