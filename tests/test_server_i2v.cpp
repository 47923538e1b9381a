// Issue 34, served: the text-to-video and image-to-video (CLIP) pipelines behind the one scheduler. A tiny random I2V
// checkpoint (text_dim 32 for the tiny UMT5, image_dim 8 for the pipeline_i2v fixtures' CLIP encoder), their VAE
// and image processor, on two CPU replicas: an i2v job over gRPC and one through the official OpenAI SDK's
// videos.create with input_reference equal `skyreels generate --pipeline i2v` bit for bit, their MP4s decode, a
// SIGKILL mid-video resumes bit-identical, and what the loaded model cannot serve is refused naming what is missing.
// On the demo (diffusion-forcing) model, pipeline t2v equals `skyreels generate --pipeline t2v`.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "model/umt5_encoder.h"
#include "model/video_mp4.h"
#include "server/api/client.h"
#include "server/replica/demo_model.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

const std::string kPrompt = "A red kite over a green hill, realistic style.";
const std::string kTokenizer = "umt5_encoder/e3_prompts_to_embeds/tokenizer";

// The pipeline_i2v fixtures' VAE, CLIP encoder and image processor (tests/data/golden/pipeline_i2v/*/case.json).
std::string fixture_weights(const std::string& part) {
  if (part == "vae") return golden_path("pipeline_df_i2v/i1_sync_1chunk_last_image/weights/vae");
  if (part == "image_encoder") return golden_path("clip_vision/c1_rgb_landscape/weights/transformers");
  return golden_path("clip_vision/c1_rgb_landscape/image_processor");
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The parts every server and `skyreels generate` of this file read, written once per process.
struct Parts {
  std::string dir, transformer, text_encoder, image;  // image: a 40x24 RGB PNG (not the video's size: resized)
};

const Parts& parts() {
  static const Parts p = [] {
    Parts made;
    made.dir = temp_dir("i2v-parts");
    made.transformer = made.dir + "/transformer";
    server::TinyModelOptions options;
    options.image_dim = 8;
    options.inject_sample_info = false;  // as the SkyReels-V2 I2V checkpoints
    server::write_tiny_model(made.transformer, options);
    made.text_encoder = made.dir + "/umt5";
    model::write_tiny_text_encoder(made.text_encoder, 32, 7);
    at::Tensor pixels = at::empty({24, 40, 3}, at::kByte);
    auto* data = pixels.data_ptr<uint8_t>();
    for (int64_t i = 0; i < pixels.numel(); ++i) data[i] = static_cast<uint8_t>((i * 37 + (i / 120) * 11) % 251);
    made.image = made.dir + "/first.png";
    write_file(made.image, video::encode_png(pixels));
    return made;
  }();
  return p;
}

std::vector<std::string> server_args() {
  const Parts& p = parts();
  return {"--model", p.transformer, "--vae", fixture_weights("vae"), "--image-encoder",
          fixture_weights("image_encoder"), "--image-processor", fixture_weights("image_processor"),
          "--text-encoder", p.text_encoder, "--tokenizer", golden_path(kTokenizer), "--dtype", "float32"};
}

// 9 frames at 32x16 (3 latent frames of 4x2), 3 steps, flow_shift 5; guidance left to the i2v default (5).
constexpr int64_t kFrames = 9, kHeight = 16, kWidth = 32, kSteps = 3;

pb::SubmitJobRequest i2v_request(uint64_t seed, int64_t steps = kSteps) {
  pb::SubmitJobRequest request;
  pb::JobSpec* spec = request.mutable_spec();
  spec->mutable_text()->set_prompt(kPrompt);
  spec->mutable_image()->set_encoded(read_file(parts().image));
  pb::GenerationParams* p = spec->mutable_params();
  p->set_num_frames(kFrames);
  p->set_height(kHeight);
  p->set_width(kWidth);
  p->set_num_inference_steps(steps);
  p->set_flow_shift(5.0);
  p->set_seed(seed);
  return request;
}

// The intra-op threads of the server's replicas (GetServerInfo): on some CPUs the i2v conditioning's float sums
// (image encoder, VAE encode) depend on how many threads share them (an AVX-512 AMD EPYC: 3e-6 between one thread
// and two), so "bit for bit" compares runs with the same number of threads.
int replica_threads(server::Client& client) {
  auto ctx = client.context(10);
  pb::ServerInfo info;
  EXPECT_TRUE(client.stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  return info.replicas_size() > 0 ? info.replicas(0).threads() : 0;
}

// `skyreels generate --pipeline i2v` (the checkpoint's default) for the same request, in one process, with the
// server's replicas' threads.
at::Tensor generate_i2v(uint64_t seed, int threads, int64_t steps = kSteps) {
  const Parts& p = parts();
  const std::string out = temp_dir("i2v-reference") + "/out.safetensors";
  EXPECT_GT(threads, 0);
  const std::string command =
      "OMP_NUM_THREADS=" + std::to_string(threads) + " " + bin_path("skyreels") + " generate --model " + p.transformer + " --vae " + fixture_weights("vae") +
      " --image-encoder " + fixture_weights("image_encoder") + " --image-processor " +
      fixture_weights("image_processor") + " --text-encoder " + p.text_encoder + " --tokenizer " +
      golden_path(kTokenizer) + " --prompt '" + kPrompt + "' --image " + p.image + " --num-frames " +
      std::to_string(kFrames) + " --height " + std::to_string(kHeight) + " --width " + std::to_string(kWidth) +
      " --num-inference-steps " + std::to_string(steps) + " --flow-shift 5 --seed " + std::to_string(seed) +
      " --dtype float32 --out " + out + " 2>&1";
  std::string log;
  EXPECT_EQ(run_command(command, &log), 0) << log;
  EXPECT_NE(log.find("pipeline i2v"), std::string::npos) << log;
  return load_tensors(out).at("latents");
}

std::string download_mp4(server::Client& client, const std::string& id) {
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(pb::RESULT_FORMAT_MP4);
  std::string mp4;
  const grpc::Status status =
      server::download_chunks(client, request, [&](int32_t, int32_t, std::string bytes) { mp4 += bytes; });
  EXPECT_TRUE(status.ok()) << status.error_message();
  return mp4;
}

void expect_mp4_of_the_video(const std::string& mp4, const std::string& what) {
  const std::string path = temp_dir("i2v-mp4") + "/video.mp4";
  write_file(path, std::vector<uint8_t>(mp4.begin(), mp4.end()));
  const auto video = video::read_video(path);
  EXPECT_EQ(video.info.frames, kFrames) << what;
  EXPECT_EQ(video.info.width, kWidth) << what;
  EXPECT_EQ(video.info.height, kHeight) << what;
}

class ServedI2v : public SharedServerSuite<ServedI2v> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    http_port_ = free_port();
    std::vector<std::string> args = server_args();
    for (const char* a : {"--devices", "cpu,cpu", "--http-listen"}) args.emplace_back(a);
    args.push_back("127.0.0.1:" + std::to_string(http_port_));
    return std::make_unique<ServerProcess>(args);
  }
  static inline int http_port_ = 0;
};

TEST_F(ServedI2v, GetServerInfoSaysTheModelRunsTheI2vPipelineWithItsImageEncoder) {
  auto ctx = server_->client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server_->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  ASSERT_EQ(info.model().pipelines_size(), 1);
  EXPECT_EQ(info.model().pipelines(0), "i2v");
  EXPECT_EQ(info.model().default_pipeline(), "i2v");
  EXPECT_EQ(info.model().in_channels(), 36);
  EXPECT_EQ(info.model().image_dim(), 8);
  EXPECT_FALSE(info.model().first_last_frame());
  EXPECT_TRUE(info.image_encoder_available());
  const std::vector<std::string> kinds(info.conditionings().begin(), info.conditionings().end());
  EXPECT_EQ(kinds, (std::vector<std::string>{"embeddings", "text", "image"}));
}

TEST_F(ServedI2v, AnI2vJobOverGrpcEqualsSkyreelsGenerateBitForBitAndItsMp4Decodes) {
  const pb::Job submitted = submit(server_->client(), i2v_request(3401));
  EXPECT_EQ(submitted.chunks_total(), 1) << "the whole video is one unit of work";
  const pb::Job job = wait_job(server_->client(), submitted.job_id(), 120s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(job.params().pipeline(), "i2v");
  EXPECT_DOUBLE_EQ(job.params().guidance_scale(), 5.0) << "SkyReelsV2ImageToVideoPipeline's default";
  const at::Tensor served = download_latents(server_->client(), job.job_id());
  const at::Tensor expected = generate_i2v(3401, replica_threads(server_->client()));
  ASSERT_EQ(served.sizes(), (std::vector<int64_t>{1, 16, 3, kHeight / 8, kWidth / 8}));
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  expect_mp4_of_the_video(download_mp4(server_->client(), job.job_id()), "gRPC");
}

TEST_F(ServedI2v, TheOpenAiSdkVideosCreateWithInputReferenceIsTheSameI2vVideo) {
  const std::string tests = data_path("..");
  ASSERT_TRUE(std::filesystem::exists(tests + "/http/node_modules/openai/package.json"))
      << "the openai npm package is not installed: run scripts/test.sh (npm ci --prefix tests/http)";
  const std::string out = temp_dir("i2v-sdk");
  const std::string command = "cd " + tests + "/http && SKYREELS_HTTP_URL=http://127.0.0.1:" +
                              std::to_string(http_port_) + " SKYREELS_OUT=" + out + " SKYREELS_IMAGE=" +
                              parts().image + " SKYREELS_PROMPT='" + kPrompt +
                              "' timeout 200 node openai_i2v.mjs > " + out + "/node.log 2>&1";
  const int rc = std::system(command.c_str());
  const std::string log = read_file(out + "/node.log");
  ASSERT_EQ(rc, 0) << log << "\nserver log:\n" << server_->log();
  const std::string id = read_file(out + "/id.txt");
  ASSERT_FALSE(id.empty()) << log;
  const at::Tensor served = download_latents(server_->client(), id);
  const at::Tensor expected = generate_i2v(3402, replica_threads(server_->client()));
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  expect_mp4_of_the_video(read_file(out + "/i2v.mp4"), "OpenAI SDK");
}

// A request the loaded model cannot serve: INVALID_ARGUMENT / FAILED_PRECONDITION naming what is missing, and the
// server keeps serving.
TEST_F(ServedI2v, WhatTheI2vModelCannotServeIsRefusedNamingWhatIsMissing) {
  struct Bad {
    std::string what;
    std::function<void(pb::SubmitJobRequest&)> change;
    grpc::StatusCode code;
    std::string message;
  };
  const std::string huge_png_header = [] {
    // A PNG signature and an IHDR claiming 20000 x 20000: refused on the header, before any decoding.
    std::string png("\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR", 16);
    for (uint32_t v : {20000u, 20000u}) {
      for (int shift = 24; shift >= 0; shift -= 8) png += static_cast<char>((v >> shift) & 0xff);
    }
    png += std::string("\x08\x02\0\0\0\0\0\0\0", 9);
    return png;
  }();
  const std::vector<Bad> cases = {
      {"no image", [](auto& r) { r.mutable_spec()->clear_image(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "image: pipeline i2v needs an image"},
      {"the df pipeline", [](auto& r) { r.mutable_spec()->mutable_params()->set_pipeline("df"); },
       grpc::StatusCode::FAILED_PRECONDITION, "pipeline: df needs a diffusion-forcing or text-to-video checkpoint"},
      {"a DF parameter", [](auto& r) { r.mutable_spec()->mutable_params()->set_ar_step(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "ar_step: a diffusion-forcing parameter; pipeline i2v does not take it"},
      {"previews", [](auto& r) { r.mutable_spec()->mutable_params()->set_preview_every(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "preview_every: a diffusion-forcing parameter"},
      {"an unknown pipeline", [](auto& r) { r.mutable_spec()->mutable_params()->set_pipeline("v2v"); },
       grpc::StatusCode::INVALID_ARGUMENT, "pipeline"},
      {"a last image on a one-image model",
       [](auto& r) { r.mutable_spec()->mutable_last_image()->set_encoded(read_file(parts().image)); },
       grpc::StatusCode::INVALID_ARGUMENT, "last_image: this I2V model takes one image"},
      {"an image as a tensor",
       [](auto& r) {
         auto* t = r.mutable_spec()->mutable_image()->mutable_tensor();
         t->set_dtype(pb::DTYPE_FLOAT32);
         for (int64_t d : {1, 3, 16, 32}) t->add_shape(d);
         t->set_data(std::string(3 * 16 * 32 * 4, '\0'));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "image.tensor: the i2v pipeline takes an encoded PNG / JPEG image"},
      {"a 20000 x 20000 PNG header",
       [&](auto& r) { r.mutable_spec()->mutable_image()->set_encoded(huge_png_header); },
       grpc::StatusCode::INVALID_ARGUMENT, "a 20000x20000 PNG, larger than the limit 4096x4096"},
      {"a CMYK JPEG",
       [](auto& r) {
         // SOI, then a baseline frame header: 8-bit, 16x16, 4 components (CMYK / YCCK).
         std::string jpeg("\xFF\xD8\xFF\xC0\x00\x14\x08\x00\x10\x00\x10\x04", 12);
         for (char id = 1; id <= 4; ++id) jpeg += std::string{id, '\x11', '\0'};
         r.mutable_spec()->mutable_image()->set_encoded(jpeg);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "image.encoded: a JPEG with 4 colour components (CMYK / YCCK)"},
      {"a 1 x 1 image",
       [](auto& r) {
         r.mutable_spec()->mutable_image()->set_encoded([] {
           const auto bytes = video::encode_png(at::zeros({1, 1, 3}, at::kByte));
           return std::string(bytes.begin(), bytes.end());
         }());
       },
       grpc::StatusCode::INVALID_ARGUMENT, "image.encoded: 1x1 pixels; an image needs at least 2 pixels"},
      {"a prompt change",
       [](auto& r) {
         auto* change = r.mutable_spec()->add_prompt_changes();
         change->set_from_frame(4);
         change->set_text("another");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt_changes: a prompt per chunk is a diffusion-forcing feature"},
  };
  for (const Bad& bad : cases) {
    pb::SubmitJobRequest request = i2v_request(1);
    bad.change(request);
    const grpc::Status status = submit_status(server_->client(), request);
    EXPECT_EQ(status.error_code(), bad.code) << bad.what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(bad.message), std::string::npos) << bad.what << ": " << status.error_message();
  }
  const pb::Job job = wait_job(server_->client(), submit(server_->client(), i2v_request(7, 1)).job_id(), 120s);
  EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << "the server still serves: " << job.error().message();
}

// The whole video is one unit of work: killed mid-video, the server resumes it from its seed, bit-identical.
TEST(ServedI2vDurable, ASigkillMidVideoResumesBitIdentical) {
  const std::string store = "sqlite:" + temp_dir("i2v-store") + "/jobs.sqlite";
  constexpr int64_t kSlowSteps = 8;
  std::vector<std::string> args = server_args();
  for (const char* a : {"--devices", "cpu", "--enable-test-hooks", "--step-delay-ms", "300", "--job-store"})
    args.emplace_back(a);
  args.push_back(store);
  std::string id;
  {
    ServerProcess server(args);
    id = submit(server.client(), i2v_request(3403, kSlowSteps)).job_id();
    // Killed after its second step: the video is half made, nothing of it is committed.
    ASSERT_TRUE(kill_after_step(server, id, 2));
  }
  ServerProcess restarted(args);
  const pb::Job done = wait_job(restarted.client(), id, 180s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  const at::Tensor served = download_latents(restarted.client(), id);
  const at::Tensor expected = generate_i2v(3403, replica_threads(restarted.client()), kSlowSteps);
  EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - generate| = " << max_abs_diff(served, expected);
}

// Cancelling acts within a step, as for a diffusion-forcing chunk (the pipeline polls between transformer blocks).
TEST(ServedI2vDurable, CancellingARunningVideoStopsItWithinAStep) {
  std::vector<std::string> args = server_args();
  for (const char* a : {"--devices", "cpu", "--enable-test-hooks", "--step-delay-ms", "300"}) args.emplace_back(a);
  ServerProcess server(args);
  const std::string id = submit(server.client(), i2v_request(3405, 20)).job_id();  // 20 steps: >= 6 s
  first_event_of_type(server.client(), id, pb::JobEvent::kStep);
  const auto t0 = std::chrono::steady_clock::now();
  pb::CancelJobRequest cancel;
  cancel.set_job_id(id);
  pb::Job response;
  auto ctx = server.client().context(10);
  ASSERT_TRUE(server.client().stub().CancelJob(ctx.get(), cancel, &response).ok());
  const pb::Job done = wait_job(server.client(), id);
  EXPECT_EQ(done.state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(done.chunks_done(), 0);
  // A step is >= 300 ms and the video's end >= 5 s away: 3 s leaves room for a loaded machine and tells them apart.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "stopped within a step, not at the video's end";
}

// An I2V checkpoint's jobs need both encoders: without them the server refuses to start, naming them; an image
// encoder on a model without the image branch is refused as well.
TEST(ServedI2vStart, AnI2vCheckpointWithoutItsImageEncoderIsRefusedAtStartNamingIt) {
  ServerProcess without({"--model", parts().transformer, "--vae", fixture_weights("vae"), "--devices", "cpu"}, false);
  EXPECT_EQ(without.wait_exit(60s), 2) << without.log();
  EXPECT_NE(without.log().find("image-to-video (I2V"), std::string::npos) << without.log();
  EXPECT_NE(without.log().find("need --image-encoder"), std::string::npos) << without.log();

  ServerProcess misplaced({"--demo", "--image-encoder", fixture_weights("image_encoder"), "--devices", "cpu"}, false);
  EXPECT_EQ(misplaced.wait_exit(60s), 2) << misplaced.log();
  EXPECT_NE(misplaced.log().find("--image-encoder: the model"), std::string::npos) << misplaced.log();
}

// The diffusion-forcing demo model also runs SkyReelsV2Pipeline (the same architecture): pipeline t2v is the whole
// video at once, equal to `skyreels generate --pipeline t2v`; i2v and images are refused there.
class ServedT2v : public SharedServerSuite<ServedT2v> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    http_port_ = free_port();
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--vae", "demo", "--devices", "cpu", "--dtype", "float32", "--http-listen",
                                 "127.0.0.1:" + std::to_string(http_port_)});
  }
  static inline int http_port_ = 0;
};

TEST_F(ServedT2v, AT2vJobOnTheDfModelEqualsSkyreelsGenerateAndI2vIsRefused) {
  pb::SubmitJobRequest request = long_video_request(3404, 3, 6.0);
  pb::GenerationParams* p = request.mutable_spec()->mutable_params();
  p->clear_base_num_frames();
  p->clear_overlap_history();
  p->set_num_frames(17);
  p->set_fps(16);  // the demo model has the fps embedding: the T2V pipeline passes it the request's fps
  p->set_pipeline("t2v");
  const pb::Job submitted = submit(server_->client(), request);
  EXPECT_EQ(submitted.chunks_total(), 1);
  const pb::Job job = wait_job(server_->client(), submitted.job_id(), 120s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  const at::Tensor served = download_latents(server_->client(), job.job_id());

  // The same call through `skyreels generate`: the demo model's bytes, the request's embeddings.
  const std::string dir = temp_dir("t2v-reference");
  server::write_tiny_model(dir + "/model");
  const auto [prompt, negative] = request_embeddings(request);
  safetensors::save(dir + "/inputs.safetensors", {{"prompt_embeds", prompt}, {"negative_prompt_embeds", negative}});
  std::ostringstream command;
  command << bin_path("skyreels") << " generate --pipeline t2v --model " << dir << "/model --inputs " << dir
          << "/inputs.safetensors --num-frames 17 --height " << p->height() << " --width " << p->width()
          << " --num-inference-steps 3 --guidance-scale 6 --fps 16 --seed 3404 --dtype float32 --out " << dir
          << "/out.safetensors 2>&1";
  std::string log;
  ASSERT_EQ(run_command(command.str(), &log), 0) << log;
  const at::Tensor expected = load_tensors(dir + "/out.safetensors").at("latents");
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);

  pb::SubmitJobRequest i2v = request;
  i2v.mutable_spec()->mutable_params()->set_pipeline("i2v");
  grpc::Status status = submit_status(server_->client(), i2v);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_NE(status.error_message().find("pipeline: i2v needs an image-to-video (I2V) checkpoint; this server's model "
                                        "runs df, t2v"),
            std::string::npos)
      << status.error_message();
  pb::SubmitJobRequest t2v_image = request;
  t2v_image.mutable_spec()->mutable_image()->set_encoded(read_file(parts().image));
  status = submit_status(server_->client(), t2v_image);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("image: pipeline t2v takes no image"), std::string::npos)
      << status.error_message();

  // The HTTP doors take `pipeline` by its name, like every generation parameter.
  const std::string body = R"({"prompt": "a cat", "size": "48x32", "pipeline": "i2v"})";
  const RawExchange http = post_json(http_port_, "/v1/videos", body);
  EXPECT_EQ(http.bytes.rfind("HTTP/1.1 4", 0), 0u) << http.bytes;
  EXPECT_NE(http.bytes.find("pipeline: i2v needs an image-to-video (I2V) checkpoint"), std::string::npos) << http.bytes;
}

}  // namespace
}  // namespace skyreels::test
