// Runs the real skyreels-server binary on 127.0.0.1 for the server suites, and talks to it like a client would.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "server/api/client.h"

namespace skyreels::test {

// A free TCP port on 127.0.0.1 (bound, read back, released).
int free_port();

class ServerProcess {
 public:
  // Starts `skyreels-server <args> --listen 127.0.0.1:P --metrics-listen 127.0.0.1:M` and waits until readiness is
  // SERVING (when wait_ready). Fails the current test (and throws) when it does not come up.
  explicit ServerProcess(std::vector<std::string> args, bool wait_ready = true, std::string api_key = "");
  ~ServerProcess();  // SIGKILL if still running
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  server::Client& client() { return *client_; }
  // A client with another API key (or none).
  std::unique_ptr<server::Client> client_with_key(const std::string& key) const;

  void signal(int sig) const;
  // Waits for the process to exit; returns its exit status, or -1 on timeout.
  int wait_exit(std::chrono::milliseconds timeout);
  bool running();
  std::string log() const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
  std::string api_key_;
  std::unique_ptr<server::Client> client_;
  bool exited_ = false;
};

// A suite's shared server, started by its first test's SetUp: null when it did not start. A failure inside
// SetUpTestSuite would make gtest report the suite's tests as skipped (and ctest with them); this way the first test
// fails with the start's own failure and every other test in SetUp (expect_suite_server).
ServerProcess* start_suite_server(const std::function<std::unique_ptr<ServerProcess>()>& start);
void expect_suite_server(const ServerProcess* server);

// One server shared by every test of a suite, started by the suite's `static std::unique_ptr<ServerProcess> start()`.
template <typename Suite>
class SharedServerSuite : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::exchange(started_, true)) server_ = start_suite_server([] { return Suite::start(); });
    expect_suite_server(server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    started_ = false;
  }
  static inline ServerProcess* server_ = nullptr;
  static inline bool started_ = false;
};

// A TCP connection to 127.0.0.1:port (a blocking socket), or -1. `receive_buffer` > 0 sets SO_RCVBUF before connect, so the window stays
// that small (a slow reader whose unread bytes back up at the server; 4096 in the memory suites). `source` (e.g.
// 127.0.0.2) makes it another client address on loopback.
int connect_loopback(int port, int receive_buffer = 0, const char* source = nullptr);

// A process's resident set (VmRSS of /proc/PID/status) in bytes, -1 when it cannot be read.
int64_t resident_bytes(pid_t pid);

// The largest resident set of `pid` seen while it lives, sampled every 20 ms (the memory suites' measure).
class RssSampler {
 public:
  explicit RssSampler(pid_t pid);
  ~RssSampler() { stop(); }
  RssSampler(const RssSampler&) = delete;
  RssSampler& operator=(const RssSampler&) = delete;
  void stop();
  int64_t peak() const { return peak_; }

 private:
  pid_t pid_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> peak_{0};
  std::thread thread_;
};

// What one raw HTTP exchange got: the bytes, and whether the server closed the connection in time.
struct RawExchange {
  std::string bytes;
  bool closed = false;
};
// Sends `raw` on a fresh connection to 127.0.0.1:port (our side stays open) and reads until the server closes it or
// `seconds` pass.
RawExchange send_raw_http(int port, const std::string& raw, double seconds);
// POST http://127.0.0.1:port/path with a JSON body (no key); the raw answer.
RawExchange post_json(int port, const std::string& path, const std::string& body, double seconds = 30);
// GET http://127.0.0.1:port/path; returns the body ("" on failure), status code into *status.
std::string http_get(int port, const std::string& path, int* status = nullptr);
// The value of one sample line "name{labels} value" of a Prometheus exposition (NaN when absent).
double metric_value(const std::string& exposition, const std::string& name_with_labels);

// grpc.health.v1 Check: the serving status enum value, or -1 with the gRPC status code in *code.
int health_status(const std::string& address, const std::string& service, int* code = nullptr);

// A long-video job on the tiny demo model: 4 chunks of 5 latent frames at 48x32 (37 frames, base 17, overlap 9).
v1::SubmitJobRequest long_video_request(uint64_t seed, int64_t steps = 3, double guidance = 5.0);
// The request's prompt embeddings as CPU float tensors (prompt, negative).
std::pair<at::Tensor, at::Tensor> request_embeddings(const v1::SubmitJobRequest& request);

// Submits and returns the status as is (for the refusals); the response into *out, the trailing `retry-after-ms`
// into *retry_after_ms when given.
grpc::Status submit_status(server::Client& client, const v1::SubmitJobRequest& request,
                           v1::SubmitJobResponse* out = nullptr, std::string* retry_after_ms = nullptr);
// Follows WatchJob until the first event of `type` (or the job's end); returns it.
v1::JobEvent first_event_of_type(server::Client& client, const std::string& id, v1::JobEvent::EventCase type,
                                 int timeout_seconds = 120);
// Reads the job's events (steps included) after `after` until `stop` holds for one, the job's stream ends, or
// `seconds`; returns the events read.
std::vector<v1::JobEvent> watch_until(server::Client& client, const std::string& id, uint64_t after,
                                      const std::function<bool(const v1::JobEvent&)>& stop, double seconds = 120);
// Follows the job until its step `step` has run, then kills the server with SIGKILL and waits for it to die (a crash
// mid-chunk: nothing of that chunk is committed). False (with the failure recorded) when the job ended first.
bool kill_after_step(ServerProcess& server, const std::string& id, int64_t step);
// GetJob; the status into *status_out when given.
v1::Job get_job(server::Client& client, const std::string& id, grpc::Status* status_out = nullptr);
// Submits; fails the test on a non-OK status.
v1::Job submit(server::Client& client, const v1::SubmitJobRequest& request);
// Follows the job to its end (WatchJob); returns the final job.
v1::Job wait_job(server::Client& client, const std::string& id,
                 std::chrono::seconds timeout = std::chrono::seconds(60));
// Every chunk of a finished job joined into fp32 latents [1, 16, F, h, w].
at::Tensor download_latents(server::Client& client, const std::string& id);

// What `skyreels generate --seed` computes for the same request: the demo model (written again from its seed),
// loaded as float32, whole video in one process.
at::Tensor reference_latents(const v1::SubmitJobRequest& request);

}  // namespace skyreels::test
