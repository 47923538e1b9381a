// fp8 checkpoints: every code of both formats decodes to the value the OCP FP8 definition gives; convert writes
// e4m3fn as PyTorch rounds; fp8 checkpoints (our convert's, and a hand-made ComfyUI-style file with scales) load to
// exactly the model of their upcast weights; a golden case runs from an fp8 copy within the error fp8 rounding
// implies; scale tensors of unknown conventions are refused by name.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/fp8.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
namespace st = skyreels::safetensors;
namespace fp8 = skyreels::fp8;
using namespace skyreels::model;
using skyreels::test::error_of;
using skyreels::test::golden_path;
using skyreels::test::temp_dir;

namespace {

// The OCP definition, written out from sign, exponent and mantissa (not from bit patterns, as fp8.cpp does).
double ocp_e4m3fn(int code) {
  const int s = code >> 7, e = (code >> 3) & 0xf, m = code & 0x7;
  const double sign = s ? -1.0 : 1.0;
  if (e == 15 && m == 7) return std::nan("");                      // S.1111.111: the only NaN; no infinities
  if (e == 0) return sign * (m / 8.0) * std::pow(2.0, 1 - 7);       // subnormal
  return sign * (1.0 + m / 8.0) * std::pow(2.0, e - 7);             // normal, bias 7
}

double ocp_e5m2(int code) {
  const int s = code >> 7, e = (code >> 2) & 0x1f, m = code & 0x3;
  const double sign = s ? -1.0 : 1.0;
  if (e == 31) return m == 0 ? sign * INFINITY : std::nan("");     // IEEE-like specials
  if (e == 0) return sign * (m / 4.0) * std::pow(2.0, 1 - 15);
  return sign * (1.0 + m / 4.0) * std::pow(2.0, e - 15);
}

// Same value, the same sign of zero, or both NaN.
bool same_value(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

const std::string kT1 = "transformer_forward/t1_tiny_df_fps";

std::string t1_weights(const std::string& layout) { return golden_path(kT1 + "/weights/" + layout); }

TransformerForwardArgs golden_inputs(const std::map<std::string, at::Tensor>& inputs) {
  TransformerForwardArgs args;
  args.hidden_states = inputs.at("hidden_states");
  args.timestep = inputs.at("timestep");
  args.encoder_hidden_states = inputs.at("encoder_hidden_states");
  args.fps = inputs.at("fps");
  return args;
}

at::Tensor forward_of(const std::string& checkpoint, const std::string& dtype = "float32") {
  const auto inputs = skyreels::test::load_tensors(golden_path(kT1 + "/inputs.safetensors"));
  return load_transformer(checkpoint, {"cpu", dtype}).model->forward(golden_inputs(inputs));
}

// A diffusers-layout float32 checkpoint holding the values `mapped` decodes to: "its upcast weights".
std::string upcast_copy(const MappedTransformerCheckpoint& mapped) {
  const std::string dir = temp_dir("upcast");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : mapped.tensors) tensors.emplace_back(name, mapped.value(name));
  st::save(dir + "/diffusion_pytorch_model.safetensors", tensors);
  std::ofstream(dir + "/config.json") << mapped.config.to_diffusers_json();
  return dir;
}

// e5m2 codes of float values: the top byte of their IEEE half (truncated, not rounded: any code is a fine test).
at::Tensor e5m2_codes(const at::Tensor& values) {
  const at::Tensor half = values.to(at::kHalf).contiguous();
  at::Tensor codes = at::empty(half.sizes(), at::kByte);
  const auto* h = half.data_ptr<at::Half>();
  auto* c = codes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < half.numel(); ++i) c[i] = static_cast<uint8_t>(h[i].x >> 8);
  return codes;
}

std::string convert_to_fp8(const std::string& src) {
  const std::string dst = temp_dir("fp8") + "/out";
  convert_transformer_checkpoint(src, dst, {"float8_e4m3fn", 5'000'000'000ull});
  return dst;
}

}  // namespace

// ---- the 256 codes -----------------------------------------------------------------------------------------------

TEST(Fp8Codes, EveryE4M3FNCodeDecodesToItsOcpValue) {
  const auto& table = fp8::table(fp8::Format::E4M3FN);
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    EXPECT_TRUE(same_value(table[code], ocp_e4m3fn(code))) << "code " << code << ": " << table[code];
    EXPECT_FALSE(std::isinf(table[code])) << "code " << code;  // e4m3fn has no infinities
    nans += std::isnan(table[code]) ? 1 : 0;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff only
  EXPECT_TRUE(std::isnan(table[0x7f]) && std::isnan(table[0xff]));
  EXPECT_EQ(table[0x7e], 448.0f);
  EXPECT_EQ(table[0xfe], -448.0f);
  EXPECT_EQ(table[0x01], std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(table[0x08], std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(table[0x38], 1.0f);
}

TEST(Fp8Codes, EveryE5M2CodeDecodesToItsOcpValue) {
  const auto& table = fp8::table(fp8::Format::E5M2);
  int nans = 0, infs = 0;
  for (int code = 0; code < 256; ++code) {
    EXPECT_TRUE(same_value(table[code], ocp_e5m2(code))) << "code " << code << ": " << table[code];
    nans += std::isnan(table[code]) ? 1 : 0;
    infs += std::isinf(table[code]) ? 1 : 0;
  }
  EXPECT_EQ(nans, 6);  // S.11111.{01,10,11}
  EXPECT_EQ(infs, 2);  // S.11111.00
  EXPECT_EQ(table[0x7c], INFINITY);
  EXPECT_EQ(table[0xfc], -INFINITY);
  EXPECT_EQ(table[0x7b], 57344.0f);
  EXPECT_EQ(table[0x01], std::ldexp(1.0f, -16));
  EXPECT_EQ(table[0x3c], 1.0f);
}

TEST(Fp8Codes, DecodingATensorIsTheTableLookupAndKeepsTheShape) {
  const at::Tensor codes = at::arange(256, at::kInt).to(at::kByte).view({16, 16});
  for (const auto format : {fp8::Format::E4M3FN, fp8::Format::E5M2}) {
    const at::Tensor values = fp8::decode(codes, format);
    ASSERT_EQ(values.sizes(), codes.sizes());
    ASSERT_EQ(values.scalar_type(), at::kFloat);
    const float* v = values.data_ptr<float>();
    for (int code = 0; code < 256; ++code) {
      const float want = fp8::table(format)[code];
      EXPECT_TRUE(std::memcmp(&v[code], &want, sizeof want) == 0 || (std::isnan(v[code]) && std::isnan(want)));
    }
    // exact in every compute dtype: bf16 and fp16 hold every finite value unchanged
    const at::Tensor finite = values.masked_select(at::isfinite(values));
    EXPECT_TRUE(at::equal(finite.to(at::kBFloat16).to(at::kFloat), finite)) << fp8::format_name(format);
    EXPECT_TRUE(at::equal(finite.to(at::kHalf).to(at::kFloat), finite)) << fp8::format_name(format);
  }
}

// ---- e4m3fn encoding (convert) -----------------------------------------------------------------------------------

TEST(Fp8Encode, EveryFiniteValueEncodesBackToItsCode) {
  const auto& table = fp8::table(fp8::Format::E4M3FN);
  for (int code = 0; code < 256; ++code) {
    if (std::isnan(table[code])) continue;
    const at::Tensor got = fp8::encode_e4m3fn(at::full({1}, table[code]), "t");
    EXPECT_EQ(got.item<uint8_t>(), code) << table[code];
  }
}

TEST(Fp8Encode, RoundsToNearestWithTiesToEvenAndSaturatesUpTo464LikePyTorch) {
  auto enc = [](float x) { return static_cast<int>(fp8::encode_e4m3fn(at::full({1}, x), "t").item<uint8_t>()); };
  EXPECT_EQ(enc(1.0625f), 0x38);   // halfway between 1 (0x38, even) and 1.125 (0x39): to even
  EXPECT_EQ(enc(1.1875f), 0x3a);   // halfway between 1.125 (0x39) and 1.25 (0x3a, even)
  EXPECT_EQ(enc(1.07f), 0x38 + 1);  // above the midpoint
  EXPECT_EQ(enc(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: ties to even (zero)
  EXPECT_EQ(enc(std::ldexp(3.0f, -10)), 0x02);  // 1.5 subnormal steps: to the even code 2
  EXPECT_EQ(enc(std::ldexp(3.0f, -11)), 0x01);  // 0.75 steps: nearest is one step
  EXPECT_EQ(enc(-0.0f), 0x80);
  EXPECT_EQ(enc(460.0f), 0x7e);  // above 448 but below 464 rounds to 448
  EXPECT_EQ(enc(-463.9f), 0xfe);
  // Random values: the code is the nearest of all 254 finite values.
  const at::Tensor x = at::randn({4096}) * 40;
  const at::Tensor codes = fp8::encode_e4m3fn(x, "t");
  const at::Tensor back = fp8::decode(codes, fp8::Format::E4M3FN);
  const at::Tensor all = fp8::decode(at::arange(256, at::kInt).to(at::kByte), fp8::Format::E4M3FN);
  const at::Tensor finite = all.masked_select(at::isfinite(all));
  const at::Tensor best = (x.unsqueeze(1) - finite.unsqueeze(0)).abs().amin(1);
  EXPECT_TRUE(at::equal((x - back).abs(), best));
}

TEST(Fp8Encode, ValuesPyTorchWouldTurnIntoNanAreRefusedByName) {
  EXPECT_HAS(error_of([] { fp8::encode_e4m3fn(at::tensor({1.0f, 464.0f}), "tensor 'w'"); }),
             "tensor 'w': value 464.000000 at flat index 1 has no float8_e4m3fn code");
  EXPECT_HAS(error_of([] { fp8::encode_e4m3fn(at::tensor({NAN}), "x"); }), "has no float8_e4m3fn code");
  EXPECT_HAS(error_of([] { fp8::encode_e4m3fn(at::tensor({-INFINITY}), "x"); }), "has no float8_e4m3fn code");
}

// ---- safetensors -------------------------------------------------------------------------------------------------

TEST(Fp8Safetensors, F8TensorsRoundTripAsUint8CodesWithTheirDtypeName) {
  const std::string path = temp_dir("st") + "/f8.safetensors";
  const at::Tensor codes = at::arange(24, at::kInt).to(at::kByte).view({4, 6});
  st::save_streaming(path, {{"a", at::kByte, {4, 6}, [&] { return codes; }, st::DType::F8_E4M3},
                            {"b", at::kByte, {4, 6}, [&] { return codes; }, st::DType::F8_E5M2}});
  const auto file = st::File::open(path);
  EXPECT_EQ(file->find("a")->dtype, st::DType::F8_E4M3);
  EXPECT_EQ(file->find("b")->dtype, st::DType::F8_E5M2);
  EXPECT_EQ(file->find("a")->end - file->find("a")->begin, 24u);
  EXPECT_TRUE(at::equal(file->tensor("a"), codes));
  EXPECT_EQ(file->tensor("b").scalar_type(), at::kByte);
  EXPECT_HAS(error_of([&] {
               st::save_streaming(path, {{"c", at::kFloat, {2}, [] { return at::ones({2}); }, st::DType::F8_E4M3}});
             }),
             "F8_E4M3 is written from Byte tensors, not Float");
}

TEST(Fp8Safetensors, ReleasingTheDecodedPagesOfAMappedViewKeepsItsBytesReadableFromTheFile) {
  const std::string path = temp_dir("st") + "/big.safetensors";
  const at::Tensor codes = at::randint(0, 255, {1 << 16}, at::kInt).to(at::kByte);  // 16 pages
  st::save(path, {{"codes", codes}});
  const auto file = st::File::open(path);
  const at::Tensor view = file->tensor("codes");
  EXPECT_TRUE(st::release_mapped_pages(view));
  EXPECT_TRUE(at::equal(view, codes));  // read from the file again
  const at::Tensor owned = codes.clone();
  EXPECT_FALSE(st::release_mapped_pages(owned));  // not a mapping: untouched
  EXPECT_TRUE(at::equal(owned, codes));
}

// ---- fp8 checkpoints load as their upcast weights ---------------------------------------------------------------

TEST(Fp8Checkpoint, ConvertWritesMatrixWeightsAsE4M3AndTheRestAsStored) {
  const std::string dst = convert_to_fp8(t1_weights("diffusers"));
  const auto file = st::File::open(dst + "/diffusion_pytorch_model.safetensors");
  const auto config = map_transformer_checkpoint(dst).config;
  int fp8_count = 0;
  for (const auto& spec : transformer_parameter_specs(config)) {
    const auto dtype = file->find(spec.name)->dtype;
    const bool matrix = spec.shape.size() >= 2 && !spec.keep_fp32;
    EXPECT_EQ(dtype, matrix ? st::DType::F8_E4M3 : st::DType::F32) << spec.name;
    fp8_count += matrix ? 1 : 0;
  }
  const auto a = analyze_transformer_checkpoint(dst);
  ASSERT_TRUE(a.ok()) << a.error_message();
  EXPECT_EQ(a.report.fp8_tensors, fp8_count);
  EXPECT_EQ(a.report.stored_dtypes.at("F8_E4M3"), fp8_count);
  std::string notes;
  for (const auto& n : a.report.notes) notes += n + "\n";
  EXPECT_HAS(notes, "fp8: " + std::to_string(fp8_count) + " float8_e4m3fn tensors, decoded exactly");
  // the stored codes are the e4m3fn rounding of the source
  const auto source = skyreels::test::load_tensors(t1_weights("diffusers") + "/diffusion_pytorch_model.safetensors");
  EXPECT_TRUE(at::equal(file->tensor("blocks.0.attn1.to_q.weight"),
                        fp8::encode_e4m3fn(source.at("blocks.0.attn1.to_q.weight"), "q")));
}

TEST(Fp8Checkpoint, OurFp8ConvertLoadsToExactlyTheModelOfItsUpcastWeights) {
  const std::string fp8_dir = convert_to_fp8(t1_weights("original"));
  const std::string upcast = upcast_copy(map_transformer_checkpoint(fp8_dir));
  for (const char* dtype : {"float32", "bfloat16"}) {
    EXPECT_TRUE(at::equal(forward_of(fp8_dir, dtype), forward_of(upcast, dtype))) << dtype;
  }
  // sharded (with an index) like a 14B fp8 download: the same model
  const std::string sharded = temp_dir("fp8") + "/sharded";
  convert_transformer_checkpoint(fp8_dir, sharded, {"float32", 40000});
  const std::string sharded_fp8 = temp_dir("fp8") + "/sharded_fp8";
  convert_transformer_checkpoint(sharded, sharded_fp8, {"float8_e4m3fn", 20000});
  EXPECT_GT(map_transformer_checkpoint(sharded_fp8).report.files.size(), 1u);
  EXPECT_TRUE(at::equal(forward_of(sharded_fp8), forward_of(upcast)));
}

// A ComfyUI "scaled fp8" single file as it is shipped: model.diffusion_model. prefix, original names, a scaled_fp8
// marker, <module>.scale_weight per fp8 weight and <module>.scale_input activation scales; one E5M2 tensor.
TEST(Fp8Checkpoint, HandMadeScaledFp8FileLoadsToExactlyItsDecodedTimesScaleWeights) {
  const std::string dir = temp_dir("scaled");
  fs::copy(t1_weights("original") + "/config.json", dir + "/config.json");
  const auto source = skyreels::test::load_tensors(t1_weights("original") + "/model.safetensors");
  std::vector<st::SaveItem> items;
  std::map<std::string, at::Tensor> upcast;  // what the file means, in float32
  const std::string p = "model.diffusion_model.";
  items.push_back({p + "scaled_fp8", at::kByte, {0}, [] { return at::empty({0}, at::kByte); }, st::DType::F8_E4M3});
  for (const auto& [key, t] : source) {
    const bool e5m2 = key == "head.head.weight";
    if (t.dim() != 2 || key.find("modulation") != std::string::npos) {
      items.push_back({p + key, t.scalar_type(), t.sizes().vec(), [t] { return t; }});
      upcast[key] = t;
      continue;
    }
    const std::string module = key.substr(0, key.size() - std::string("weight").size());
    const float scale = t.abs().max().item<float>() / (e5m2 ? 57344.0f : 448.0f);
    const at::Tensor scaled = t / scale;
    const at::Tensor stored = e5m2 ? e5m2_codes(scaled) : fp8::encode_e4m3fn(scaled, key);
    items.push_back({p + key, at::kByte, t.sizes().vec(), [stored] { return stored; },
                     e5m2 ? st::DType::F8_E5M2 : st::DType::F8_E4M3});
    const at::Tensor s = at::full({}, scale);
    items.push_back({p + module + "scale_weight", at::kFloat, {}, [s] { return s; }});
    items.push_back({p + module + "scale_input", at::kFloat, {}, [] { return at::ones({}); }});
    upcast[key] = fp8::decode(stored, e5m2 ? fp8::Format::E5M2 : fp8::Format::E4M3FN) * scale;
  }
  st::save_streaming(dir + "/model.safetensors", items);
  const std::string reference = temp_dir("scaled-ref");
  fs::copy(t1_weights("original") + "/config.json", reference + "/config.json");
  st::save(reference + "/model.safetensors", {upcast.begin(), upcast.end()});

  const auto a = analyze_transformer_checkpoint(dir);
  ASSERT_TRUE(a.ok()) << a.error_message();
  std::string notes;
  for (const auto& n : a.report.notes) notes += n + "\n";
  EXPECT_HAS(notes, "'model.diffusion_model.scaled_fp8': ComfyUI scaled-fp8 marker (F8_E4M3), dropped");
  EXPECT_HAS(notes, "1 float8_e5m2");
  EXPECT_HAS(notes, "'<module>.scale_weight' tensors applied in float32");
  EXPECT_HAS(notes, "activation scales (scale_input / input_scale): weights are upcast");
  EXPECT_EQ(a.report.scaled_tensors, a.report.fp8_tensors);
  EXPECT_TRUE(at::equal(forward_of(dir), forward_of(reference)));
}

// fp8 rounding error: e4m3fn keeps 3 mantissa bits, so each weight moves by at most 2^-4 of itself (half a step of
// 2^-3). The output of the tiny model moves by about that relative amount too (errors of independent weights partly
// cancel, residual paths add little): the bound is a relative L2 error of 2^-4 = 6.25%, with the measured value
// printed. A wrong exponent bias or mantissa width would be off by 2x or more (relative error ~1).
TEST(Fp8Checkpoint, GoldenCaseRunsFromAnFp8CopyWithinTheErrorFp8RoundingImplies) {
  const at::Tensor expected = skyreels::test::load_tensors(golden_path(kT1 + "/output.safetensors")).at("sample");
  for (const char* layout : {"diffusers_sharded", "norm_out_linear"}) {
    const at::Tensor out = forward_of(convert_to_fp8(t1_weights(layout)));
    const double rel = ((out - expected).norm() / expected.norm()).item<double>();
    std::cout << "[ fp8 ] " << layout << ": relative L2 error of the e4m3fn copy " << rel << "\n";
    EXPECT_LT(rel, 1.0 / 16) << layout;
    EXPECT_GT(rel, 0.0) << layout;  // it did run from the rounded weights
  }
}

// ---- scales that are not understood ------------------------------------------------------------------------------

TEST(Fp8CheckpointDamage, UnknownScaleConventionsAreRefusedByName) {
  const std::string dir = temp_dir("badscale");
  fs::copy(t1_weights("diffusers"), dir, fs::copy_options::recursive);
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  auto tensors = st::load_all(file);
  tensors["blocks.0.attn1.to_q.weight_scale_inv"] = at::ones({1, 1});
  tensors["blocks.1.attn1.to_k.scale_weight"] = at::full({}, -2.0);
  tensors["blocks.1.attn1.to_v.weight_scale"] = at::ones({3});
  tensors["blocks.1.attn1.nothing.scale_weight"] = at::ones({});
  st::save(file, {tensors.begin(), tensors.end()});
  const auto a = analyze_transformer_checkpoint(dir);
  std::string msg = a.error_message();
  EXPECT_HAS(msg, "'blocks.0.attn1.to_q.weight_scale_inv': unknown scale tensor (supported: <module>.scale_weight");
  EXPECT_HAS(msg, "'blocks.1.attn1.to_k.scale_weight': scale is not a finite positive number");
  EXPECT_HAS(msg, "'blocks.1.attn1.to_v.weight_scale': scale of shape [3] for 'blocks.1.attn1.to_v.weight' [24, 24]; "
                  "expected one value, or one per output row [24]");
  EXPECT_HAS(msg, "'blocks.1.attn1.nothing.scale_weight': a weight scale, but the checkpoint has no "
                  "'blocks.1.attn1.nothing.weight' to scale");
}

TEST(Fp8CheckpointDamage, AnFp8SourceNeedsADtypeToConvert) {
  const std::string fp8_dir = convert_to_fp8(t1_weights("diffusers"));
  EXPECT_HAS(error_of([&] { convert_transformer_checkpoint(fp8_dir, temp_dir("c") + "/out"); }),
             "fp8 or scaled tensors, which the diffusers layout cannot hold as stored; pass --dtype");
  const std::string back = temp_dir("c") + "/bf16";
  convert_transformer_checkpoint(fp8_dir, back, {"bfloat16", 5'000'000'000ull});
  const auto mapped = map_transformer_checkpoint(fp8_dir);
  const auto written = skyreels::test::load_tensors(back + "/diffusion_pytorch_model.safetensors");
  EXPECT_TRUE(at::equal(written.at("blocks.0.ffn.net.2.weight").to(at::kFloat),
                        mapped.value("blocks.0.ffn.net.2.weight")));  // fp8 -> bf16 is exact
}
