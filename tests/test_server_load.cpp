// A bounded loopback load test: many concurrent clients against one skyreels-server (two CPU replicas, a small
// queue so that back-pressure happens), every job accounted for.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "tests/test_server_harness.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

constexpr int kClients = 16;
constexpr int kJobsPerClient = 4;

pb::SubmitJobRequest small_job(uint64_t seed) {
  pb::SubmitJobRequest request = long_video_request(seed, 2);
  if (seed % 2 == 0) {  // half of them single-chunk videos
    request.mutable_spec()->mutable_params()->set_num_frames(17);
  }
  return request;
}

TEST(ServerLoad, ManyConcurrentClientsEveryJobAccountedFor) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--max-queue", "8", "--log-level", "warn"});
  std::mutex mu;
  std::map<std::string, pb::Job> finished;  // job id -> final state
  std::atomic<int> queue_full{0};
  std::atomic<int> errors{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      server::ConnectionOptions options;
      options.server = server.address();
      server::Client client(options);
      for (int j = 0; j < kJobsPerClient; ++j) {
        const pb::SubmitJobRequest request = small_job(static_cast<uint64_t>(c * 100 + j));
        pb::SubmitJobResponse response;
        grpc::Status status;
        for (int attempt = 0; attempt < 600; ++attempt) {  // back off while the queue is full
          auto ctx = client.context(30);
          status = client.stub().SubmitJob(ctx.get(), request, &response);
          if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
          ++queue_full;
          std::this_thread::sleep_for(20ms);  // the server hints >= 1 s; the test backs off less to stay fast
        }
        if (!status.ok()) {
          ++errors;
          ADD_FAILURE() << "client " << c << " job " << j << ": " << server::describe(status);
          continue;
        }
        const pb::Job job = wait_job(client, response.job().job_id());
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_TRUE(finished.emplace(job.job_id(), job).second) << "job id handed out twice: " << job.job_id();
      }
    });
  }
  for (auto& t : clients) t.join();

  EXPECT_EQ(errors.load(), 0);
  ASSERT_EQ(finished.size(), static_cast<size_t>(kClients * kJobsPerClient));
  int chunks = 0;
  for (const auto& [id, job] : finished) {
    EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << id << ": " << job.error().message();
    chunks += job.chunks_done();
  }

  // The server's own books agree: ListJobs and the metrics count every job exactly once.
  std::set<std::string> listed;
  std::string token;
  do {
    pb::ListJobsRequest request;
    request.set_page_size(25);
    request.set_page_token(token);
    pb::ListJobsResponse response;
    auto ctx = server.client().context(10);
    ASSERT_TRUE(server.client().stub().ListJobs(ctx.get(), request, &response).ok());
    for (const auto& j : response.jobs()) {
      listed.insert(j.job_id());
      EXPECT_EQ(j.state(), pb::JOB_STATE_SUCCEEDED);
    }
    token = response.next_page_token();
  } while (!token.empty());
  EXPECT_EQ(listed.size(), finished.size());

  const std::string text = http_get(server.metrics_port(), "/metrics");
  EXPECT_EQ(metric_value(text, "skyreels_jobs_submitted_total"), kClients * kJobsPerClient);
  EXPECT_EQ(metric_value(text, "skyreels_jobs_finished_total{outcome=\"succeeded\"}"), kClients * kJobsPerClient);
  EXPECT_EQ(metric_value(text, "skyreels_jobs_rejected_total{reason=\"queue_full\"}"), queue_full.load());
  EXPECT_EQ(metric_value(text, "skyreels_queue_depth"), 0);
  EXPECT_EQ(metric_value(text, "skyreels_jobs_running"), 0);
  EXPECT_EQ(metric_value(text, "skyreels_chunk_duration_seconds_count{replica=\"cpu:0\"}") +
                metric_value(text, "skyreels_chunk_duration_seconds_count{replica=\"cpu:1\"}"),
            chunks);
  std::cout << "load: " << finished.size() << " jobs, " << chunks << " chunks, " << queue_full.load()
            << " queue-full answers, handoffs " << metric_value(text, "skyreels_chunk_handoffs_total") << "\n";
}

}  // namespace
}  // namespace skyreels::test
