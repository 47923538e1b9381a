// Issue 14, the real skyreels-server on a PostgreSQL job store as a single pod: the store named through
// $SKYREELS_JOB_STORE (so the URL and its password are in neither the process list nor the log), killed with SIGKILL
// after chunk 2 and restarted on the same database: the job resumes at its first uncommitted chunk and its latents
// equal the uninterrupted single-process result bit for bit (the SQLite scenario of tests/test_server_store.cpp).
// An unreachable store stops the start, naming it without its password.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/pg_fixture.h"
#include "tests/test_server_harness.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

// One replica (all cores, float32) as `skyreels generate` runs, slowed so that a kill lands mid-job; no --job-store.
// A short lease: the chunk the killed pod held is taken over 2 s after its last heartbeat.
std::vector<std::string> pod_args(int step_delay_ms = 60) {
  return {"--demo", "--devices", "cpu", "--dtype", "float32", "--enable-test-hooks", "--step-delay-ms",
          std::to_string(step_delay_ms), "--lease-seconds", "2"};
}

// $SKYREELS_JOB_STORE for the servers this test starts, unset again at the end of the test.
class StoreEnv {
 public:
  explicit StoreEnv(const std::string& spec) { setenv("SKYREELS_JOB_STORE", spec.c_str(), 1); }
  ~StoreEnv() { unsetenv("SKYREELS_JOB_STORE"); }
};

// trust authentication: the password is accepted and never checked, but it must never show.
std::string url_with_password(const PgServer& pg) {
  return "postgresql://postgres:s3cret-pw@/postgres?host=" + pg.dir();
}

std::string cmdline_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

TEST(PostgresPod, KilledAfterChunkTwoResumesAtChunkThreeAndEqualsGenerate) {
  PgServer pg;
  StoreEnv env(url_with_password(pg));
  pb::SubmitJobRequest request = long_video_request(1401);
  request.mutable_spec()->mutable_params()->set_num_frames(57);  // six chunks
  std::string id;
  uint64_t last_seen = 0;
  {
    ServerProcess server(pod_args());
    const std::string cmdline = cmdline_of(server.pid());
    EXPECT_EQ(cmdline.find("postgresql://"), std::string::npos) << "the store URL is in the process list";
    EXPECT_EQ(cmdline.find("s3cret-pw"), std::string::npos) << "the password is in the process list";
    id = submit(server.client(), request).job_id();
    const auto events = watch_until(server.client(), id, 0, [](const pb::JobEvent& e) {
      return e.has_chunk_finished() && e.chunk_finished().chunk_index() == 2;
    });
    ASSERT_FALSE(events.empty());
    ASSERT_TRUE(events.back().has_chunk_finished()) << "the job ended before chunk 2 finished";
    last_seen = events.back().sequence();
    server.signal(SIGKILL);
    ASSERT_NE(server.wait_exit(10s), -1) << "the server did not die";
    EXPECT_NE(server.log().find("postgres:***@"), std::string::npos) << "the log does not name the store";
    EXPECT_EQ(server.log().find("s3cret-pw"), std::string::npos) << "the password is in the log";
  }

  ServerProcess restarted(pod_args());
  const int64_t resume_chunk = get_job(restarted.client(), id).chunks_done();
  EXPECT_GE(resume_chunk, 3) << "committed chunks are lost";
  EXPECT_LE(resume_chunk, 4);  // chunk 3 may have committed between the event and the kill
  const auto after = watch_until(restarted.client(), id, last_seen, [](const pb::JobEvent& e) { return e.has_finished(); });
  ASSERT_FALSE(after.empty());
  EXPECT_GT(after.front().sequence(), last_seen);
  int64_t first_started = -1;
  for (const auto& e : after) {
    if (e.has_chunk_finished()) {
      EXPECT_GE(e.chunk_finished().chunk_index(), 3);
    }
    if (e.has_chunk_started() && first_started < 0) first_started = e.chunk_started().chunk_index();
  }
  EXPECT_EQ(first_started, resume_chunk) << "the resumed job did not start at its first uncommitted chunk";
  ASSERT_TRUE(after.back().has_finished());
  const pb::Job done = after.back().finished().job();
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  EXPECT_EQ(done.chunks_done(), 6);

  const at::Tensor expected = reference_latents(request);
  const at::Tensor served = download_latents(restarted.client(), id);
  ASSERT_TRUE(served.defined());
  EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - generate| = " << (served - expected).abs().max().item<double>();
}

TEST(PostgresPod, AnUnreachableStoreStopsTheStartNamingItWithoutThePassword) {
  PgServer pg;
  pg.stop();
  StoreEnv env(url_with_password(pg));
  ServerProcess server(pod_args(), false);
  const int status = server.wait_exit(60s);
  EXPECT_GT(status, 0) << "the server started without its store (-1: it still runs)";
  const std::string log = server.log();
  EXPECT_NE(log.find("postgresql://postgres:***@/postgres"), std::string::npos) << log;
  EXPECT_EQ(log.find("s3cret-pw"), std::string::npos) << log;
}

}  // namespace
}  // namespace skyreels::test
