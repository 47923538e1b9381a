// bench_soak: the real skyreels-server on 127.0.0.1 under many small jobs and hundreds of open streams, bounded in
// time. Reports the server's RSS and thread count before the load, at its peak and after it, and how long the server
// takes to exit on SIGTERM afterwards.
//
//   bench_soak [--jobs 3000] [--clients 8] [--watchers 200] [--hold-streams 300] [--timeout-seconds 900]
//
// Every job is tiny (the demo model, 5 frames at 16x16, one step, no guidance) so that the server's transport,
// scheduler and bookkeeping are what is measured, not the model. Each accepted job is followed by a WatchJob stream
// until it ends; up to --watchers streams are open at once. Clients back off on RESOURCE_EXHAUSTED (retry-after-ms).
// Besides, --hold-streams WatchJob streams follow one long "anchor" job for the whole run (cancelled at the end), so
// that hundreds of streams stay open however fast the tiny jobs go.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "server/api/client.h"

namespace {

namespace pb = skyreels::v1;
using skyreels::server::Client;
using Steady = std::chrono::steady_clock;

struct Options {
  int jobs = 3000;
  int clients = 8;
  int watchers = 200;
  int hold_streams = 300;
  int timeout_seconds = 900;
};

int free_port() {
  // Bind port 0 through a throwaway server-less socket: let the kernel pick, read it back.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

struct Sample {
  double rss_mb = 0;
  int64_t threads = 0;
};

Sample sample(pid_t pid) {
  return {static_cast<double>(skyreels::bench::proc_status(std::to_string(pid), "VmRSS")) / 1024.0, skyreels::bench::proc_status(std::to_string(pid), "Threads")};
}

pb::SubmitJobRequest tiny_job(uint64_t seed) {
  pb::SubmitJobRequest request;
  *request.mutable_spec()->mutable_embeddings()->mutable_prompt_embeds() =
      skyreels::server::random_embeddings(1, 32, seed);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_num_frames(5);
  p->set_base_num_frames(5);
  p->set_height(16);
  p->set_width(16);
  p->set_num_inference_steps(1);
  p->set_guidance_scale(1.0);
  p->set_seed(seed);
  return request;
}

// Job ids waiting for a watcher.
struct IdQueue {
  std::mutex mu;
  std::deque<std::string> ids;
  void push(std::string id) {
    std::lock_guard<std::mutex> lock(mu);
    ids.push_back(std::move(id));
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return ids.size();
  }
  bool pop(std::string* id) {
    std::lock_guard<std::mutex> lock(mu);
    if (ids.empty()) return false;
    *id = std::move(ids.front());
    ids.pop_front();
    return true;
  }
};

// Submits `count` jobs, backing off on RESOURCE_EXHAUSTED; pushes every accepted id.
void submit_jobs(Client& client, int first_seed, int count, IdQueue& queue, std::atomic<int>& refused,
                 const Steady::time_point& until) {
  for (int i = 0; i < count && Steady::now() < until;) {
    // Back-pressure: watchers must reach each job before it is dropped (the server keeps 256 finished jobs).
    while (queue.size() > 16 && Steady::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto ctx = client.context(30);
    pb::SubmitJobResponse response;
    const grpc::Status status = client.stub().SubmitJob(ctx.get(), tiny_job(first_seed + i), &response);
    if (status.ok()) {
      queue.push(response.job().job_id());
      ++i;
      continue;
    }
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      std::fprintf(stderr, "bench_soak: submit failed: %s\n", skyreels::server::describe(status).c_str());
      std::exit(1);
    }
    ++refused;
    int64_t ms = 50;
    for (const auto& [key, value] : ctx->GetServerTrailingMetadata()) {
      if (key == "retry-after-ms") ms = std::atoll(std::string(value.data(), value.size()).c_str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::clamp<int64_t>(ms, 5, 50)));
  }
}

// Follows every queued job with a WatchJob stream to its end, at most `width` open at once, on one completion queue.
struct WatchStats {
  int watched = 0;
  int succeeded = 0;
  int peak_open = 0;
};

WatchStats watch_all(Client& client, IdQueue& queue, int width, const std::atomic<bool>& submitting,
                     const Steady::time_point& until, int expected) {
  struct Stream {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientAsyncReader<pb::JobEvent>> reader;
    pb::JobEvent event;
    grpc::Status status;
    bool succeeded = false;
  };
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Stream>> slots(static_cast<size_t>(width));
  WatchStats stats;
  int open = 0;
  auto start = [&](size_t slot, const std::string& id) {
    auto s = std::make_unique<Stream>();
    s->ctx = client.context(600);
    pb::WatchJobRequest request;
    request.set_job_id(id);
    request.set_skip_steps(true);
    s->reader = client.stub().PrepareAsyncWatchJob(s->ctx.get(), request, &cq);
    s->reader->StartCall(reinterpret_cast<void*>(slot * 2 + 2));  // even: read next; odd: finished
    slots[slot] = std::move(s);
    ++open;
    stats.peak_open = std::max(stats.peak_open, open);
  };
  while (Steady::now() < until && (stats.watched < expected || open > 0)) {
    for (size_t slot = 0; slot < slots.size(); ++slot) {
      std::string id;
      if (!slots[slot] && queue.pop(&id)) start(slot, id);
    }
    void* tag = nullptr;
    bool ok = false;
    const auto next = cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + std::chrono::milliseconds(20));
    if (next != grpc::CompletionQueue::NextStatus::GOT_EVENT) {
      if (!submitting && open == 0 && queue.ids.empty()) break;
      continue;
    }
    const auto value = reinterpret_cast<size_t>(tag);
    const size_t slot = value / 2 - 1;
    Stream& s = *slots[slot];
    if (value % 2 == 0) {
      if (ok) {
        if (s.event.has_finished()) s.succeeded = s.event.finished().job().state() == pb::JOB_STATE_SUCCEEDED;
        s.reader->Read(&s.event, reinterpret_cast<void*>(value));
      } else {
        s.reader->Finish(&s.status, reinterpret_cast<void*>(value + 1));
      }
    } else {
      ++stats.watched;
      stats.succeeded += s.status.ok() && s.succeeded ? 1 : 0;
      slots[slot].reset();
      --open;
    }
  }
  for (auto& s : slots) {
    if (s) s->ctx->TryCancel();
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return stats;
}

// `count` WatchJob streams on one job, open until close(): each has sent its first event when open() returns.
class HeldStreams {
 public:
  bool open(Client& client, const std::string& id, int count) {
    pb::WatchJobRequest request;
    request.set_job_id(id);
    request.set_skip_steps(true);
    streams_.resize(static_cast<size_t>(count));
    for (size_t i = 0; i < streams_.size(); ++i) {
      streams_[i].ctx = client.context(3600);
      streams_[i].reader = client.stub().PrepareAsyncWatchJob(streams_[i].ctx.get(), request, &cq_);
      streams_[i].reader->StartCall(reinterpret_cast<void*>(i * 2 + 2));
    }
    for (size_t answered = 0; answered < 2 * streams_.size();) {  // each: StartCall done, first Read done
      void* tag = nullptr;
      bool ok = false;
      if (cq_.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + std::chrono::seconds(60)) !=
              grpc::CompletionQueue::NextStatus::GOT_EVENT ||
          !ok) {
        return false;
      }
      const auto value = reinterpret_cast<size_t>(tag);
      Stream& s = streams_[value / 2 - 1];
      if (!s.started) {
        s.started = true;
        s.reader->Read(&s.event, tag);
      }
      ++answered;
    }
    return true;
  }
  void close() {
    for (auto& s : streams_) s.ctx->TryCancel();
    for (size_t i = 0; i < streams_.size(); ++i) streams_[i].reader->Finish(&streams_[i].status, nullptr);
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

 private:
  struct Stream {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientAsyncReader<pb::JobEvent>> reader;
    pb::JobEvent event;
    grpc::Status status;
    bool started = false;
  };
  grpc::CompletionQueue cq_;
  std::vector<Stream> streams_;
};

// A job that keeps running for minutes on the demo model (cancelled at the end of the soak): 64 chunks of 50 steps,
// the most chunks the default --max-chunks admits.
pb::SubmitJobRequest anchor_job() {
  pb::SubmitJobRequest request = tiny_job(7);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_num_frames(521);
  p->set_base_num_frames(17);
  p->set_overlap_history(9);
  p->set_num_inference_steps(50);
  request.set_priority(-10);  // the tiny jobs go first
  return request;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--jobs") {
      o.jobs = value;
    } else if (flag == "--clients") {
      o.clients = value;
    } else if (flag == "--watchers") {
      o.watchers = value;
    } else if (flag == "--hold-streams") {
      o.hold_streams = value;
    } else if (flag == "--timeout-seconds") {
      o.timeout_seconds = value;
    } else {
      std::fprintf(stderr,
                   "usage: bench_soak [--jobs N] [--clients N] [--watchers N] [--hold-streams N] "
                   "[--timeout-seconds N]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::string server_bin =
      (std::filesystem::path(std::filesystem::read_symlink("/proc/self/exe")).parent_path() / "skyreels-server")
          .string();
  const int port = free_port(), metrics_port = free_port();
  const std::string log_path = "/tmp/bench_soak-" + std::to_string(::getpid()) + ".log";
  const std::string streams = std::to_string(o.watchers + o.hold_streams + 64);
  std::vector<std::string> args = {server_bin,
                                   "--demo",
                                   "--devices",
                                   "cpu,cpu",
                                   "--dtype",
                                   "float32",
                                   "--listen",
                                   "127.0.0.1:" + std::to_string(port),
                                   "--metrics-listen",
                                   "127.0.0.1:" + std::to_string(metrics_port),
                                   "--max-queue",
                                   "512",
                                   "--max-jobs-per-client",
                                   "512",
                                   "--max-streams",
                                   streams,
                                   "--max-streams-per-client",
                                   streams,
                                   "--job-store",
                                   "memory",  // measured before the durable store existed; nothing left on disk
                                   "--log-level",
                                   "warn"};
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv_c;
    for (auto& a : args) argv_c.push_back(a.data());
    argv_c.push_back(nullptr);
    ::execv(argv_c[0], argv_c.data());
    ::_exit(127);
  }
  const auto until = Steady::now() + std::chrono::seconds(o.timeout_seconds);
  auto fail = [&](const char* why) {
    std::fprintf(stderr, "bench_soak: %s (server log: %s)\n", why, log_path.c_str());
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return 1;
  };
  skyreels::server::ConnectionOptions connection;
  connection.server = "127.0.0.1:" + std::to_string(port);
  auto watcher_owner = std::make_unique<Client>(connection);
  Client& watcher_client = *watcher_owner;
  if (!watcher_client.wait_ready(120)) return fail("server did not become ready");
  const Sample before = sample(pid);

  std::string anchor_id;
  {
    auto ctx = watcher_client.context(30);
    pb::SubmitJobResponse response;
    const grpc::Status status = watcher_client.stub().SubmitJob(ctx.get(), anchor_job(), &response);
    if (!status.ok()) return fail(("anchor job refused: " + skyreels::server::describe(status)).c_str());
    anchor_id = response.job().job_id();
  }
  auto held_owner = std::make_unique<HeldStreams>();
  HeldStreams& held = *held_owner;
  if (!held.open(watcher_client, anchor_id, o.hold_streams)) return fail("could not open the held streams");
  const Sample held_open = sample(pid);

  IdQueue queue;
  std::atomic<int> refused{0};
  std::atomic<bool> submitting{true};
  Sample peak = before;
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling) {
      const Sample s = sample(pid);
      peak.rss_mb = std::max(peak.rss_mb, s.rss_mb);
      peak.threads = std::max(peak.threads, s.threads);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const auto t0 = Steady::now();
  std::vector<std::thread> clients;
  const int per_client = o.jobs / o.clients;
  for (int c = 0; c < o.clients; ++c) {
    clients.emplace_back([&, c] {
      Client client(connection);  // a channel (connection) per client
      submit_jobs(client, 1000 + c * per_client, per_client, queue, refused, until);
    });
  }
  std::thread closer([&] {
    for (auto& t : clients) t.join();
    submitting = false;
  });
  const WatchStats stats = watch_all(watcher_client, queue, o.watchers, submitting, until, per_client * o.clients);
  closer.join();
  const double seconds = std::chrono::duration<double>(Steady::now() - t0).count();
  sampling = false;
  sampler.join();
  if (Steady::now() >= until) return fail("timed out");
  held.close();
  {
    auto ctx = watcher_client.context(30);
    pb::CancelJobRequest cancel;
    cancel.set_job_id(anchor_id);
    pb::Job job;
    watcher_client.stub().CancelJob(ctx.get(), cancel, &job);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // streams closed, GC'd jobs settle
  const Sample after = sample(pid);

  // The clients go away first: gRPC's Shutdown waits (up to its 5 s deadline) for connections that still hold calls.
  held_owner.reset();
  watcher_owner.reset();
  const auto stop0 = Steady::now();
  ::kill(pid, SIGTERM);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Steady::now() - stop0 > std::chrono::seconds(60)) return fail("server did not exit within 60 s of SIGTERM");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double shutdown = std::chrono::duration<double>(Steady::now() - stop0).count();
  const int jobs = per_client * o.clients;

  std::printf(
      "bench_soak: %d jobs from %d clients; %d WatchJob streams held open on a long job throughout, plus one "
      "per tiny job (up to %d at once)\n",
      jobs, o.clients, o.hold_streams, o.watchers);
  std::printf("| measure | value |\n|---|---|\n");
  std::printf("| jobs succeeded / watched to the end | %d / %d |\n", stats.succeeded, stats.watched);
  std::printf("| wall time | %.1f s (%.0f jobs/s) |\n", seconds, jobs / seconds);
  std::printf("| submissions refused (RESOURCE_EXHAUSTED, retried) | %d |\n", refused.load());
  std::printf("| WatchJob streams open at once (held + per job, peak) | %d + %d |\n", o.hold_streams, stats.peak_open);
  std::printf("| server RSS / threads with the held streams open, before the jobs | %.0f MiB / %lld |\n",
              held_open.rss_mb, static_cast<long long>(held_open.threads));
  std::printf("| server RSS before / peak / after | %.0f / %.0f / %.0f MiB |\n", before.rss_mb, peak.rss_mb,
              after.rss_mb);
  std::printf("| server threads before / peak / after | %lld / %lld / %lld |\n", static_cast<long long>(before.threads),
              static_cast<long long>(peak.threads), static_cast<long long>(after.threads));
  std::printf("| exit after SIGTERM | %.2f s (status %d) |\n", shutdown, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  std::remove(log_path.c_str());
  return stats.succeeded == jobs && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
