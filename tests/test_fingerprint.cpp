// Idempotency fingerprints are stored with their jobs: a retry after an upgrade must still match its job, so the
// values are pinned here (taken before the fingerprint moved to server/job/fingerprint.h, issue 42).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/api/codec.h"
#include "server/job/fingerprint.h"
#include "server/replica/model_job.h"
#include "skyreels/v1/video_service.pb.h"
#include "tests/job_requests.h"

namespace skyreels::server {
namespace {

namespace pb = skyreels::v1;

// Every part of a request the fingerprint reads.
JobRequest every_part() {
  JobRequest r = test_requests::long_video();
  r.embeddings_safetensors = std::string("safetensors bytes");
  r.prompt = "A dog runs.";
  r.negative_prompt = "blurry";
  r.image = PixelRequest{std::string("png bytes"), std::nullopt};
  r.video = PixelRequest{std::nullopt, test_requests::embeddings(2, 4, 3)};
  r.prompt_changes.push_back({17, test_requests::embeddings(8, 32, 4), std::nullopt, std::string("A cat")});
  r.sampler = "euler";
  r.timesteps = {1000, 750, 500, 250};
  return r;
}

TEST(Fingerprint, TheRequestsValuesStayAsStored) {
  const std::vector<AdapterChoice> adapters = {{"style", 0.5, "ab12"}, {"light", std::nullopt, "cd34"}};
  const Fingerprint f = request_fingerprint(every_part(), adapters);
  EXPECT_EQ(f.v1, 0x26171bf93f7a1c57ULL);
  EXPECT_EQ(f.v2, "sha256:20d787ff665206f19f1276ef8b83eb89607ab53389021004f1d2c5215c0bb3c6");

  ModelDescription model;
  model.config.text_dim = 32;
  const auto job = ModelJob::create(test_requests::long_video(), model, ServerLimits{}, 1);
  EXPECT_EQ(job->fingerprint(), 0x0b286e0860f1df98ULL);
  EXPECT_EQ(job->fingerprint_v2(), "sha256:9fe9006ef741d5b5331e603eec9e2a3c732ea029c379f57011cc202771633825");
}

TEST(Fingerprint, TheSubmissionsValuesStayAsStored) {
  ModelDescription model;
  model.config.text_dim = 32;
  const auto job = ModelJob::create(test_requests::long_video(), model, ServerLimits{}, 1);
  const Fingerprint request{job->fingerprint(), job->fingerprint_v2()};
  struct Case {
    pb::SubmitJobRequest submit;
    uint64_t v1;
    std::string v2;
  };
  std::vector<Case> cases(3);
  cases[0] = {{}, 0xc74a54f018c28b7fULL, "sha256:e3f09b6c898eadb6f45c01e9a7bd931005b5f8579a28d2b6fd122bb7585dd429"};
  cases[1] = {{}, 0x4eb822928dca49f8ULL, "sha256:e87a9ea814fb5eebaea25b7021e012e4a6195763ac371c1273715059b96197a5"};
  cases[1].submit.set_priority(-7);
  cases[1].submit.mutable_timeout()->set_seconds(90);
  cases[1].submit.mutable_timeout()->set_nanos(5);
  cases[2] = {{}, 0x27aa77260d38608aULL, "sha256:06dbfbf84a5d9a5be3cd74d1b9c9b4dda259b1aa0404762d2b13c6db9afbba3b"};
  cases[2].submit.set_priority(4);
  cases[2].submit.mutable_deadline()->set_seconds(1700000000);
  cases[2].submit.mutable_deadline()->set_nanos(-3);
  for (const Case& c : cases) {
    const Fingerprint f = submission_fingerprint(request, api::submission_terms(c.submit));
    EXPECT_EQ(f.v1, c.v1) << c.submit.ShortDebugString();
    EXPECT_EQ(f.v2, c.v2) << c.submit.ShortDebugString();
  }
}

}  // namespace
}  // namespace skyreels::server
