// Issue 45, served: diffusers' TaylorSeer and MagCache on the t2v pipeline of the demo model. MagCache's ratios come
// from `skyreels calibrate-magcache` on the demo model's bytes and reach the server with --magcache-ratios; a job with
// each cache equals `skyreels generate` with the same flags bit for bit, its skipped token-blocks are counted in the
// job's transformer_work and in skyreels_transformer_token_blocks_total{kind="saved_cache"}, and bad settings and bad
// ratios files are refused naming the field / the file / the flag.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "server/api/client.h"
#include "server/replica/demo_model.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

constexpr uint64_t kSeed = 4501;
constexpr int64_t kSteps = 8;

// A t2v job on the demo model: 17 frames at 48x32, 8 steps, CFG 6.
pb::SubmitJobRequest t2v_request(uint64_t seed = kSeed) {
  pb::SubmitJobRequest request = long_video_request(seed, kSteps, 6.0);
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->clear_base_num_frames();
  p->clear_overlap_history();
  p->set_num_frames(17);
  p->set_fps(16);
  p->set_pipeline("t2v");
  return request;
}

// The demo model's bytes, the request's embeddings and the ratios `skyreels calibrate-magcache` makes of them.
struct Parts {
  std::string dir = temp_dir("step-caches");
  std::string model = dir + "/model";
  std::string inputs = dir + "/inputs.safetensors";
  std::string ratios = dir + "/ratios.json";

  Parts() {
    server::write_tiny_model(model);
    const auto [prompt, negative] = request_embeddings(t2v_request());
    safetensors::save(inputs, {{"prompt_embeds", prompt}, {"negative_prompt_embeds", negative}});
    std::string log;
    const int rc =
        run_command(bin_path("skyreels") + " calibrate-magcache --model " + model + " --inputs " + inputs +
                        " --num-frames 17 --height 32 --width 48 --num-inference-steps " + std::to_string(kSteps) +
                        " --guidance-scale 6 --fps 16 --seed 7 --dtype float32" + " --out " + ratios + " 2>&1",
                    &log);
    EXPECT_EQ(rc, 0) << log;
  }
};

const Parts& parts() {
  static const Parts p;
  return p;
}

// `skyreels generate --pipeline t2v` with the request's settings and `flags`.
at::Tensor generate(const std::string& flags, std::string* log_out = nullptr) {
  const std::string out = parts().dir + "/out.safetensors";
  std::ostringstream command;
  command << bin_path("skyreels") << " generate --pipeline t2v --model " << parts().model << " --inputs "
          << parts().inputs << " --num-frames 17 --height 32 --width 48 --num-inference-steps " << kSteps
          << " --guidance-scale 6 --fps 16 --seed " << kSeed << " --dtype float32 " << flags << " --out " << out
          << " 2>&1";
  std::string log;
  EXPECT_EQ(run_command(command.str(), &log), 0) << log;
  if (log_out) *log_out = log;
  return load_tensors(out).at("latents");
}

std::string tokenizer() { return golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"); }

class ServedStepCaches : public SharedServerSuite<ServedStepCaches> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    http_port_ = free_port();
    return std::make_unique<ServerProcess>(std::vector<std::string>{
        "--demo", "--devices", "cpu", "--dtype", "float32", "--magcache-ratios", parts().ratios, "--http-listen",
        "127.0.0.1:" + std::to_string(http_port_), "--text-encoder", "demo", "--tokenizer", tokenizer()});
  }
  static inline int http_port_ = 0;
};

pb::Job run_job(ServerProcess& server, const pb::SubmitJobRequest& request) {
  const pb::Job submitted = submit(server.client(), request);
  const pb::Job job = wait_job(server.client(), submitted.job_id(), 120s);
  EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  return job;
}

TEST_F(ServedStepCaches, AMagCacheJobEqualsSkyreelsGenerateAndItsSkipsAreCounted) {
  pb::SubmitJobRequest request = t2v_request();
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->set_cache("magcache");
  p->set_magcache_threshold(0.5);
  p->set_magcache_max_skip_steps(2);
  const pb::Job job = run_job(*server_, request);
  const at::Tensor served = download_latents(server_->client(), job.job_id());
  std::string log;
  const at::Tensor expected = generate(
      "--cache magcache --magcache-threshold 0.5 --magcache-max-skip-steps 2 "
      "--magcache-ratios " +
          parts().ratios + " --cache-log " + parts().dir + "/magcache.json",
      &log);
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  const auto& work = job.transformer_work();
  EXPECT_GT(work.saved_cache(), 0) << log;
  EXPECT_EQ(work.computed() + work.saved_cache() + work.saved_exact(), work.full());
  const std::string metrics = http_get(server_->metrics_port(), "/metrics");
  EXPECT_GE(metric_value(metrics, "skyreels_transformer_token_blocks_total{kind=\"saved_cache\"}"),
            static_cast<double>(work.saved_cache()))
      << metrics;
}

TEST_F(ServedStepCaches, ATaylorSeerJobEqualsSkyreelsGenerate) {
  pb::SubmitJobRequest request = t2v_request(kSeed);
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->set_cache("taylorseer");
  p->set_taylorseer_cache_interval(2);
  p->set_taylorseer_disable_cache_before_step(2);
  p->set_taylorseer_factors_dtype("float32");
  const pb::Job job = run_job(*server_, request);
  const at::Tensor served = download_latents(server_->client(), job.job_id());
  const at::Tensor expected = generate(
      "--cache taylorseer --taylorseer-cache-interval 2 "
      "--taylorseer-disable-cache-before-step 2 --taylorseer-factors-dtype float32");
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  EXPECT_GT(job.transformer_work().saved_cache(), 0);
  const at::Tensor plain = generate("");
  EXPECT_GT(max_abs_diff(served, plain), 0.0) << "TaylorSeer predicted nothing";
}

// Synchronous diffusion forcing: a long video (4 chunks) with MagCache, its state reset at every chunk (each chunk may
// run on any replica), equals `skyreels generate` with the same flags.
TEST_F(ServedStepCaches, ASyncDiffusionForcingMagCacheJobEqualsSkyreelsGenerate) {
  pb::SubmitJobRequest request = long_video_request(kSeed, kSteps, 5.0);
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->set_cache("magcache");
  p->set_magcache_threshold(0.5);
  const pb::Job job = run_job(*server_, request);
  EXPECT_EQ(job.chunks_total(), 4);
  const at::Tensor served = download_latents(server_->client(), job.job_id());
  const std::string dir = parts().dir;
  const auto [prompt, negative] = request_embeddings(request);
  safetensors::save(dir + "/df_inputs.safetensors", {{"prompt_embeds", prompt}, {"negative_prompt_embeds", negative}});
  std::string log;
  const std::string command =
      bin_path("skyreels") + " generate --pipeline df --model " + parts().model + " --inputs " + dir +
      "/df_inputs.safetensors --num-frames 37 --base-num-frames 17 --overlap-history 9 --height 32 --width 48 " +
      "--num-inference-steps " + std::to_string(kSteps) + " --guidance-scale 5 --seed " + std::to_string(kSeed) +
      " --dtype float32 --cache magcache --magcache-threshold 0.5 --magcache-ratios " + parts().ratios + " --out " +
      dir + "/df_out.safetensors 2>&1";
  ASSERT_EQ(run_command(command, &log), 0) << log;
  const at::Tensor expected = load_tensors(dir + "/df_out.safetensors").at("latents");
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  EXPECT_GT(job.transformer_work().saved_cache(), 0);
}

// POST /v1/videos names the cache's fields like every generation parameter: the same latents as over gRPC.
TEST_F(ServedStepCaches, AMagCacheVideoOverHttpIsTheGrpcJobsVideo) {
  const std::string created =
      post_json(http_port_, "/v1/videos",
                R"({"prompt": "A dog runs.", "size": "48x32", "seconds": 2, "fps": 8, )"
                R"("seed": 5, "num_inference_steps": 8, "pipeline": "t2v", )"
                R"("cache": "magcache", "magcache_threshold": 0.5, "magcache_max_skip_steps": 2})")
          .bytes;
  ASSERT_EQ(created.rfind("HTTP/1.1 200", 0), 0u) << created;
  const auto body =
      nlohmann::json::parse(created.substr(created.find('{'), created.rfind('}') - created.find('{') + 1));
  const std::string by_http = body.at("id");
  const pb::Job http_job = wait_job(server_->client(), by_http, 120s);
  ASSERT_EQ(http_job.state(), pb::JOB_STATE_SUCCEEDED) << http_job.error().message();
  EXPECT_EQ(http_job.params().cache(), "magcache");

  pb::SubmitJobRequest request;
  request.mutable_spec()->mutable_text()->set_prompt("A dog runs.");
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->set_width(48);
  p->set_height(32);
  p->set_num_frames(17);
  p->set_fps(8);
  p->set_seed(5);
  p->set_num_inference_steps(8);
  p->set_pipeline("t2v");
  p->set_cache("magcache");
  p->set_magcache_threshold(0.5);
  p->set_magcache_max_skip_steps(2);
  const pb::Job grpc_job = run_job(*server_, request);
  const at::Tensor a = download_latents(server_->client(), by_http);
  const at::Tensor b = download_latents(server_->client(), grpc_job.job_id());
  EXPECT_TRUE(a.equal(b)) << "max |http - grpc| = " << max_abs_diff(a, b);
  EXPECT_GT(grpc_job.transformer_work().saved_cache(), 0);
  EXPECT_EQ(http_job.transformer_work().saved_cache(), grpc_job.transformer_work().saved_cache());
}

TEST_F(ServedStepCaches, BadSettingsAreRefusedNamingTheField) {
  struct Case {
    const char* what;
    std::function<void(pb::GenerationParams&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"interval 0",
       [](auto& p) {
         p.set_cache("taylorseer");
         p.set_taylorseer_cache_interval(0);
       },
       "taylorseer_cache_interval"},
      {"order 9",
       [](auto& p) {
         p.set_cache("taylorseer");
         p.set_taylorseer_max_order(9);
       },
       "taylorseer_max_order"},
      {"patterns hooking nothing",
       [](auto& p) {
         p.set_cache("taylorseer");
         p.set_taylorseer_cache_modules("^blocks.*attn");
       },
       "taylorseer_cache_modules: the patterns hook no module"},
      {"a bad regex",
       [](auto& p) {
         p.set_cache("taylorseer");
         p.set_taylorseer_cache_modules("blocks\\.(");
       },
       "taylorseer_cache_modules"},
      {"threshold -1",
       [](auto& p) {
         p.set_cache("magcache");
         p.set_magcache_threshold(-1);
       },
       "magcache_threshold"},
      {"skips 0",
       [](auto& p) {
         p.set_cache("magcache");
         p.set_magcache_max_skip_steps(0);
       },
       "magcache_max_skip_steps"},
      {"retention 2",
       [](auto& p) {
         p.set_cache("magcache");
         p.set_magcache_retention_ratio(2);
       },
       "magcache_retention_ratio"},
      {"magcache on async df",
       [](auto& p) {
         p.set_cache("magcache");
         p.set_pipeline("df");
         p.set_ar_step(2);
       },
       "cache: \"magcache\" needs ar_step 0"},
      {"first-block on t2v", [](auto& p) { p.set_cache("first-block"); }, "cache: \"first-block\" is a diffusion"},
  };
  for (const Case& c : cases) {
    pb::SubmitJobRequest request = t2v_request();
    c.edit(*request.mutable_spec()->mutable_params());
    const grpc::Status status = submit_status(server_->client(), request);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos) << c.what << ": " << status.error_message();
  }
  // The HTTP door takes the same fields by name.
  const RawExchange http = post_json(http_port_, "/v1/videos",
                                     R"({"prompt": "a cat", "size": "48x32", "pipeline": "t2v", "cache": "taylorseer",)"
                                     R"( "taylorseer_cache_interval": 0})");
  EXPECT_EQ(http.bytes.rfind("HTTP/1.1 4", 0), 0u) << http.bytes;
  EXPECT_NE(http.bytes.find("taylorseer_cache_interval"), std::string::npos) << http.bytes;
}

// A ratios file rewritten by `edit`, and the server's start with it: exit 2 naming the file.
void expect_refused_at_start(const std::string& name, const std::function<void(std::string&)>& edit,
                             const std::string& message) {
  std::ifstream in(parts().ratios);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  edit(text);
  const std::string path = parts().dir + "/" + name + ".json";
  std::ofstream(path) << text;
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--magcache-ratios", path}, false);
  EXPECT_EQ(server.wait_exit(60s), 2) << name << ": " << server.log();
  EXPECT_NE(server.log().find("--magcache-ratios: " + path), std::string::npos) << name << ": " << server.log();
  EXPECT_NE(server.log().find(message), std::string::npos) << name << ": " << server.log();
}

TEST(ServedStepCachesStart, DamagedOversizedAndOtherModelsRatiosStopTheStartNamingTheFile) {
  expect_refused_at_start(
      "damaged", [](std::string& t) { t.resize(t.size() / 2); }, "not a JSON object");
  expect_refused_at_start(
      "oversized", [](std::string& t) { t.append(size_t{2} << 20, ' '); }, "bytes, more than");
  auto json_edit = [](const std::function<void(nlohmann::json&)>& change) {
    return [change](std::string& t) {
      nlohmann::json j = nlohmann::json::parse(t);
      change(j);
      t = j.dump();
    };
  };
  expect_refused_at_start("other_model", json_edit([](auto& j) { j["model"] = "layers=9"; }),
                          "calibrated on another model");
  expect_refused_at_start("negative", json_edit([](auto& j) { j["ratios_cond"][1] = -0.5; }), "finite and positive");
  expect_refused_at_start("short", json_edit([](auto& j) { j["ratios_cond"].erase(0); }), "needs num_inference_steps");
}

// The cache's state lives in the run: a server killed mid-video runs the job again after its restart (the same
// --magcache-ratios) and makes the video `skyreels generate` makes, bit for bit.
TEST(ServedStepCachesDurable, ASigkillMidVideoResumesBitIdentical) {
  const std::string store = "sqlite:" + temp_dir("step-caches-store") + "/jobs.sqlite";
  const std::vector<std::string> args = {"--demo",
                                         "--devices",
                                         "cpu",
                                         "--dtype",
                                         "float32",
                                         "--magcache-ratios",
                                         parts().ratios,
                                         "--enable-test-hooks",
                                         "--step-delay-ms",
                                         "300",
                                         "--job-store",
                                         store};
  pb::SubmitJobRequest request = t2v_request();
  request.mutable_spec()->mutable_params()->set_cache("magcache");
  request.mutable_spec()->mutable_params()->set_magcache_threshold(0.5);
  std::string id;
  {
    ServerProcess server(args);
    id = submit(server.client(), request).job_id();
    ASSERT_TRUE(kill_after_step(server, id, 2));
  }
  ServerProcess restarted(args);
  const pb::Job done = wait_job(restarted.client(), id, 180s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  const at::Tensor served = download_latents(restarted.client(), id);
  const at::Tensor expected = generate("--cache magcache --magcache-threshold 0.5 --magcache-ratios " + parts().ratios);
  EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - generate| = " << max_abs_diff(served, expected);
  EXPECT_GT(done.transformer_work().saved_cache(), 0);
}

TEST(ServedStepCachesStart, AMagCacheJobOnAServerWithoutRatiosIsRefusedNamingTheFlag) {
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32"});
  pb::SubmitJobRequest request = t2v_request();
  request.mutable_spec()->mutable_params()->set_cache("magcache");
  const grpc::Status status = submit_status(server.client(), request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("--magcache-ratios"), std::string::npos) << status.error_message();
}

}  // namespace
}  // namespace skyreels::test
