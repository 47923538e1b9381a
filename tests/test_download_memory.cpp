// Issue 36, part 2: a download holds a bounded piece of the result, whatever the video's size. 100 HTTP clients
// (GET /v1/videos/{id}/content) and 100 gRPC DownloadResult streams read a large video slowly (a few KiB, then a
// pause) at once: the server's resident memory grows by less than 64 MiB + 1 MiB per reader, the probes answer
// meanwhile, and every reader finally gets the exact bytes. The real binary on 127.0.0.1 (test_server_harness).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;
using namespace std::chrono_literals;

const std::string kKey = "download-key-0123456789abcdef012345678";
constexpr int kHttpReaders = 100;
constexpr int kGrpcReaders = 100;
constexpr int64_t kAllowedGrowth = (64LL << 20) + (kHttpReaders + kGrpcReaders) * (1LL << 20);

// One slow HTTP download: a small receive buffer, a few KiB read, then a pause until `go` (bounded by `until`), then
// the rest. Returns the body ("" on failure).
std::string slow_http_download(int port, const std::string& id, std::atomic<int>* started, const std::atomic<bool>& go,
                               std::chrono::steady_clock::time_point until) {
  const int fd = connect_loopback(port, 4096);
  if (fd < 0) return "";
  const std::string request = "GET /v1/videos/" + id + "/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey +
                              "\r\nConnection: close\r\n\r\n";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string answer;
  char buffer[4096];
  bool counted = false;
  while (std::chrono::steady_clock::now() < until) {
    if (!go && counted) {  // the pause: nothing read, the server's writes back up
      std::this_thread::sleep_for(20ms);
      continue;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, go ? sizeof buffer : 1024, 0);
    if (n <= 0) break;
    answer.append(buffer, static_cast<size_t>(n));
    if (!counted && answer.size() >= 4096) {  // a few KiB in: this reader now pauses
      counted = true;
      ++*started;
    }
  }
  ::close(fd);
  const size_t end = answer.find("\r\n\r\n");
  if (answer.rfind("HTTP/1.1 200", 0) != 0 || end == std::string::npos) return "";
  return answer.substr(end + 4);
}

// One slow gRPC download of the MP4: the first part, a pause until `go`, then the rest.
std::string slow_grpc_download(ServerProcess& server, const std::string& id, std::atomic<int>* started,
                               const std::atomic<bool>& go, std::chrono::steady_clock::time_point until) {
  auto client = server.client_with_key(kKey);
  auto ctx = client->context(600);
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(pb::RESULT_FORMAT_MP4);
  request.set_no_wait(true);
  auto reader = client->stub().DownloadResult(ctx.get(), request);
  std::string bytes;
  pb::ResultPart part;
  bool counted = false;
  while (reader->Read(&part)) {
    bytes += part.data();
    if (!counted) {
      counted = true;
      ++*started;
      while (!go && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
    }
  }
  const grpc::Status status = reader->Finish();
  return status.ok() ? bytes : "";
}

// GET `path` with `header` (whole answer until the server closes; Connection: close).
std::string get_with(int port, const std::string& path, const std::string& header) {
  return send_raw_http(port,
                       "GET " + path + " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey + "\r\n" + header +
                           "\r\nConnection: close\r\n\r\n",
                       120)
      .bytes;
}

TEST(DownloadMemory, TwoHundredSlowReadersOfALargeVideoHoldABoundedPieceEach) {
  const std::string dir = temp_dir("download-memory");
  std::ofstream(dir + "/keys") << kKey << " download-client\n";
  const int http_port = free_port();
  ServerProcess server({"--demo", "--vae", "demo", "--devices", "cpu", "--dtype", "float32", "--api-keys",
                        dir + "/keys", "--http-listen", "127.0.0.1:" + std::to_string(http_port),
                        "--http-idle-timeout-seconds", "300", "--max-streams", "400", "--max-streams-per-client",
                        "400"},
                       true, kKey);
  // A large video: 4 chunks at 832x480; the demo's noise compresses badly, so its MP4 is about 9 MiB.
  pb::SubmitJobRequest request = long_video_request(5, 1, 1.0);
  request.mutable_spec()->mutable_params()->set_width(832);
  request.mutable_spec()->mutable_params()->set_height(480);
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id(), 600s);
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();

  // The reference bytes (this download also makes the segments), and the memory with them made.
  std::atomic<int> ignored{0};
  std::atomic<bool> at_once{true};
  const std::string reference =
      slow_grpc_download(server, job.job_id(), &ignored, at_once, std::chrono::steady_clock::now() + 600s);
  ASSERT_GT(reference.size(), size_t{4} << 20) << "the video is too small to tell a copy per reader from none";
  ASSERT_EQ(slow_http_download(http_port, job.job_id(), &ignored, at_once, std::chrono::steady_clock::now() + 600s),
            reference);
  // DownloadResult's sizes_only (each chunk's size, no data) and from_offset (a start within from_chunk's blob).
  std::vector<uint64_t> sizes;
  {
    auto ctx = server.client().context(120);
    pb::DownloadResultRequest sized;
    sized.set_job_id(job.job_id());
    sized.set_format(pb::RESULT_FORMAT_MP4);
    sized.set_no_wait(true);
    sized.set_sizes_only(true);
    auto reader = server.client().stub().DownloadResult(ctx.get(), sized);
    pb::ResultPart part;
    while (reader->Read(&part)) {
      EXPECT_TRUE(part.data().empty());
      EXPECT_TRUE(part.last_part());
      EXPECT_EQ(part.chunk_index(), static_cast<int32_t>(sizes.size()));
      sizes.push_back(part.chunk_bytes());
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  ASSERT_EQ(sizes.size(), 4u);
  EXPECT_EQ(sizes[0] + sizes[1] + sizes[2] + sizes[3], reference.size());
  const auto download_from = [&](int32_t chunk, uint64_t offset, grpc::Status* status) {
    auto ctx = server.client().context(120);
    pb::DownloadResultRequest from;
    from.set_job_id(job.job_id());
    from.set_format(pb::RESULT_FORMAT_MP4);
    from.set_no_wait(true);
    from.set_from_chunk(chunk);
    from.set_from_offset(offset);
    auto reader = server.client().stub().DownloadResult(ctx.get(), from);
    std::string bytes;
    pb::ResultPart part;
    while (reader->Read(&part)) bytes += part.data();
    *status = reader->Finish();
    return bytes;
  };
  grpc::Status status;
  EXPECT_TRUE(download_from(1, 1000, &status) == reference.substr(sizes[0] + 1000));
  EXPECT_TRUE(status.ok()) << status.error_message();
  download_from(1, sizes[1], &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();

  // Byte ranges, read from the store a piece at a time across the segments' boundaries, are the reference's bytes.
  const std::string path = "/v1/videos/" + job.job_id() + "/content";
  const size_t size = reference.size();
  for (const size_t first : {size_t{0}, size / 5, size / 3, size / 2, size - (3 << 20)}) {
    const size_t last = std::min(size - 1, first + (3 << 20) - 1);
    const std::string range = "bytes=" + std::to_string(first) + "-" + std::to_string(last);
    const std::string answer = get_with(http_port, path, "Range: " + range);
    ASSERT_EQ(answer.rfind("HTTP/1.1 206", 0), 0u) << range << ": " << answer.substr(0, 300);
    EXPECT_NE(answer.find("Content-Range: bytes " + std::to_string(first) + "-" + std::to_string(last) + "/" +
                          std::to_string(size)),
              std::string::npos)
        << answer.substr(0, 300);
    EXPECT_TRUE(answer.substr(answer.find("\r\n\r\n") + 4) == reference.substr(first, last - first + 1)) << range;
  }
  const std::string tail = get_with(http_port, path, "Range: bytes=-100");
  EXPECT_TRUE(tail.substr(tail.find("\r\n\r\n") + 4) == reference.substr(size - 100));
  EXPECT_EQ(get_with(http_port, path, "Range: bytes=" + std::to_string(size) + "-").rfind("HTTP/1.1 416", 0), 0u);

  std::this_thread::sleep_for(500ms);
  const int64_t before = resident_bytes(server.pid());
  ASSERT_GT(before, 0);

  RssSampler sampler(server.pid());
  std::atomic<int> started{0};
  std::atomic<bool> go{false};
  const auto until = std::chrono::steady_clock::now() + 900s;  // a bound on the whole test, never reached when it passes
  std::vector<std::string> got(kHttpReaders + kGrpcReaders);
  std::vector<std::thread> readers;
  // Every reader of a group has read its first piece and pauses; the server holds what it holds for them.
  const auto wait_started = [&](int count) {
    const auto by = std::chrono::steady_clock::now() + 300s;
    while (started < count && std::chrono::steady_clock::now() < by) std::this_thread::sleep_for(50ms);
    EXPECT_EQ(started.load(), count) << "not every reader started";
    std::this_thread::sleep_for(3s);  // let what is held settle (sampled meanwhile)
  };
  for (int i = 0; i < kHttpReaders; ++i) {
    readers.emplace_back([&, i] { got[i] = slow_http_download(http_port, job.job_id(), &started, go, until); });
  }
  wait_started(kHttpReaders);
  const int64_t http_peak = sampler.peak();
  for (int i = 0; i < kGrpcReaders; ++i) {
    readers.emplace_back(
        [&, i] { got[kHttpReaders + i] = slow_grpc_download(server, job.job_id(), &started, go, until); });
  }
  wait_started(kHttpReaders + kGrpcReaders);
  // The probes answer meanwhile.
  int probe = 0;
  http_get(http_port, "/healthz", &probe);
  EXPECT_EQ(probe, 200);
  EXPECT_EQ(health_status(server.address(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(health_status(server.address(), "liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  const int64_t paused_peak = sampler.peak();

  go = true;  // now everyone reads the rest
  for (std::thread& t : readers) t.join();
  sampler.stop();
  int exact = 0;
  for (const std::string& bytes : got) exact += bytes == reference ? 1 : 0;
  EXPECT_EQ(exact, kHttpReaders + kGrpcReaders) << "readers that did not get the exact video";

  const double mib = 1 << 20;
  std::printf("[ download-memory ] video %.1f MiB; RSS before %.0f MiB; %d paused HTTP readers +%.0f MiB; and %d paused "
              "gRPC readers +%.0f MiB in all; peak overall (the rest read at full speed) +%.0f MiB; bound +%.0f MiB\n",
              reference.size() / mib, before / mib, kHttpReaders, (http_peak - before) / mib, kGrpcReaders,
              (paused_peak - before) / mib, (sampler.peak() - before) / mib, kAllowedGrowth / mib);
  EXPECT_LT(sampler.peak() - before, kAllowedGrowth);
}

}  // namespace
}  // namespace skyreels::test
