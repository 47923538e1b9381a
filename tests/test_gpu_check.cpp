// scripts/gpu-check.sh --cpu: the prepared GPU check run end to end on this machine's CPU at tiny sizes, on the
// binaries of this build (--bin), so the script that a lent GPU machine runs unchanged is exercised on every build:
// its report must say that every checkpoint layout loaded onto the device it was asked for and ran, that every
// parity check against diffusers' fixtures passed, and carry the speed rows it exists to measure.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

fs::path repo_root() { return fs::path(SKYREELS_TEST_DATA).parent_path().parent_path(); }

Json run_cpu_check(const std::string& out) {
  std::string log;
  const int rc = skyreels::test::run_command((repo_root() / "scripts" / "gpu-check.sh").string() + " " + out +
                                                 " --cpu --bin " + fs::path(skyreels::test::bin_path("skyreels")).parent_path().string(),
                                             &log);
  EXPECT_EQ(rc, 0) << log;
  std::ifstream file(out + "/report.json");
  EXPECT_TRUE(file.good()) << "no report.json\n" << log;
  return file.good() ? Json::parse(file) : Json::object();
}

TEST(GpuCheckCpu, EveryStepPassesAndTheReportSaysWhatWasChecked) {
  const std::string out = skyreels::test::temp_dir("gpu-check");
  const Json report = run_cpu_check(out);
  ASSERT_TRUE(report.contains("verdict"));
  EXPECT_EQ(report.at("verdict"), "PASS") << report.at("failures").dump(1);
  EXPECT_EQ(report.at("device"), "cpu");

  // Device exactness: every layout the loader reads, in both dtypes for the bf16 checkpoint, on the device.
  std::set<std::string> layouts, dtypes;
  for (const Json& p : report.at("placement")) {
    EXPECT_TRUE(p.at("placement_ok").get<bool>()) << p.dump();
    EXPECT_EQ(p.at("placed_on"), "cpu") << p.dump();
    EXPECT_GT(p.at("tensors_on_device").get<int>(), 20) << p.dump();
    layouts.insert(p.at("layout").get<std::string>());
    dtypes.insert(p.at("dtype").get<std::string>());
  }
  EXPECT_EQ(layouts, (std::set<std::string>{"diffusers", "diffusers_sharded", "norm_out_linear", "original"}));
  EXPECT_EQ(dtypes, (std::set<std::string>{"bfloat16", "float32"}));

  // Parity rows: one per placement run, fp32 within 1e-4 of diffusers, bf16 within the stated bf16 tolerance.
  EXPECT_EQ(report.at("transformer").size(), report.at("placement").size());
  for (const Json& t : report.at("transformer")) {
    EXPECT_TRUE(t.at("ok").get<bool>()) << t.dump();
    if (t.at("dtype") == "float32") {
      EXPECT_LT(t.at("max_abs_diff").get<double>(), 1e-4) << t.dump();
    }
  }
  std::set<std::string> kinds;
  for (const Json& p : report.at("pipelines")) {
    EXPECT_TRUE(p.at("ok").get<bool>()) << p.dump();
    EXPECT_LT(p.at("max_abs_diff").get<double>(), 1e-4) << p.dump();
    kinds.insert(p.at("case").get<std::string>().substr(0, p.at("case").get<std::string>().find('/')));
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"pipeline_df", "pipeline_df_i2v", "pipeline_df_v2v"}));
  ASSERT_FALSE(report.at("seeded").empty());
  for (const Json& s : report.at("seeded")) EXPECT_TRUE(s.at("ok").get<bool>()) << s.dump();
  // One video on several ranks: cfg=2, ulysses=2 and ulysses=2 with sharded weights on two CPU ranks, each checked
  // against one device and diffusers (this build has Gloo: none may be skipped).
  ASSERT_EQ(report.at("parallel").size(), 3u) << report.at("parallel").dump(1);
  for (const Json& p : report.at("parallel")) {
    EXPECT_TRUE(p.at("ok").get<bool>()) << p.dump();
    EXPECT_FALSE(p.contains("note")) << p.dump();
    EXPECT_LE(p.at("vs_one_device").get<double>(), 1e-5) << p.dump();
  }
  EXPECT_TRUE(report.at("vae").at("ok").get<bool>());
  EXPECT_LT(report.at("vae").at("max_abs_diff").get<double>(), 1e-4);
  EXPECT_TRUE(report.at("host_syncs").empty()) << "syncs are counted on CUDA only";

  // Speed rows: the two transformer widths and the VAE decode, timed, with the matmul peak of the same process.
  const Json& speed = report.at("speed");
  for (const char* name : {"df_1_3b", "df_14b"}) {
    ASSERT_TRUE(speed.contains(name)) << name;
    EXPECT_GT(speed.at(name).at("seconds_per_pass").get<double>(), 0.0) << name;
    EXPECT_GT(speed.at(name).at("matmul_peak_tflops").get<double>(), 0.0) << name;
    EXPECT_GT(speed.at(name).at("mfu").get<double>(), 0.0) << name;
    EXPECT_TRUE(speed.at(name).at("finite").get<bool>()) << name;
  }
  EXPECT_EQ(speed.at("df_14b").at("layers"), 1);
  ASSERT_TRUE(speed.contains("vae_decode"));
  EXPECT_GT(speed.at("vae_decode").at("seconds").get<double>(), 0.0);
  EXPECT_TRUE(speed.at("diffusers").contains("status"));

  std::ifstream md(out + "/report.md");
  const std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  for (const char* heading : {"# GPU check: PASS", "## Device exactness", "## Parity", "## Speed"}) {
    EXPECT_NE(text.find(heading), std::string::npos) << heading;
  }
}

}  // namespace
