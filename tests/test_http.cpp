// The HTTP door (--http-listen): OpenAI's Videos API driven by the official `openai` npm package (tests/http), the
// probes and /metrics, and hostile HTTP clients. The server is the real binary on 127.0.0.1 (test_server_harness).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "model/umt5_encoder.h"
#include "model/video_mp4.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;

const std::string kKey = "http-key-0123456789abcdef0123456789ab";

// One connection from `source` (e.g. 127.0.0.2, another client address on loopback) to 127.0.0.1:port, or -1.
int connect_from(int port, const char* source = nullptr) { return connect_loopback(port, 0, source); }

// Everything the server sends until it closes the connection or `seconds` pass.
std::string read_all(int fd, double seconds) {
  std::string out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  char buffer[65536];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// Sends `raw` (a whole request, "Connection: close" in it) and returns the answer.
std::string http_exchange(int port, const std::string& raw, double seconds = 10, const char* source = nullptr) {
  const int fd = connect_from(port, source);
  if (fd < 0) return "";
  size_t sent = 0;
  while (sent < raw.size()) {
    const ssize_t n = ::send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  const std::string answer = read_all(fd, seconds);
  ::close(fd);
  return answer;
}

int status_of(const std::string& answer) {
  if (answer.rfind("HTTP/1.", 0) != 0 || answer.size() < 12) return -1;
  return std::atoi(answer.substr(9, 3).c_str());
}

std::string body_of(const std::string& answer) {
  const size_t end = answer.find("\r\n\r\n");
  return end == std::string::npos ? "" : answer.substr(end + 4);
}

std::string post(const std::string& path, const std::string& content_type, const std::string& body,
                 const std::string& key = kKey) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer " + key +
         "\r\nContent-Type: " + content_type + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
         body;
}

std::string get(const std::string& path) {
  return "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer " + kKey +
         "\r\n\r\n";
}

class HttpServerTest : public ::testing::Test {
 protected:
  static void start_server() {
    const std::string dir = temp_dir("http");
    std::ofstream(dir + "/keys") << kKey << " http-client\n";
    encoder_dir_ = new std::string(temp_dir("http-umt5"));
    model::write_tiny_text_encoder(*encoder_dir_, 32, 7);  // d_model = the demo transformer's text_dim
    http_port_ = free_port();
    server_ = start_suite_server([&] {
      return std::make_unique<ServerProcess>(std::vector<std::string>
        {"--demo", "--vae", "demo", "--devices", "cpu", "--dtype", "float32", "--text-encoder", *encoder_dir_,
         "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"), "--api-keys", dir + "/keys",
         "--http-listen", "127.0.0.1:" + std::to_string(http_port_), "--http-idle-timeout-seconds", "2",
         "--max-streams-per-client", "8"},
        true, kKey);
    });
  }
  void SetUp() override {
    if (!std::exchange(started_, true)) start_server();
    expect_suite_server(server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    started_ = false;
    delete encoder_dir_;
  }
  static inline ServerProcess* server_ = nullptr;
  static inline bool started_ = false;
  static inline std::string* encoder_dir_ = nullptr;
  static inline int http_port_ = 0;
};

TEST_F(HttpServerTest, TheOfficialOpenAiSdkMakesListsDownloadsAndDeletesVideos) {
  const std::string tests = data_path("..");
  ASSERT_TRUE(std::filesystem::exists(tests + "/http/node_modules/openai/package.json"))
      << "the openai npm package is not installed: run scripts/test.sh (npm ci --prefix tests/http)";
  const std::string out = temp_dir("http-sdk");
  const std::string command = "cd " + tests + "/http && SKYREELS_HTTP_URL=http://127.0.0.1:" +
                              std::to_string(http_port_) + " SKYREELS_API_KEY=" + kKey + " SKYREELS_OUT=" + out +
                              " timeout 240 node openai_sdk.test.mjs > " + out + "/node.log 2>&1";
  const int rc = std::system(command.c_str());
  std::ifstream log(out + "/node.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << text << "\nserver log:\n" << server_->log();

  // The MP4s decode with FFmpeg to the video's frames: 2 s at 8 fps = 17.
  for (const char* name : {"plain.mp4", "reference.mp4"}) {
    const auto video = video::read_video(out + "/" + name);
    EXPECT_EQ(video.info.frames, 17) << name;
    EXPECT_EQ(video.info.width, 48) << name;
    EXPECT_EQ(video.info.height, 32) << name;
  }
  {
    const auto video = video::read_video(out + "/extended.mp4");  // the continued 9 frames and 16 new ones
    EXPECT_EQ(video.info.frames, 25);
    EXPECT_EQ(video.info.width, 48);
    EXPECT_EQ(video.info.height, 32);
  }

  const auto thumbnail = video::read_video(out + "/thumbnail.png");
  EXPECT_EQ(thumbnail.info.frames, 1);
  EXPECT_EQ(thumbnail.info.width, 48);
  EXPECT_EQ(thumbnail.info.height, 32);

  // HTTP and gRPC make the same video from the same request: the latents are equal bit for bit.
  std::ifstream ids_file(out + "/ids.json");
  const auto ids = nlohmann::json::parse(ids_file);
  pb::SubmitJobRequest request;
  request.mutable_spec()->mutable_text()->set_prompt("A cat walks on the grass, realistic style.");
  auto* p = request.mutable_spec()->mutable_params();
  p->set_width(48);
  p->set_height(32);
  p->set_num_frames(17);
  p->set_fps(8);
  p->set_num_inference_steps(2);
  p->set_seed(7);
  const pb::Job by_grpc = wait_job(server_->client(), submit(server_->client(), request).job_id());
  ASSERT_EQ(by_grpc.state(), pb::JOB_STATE_SUCCEEDED) << by_grpc.error().message();
  const at::Tensor a = download_latents(server_->client(), ids["plain"].get<std::string>());
  const at::Tensor b = download_latents(server_->client(), by_grpc.job_id());
  EXPECT_TRUE(a.equal(b)) << "max |diff| " << (a - b).abs().max().item<double>();
}

TEST_F(HttpServerTest, ProbesAndMetricsAnswerWithoutAKey) {
  const std::string live = http_exchange(http_port_, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(live), 200) << live;
  const std::string ready = http_exchange(http_port_, "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(ready), 200) << ready;
  const std::string metrics = http_exchange(http_port_, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(metrics), 200);
  EXPECT_NE(body_of(metrics).find("skyreels_replicas"), std::string::npos) << body_of(metrics).substr(0, 500);
  // Requests are counted by route template and status.
  EXPECT_GE(metric_value(body_of(metrics), "skyreels_http_requests_total{code=\"200\",route=\"/readyz\"}"), 1);
  EXPECT_GE(metric_value(body_of(metrics), "skyreels_http_request_duration_seconds_count{route=\"/readyz\"}"), 1);
}

TEST_F(HttpServerTest, ErrorsComeInOpenAisShapeWithTheRightStatus) {
  auto error_of = [](const std::string& answer) {
    return nlohmann::json::parse(body_of(answer), nullptr, false);
  };
  const std::string no_key = http_exchange(http_port_, post("/v1/videos", "application/json", R"({"prompt":"x"})", "wrong"));
  EXPECT_EQ(status_of(no_key), 401) << no_key;
  EXPECT_EQ(error_of(no_key)["error"]["type"], "authentication_error");

  const std::string unknown = http_exchange(http_port_, post("/v1/videos", "application/json", R"({"prompt":"x","colour":1})"));
  EXPECT_EQ(status_of(unknown), 400) << unknown;
  EXPECT_EQ(error_of(unknown)["error"]["param"], "colour");

  const std::string bad_field =
      http_exchange(http_port_, post("/v1/videos", "application/json", R"({"prompt":"x","num_inference_steps":"many"})"));
  EXPECT_EQ(status_of(bad_field), 400) << bad_field;

  const std::string no_webhooks = http_exchange(
      http_port_, post("/v1/videos", "application/json", R"({"prompt":"x","webhook_url":"http://127.0.0.1:9/h"})"));
  EXPECT_EQ(status_of(no_webhooks), 400) << no_webhooks;  // this server has no --webhook-secret-file
  EXPECT_EQ(error_of(no_webhooks)["error"]["code"], "failed_precondition");

  const std::string not_json = http_exchange(http_port_, post("/v1/videos", "application/json", "{not json"));
  EXPECT_EQ(status_of(not_json), 400) << not_json;

  const std::string missing = http_exchange(http_port_, get("/v1/videos/nope"));
  EXPECT_EQ(status_of(missing), 404) << missing;
  EXPECT_EQ(error_of(missing)["error"]["type"], "not_found_error");

  const std::string route = http_exchange(http_port_, get("/v2/nothing"));
  EXPECT_EQ(status_of(route), 404) << route;
}

TEST_F(HttpServerTest, JsonBodiesCreateVideosAsFormsDo) {
  const std::string created = http_exchange(
      http_port_, post("/v1/videos", "application/json",
                       R"({"prompt":"A dog runs.","size":"48x32","seconds":2,"fps":8,"num_inference_steps":1,"seed":3})"));
  ASSERT_EQ(status_of(created), 200) << created;
  const auto video = nlohmann::json::parse(body_of(created));
  EXPECT_EQ(video["object"], "video");
  EXPECT_EQ(video["size"], "48x32");
  EXPECT_EQ(video["seconds"], "2");
  EXPECT_EQ(video["skyreels"]["params"]["num_frames"], "17") << "the job's own fields, proto JSON mapping";
  wait_job(server_->client(), video["id"].get<std::string>());
}

// The Euler sampler with LightX2V's 4-step list and no guidance: POST /v1/videos (parameters by name), POST
// /skyreels/v1/jobs (protobuf's JSON mapping) and gRPC make the same latents; a bad list is a 400 naming the field.
TEST_F(HttpServerTest, TheEulerSamplerOverEveryDoorGivesTheSameLatents) {
  const std::string fields =
      R"("size":"48x32","seconds":2,"fps":8,"seed":5,"guidance_scale":1,"flow_shift":5,)"
      R"("scheduler":{"type":"euler","timesteps":[1000,750,500,250]})";
  const std::string created = http_exchange(
      http_port_, post("/v1/videos", "application/json", R"({"prompt":"A dog runs.",)" + fields + "}"));
  ASSERT_EQ(status_of(created), 200) << created;
  const auto video = nlohmann::json::parse(body_of(created));
  EXPECT_EQ(video["skyreels"]["params"]["scheduler"]["type"], "euler");
  EXPECT_EQ(video["skyreels"]["params"]["num_inference_steps"], "4") << "the list's length";
  const std::string by_openai = video["id"];
  ASSERT_EQ(wait_job(server_->client(), by_openai).state(), pb::JOB_STATE_SUCCEEDED);

  pb::SubmitJobRequest request;
  request.mutable_spec()->mutable_text()->set_prompt("A dog runs.");
  auto* p = request.mutable_spec()->mutable_params();
  p->set_width(48);
  p->set_height(32);
  p->set_num_frames(17);
  p->set_fps(8);
  p->set_seed(5);
  p->set_guidance_scale(1.0);
  p->set_flow_shift(5.0);
  p->mutable_scheduler()->set_type("euler");
  for (int64_t t : {1000, 750, 500, 250}) p->mutable_scheduler()->add_timesteps(t);
  const pb::Job by_grpc = wait_job(server_->client(), submit(server_->client(), request).job_id());
  ASSERT_EQ(by_grpc.state(), pb::JOB_STATE_SUCCEEDED) << by_grpc.error().message();

  std::string body;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(request, &body).ok());
  const std::string submitted = http_exchange(http_port_, post("/skyreels/v1/jobs", "application/json", body));
  ASSERT_EQ(status_of(submitted), 200) << submitted;
  const std::string by_json = nlohmann::json::parse(body_of(submitted))["job"]["job_id"];
  ASSERT_EQ(wait_job(server_->client(), by_json).state(), pb::JOB_STATE_SUCCEEDED);

  const at::Tensor a = download_latents(server_->client(), by_openai);
  const at::Tensor b = download_latents(server_->client(), by_grpc.job_id());
  const at::Tensor c = download_latents(server_->client(), by_json);
  EXPECT_TRUE(a.equal(b)) << "max |diff| " << (a - b).abs().max().item<double>();
  EXPECT_TRUE(c.equal(b)) << "max |diff| " << (c - b).abs().max().item<double>();

  for (const char* list : {"[1000,750,750]", "[250,500,1000]", "[1000,0]", "[1001,500]", "[999,500]"}) {
    const std::string bad = http_exchange(
        http_port_, post("/v1/videos", "application/json",
                         std::string(R"({"prompt":"A dog runs.","scheduler":{"type":"euler","timesteps":)") + list +
                             "}}"));
    EXPECT_EQ(status_of(bad), 400) << list << ": " << bad;
    EXPECT_NE(body_of(bad).find("scheduler.timesteps"), std::string::npos) << list << ": " << bad;
  }
  const std::string with_unipc = http_exchange(
      http_port_, post("/skyreels/v1/jobs", "application/json",
                       R"({"spec":{"text":{"prompt":"x"},"params":{"scheduler":{"timesteps":["1000","500"]}}}})"));
  EXPECT_EQ(status_of(with_unipc), 400) << with_unipc;
  EXPECT_NE(body_of(with_unipc).find("scheduler.timesteps"), std::string::npos) << with_unipc;
}

TEST_F(HttpServerTest, HostileClientsGetBoundedAnswersAndLeaveGrpcAndProbesAlone) {
  // A body announced far over the limit: refused before it is read.
  const std::string huge = http_exchange(
      http_port_, "POST /v1/videos HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                  "Authorization: Bearer " + kKey + "\r\nContent-Length: 1000000000000\r\n\r\n{");
  EXPECT_EQ(status_of(huge), 413) << huge;

  // A multipart of 10,000 parts, and one that is not multipart at all.
  std::string parts;
  for (int i = 0; i < 10000; ++i) parts += "--b\r\nContent-Disposition: form-data; name=\"f" + std::to_string(i) + "\"\r\n\r\nv\r\n";
  parts += "--b--\r\n";
  const std::string many = http_exchange(http_port_, post("/v1/videos", "multipart/form-data; boundary=b", parts));
  EXPECT_EQ(status_of(many), 400) << many.substr(0, 300);
  const std::string broken = http_exchange(http_port_, post("/v1/videos", "multipart/form-data", "garbage"));
  EXPECT_EQ(status_of(broken), 400) << broken;

  // A header bomb: bounded by the connection's header memory.
  std::string bomb = "GET /readyz HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 4000; ++i) bomb += "X-Bomb-" + std::to_string(i) + ": " + std::string(40, 'a') + "\r\n";
  bomb += "Connection: close\r\n\r\n";
  const std::string bombed = http_exchange(http_port_, bomb);
  EXPECT_TRUE(status_of(bombed) == 431 || status_of(bombed) == 413 || bombed.empty()) << bombed.substr(0, 200);

  // Slowloris: a request line that never ends is closed after the idle timeout (2 s here).
  const int slow = connect_from(http_port_);
  ASSERT_GE(slow, 0);
  ::send(slow, "GET /readyz HTTP/1.1\r\nHost:", 27, MSG_NOSIGNAL);
  const auto t0 = std::chrono::steady_clock::now();
  read_all(slow, 10);
  const double held = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(slow);
  EXPECT_LT(held, 6.0) << "the idle connection was not closed";

  // 1,000 idle connections from one address: at most --max-streams-per-client are kept; another address, gRPC and
  // the probes are unaffected.
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    const int fd = connect_from(http_port_);
    if (fd >= 0) idle.push_back(fd);
  }
  const std::string other = http_exchange(http_port_, "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10,
                                     "127.0.0.2");
  EXPECT_EQ(status_of(other), 200) << other;
  EXPECT_EQ(health_status(server_->address(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
  for (int fd : idle) ::close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string after = http_exchange(http_port_, "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(after), 200) << after;
}

}  // namespace
}  // namespace skyreels::test

namespace skyreels::test {
namespace {

// The `id:` of every Server-Sent Event in `text`, in order; *finished when a `finished` event is among them.
std::vector<uint64_t> event_ids(const std::string& text, bool* finished = nullptr) {
  std::vector<uint64_t> ids;
  size_t at = 0;
  while ((at = text.find("\nid: ", at)) != std::string::npos || (ids.empty() && text.rfind("id: ", 0) == 0)) {
    at = at == std::string::npos ? 0 : at + 1;
    ids.push_back(std::stoull(text.substr(at + 4)));
    at += 4;
  }
  if (finished) *finished = text.find("\nevent: finished\n") != std::string::npos;
  return ids;
}

// GET the job's events (HTTP/1.0: no chunked framing) until `events` have arrived or the stream ends.
std::string read_events(int port, const std::string& id, const std::string& last_event_id, size_t events) {
  const int fd = connect_from(port);
  if (fd < 0) return "";
  std::string request = "GET /skyreels/v1/jobs/" + id + "/events HTTP/1.0\r\nAuthorization: Bearer " + kKey + "\r\n";
  if (!last_event_id.empty()) request += "Last-Event-ID: " + last_event_id + "\r\n";
  request += "\r\n";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string text;
  char buffer[65536];
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until && event_ids(text).size() < events) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

// Chunk `chunk`'s result bytes as gRPC's DownloadResult sends them.
std::string grpc_chunk(server::Client& client, const std::string& id, int chunk) {
  auto ctx = client.context(60);
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_from_chunk(chunk);
  request.set_no_wait(true);
  auto reader = client.stub().DownloadResult(ctx.get(), request);
  std::string bytes;
  pb::ResultPart part;
  while (reader->Read(&part) && part.chunk_index() == chunk) {
    bytes += part.data();
    if (part.last_part()) break;
  }
  ctx->TryCancel();
  reader->Finish();
  return bytes;
}

TEST_F(HttpServerTest, TheJsonApiStreamsResumableEventsAndServesTheLatentsGrpcServes) {
  // A long video (4 chunks) as SubmitJobRequest JSON, embeddings included (bytes in base64).
  std::string body;
  google::protobuf::util::JsonPrintOptions options;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(long_video_request(11, 2), &body, options).ok());
  const std::string submitted = http_exchange(http_port_, post("/skyreels/v1/jobs", "application/json", body));
  ASSERT_EQ(status_of(submitted), 200) << submitted.substr(0, 500);
  const std::string id = nlohmann::json::parse(body_of(submitted))["job"]["job_id"];

  // Three events, a disconnect, then the rest from Last-Event-ID: together exactly the uninterrupted stream.
  std::vector<uint64_t> head = event_ids(read_events(http_port_, id, "", 3));
  ASSERT_GE(head.size(), 3u);
  head.resize(3);  // what this client saw before it went away (one read may bring more)
  bool finished = false;
  const std::vector<uint64_t> tail =
      event_ids(read_events(http_port_, id, std::to_string(head.back()), 100000), &finished);
  EXPECT_TRUE(finished);
  std::vector<uint64_t> resumed = head;
  resumed.insert(resumed.end(), tail.begin(), tail.end());
  const std::vector<uint64_t> whole = event_ids(read_events(http_port_, id, "", 100000));
  EXPECT_EQ(resumed, whole) << "an event lost or repeated across the reconnect";
  EXPECT_TRUE(std::is_sorted(whole.begin(), whole.end()));

  const std::string job = http_exchange(http_port_, get("/skyreels/v1/jobs/" + id));
  ASSERT_EQ(status_of(job), 200);
  const auto state = nlohmann::json::parse(body_of(job));
  EXPECT_EQ(state["state"], "JOB_STATE_SUCCEEDED");
  const int chunks = state["chunks_total"];
  EXPECT_EQ(chunks, 4);
  for (int c = 0; c < chunks; ++c) {
    const std::string http = http_exchange(http_port_, get("/skyreels/v1/jobs/" + id + "/result?chunk=" + std::to_string(c)));
    ASSERT_EQ(status_of(http), 200) << http.substr(0, 300);
    EXPECT_EQ(body_of(http), grpc_chunk(server_->client(), id, c)) << "chunk " << c;
  }
  // The sprite sheet: the first frame of each of the 4 chunks, in a 2 x 2 grid.
  const std::string sheet = http_exchange(http_port_, get("/v1/videos/" + id + "/content?variant=spritesheet"), 60);
  ASSERT_EQ(status_of(sheet), 200) << sheet.substr(0, 300);
  const std::string png = body_of(sheet);
  const auto decoded = video::read_video_bytes(std::vector<uint8_t>(png.begin(), png.end()));
  EXPECT_EQ(decoded.info.width, 2 * 48);
  EXPECT_EQ(decoded.info.height, 2 * 32);

  const std::string info = http_exchange(http_port_, get("/skyreels/v1/server-info"));
  EXPECT_EQ(status_of(info), 200);
  EXPECT_EQ(nlohmann::json::parse(body_of(info))["vae_available"], true);
}

}  // namespace
}  // namespace skyreels::test

namespace skyreels::test {
namespace {

// The page at / in headless Chromium (Debian's `chromium`, driven over the DevTools protocol by
// tests/http/page_in_chromium.mjs): a prompt submitted, progress advancing, a preview changing in place before its
// chunk's frames arrive, the video playing before the job ends.
TEST(HttpPageTest, ThePageInChromiumShowsProgressPreviewsAndPlaysTheVideoBeforeTheJobEnds) {
  ASSERT_EQ(std::system("command -v chromium > /dev/null"), 0) << "Debian's chromium is missing (scripts/setup.sh)";
  const std::string encoder_dir = temp_dir("http-page-umt5");
  model::write_tiny_text_encoder(encoder_dir, 32, 7);
  const int http_port = free_port();
  ServerProcess server({"--demo", "--vae", "demo", "--devices", "cpu", "--dtype", "float32", "--text-encoder",
                        encoder_dir, "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"),
                        "--http-listen", "127.0.0.1:" + std::to_string(http_port), "--enable-test-hooks",
                        "--step-delay-ms", "150"});
  const std::string page = http_exchange(http_port, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(status_of(page), 200);
  EXPECT_NE(page.find("text/html"), std::string::npos);

  // 37 frames at 8 fps in chunks of 17 with an overlap of 9: 4 chunks, each played as soon as it is made.
  const std::string url = "http://127.0.0.1:" + std::to_string(http_port) +
                          "/#prompt=A%20cat%20walks%20on%20the%20grass&size=64x64&seconds=4.5&fps=8&steps=4&seed=5"
                          "&base_num_frames=17&overlap_history=9&preview_every=1&autostart";
  const std::string out = temp_dir("http-page");
  const std::string command = "cd " + data_path("..") + "/http && SKYREELS_PAGE_URL='" + url + "' SKYREELS_OUT=" +
                              out + " timeout 200 node page_in_chromium.mjs > " + out + "/node.log 2>&1";
  const int rc = std::system(command.c_str());
  std::ifstream log(out + "/node.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << text << "\nserver log:\n" << server.log();
  // Kept as the test's artifacts (and the README's pictures when refreshed by hand: docs/images).
  std::filesystem::create_directories(std::string(SKYREELS_BIN_DIR) + "/../test-artifacts");
  for (const char* shot : {"page.png", "preview.png"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + shot)) << shot;
    std::filesystem::copy_file(out + "/" + shot, std::string(SKYREELS_BIN_DIR) + "/../test-artifacts/" + shot,
                               std::filesystem::copy_options::overwrite_existing);
  }
}

}  // namespace
}  // namespace skyreels::test

namespace skyreels::test {
namespace {

std::string json_post(const std::string& path, const std::string& body, const std::string& idempotency_key = "") {
  std::string request = "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n";
  if (!idempotency_key.empty()) request += "Idempotency-Key: " + idempotency_key + "\r\n";
  return request + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string header_of(const std::string& answer, const std::string& name) {
  const std::string head = answer.substr(0, answer.find("\r\n\r\n"));
  std::string lower = head;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  const size_t at = lower.find("\r\n" + name + ":");
  if (at == std::string::npos) return "";
  const size_t begin = head.find_first_not_of(' ', at + name.size() + 3);
  return head.substr(begin, head.find("\r\n", begin) - begin);
}

// Admission over HTTP is gRPC's: the per-client cap counts HTTP clients by their own address, a full cap is 429 with
// Retry-After, and an idempotency key reused with another request is 409.
TEST(HttpAdmissionTest, CapsCountEachClientAddressAndRefusalsCarryRetryAfter) {
  const std::string encoder_dir = temp_dir("http-admission-umt5");
  model::write_tiny_text_encoder(encoder_dir, 32, 7);
  const int http_port = free_port();
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--text-encoder", encoder_dir,
                        "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"), "--http-listen",
                        "127.0.0.1:" + std::to_string(http_port), "--max-jobs-per-client", "1", "--enable-test-hooks",
                        "--step-delay-ms", "100"});
  const std::string video = R"({"prompt":"A dog runs.","size":"48x32","seconds":2,"fps":8,"num_inference_steps":20})";
  const std::string first = http_exchange(http_port, json_post("/v1/videos", video, "key-1"));
  ASSERT_EQ(status_of(first), 200) << first;

  const std::string over = http_exchange(http_port, json_post("/v1/videos", video));
  EXPECT_EQ(status_of(over), 429) << over;
  EXPECT_FALSE(header_of(over, "retry-after").empty()) << over;
  EXPECT_EQ(nlohmann::json::parse(body_of(over))["error"]["type"], "rate_limit_error");

  const std::string other_client =
      http_exchange(http_port, json_post("/v1/videos", video), 10, "127.0.0.2");  // another address: its own cap
  EXPECT_EQ(status_of(other_client), 200) << other_client;

  const std::string same_key_other_request = http_exchange(
      http_port, json_post("/v1/videos", R"({"prompt":"A cat.","size":"48x32","seconds":2,"fps":8})", "key-1"));
  EXPECT_EQ(status_of(same_key_other_request), 409) << same_key_other_request;
  const std::string same_key_same_request = http_exchange(http_port, json_post("/v1/videos", video, "key-1"));
  ASSERT_EQ(status_of(same_key_same_request), 200) << same_key_same_request;
  EXPECT_EQ(nlohmann::json::parse(body_of(same_key_same_request))["id"], nlohmann::json::parse(body_of(first))["id"]);
}

// Over TLS with the gRPC port's certificate (--tls-cert/--tls-key); plain HTTP is not answered there.
TEST(HttpTlsTest, TheHttpPortServesTlsWithTheGrpcCertificate) {
  const std::string dir = temp_dir("http-tls");
  ASSERT_EQ(std::system(("openssl req -x509 -newkey rsa:2048 -nodes -keyout " + dir + "/key.pem -out " + dir +
                         "/cert.pem -days 1 -subj /CN=localhost > /dev/null 2>&1")
                            .c_str()),
            0);
  const int http_port = free_port();
  ServerProcess server({"--demo", "--devices", "cpu", "--tls-cert", dir + "/cert.pem", "--tls-key", dir + "/key.pem",
                        "--http-listen", "127.0.0.1:" + std::to_string(http_port)},
                       false);
  const std::string url = "https://127.0.0.1:" + std::to_string(http_port) + "/healthz";
  std::string answer;
  for (int i = 0; i < 100 && answer.find("live ok") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    FILE* curl = ::popen(("curl -s --cacert " + dir + "/cert.pem --resolve localhost:" + std::to_string(http_port) +
                          ":127.0.0.1 https://localhost:" + std::to_string(http_port) + "/healthz")
                             .c_str(),
                         "r");
    ASSERT_NE(curl, nullptr);
    char buffer[256];
    answer.clear();
    while (std::fgets(buffer, sizeof buffer, curl) != nullptr) answer += buffer;
    ::pclose(curl);
  }
  EXPECT_NE(answer.find("live ok"), std::string::npos) << url << ": " << answer << "\n" << server.log();
  const std::string plain = http_exchange(http_port, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 3);
  EXPECT_NE(status_of(plain), 200) << plain;
}

}  // namespace
}  // namespace skyreels::test
