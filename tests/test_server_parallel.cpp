// One video on several devices, served (issue 43): a replica is a group of devices (--devices grouped by
// --parallel cfg=C,ulysses=U), its ranks threads of the server joined by c10d Gloo; the scheduler, GetServerInfo and
// the chunk retries treat the group as one replica. Videos are compared with `skyreels generate` on one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

constexpr double kAtol = 1e-5;  // the same math split over ranks: float32 reductions may round differently

pb::ServerInfo server_info(ServerProcess& server) {
  auto ctx = server.client().context(10);
  pb::ServerInfo info;
  EXPECT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  return info;
}

TEST(ServedParallel, AFourCpuCfg2Ulysses2ReplicaServesALongVideoEqualToOneDeviceAndIsListedAsOneGroup) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu,cpu,cpu", "--parallel", "cfg=2,ulysses=2", "--dtype",
                        "float32"});
  const pb::ServerInfo info = server_info(server);
  ASSERT_EQ(info.replicas_size(), 1);
  const pb::ReplicaInfo& group = info.replicas(0);
  EXPECT_EQ(group.name(), "cpu:0+cpu:1+cpu:2+cpu:3");
  EXPECT_EQ(group.parallel(), "cfg=2,ulysses=2");
  ASSERT_EQ(group.devices_size(), 4);
  for (const auto& d : group.devices()) EXPECT_EQ(d, "cpu");

  const pb::SubmitJobRequest request = long_video_request(4301);  // 4 chunks, guidance 5
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id(), 180s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  const at::Tensor served = download_latents(server.client(), job.job_id());
  const at::Tensor one_device = reference_latents(request);
  EXPECT_LE(max_abs_diff(served, one_device), kAtol);
  std::printf("[ served cfg=2,ulysses=2 ] max |diff| to one device = %.3g\n", max_abs_diff(served, one_device));
  const std::string metrics = http_get(server.metrics_port(), "/metrics");
  EXPECT_EQ(metric_value(metrics, "skyreels_chunk_duration_seconds_count{replica=\"cpu:0+cpu:1+cpu:2+cpu:3\"}"), 4)
      << "the group ran the 4 chunks as one replica";
}

TEST(ServedParallel, AGroupWithShardedWeightsServesTheSameVideo) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--parallel", "cfg=2", "--shard-weights", "--dtype",
                        "float32"});
  const pb::SubmitJobRequest request = long_video_request(4304);
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id(), 180s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_LE(max_abs_diff(download_latents(server.client(), job.job_id()), reference_latents(request)), kAtol);
  EXPECT_NE(server.log().find("event=weights_sharded ranks=2"), std::string::npos) << server.log();
}

TEST(ServedParallel, ARankThatThrowsMidChunkFailsTheChunkItIsRetriedAndTheVideoEqualsAnUninterruptedRun) {
  // Rank 1's second chunk run throws after its first row; rank 0 is then waiting on it in an exchange.
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--parallel", "ulysses=2", "--dtype", "float32",
                        "--enable-test-hooks", "--fault-inject", "cpu:0+cpu:1@2#1", "--collective-timeout-seconds",
                        "60"});
  const pb::SubmitJobRequest request = long_video_request(4302);
  const auto start = std::chrono::steady_clock::now();
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id(), 180s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(job.retries(), 1);
  EXPECT_TRUE(all_close(download_latents(server.client(), job.job_id()), reference_latents(request), kAtol));
  // Rank 0 did not wait out the 60 s timeout: its peer's group went away with the fault.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 55s);
  const std::string log = server.log();
  EXPECT_NE(log.find("injected fault (--fault-inject) on replica cpu:0+cpu:1"), std::string::npos) << log;
  const pb::ServerInfo info = server_info(server);
  ASSERT_EQ(info.replicas_size(), 1);
  EXPECT_TRUE(info.replicas(0).healthy()) << "the group came back after its re-test";
  EXPECT_EQ(info.replicas(0).failures(), 1);
}

TEST(ServedParallel, ARankThatStallsFailsItsPeersAfterTheCollectiveTimeoutAndTheJobStillSucceeds) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--parallel", "ulysses=2", "--dtype", "float32",
                        "--enable-test-hooks", "--fault-inject", "cpu:0+cpu:1@1:stall#1",
                        "--collective-timeout-seconds", "2"});
  const pb::SubmitJobRequest request = long_video_request(4303);
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id(), 180s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(job.retries(), 1);
  EXPECT_TRUE(all_close(download_latents(server.client(), job.job_id()), reference_latents(request), kAtol));
}

TEST(ServedParallel, LayoutsThatCannotWorkStopTheStartWithExitCode2NamingTheFlag) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--devices", "cpu,cpu,cpu", "--parallel", "ulysses=2"}, "--devices: 3 device(s) cannot be grouped"},
      {{"--devices", "cpu,cpu,cpu,cpu", "--parallel", "ulysses=4"},
       "--parallel: ulysses=4 does not divide the 2 attention heads of this model (degrees that do: 1, 2)"},
      {{"--devices", "cpu,cpu", "--parallel", "cfg=2,tp=2"}, "--parallel: unknown item 'tp=2'"},
      {{"--devices", "cpu,cpu", "--parallel", "ulysses=0"}, "--parallel: ulysses=0"},
      {{"--devices", "cpu", "--shard-weights"}, "--shard-weights: needs a replica of more than one device"},
      {{"--devices", "cpu,cpu", "--parallel", "ulysses=2", "--enable-test-hooks", "--fault-inject",
        "cpu:0+cpu:1@1#2"},
       "--fault-inject: rank 2 of replica 'cpu:0+cpu:1' does not exist"},
  };
  for (const auto& [flags, expected] : cases) {
    std::vector<std::string> args{"--demo"};
    args.insert(args.end(), flags.begin(), flags.end());
    ServerProcess server(args, /*wait_ready=*/false);
    EXPECT_EQ(server.wait_exit(60s), 2) << expected;
    EXPECT_NE(server.log().find(expected), std::string::npos) << server.log();
  }
}

}  // namespace
}  // namespace skyreels::test
