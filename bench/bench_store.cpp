// Job store cost (issue 13): what durability adds per submit and per chunk commit, for DF-1.3B-540P-sized data, as
// a ratio to that chunk's compute. A submit stores the request with its encoded prompt embeddings (two [1, 512, 4096]
// fp32 tensors, 16 MiB); a chunk commit stores the chunk's new latents ([1, 16, 25, 68, 120] fp32, 12.5 MiB) with
// chunks_done in one transaction, plus its ChunkFinished event.
//
//   bench_store [--dir DIR] [--repeats N] [--tflops T] [--pg URL] [--claim-jobs N]
//
// PostgreSQL: the server at --pg URL, else a throwaway local one (unix socket, PostgreSQL's durable defaults: fsync
// on). Besides submit and commit it measures chunk leases: --claim-jobs one-chunk jobs claimed and committed by 3
// threads, each its own store (pods): claim latency (median, p99) and claim+commit cycles per second.
//
// Stores: memory, SQLite (synchronous=NORMAL, the default) and SQLite with synchronous=FULL (an fsync per commit).
//
// The compute estimate counts the DF-1.3B transformer's FLOPs for one chunk (tokens L = 25 x 34 x 60 = 51,000; 30
// layers, D 1536, FFN 8960, 512 text rows; 30 denoising rows x 2 CFG passes) at T TFLOP/s sustained (default 400, a
// modern data-centre GPU in bf16); the ratio is store seconds / compute seconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/store/job_lease.h"
#include "server/store/job_store.h"
#include "tests/pg_fixture.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double chunk_flops() {
  const double L = 25.0 * 34 * 60, D = 1536, Dff = 8960, T = 512, layers = 30, rows = 30, passes = 2;
  const double block = 8 * L * D * D + 4 * L * L * D + 4 * L * D * D + 4 * T * D * D + 4 * L * T * D + 4 * L * D * Dff;
  return block * layers * rows * passes;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// `jobs` one-chunk jobs, claimed and committed (small result, one event) by 3 threads, each with a store of its own.
void bench_claims(const std::string& url, int jobs, const std::string& run, double compute_s) {
  constexpr int kThreads = 3;
  {
    auto store = skyreels::server::open_job_store(url);
    for (int i = 0; i < jobs; ++i) {
      skyreels::server::StoredJob job;
      job.id = "j-claim-" + run + "-" + std::to_string(i);
      job.order = static_cast<uint64_t>(i);
      job.state = "queued";
      job.chunk_count = 1;
      job.request = "small request";
      store->insert_job(std::move(job));
    }
  }
  std::vector<std::unique_ptr<skyreels::server::LeaseStore>> pods;
  for (int t = 0; t < kThreads; ++t) {
    pods.push_back(skyreels::server::lease_store_over(skyreels::server::open_job_store(url), "finished"));
  }
  std::mutex mu;
  std::vector<double> claim_s;
  int64_t cycles = 0;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      skyreels::server::LeaseStore& leases = *pods[static_cast<size_t>(t)];
      const std::string replica = "pod" + std::to_string(t) + "/cuda:0";
      while (true) {
        const auto c0 = Clock::now();
        auto lease = leases.claim(replica, std::chrono::seconds(60));
        const double seconds = std::chrono::duration<double>(Clock::now() - c0).count();
        if (!lease) {
          if (leases.queue_depth() == 0) break;
          continue;
        }
        leases.commit(*lease, {lease->chunk_index, replica, 1, "latents"}, {R"({"type":3})"});
        std::lock_guard<std::mutex> lock(mu);
        claim_s.push_back(seconds);
        ++cycles;
      }
    });
  }
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double claim = median(claim_s);
  std::printf("%s,claim,0,%.2f,%.2e\n", pods[0]->records().describe().c_str(), claim * 1e3, claim / compute_s);
  std::printf("%s,claim_p99,0,%.2f,%.2e\n", pods[0]->records().describe().c_str(), percentile(claim_s, 0.99) * 1e3,
              percentile(claim_s, 0.99) / compute_s);
  std::printf("# claims: %d threads (one store each), %lld one-chunk jobs claimed and committed in %.2f s = %.0f/s\n",
              kThreads, static_cast<long long>(cycles), wall, static_cast<double>(cycles) / wall);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = (std::filesystem::temp_directory_path() / "skyreels-bench-store").string();
  int repeats = 10, claim_jobs = 600;
  double tflops = 400;
  std::string pg_url;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--repeats") repeats = std::max(1, std::atoi(argv[i + 1]));
    if (flag == "--tflops") tflops = std::atof(argv[i + 1]);
    if (flag == "--pg") pg_url = argv[i + 1];
    if (flag == "--claim-jobs") claim_jobs = std::max(1, std::atoi(argv[i + 1]));
  }
  std::unique_ptr<skyreels::test::PgServer> local_pg;
  if (pg_url.empty()) {
    local_pg = std::make_unique<skyreels::test::PgServer>(true);
    pg_url = local_pg->url();
  }
  const std::string run = std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string request(size_t{2} * 512 * 4096 * 4 + 4096, '\x3f');   // two embeddings + the rest of a request
  const std::string chunk(size_t{16} * 25 * 68 * 120 * 4 + 512, '\x3f');  // safetensors latents of one chunk
  const double compute_s = chunk_flops() / (tflops * 1e12);

  std::printf("store,operation,bytes,median_ms,ratio_to_chunk_compute\n");
  for (const std::string& spec : {std::string("memory"), "sqlite:" + dir + "/jobs.sqlite",
                                  "sqlite:" + dir + "/full.sqlite?synchronous=full", pg_url}) {
    auto store = skyreels::server::open_job_store(spec);
    std::vector<double> submit_s, commit_s;
    for (int r = 0; r < repeats; ++r) {
      const std::string id = "j-bench-" + run + "-" + std::to_string(r);
      skyreels::server::StoredJob job;
      job.id = id;
      job.order = static_cast<uint64_t>(r);
      job.state = "queued";
      job.chunk_count = 8;
      job.request = request;
      auto t0 = Clock::now();
      store->insert_job(std::move(job));
      submit_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      const skyreels::server::StoredChunk result{0, "cuda:0", 1, chunk};  // built before timing, as the replica does
      t0 = Clock::now();
      store->commit_chunk(id, result);
      store->append_event(id, {1, R"({"type":3})"});  // (job was moved into the store)
      commit_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double submit = median(submit_s), commit = median(commit_s);
    std::printf("%s,submit,%zu,%.2f,%.2e\n", store->describe().c_str(), request.size(), submit * 1e3,
                submit / compute_s);
    std::printf("%s,chunk_commit,%zu,%.2f,%.2e\n", store->describe().c_str(), chunk.size(), commit * 1e3,
                commit / compute_s);
    for (int r = 0; r < repeats; ++r) store->drop_job("j-bench-" + run + "-" + std::to_string(r), "benchmark");
  }
  bench_claims(pg_url, claim_jobs, run, compute_s);
  std::printf("# chunk compute estimate: %.3g FLOP at %.0f TFLOP/s = %.1f s\n", chunk_flops(), tflops, compute_s);
  std::filesystem::remove_all(dir);
  return 0;
}
