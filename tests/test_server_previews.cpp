// Previews of the running chunk served (issue 35): WatchJob carries them between each chunk's start and its frames,
// each a PNG of the chunk's new frames at latent resolution; they change nothing in the video; out-of-range
// `preview_every` is refused naming it; `skyreels watch --previews DIR` writes them; a watcher may leave them out.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "model/video_mp4.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;

class ServedPreviews : public SharedServerSuite<ServedPreviews> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--devices", "cpu", "--dtype", "float32", "--step-delay-ms", "60"});
  }
};

bool finished(const pb::JobEvent& e) { return e.has_finished(); }

pb::SubmitJobRequest with_previews(uint64_t seed, int64_t every, int64_t steps = 6) {
  pb::SubmitJobRequest request = long_video_request(seed, steps);  // 4 chunks, 48x32
  request.mutable_spec()->mutable_params()->set_preview_every(every);
  return request;
}

TEST_F(ServedPreviews, EveryChunkShowsPreviewsBeforeItsFramesAndTheVideoIsTheSameWithout) {
  const pb::Job job = submit(server_->client(), with_previews(3501, 1));
  // A watch subscribes before it replays: the chunks that had not started when its first event came are checked.
  std::vector<pb::JobEvent> events;
  std::atomic<bool> attached{false};
  std::thread watcher([&] {
    events = watch_until(server_->client(), job.job_id(), 0, [&](const pb::JobEvent& e) {
      attached = true;
      return finished(e);
    }, 120);
  });
  while (!attached) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const int first_checked = get_job(server_->client(), job.job_id()).chunks_done() + 1;
  watcher.join();
  ASSERT_FALSE(events.empty());
  ASSERT_TRUE(events.back().has_finished());
  ASSERT_EQ(events.back().finished().job().state(), pb::JOB_STATE_SUCCEEDED);

  std::map<int, int> previews_of;  // chunk -> previews seen while it ran
  std::set<int> running, done;
  uint64_t last_sequence = 0;
  for (const pb::JobEvent& e : events) {
    if (e.has_preview()) {
      const pb::ChunkPreview& p = e.preview();
      EXPECT_EQ(e.sequence(), 0u) << "a preview is not in the job's log";
      EXPECT_TRUE(running.count(p.chunk_index()) && !done.count(p.chunk_index()))
          << "preview of chunk " << p.chunk_index() << " outside its run";
      EXPECT_EQ(p.mime_type(), "image/png");
      EXPECT_EQ(p.frame_width(), 48 / 8);
      EXPECT_EQ(p.frame_height(), 32 / 8);
      EXPECT_GE(p.step(), 1);
      EXPECT_LE(p.step(), p.steps());
      const video::DecodedVideo image =
          video::read_video_bytes(std::vector<uint8_t>(p.image().begin(), p.image().end()));
      EXPECT_EQ(image.frames.sizes(), (std::vector<int64_t>{1, p.frame_height(),
                                                            (p.latent_frame_end() - p.latent_frame_begin()) *
                                                                p.frame_width(),
                                                            3}));
      ++previews_of[p.chunk_index()];
      continue;
    }
    EXPECT_GT(e.sequence(), last_sequence);
    last_sequence = e.sequence();
    if (e.has_chunk_started()) running.insert(e.chunk_started().chunk_index());
    if (e.has_chunk_finished()) {
      done.insert(e.chunk_finished().chunk_index());
      const int chunk = e.chunk_finished().chunk_index();
      if (chunk >= first_checked) {
        EXPECT_GE(previews_of[chunk], 1) << "chunk " << chunk;
      }
    }
  }
  EXPECT_EQ(done.size(), 4u);

  // The same request without previews: the same latents, bit for bit.
  const at::Tensor with = download_latents(server_->client(), job.job_id());
  const pb::Job plain = submit(server_->client(), with_previews(3501, 0));
  ASSERT_EQ(wait_job(server_->client(), plain.job_id()).state(), pb::JOB_STATE_SUCCEEDED);
  const at::Tensor without = download_latents(server_->client(), plain.job_id());
  EXPECT_TRUE(at::equal(with, without));
}

TEST_F(ServedPreviews, PreviewEveryBelowZeroOrBeyondTheStepsIsRefusedNamingIt) {
  for (const int64_t every : {int64_t{-1}, int64_t{7}}) {  // the request has 6 steps
    const grpc::Status status = submit_status(server_->client(), with_previews(3502, every));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << every;
    EXPECT_NE(status.error_message().find("preview_every"), std::string::npos) << status.error_message();
  }
  EXPECT_TRUE(submit_status(server_->client(), with_previews(3502, 6)).ok());
}

TEST_F(ServedPreviews, AWatcherThatSkipsPreviewsGetsNoneAndSkyreelsWatchWritesThemAsPngFiles) {
  const pb::Job job = submit(server_->client(), with_previews(3503, 10, 20));  // rows 10 and 20 of each chunk
  const std::string dir = temp_dir("watch-previews");
  std::string output;
  const int rc = run_command(std::string(SKYREELS_BIN_DIR) + "/skyreels watch " + job.job_id() + " --server " +
                                 server_->address() + " --no-progress --previews " + dir + " 2>&1",
                             &output);
  EXPECT_EQ(rc, 0) << output;
  // What it wrote are previews of the rows asked for (a watcher that joins late or falls behind skips some).
  int written = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name.size() == 20 && name.rfind("chunk00", 0) == 0 &&
                (name.substr(8) == "_row0009.png" || name.substr(8) == "_row0019.png"))
        << name;
    EXPECT_EQ(video::read_video(entry.path().string()).frames.size(1), 32 / 8) << name;
    ++written;
  }
  EXPECT_GE(written, 1) << output;

  pb::WatchJobRequest request;
  request.set_job_id(job.job_id());
  request.set_skip_previews(true);
  auto ctx = server_->client().context(30);
  auto reader = server_->client().stub().WatchJob(ctx.get(), request);
  pb::JobEvent event;
  int events = 0;
  while (reader->Read(&event)) {
    EXPECT_FALSE(event.has_preview());
    ++events;
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_GT(events, 3);
}

}  // namespace
}  // namespace skyreels::test
