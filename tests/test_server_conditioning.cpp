// The server side of image-to-video, video extension and a prompt per chunk: the real skyreels-server on 127.0.0.1
// with the fixtures' tiny transformer and VAE on two replicas. Jobs whose chunks move between replicas equal
// `skyreels generate` in one process; bad images and videos are INVALID_ARGUMENT and the server keeps serving.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "model/sampler_flow_unipc.h"
#include "model/video_mp4.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;

const std::string kI2v = "pipeline_df_i2v/i2_long_3chunks_overlap9";  // its transformer and VAE serve every job
const std::string kV2v = "pipeline_df_v2v/v2_long_3chunks";

pb::Tensor wire(const at::Tensor& tensor) {
  const at::Tensor t = tensor.to(at::kFloat).contiguous();
  pb::Tensor out;
  out.set_dtype(pb::DTYPE_FLOAT32);
  for (int64_t d : t.sizes()) out.add_shape(d);
  out.set_data(t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  return out;
}

std::string inputs_of(const std::string& fixture) { return golden_path(fixture) + "/inputs.safetensors"; }

// 33 frames at 32x32 in 3 chunks of 5 latent frames (base 17, overlap 9), CFG 5, 3 steps: both fixtures' settings.
pb::SubmitJobRequest long_request(const std::string& fixture, uint64_t seed) {
  const auto inputs = load_tensors(inputs_of(fixture));
  pb::SubmitJobRequest request;
  pb::JobSpec* spec = request.mutable_spec();
  *spec->mutable_embeddings()->mutable_prompt_embeds() = wire(inputs.at("prompt_embeds"));
  *spec->mutable_embeddings()->mutable_negative_prompt_embeds() = wire(inputs.at("negative_prompt_embeds"));
  pb::GenerationParams* p = spec->mutable_params();
  p->set_num_frames(33);
  p->set_height(32);
  p->set_width(32);
  p->set_num_inference_steps(3);
  p->set_guidance_scale(5.0);
  p->set_base_num_frames(17);
  p->set_overlap_history(9);
  p->set_seed(seed);
  const auto scheduler = model::FlowUniPCConfig::from_file(golden_path(fixture) + "/scheduler/scheduler_config.json");
  p->set_flow_shift(scheduler.flow_shift);
  p->mutable_scheduler()->set_solver_order(scheduler.solver_order);
  p->mutable_scheduler()->set_solver_type(scheduler.solver_type);
  p->mutable_scheduler()->set_lower_order_final(scheduler.lower_order_final);
  p->mutable_scheduler()->set_final_sigmas_type(scheduler.final_sigmas_type);
  p->mutable_scheduler()->set_num_train_timesteps(scheduler.num_train_timesteps);
  return request;
}

pb::SubmitJobRequest image_request(uint64_t seed) {
  pb::SubmitJobRequest request = long_request(kI2v, seed);
  *request.mutable_spec()->mutable_image()->mutable_tensor() = wire(load_tensors(inputs_of(kI2v)).at("image"));
  return request;
}

// Video extension, with the prompt of the i2v fixture taking over at the third chunk's first new frame (25).
pb::SubmitJobRequest video_request(uint64_t seed) {
  pb::SubmitJobRequest request = long_request(kV2v, seed);
  *request.mutable_spec()->mutable_video()->mutable_tensor() = wire(load_tensors(inputs_of(kV2v)).at("video"));
  pb::PromptChange* change = request.mutable_spec()->add_prompt_changes();
  change->set_from_frame(25);
  const auto other = load_tensors(inputs_of(kI2v));  // as `--inputs-at 25:FILE` reads it: both prompts
  *change->mutable_embeddings()->mutable_prompt_embeds() = wire(other.at("prompt_embeds"));
  *change->mutable_embeddings()->mutable_negative_prompt_embeds() = wire(other.at("negative_prompt_embeds"));
  return request;
}

// `skyreels generate --seed` for the same request, in one process.
at::Tensor generate_reference(const std::string& fixture, const std::string& conditioning_flags, uint64_t seed) {
  const std::string model_dir = golden_path(kI2v);
  const std::string out = temp_dir("reference") + "/out.safetensors";
  const std::string command = bin_path("skyreels") + " generate --model " + model_dir + "/weights/diffusers --vae " +
                              model_dir + "/weights/vae --inputs " + inputs_of(fixture) + conditioning_flags +
                              " --num-frames 33 --height 32 --width 32 --num-inference-steps 3 --guidance-scale 5"
                              " --base-num-frames 17 --overlap-history 9 --scheduler-config " +
                              golden_path(fixture) + "/scheduler/scheduler_config.json --seed " + std::to_string(seed) +
                              " --out " + out;
  std::string log;
  EXPECT_EQ(run_command(command, &log), 0) << log;
  return load_tensors(out).at("latents");
}

class ConditioningServerTest : public SharedServerSuite<ConditioningServerTest> {
 public:
  // Slowed steps so that the three jobs overlap and chunks move between the two replicas.
  static std::unique_ptr<ServerProcess> start() {
    const std::string dir = golden_path(kI2v) + "/weights";
    return std::make_unique<ServerProcess>(std::vector<std::string>{
        "--model", dir + "/diffusers", "--vae", dir + "/vae", "--devices", "cpu,cpu", "--dtype", "float32",
        "--handoff-cost-seconds", "0", "--enable-test-hooks", "--step-delay-ms", "25"});
  }
};

TEST_F(ConditioningServerTest, ImageToVideoAndVideoExtensionAcrossReplicasEqualTheSingleProcessResult) {
  // Three overlapping 3-chunk jobs on two replicas move between them; rounds repeat (new seeds) until an
  // image-to-video and the video-extension job have each run on both replicas. (The placement is deterministic: the
  // job submitted last moves; the fault-injected run below moves a video-extension job for certain.)
  bool image_moved = false, video_moved = false;
  for (uint64_t round = 0; round < 2 && !(image_moved && video_moved); ++round) {
    const uint64_t seed = 41 + 10 * round;
    const std::vector<pb::SubmitJobRequest> requests = {image_request(seed), video_request(seed + 1),
                                                        image_request(seed + 2)};
    std::vector<std::string> ids;
    for (const auto& r : requests) ids.push_back(submit(server_->client(), r).job_id());
    const std::vector<at::Tensor> expected = {
        generate_reference(kI2v, " --image " + inputs_of(kI2v), seed),
        generate_reference(kV2v, " --video " + inputs_of(kV2v) + " --inputs-at 25:" + inputs_of(kI2v), seed + 1),
        generate_reference(kI2v, " --image " + inputs_of(kI2v), seed + 2)};
    for (size_t i = 0; i < ids.size(); ++i) {
      const pb::Job job = wait_job(server_->client(), ids[i], std::chrono::seconds(120));
      ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
      ASSERT_EQ(job.chunks_total(), 3);
      const std::set<std::string> replicas(job.chunk_replicas().begin(), job.chunk_replicas().end());
      (i == 1 ? video_moved : image_moved) |= replicas.size() > 1;
      const at::Tensor served = download_latents(server_->client(), ids[i]);
      const double diff = max_abs_diff(served, expected[i]);
      std::cout << (i == 1 ? "video extension" : "image-to-video") << " job, chunks on "
                << ::testing::PrintToString(job.chunk_replicas()) << ", handoffs " << job.handoffs()
                << ": max |served - skyreels generate| = " << diff << "\n";
      EXPECT_TRUE(at::equal(served, expected[i])) << "job " << i << ", max diff " << diff;
    }
  }
  // A video-extension job moved midway for certain: its second chunk fails on cpu:0, so the retry runs on cpu:1 from
  // the first chunk's stored result.
  const std::string dir = golden_path(kI2v) + "/weights";
  ServerProcess faulty({"--model", dir + "/diffusers", "--vae", dir + "/vae", "--devices", "cpu,cpu", "--dtype",
                        "float32", "--handoff-cost-seconds", "0", "--enable-test-hooks", "--fault-inject", "cpu:0@2"});
  const std::string id = submit(faulty.client(), video_request(77)).job_id();
  const pb::Job job = wait_job(faulty.client(), id, std::chrono::seconds(120));
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(job.retries(), 1);
  const std::set<std::string> replicas(job.chunk_replicas().begin(), job.chunk_replicas().end());
  video_moved |= replicas.size() > 1;
  const at::Tensor expected =
      generate_reference(kV2v, " --video " + inputs_of(kV2v) + " --inputs-at 25:" + inputs_of(kI2v), 77);
  EXPECT_TRUE(at::equal(download_latents(faulty.client(), id), expected))
      << "chunks on " << ::testing::PrintToString(job.chunk_replicas());
  EXPECT_TRUE(image_moved) << "no image-to-video job ran on both replicas";
  EXPECT_TRUE(video_moved) << "the video-extension job never ran on both replicas";
}

TEST_F(ConditioningServerTest, SkyreelsSubmitTakesTheSameConditioningFlagsAsGenerate) {
  const std::string flags = " --video " + inputs_of(kV2v) + " --inputs-at 25:" + inputs_of(kI2v);
  const at::Tensor expected = generate_reference(kV2v, flags, 45);
  const std::string out = temp_dir("submit");
  std::string log;
  ASSERT_EQ(run_command(bin_path("skyreels") + " submit --server " + server_->address() + " --inputs " +
                            inputs_of(kV2v) + flags +
                            " --num-frames 33 --height 32 --width 32 --num-inference-steps 3 --guidance-scale 5"
                            " --base-num-frames 17 --overlap-history 9 --scheduler-config " +
                            golden_path(kV2v) + "/scheduler/scheduler_config.json --seed 45 --watch --out " + out,
                        &log),
            0)
      << log;
  const auto files = std::filesystem::directory_iterator(out);
  ASSERT_NE(files, std::filesystem::directory_iterator());
  EXPECT_TRUE(at::equal(load_tensors(files->path().string()).at("latents"), expected));
}

TEST_F(ConditioningServerTest, GetServerInfoListsTheConditioningsOfTheLoadedModel) {
  auto ctx = server_->client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server_->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  const std::set<std::string> kinds(info.conditionings().begin(), info.conditionings().end());
  for (const char* kind : {"embeddings", "prompt_changes", "image", "last_image", "video"}) {
    EXPECT_TRUE(kinds.count(kind)) << kind;
  }
  EXPECT_FALSE(kinds.count("text"));  // no text encoder loaded
}

TEST_F(ConditioningServerTest, TheMp4OfAnImageToVideoWithALastImageLeavesTheLastImageFrameOutAsDiffusersDoes) {
  pb::SubmitJobRequest request = image_request(44);
  const at::Tensor image = load_tensors(inputs_of(kI2v)).at("image");
  *request.mutable_spec()->mutable_last_image()->mutable_tensor() = wire(image.flip({3}));
  const pb::Job job =
      wait_job(server_->client(), submit(server_->client(), request).job_id(), std::chrono::seconds(120));
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(download_latents(server_->client(), job.job_id()).size(2), 10);  // 9 + the last_image latent
  pb::DownloadResultRequest download;
  download.set_job_id(job.job_id());
  download.set_format(pb::RESULT_FORMAT_MP4);
  std::string mp4;
  ASSERT_TRUE(
      server::download_chunks(server_->client(), download, [&](int32_t, int32_t, std::string b) { mp4 += b; }).ok());
  EXPECT_EQ(video::read_video_bytes(std::vector<uint8_t>(mp4.begin(), mp4.end())).info.frames, 33);
}

std::string mp4_bytes(int64_t frames, int64_t size) {
  const at::Tensor video = at::rand({3, frames, size, size}) * 2 - 1;
  const std::vector<uint8_t> bytes = video::encode_mp4_segment(video);
  return std::string(bytes.begin(), bytes.end());
}

// A PNG signature and IHDR claiming width x height, nothing else.
std::string png_header(uint32_t width, uint32_t height) {
  std::string b("\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR", 16);
  for (uint32_t v : {width, height}) {
    for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<char>((v >> shift) & 0xff));
  }
  b += std::string("\x08\x02\0\0\0\0\0\0\0", 9);
  return b;
}

TEST_F(ConditioningServerTest, BadImagesAndVideosAreInvalidArgumentAndTheServerKeepsServing) {
  struct Bad {
    std::string what;
    pb::SubmitJobRequest request;
    std::string message_part;
  };
  std::vector<Bad> cases;
  auto with_image = [](std::string bytes) {
    pb::SubmitJobRequest r = long_request(kI2v, 1);
    r.mutable_spec()->mutable_image()->set_encoded(std::move(bytes));
    return r;
  };
  auto with_video = [](std::string bytes) {
    pb::SubmitJobRequest r = long_request(kV2v, 1);
    r.mutable_spec()->mutable_video()->set_encoded(std::move(bytes));
    return r;
  };
  const std::string good_video = mp4_bytes(9, 32);
  cases.push_back({"truncated MP4", with_video(good_video.substr(0, good_video.size() / 2)), "video.encoded"});
  cases.push_back({"MP4 cut in its header", with_video(good_video.substr(0, 64)), "video.encoded"});
  cases.push_back({"huge PNG", with_image(png_header(100000, 100000)), "larger than the limit"});
  cases.push_back({"MP4 larger than the request", with_video(mp4_bytes(5, 64)), "larger than the limit"});
  cases.push_back({"3-frame MP4 as an image", with_image(mp4_bytes(3, 32)), "image.encoded"});
  cases.push_back({"text as an image", with_image("this is not an image, just some text bytes"), "image.encoded"});
  cases.push_back({"empty video", with_video(""), "video.encoded: empty"});
  pb::SubmitJobRequest wrong_size = long_request(kI2v, 1);
  *wrong_size.mutable_spec()->mutable_image()->mutable_tensor() = wire(at::rand({1, 3, 32, 48}));
  cases.push_back({"image tensor of another size", wrong_size, "image.tensor: expected [1, 3, 32, 32]"});
  pb::SubmitJobRequest short_data = long_request(kV2v, 1);
  pb::Tensor* t = short_data.mutable_spec()->mutable_video()->mutable_tensor();
  *t = wire(at::rand({1, 5, 3, 32, 32}));
  t->set_data(t->data().substr(0, 100));
  cases.push_back({"video tensor with too few bytes", short_data, "video.tensor"});
  pb::SubmitJobRequest no_overlap = long_request(kV2v, 1);
  no_overlap.mutable_spec()->mutable_params()->clear_overlap_history();
  no_overlap.mutable_spec()->mutable_params()->set_num_frames(17);
  *no_overlap.mutable_spec()->mutable_video()->mutable_tensor() = wire(at::rand({1, 5, 3, 32, 32}));
  cases.push_back({"video without overlap_history", no_overlap, "overlap_history: required to extend a video"});
  pb::SubmitJobRequest both = image_request(1);
  both.mutable_spec()->mutable_video()->set_encoded(good_video);
  cases.push_back({"image and video", both, "exclusive"});

  for (const Bad& bad : cases) {
    const grpc::Status status = submit_status(server_->client(), bad.request);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(bad.message_part), std::string::npos)
        << bad.what << ": " << status.error_message();
  }
  ASSERT_TRUE(server_->running());
  // An MP4 at the request's size is accepted as a video to extend, and a 1-frame MP4 as an image.
  pb::SubmitJobRequest video_ok = long_request(kV2v, 2);
  video_ok.mutable_spec()->mutable_video()->set_encoded(good_video);
  pb::SubmitJobRequest image_ok = long_request(kI2v, 2);
  image_ok.mutable_spec()->mutable_image()->set_encoded(mp4_bytes(1, 32));
  for (const auto& request : {video_ok, image_ok}) {
    const pb::Job job =
        wait_job(server_->client(), submit(server_->client(), request).job_id(), std::chrono::seconds(120));
    EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  }
}

}  // namespace
}  // namespace skyreels::test
