// bench_scheduler: the chunk scheduler's own cost, with fake executors (no model).
//  1. Overhead per chunk: executors that return at once, so the measured time is dispatch + completion + events.
//  2. Throughput against the number of replicas: executors that sleep a fixed chunk time (so the 2-core machine is
//     not the limit), many jobs of several chunks, chunks/s compared with the ideal replicas / chunk time.
//
//   bench_scheduler [--jobs 64] [--chunks 4] [--chunk-ms 20] [--rows 10]
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/queue/scheduler.h"

namespace {

using namespace skyreels::server;

struct Empty : JobPayload {};

class SleepExecutor : public ChunkExecutor {
 public:
  SleepExecutor(std::string name, std::chrono::microseconds chunk, int rows)
      : name_(std::move(name)), chunk_(chunk), rows_(rows) {}
  std::string name() const override { return name_; }
  ChunkResult run(const ChunkWork&, const ChunkCallbacks& callbacks) override {
    for (int row = 1; row <= rows_; ++row) {
      if (callbacks.should_stop()) return {ChunkOutcome::Stopped, "", 0, {}, {}};
      if (chunk_.count() > 0) std::this_thread::sleep_for(chunk_ / rows_);
      callbacks.on_step(row, rows_);
    }
    return {ChunkOutcome::Succeeded, "", 80, {}, {}};
  }

 private:
  std::string name_;
  std::chrono::microseconds chunk_;
  int rows_;
};

struct Result {
  double seconds = 0;
  int64_t chunks = 0;
  int64_t handoffs = 0;
};

Result run(int replicas, int jobs, int chunks, std::chrono::microseconds chunk_time, int rows) {
  std::vector<std::unique_ptr<ChunkExecutor>> executors;
  for (int i = 0; i < replicas; ++i) {
    executors.push_back(std::make_unique<SleepExecutor>("fake:" + std::to_string(i), chunk_time, rows));
  }
  SchedulerOptions options;
  options.max_jobs = jobs;
  options.max_retained_jobs = jobs;
  const std::unique_ptr<LeaseStore> leases = with_leases(open_job_store("memory"));
  PodOptions pod;
  pod.scheduling = options;
  auto loader = [rows](const StoredJob& job, std::vector<StoredChunk>) {  // a payload this server evicted
    RestoredJob r;
    r.payload = std::make_shared<Empty>();
    r.chunk_rows.assign(static_cast<size_t>(job.chunk_count), rows);
    return r;
  };
  Scheduler scheduler(std::move(executors), pod, leases->records(), *leases, loader);
  scheduler.start();
  while (!scheduler.all_loaded()) std::this_thread::sleep_for(std::chrono::milliseconds(1));

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> ids;
  for (int j = 0; j < jobs; ++j) {
    JobSpec spec;
    spec.chunk_work.assign(static_cast<size_t>(chunks), 1.0);
    spec.chunk_rows.assign(static_cast<size_t>(chunks), rows);
    spec.payload = std::make_shared<Empty>();
    ids.push_back(scheduler.submit(std::move(spec)).job.id);
  }
  scheduler.wait_idle(Clock::now() + std::chrono::minutes(10));
  Result r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& id : ids) {
    const auto job = scheduler.get(id, "");
    if (!job || job->state != JobState::Succeeded) {
      std::fprintf(stderr, "job %s did not succeed\n", id.c_str());
      std::exit(1);
    }
    r.chunks += job->chunks_done;
    r.handoffs += job->handoffs;
  }
  return r;
}

int flag(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  const int jobs = flag(argc, argv, "--jobs", 64);
  const int chunks = flag(argc, argv, "--chunks", 4);
  const int chunk_ms = flag(argc, argv, "--chunk-ms", 20);
  const int rows = flag(argc, argv, "--rows", 10);

  run(1, 8, 8, std::chrono::microseconds(0), rows);  // warm-up: threads, allocator

  std::printf("scheduling overhead on one replica (executors return at once; %d step events per chunk)\n", rows);
  std::printf("%14s %8s %10s %14s\n", "jobs waiting", "chunks", "seconds", "us per chunk");
  for (int waiting : {1, 16, 64, 256, 1024}) {
    const int chunk_count = std::max(1, 1024 / waiting);
    const Result r = run(1, waiting, chunk_count, std::chrono::microseconds(0), rows);
    std::printf("%14d %8lld %10.4f %14.1f\n", waiting, static_cast<long long>(r.chunks), r.seconds,
                1e6 * r.seconds / static_cast<double>(r.chunks));
  }

  std::printf("\nthroughput against replicas (%d jobs x %d chunks, %d ms per chunk in %d sleeping steps)\n", jobs,
              chunks, chunk_ms, rows);
  std::printf("%9s %10s %10s %9s %11s %9s\n", "replicas", "seconds", "chunks/s", "speedup", "efficiency", "handoffs");
  double base = 0;
  for (int replicas : {1, 2, 4, 8}) {
    const Result r = run(replicas, jobs, chunks, std::chrono::milliseconds(chunk_ms), rows);
    const double rate = static_cast<double>(r.chunks) / r.seconds;
    if (replicas == 1) base = rate;
    std::printf("%9d %10.3f %10.1f %8.2fx %10.1f%% %9lld\n", replicas, r.seconds, rate, rate / base,
                100.0 * rate / base / replicas, static_cast<long long>(r.handoffs));
  }
  return 0;
}
