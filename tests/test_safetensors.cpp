// The safetensors reader: round trips, zero copy, and every kind of damaged file named in a clear error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include "model/safetensors.h"
#include "model/safetensors_limits.h"
#include "tests/test_util.h"

namespace st = skyreels::safetensors;
using skyreels::test::temp_dir;

namespace {

// Writes a file from a raw header and a data area, as a damaged checkpoint would look.
std::string write_raw(const std::string& dir, const std::string& name, const std::string& header,
                      const std::string& data, int64_t header_len_override = -1) {
  const std::string path = dir + "/" + name;
  std::ofstream out(path, std::ios::binary);
  uint64_t len = header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

std::string error_of(const std::string& path) {
  try {
    st::File::open(path);
  } catch (const st::FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  const std::string dir = temp_dir("st");
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"f32", at::randn({3, 4})},
                                                             {"bf16", at::randn({5}).to(at::kBFloat16)},
                                                             {"f64", at::randn({2, 2}, at::kDouble)},
                                                             {"i64", at::arange(6, at::kLong).view({2, 3})},
                                                             {"bool", at::tensor({1, 0, 1}).to(at::kBool)},
                                                             {"empty", at::empty({0, 3})},
                                                             {"noncontig", at::randn({4, 3}).t()}};
  st::save(dir + "/a.safetensors", tensors, {{"format", "pt"}});
  auto file = st::File::open(dir + "/a.safetensors");
  EXPECT_EQ(file->metadata().at("format"), "pt");
  for (const auto& [name, t] : tensors) {
    at::Tensor back = file->tensor(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(back, t.contiguous())) << name;
  }
}

TEST(Safetensors, TensorsViewTheMappingWithoutCopy) {
  const std::string dir = temp_dir("st");
  st::save(dir + "/a.safetensors", {{"w", at::ones({256})}});
  auto file = st::File::open(dir + "/a.safetensors");
  at::Tensor w = file->tensor("w");
  EXPECT_EQ(static_cast<const void*>(w.data_ptr()), static_cast<const void*>(file->data(*file->find("w"))));
  file.reset();  // the tensor keeps the mapping alive
  EXPECT_FLOAT_EQ(w.sum().item<float>(), 256.f);
}

TEST(Safetensors, ReadsTheGoldenFixtures) {
  auto file = st::File::open(skyreels::test::golden_path("transformer_forward/t1_tiny_df_fps/inputs.safetensors"));
  EXPECT_EQ(file->tensor("hidden_states").sizes().vec(), (std::vector<int64_t>{1, 16, 5, 6, 8}));
  EXPECT_EQ(file->tensor("timestep").scalar_type(), at::kLong);
}

TEST(SafetensorsDamage, TruncatedFileNamesTheTensor) {
  const std::string dir = temp_dir("st");
  const std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  const std::string msg = error_of(write_raw(dir, "t.safetensors", header, std::string(8, '\0')));
  EXPECT_NE(msg.find("t.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("past the data area"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, FileShorterThanTheLengthPrefix) {
  const std::string dir = temp_dir("st");
  const std::string path = dir + "/short.safetensors";
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_NE(error_of(path).find("too short"), std::string::npos) << error_of(path);
}

TEST(SafetensorsDamage, HeaderLengthPastTheEnd) {
  const std::string dir = temp_dir("st");
  const std::string msg = error_of(write_raw(dir, "h.safetensors", "{}", "", 1 << 20));
  EXPECT_NE(msg.find("header length 1048576 is past the end"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, InvalidJson) {
  const std::string dir = temp_dir("st");
  const std::string msg = error_of(write_raw(dir, "j.safetensors", R"({"w": {"dtype": )", ""));
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, UnknownDtype) {
  const std::string dir = temp_dir("st");
  const std::string header = R"({"w":{"dtype":"F12","shape":[1],"data_offsets":[0,4]}})";
  const std::string msg = error_of(write_raw(dir, "d.safetensors", header, std::string(4, '\0')));
  EXPECT_NE(msg.find("tensor 'w': unknown dtype 'F12'"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, OverlappingOffsets) {
  const std::string dir = temp_dir("st");
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  const std::string msg = error_of(write_raw(dir, "o.safetensors", header, std::string(12, '\0')));
  EXPECT_NE(msg.find("'a' and 'b' have overlapping data_offsets"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, ByteLengthDisagreesWithShape) {
  const std::string dir = temp_dir("st");
  const std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  const std::string msg = error_of(write_raw(dir, "s.safetensors", header, std::string(8, '\0')));
  EXPECT_NE(msg.find("byte length 8 does not match shape x F32 = 12"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, MissingFileIsAnError) {
  EXPECT_NE(error_of("/nonexistent/x.safetensors").find("cannot open"), std::string::npos);
}

TEST(SafetensorsDamage, ShapeWhoseByteSizeOverflowsIsAnErrorNotAWrapAround) {
  const std::string dir = temp_dir("st");
  // 2^62 x 2^2 x 4 bytes wraps to 0 in 64 bits; it must not pass as an empty tensor.
  const std::string header = R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})";
  const std::string msg = error_of(write_raw(dir, "big.safetensors", header, ""));
  EXPECT_NE(msg.find("tensor 'w': shape is too large"), std::string::npos) << msg;
}

TEST(SafetensorsDamage, DeeplyNestedHeaderIsRefusedBeforeParsing) {
  // 4 MB of "[[[[...": nlohmann::json would take seconds and gigabytes; the nesting check answers at once.
  const std::string dir = temp_dir("st");
  const std::string header = "{\"w\":" + std::string(4u << 20, '[');
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of(write_raw(dir, "deep.safetensors", header, ""));
  EXPECT_NE(msg.find("header nests deeper than 8 levels"), std::string::npos) << msg;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // Brackets inside strings are not nesting.
  EXPECT_TRUE(st::json_nesting_within(R"({"__metadata__":{"note":"[[[[[[[[[[[[[[[["}})", st::kMaxJsonDepth));
  EXPECT_FALSE(st::json_nesting_within("[[[[[[[[[]]]]]]]]]", 8));
  EXPECT_TRUE(st::json_nesting_within("[[[[[[[[]]]]]]]]", 8));
}

TEST(SafetensorsDamage, ParseHeaderRejectsALengthPastTheFile) {
  std::vector<st::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  try {
    st::parse_header("x.safetensors", "{}", 100, 50, tensors, metadata);
    FAIL() << "no error";
  } catch (const st::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("header length 100 is past the end of the file (50 bytes)"), std::string::npos)
        << e.what();
  }
}

TEST(SafetensorsWrite, StreamingSaveProducesOneTensorAtATimeAndReadsBack) {
  const std::string dir = temp_dir("st");
  int produced = 0;
  std::vector<st::SaveItem> items;
  for (int i = 0; i < 3; ++i) {
    items.push_back({"t" + std::to_string(i), at::kBFloat16, {2, 3}, [i, &produced] {
                       ++produced;
                       return at::full({2, 3}, i, at::kFloat).to(at::kBFloat16);
                     }});
  }
  st::save_streaming(dir + "/s.safetensors", items, {{"format", "pt"}});
  EXPECT_EQ(produced, 3);
  EXPECT_FALSE(std::ifstream(dir + "/s.safetensors.partial").good());
  auto file = st::File::open(dir + "/s.safetensors");
  EXPECT_EQ(file->tensor("t2").scalar_type(), at::kBFloat16);
  EXPECT_EQ(file->tensor("t2")[1][2].item<float>(), 2.f);
}

TEST(SafetensorsWrite, AFailedWriteLeavesNoFileBehind) {
  const std::string dir = temp_dir("st");
  std::vector<st::SaveItem> items = {{"ok", at::kFloat, {2}, [] { return at::ones({2}); }},
                                     {"bad", at::kFloat, {2}, [] { return at::ones({3}); }}};
  try {
    st::save_streaming(dir + "/f.safetensors", items);
    FAIL() << "no error";
  } catch (const st::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'bad'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::ifstream(dir + "/f.safetensors").good());
  EXPECT_FALSE(std::ifstream(dir + "/f.safetensors.partial").good());
}
