#include "tests/test_server_harness.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "model/diffusion_forcing.h"
#include "model/transformer_loader.h"
#include "server/job/blob.h"
#include "server/replica/demo_model.h"
#include "tests/test_util.h"

namespace skyreels::test {

namespace pb = skyreels::v1;

// A port the kernel just had free, never one this process handed out before: a server's gRPC and HTTP ports are
// asked for one after the other, and the kernel may offer the first again before anything binds it (both listeners
// then share it through SO_REUSEPORT and the server never looks ready).
int free_port() {
  static std::mutex mu;
  static std::set<int> given;
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) throw std::runtime_error("bind failed");
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    const int port = ntohs(addr.sin_port);
    ::close(fd);
    std::lock_guard<std::mutex> lock(mu);
    if (given.insert(port).second) return port;
  }
}

ServerProcess::ServerProcess(std::vector<std::string> args, bool wait_ready, std::string api_key)
    : api_key_(std::move(api_key)) {
  port_ = free_port();
  metrics_port_ = free_port();
  log_path_ = temp_dir("server-log") + "/server.log";
  // Every server gets its own store: the default SQLite one in a fresh temp data dir (never ./skyreels-data), or
  // memory when SKYREELS_TEST_JOB_STORE=memory (the suites run on both backends). A test that names a store keeps it.
  const bool names_store = std::find(args.begin(), args.end(), "--job-store") != args.end() ||
                           std::find(args.begin(), args.end(), "--data-dir") != args.end();
  if (!names_store) {
    const char* backend = std::getenv("SKYREELS_TEST_JOB_STORE");
    if (backend != nullptr && std::string(backend) == "memory") {
      args.insert(args.end(), {"--job-store", "memory"});
    } else {
      args.insert(args.end(), {"--data-dir", temp_dir("server-data")});
    }
  }
  // $SKYREELS_TEST_SERVER_BIN: another build's binary (a before/after figure, e.g. docs/BENCHMARKS.md's issue 36).
  const char* other_binary = std::getenv("SKYREELS_TEST_SERVER_BIN");
  args.insert(args.begin(), other_binary != nullptr && *other_binary != '\0' ? std::string(other_binary)
                                                                              : bin_path("skyreels-server"));
  args.push_back("--listen");
  args.push_back(address());
  args.push_back("--metrics-listen");
  args.push_back("127.0.0.1:" + std::to_string(metrics_port_));
  pid_ = ::fork();
  if (pid_ == 0) {
    const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  server::ConnectionOptions options;
  options.server = address();
  options.api_key = api_key_;
  client_ = std::make_unique<server::Client>(options);
  if (!wait_ready) return;
  std::string why;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    if (!running()) break;
    if (client_->wait_ready(0.5, &why)) return;
  }
  ADD_FAILURE() << "skyreels-server did not become ready (" << why << "); log:\n" << log();
  // The destructor does not run for a constructor that throws: the process goes here.
  if (running()) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  exited_ = true;
  throw std::runtime_error("server did not start");
}

ServerProcess* start_suite_server(const std::function<std::unique_ptr<ServerProcess>()>& start) {
  try {
    return start().release();
  } catch (const std::exception&) {  // ServerProcess reported why
    return nullptr;
  }
}

void expect_suite_server(const ServerProcess* server) {
  if (server == nullptr) GTEST_FAIL() << "the suite's skyreels-server did not start (see the first failure)";
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

std::unique_ptr<server::Client> ServerProcess::client_with_key(const std::string& key) const {
  server::ConnectionOptions options;
  options.server = address();
  options.api_key = key;
  return std::make_unique<server::Client>(options);
}

void ServerProcess::signal(int sig) const { ::kill(pid_, sig); }

bool ServerProcess::running() {
  if (exited_) return false;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) {
    exited_ = true;
    return false;
  }
  return true;
}

int ServerProcess::wait_exit(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

std::string ServerProcess::log() const {
  std::ifstream in(log_path_);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

int connect_loopback(int port, int receive_buffer, const char* source) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (receive_buffer > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
  if (source != nullptr) {
    sockaddr_in local{};
    local.sin_family = AF_INET;
    ::inet_pton(AF_INET, source, &local.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int64_t resident_bytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

RssSampler::RssSampler(pid_t pid) : pid_(pid), thread_([this] {
  while (!stop_) {
    const int64_t now = resident_bytes(pid_);
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}) {}

void RssSampler::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

RawExchange post_json(int port, const std::string& path, const std::string& body, double seconds) {
  return send_raw_http(port,
                       "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: "
                       "application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body,
                       seconds);
}

RawExchange send_raw_http(int port, const std::string& raw, double seconds) {
  RawExchange out;
  const int fd = connect_loopback(port);
  if (fd < 0) return out;
  size_t sent = 0;
  while (sent < raw.size()) {
    const ssize_t n = ::send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  char buffer[65536];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) {
      out.closed = true;
      break;
    }
    out.bytes.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

std::string http_get(int port, const std::string& path, int* status) {
  if (status) *status = 0;
  const int fd = connect_loopback(port);
  if (fd < 0) return "";
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[4096];
  ssize_t n = 0;
  while ((n = ::recv(fd, buffer, sizeof buffer, 0)) > 0) response.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  if (status && response.size() > 12) *status = std::atoi(response.substr(9, 3).c_str());
  const auto body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

double metric_value(const std::string& exposition, const std::string& name_with_labels) {
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name_with_labels + " ", 0) == 0) return std::stod(line.substr(name_with_labels.size() + 1));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

int health_status(const std::string& address, const std::string& service, int* code) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&ctx, request, &response);
  if (code) *code = static_cast<int>(status.error_code());
  return status.ok() ? static_cast<int>(response.status()) : -1;
}

pb::SubmitJobRequest long_video_request(uint64_t seed, int64_t steps, double guidance) {
  pb::SubmitJobRequest request;
  auto* embeddings = request.mutable_spec()->mutable_embeddings();
  *embeddings->mutable_prompt_embeds() = server::random_embeddings(16, 32, seed * 7 + 1);
  *embeddings->mutable_negative_prompt_embeds() = server::random_embeddings(16, 32, seed * 7 + 2);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_num_frames(37);
  p->set_height(32);
  p->set_width(48);
  p->set_num_inference_steps(steps);
  p->set_guidance_scale(guidance);
  p->set_base_num_frames(17);
  p->set_overlap_history(9);
  p->set_seed(seed);
  return request;
}

std::pair<at::Tensor, at::Tensor> request_embeddings(const pb::SubmitJobRequest& request) {
  auto tensor = [](const pb::Tensor& t) {
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    return at::from_blob(const_cast<char*>(t.data().data()), shape, at::kFloat).clone();
  };
  const auto& e = request.spec().embeddings();
  return {tensor(e.prompt_embeds()), tensor(e.negative_prompt_embeds())};
}

grpc::Status submit_status(server::Client& client, const pb::SubmitJobRequest& request,
                           pb::SubmitJobResponse* out, std::string* retry_after_ms) {
  auto ctx = client.context(30);
  pb::SubmitJobResponse response;
  const grpc::Status status = client.stub().SubmitJob(ctx.get(), request, &response);
  if (out) *out = response;
  if (retry_after_ms) {
    for (const auto& [key, value] : ctx->GetServerTrailingMetadata()) {
      if (key == "retry-after-ms") *retry_after_ms = std::string(value.data(), value.size());
    }
  }
  return status;
}

pb::JobEvent first_event_of_type(server::Client& client, const std::string& id, pb::JobEvent::EventCase type,
                                 int timeout_seconds) {
  auto ctx = client.context(timeout_seconds);
  pb::WatchJobRequest request;
  request.set_job_id(id);
  auto reader = client.stub().WatchJob(ctx.get(), request);
  pb::JobEvent event;
  while (reader->Read(&event)) {
    if (event.event_case() == type) {
      ctx->TryCancel();
      break;
    }
  }
  reader->Finish();
  return event;
}

std::vector<pb::JobEvent> watch_until(server::Client& client, const std::string& id, uint64_t after,
                                      const std::function<bool(const pb::JobEvent&)>& stop, double seconds) {
  auto ctx = client.context(seconds);
  pb::WatchJobRequest request;
  request.set_job_id(id);
  request.set_after_sequence(after);
  auto reader = client.stub().WatchJob(ctx.get(), request);
  std::vector<pb::JobEvent> events;
  pb::JobEvent event;
  while (reader->Read(&event)) {
    events.push_back(event);
    if (stop(event)) {
      ctx->TryCancel();
      break;
    }
  }
  reader->Finish();
  return events;
}

bool kill_after_step(ServerProcess& server, const std::string& id, int64_t step) {
  const auto events = watch_until(server.client(), id, 0,
                                  [step](const pb::JobEvent& e) { return e.has_step() && e.step().step() >= step; });
  if (events.empty() || !events.back().has_step()) {
    ADD_FAILURE() << "job " << id << " ended before its step " << step;
    return false;
  }
  server.signal(SIGKILL);
  if (server.wait_exit(std::chrono::seconds(10)) == -1) {
    ADD_FAILURE() << "the server did not die";
    return false;
  }
  return true;
}

pb::Job get_job(server::Client& client, const std::string& id, grpc::Status* status_out) {
  auto ctx = client.context(10);
  pb::GetJobRequest request;
  request.set_job_id(id);
  pb::Job job;
  const grpc::Status status = client.stub().GetJob(ctx.get(), request, &job);
  if (status_out != nullptr) *status_out = status;
  return job;
}

pb::Job submit(server::Client& client, const pb::SubmitJobRequest& request) {
  auto ctx = client.context(30);
  pb::SubmitJobResponse response;
  const grpc::Status status = client.stub().SubmitJob(ctx.get(), request, &response);
  EXPECT_TRUE(status.ok()) << server::describe(status);
  return response.job();
}

pb::Job wait_job(server::Client& client, const std::string& id, std::chrono::seconds timeout) {
  auto ctx = client.context(static_cast<double>(timeout.count()));
  pb::WatchJobRequest request;
  request.set_job_id(id);
  request.set_skip_steps(true);
  auto reader = client.stub().WatchJob(ctx.get(), request);
  pb::JobEvent event;
  pb::Job job;
  while (reader->Read(&event)) {
    if (event.has_finished()) job = event.finished().job();
  }
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << "watch " << id << ": " << server::describe(status);
  return job;
}

at::Tensor download_latents(server::Client& client, const std::string& id) {
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  std::vector<std::string> chunks;
  const grpc::Status status = server::download_chunks(
      client, request, [&](int32_t, int32_t, std::string bytes) { chunks.push_back(std::move(bytes)); });
  EXPECT_TRUE(status.ok()) << "download " << id << ": " << server::describe(status);
  if (chunks.empty()) return at::Tensor();
  const std::string joined = server::concat_latent_chunks(chunks);
  const auto view = server::parse_f32_tensor(joined, "latents");
  return at::from_blob(const_cast<char*>(view.data), view.shape, at::kFloat).clone();
}

at::Tensor reference_latents(const pb::SubmitJobRequest& request) {
  static std::mutex mu;
  static std::unique_ptr<model::SkyReelsV2Transformer> transformer;
  std::lock_guard<std::mutex> lock(mu);
  if (!transformer) {
    const std::string dir = temp_dir("tiny-model");
    server::write_tiny_model(dir);  // the --demo model: same default seed, same bytes
    model::TransformerLoadOptions options;
    options.dtype = "float32";
    transformer = model::load_transformer(dir, options).model;
  }
  const auto& p = request.spec().params();
  model::GenerationParams params;
  params.num_frames = p.num_frames();
  params.height = p.height();
  params.width = p.width();
  params.num_inference_steps = p.num_inference_steps();
  params.guidance_scale = p.guidance_scale();
  if (p.has_flow_shift()) params.flow_shift = p.flow_shift();
  params.base_num_frames = p.base_num_frames();
  if (p.has_overlap_history()) params.overlap_history = p.overlap_history();
  if (p.has_ar_step()) params.ar_step = p.ar_step();
  if (p.has_causal_block_size()) params.causal_block_size = p.causal_block_size();
  if (p.has_addnoise_condition()) params.addnoise_condition = p.addnoise_condition();
  if (p.has_fps()) params.fps = p.fps();
  params.seed = p.seed();
  if (p.has_exact_savings()) params.exact_savings = p.exact_savings();
  if (p.has_cache() && p.cache() == "first-block") {
    params.cache.kind = model::StepCacheKind::kFirstBlock;
    params.cache.threshold = p.cache_threshold();
  }
  if (p.has_cache() && p.cache() == "first-block-per-block") {
    params.cache.kind = model::StepCacheKind::kFirstBlockPerBlock;
    params.cache.threshold = p.cache_threshold();
    if (p.has_cache_max_skips()) params.cache.max_skips = p.cache_max_skips();
  }
  if (p.has_scheduler()) {
    const auto& c = p.scheduler();
    if (c.has_num_train_timesteps()) params.scheduler.num_train_timesteps = c.num_train_timesteps();
    if (c.has_solver_order()) params.scheduler.solver_order = c.solver_order();
    if (c.has_solver_type()) params.scheduler.solver_type = c.solver_type();
    if (c.has_lower_order_final()) params.scheduler.lower_order_final = c.lower_order_final();
    if (c.has_final_sigmas_type()) params.scheduler.final_sigmas_type = c.final_sigmas_type();
    params.scheduler.disable_corrector.assign(c.disable_corrector().begin(), c.disable_corrector().end());
  }
  const auto [prompt, negative] = request_embeddings(request);
  model::Conditioning conditioning;
  conditioning.prompt_embeds = prompt;
  conditioning.negative_prompt_embeds = negative;
  auto noise = model::make_seeded_noise(p.seed());
  return model::generate(*transformer, params, conditioning, *noise);
}

}  // namespace skyreels::test
