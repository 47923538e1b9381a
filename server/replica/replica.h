// One replica: the transformer loaded onto one device, or onto a group of devices that run each chunk together
// (--parallel: guidance-parallel and Ulysses ranks joined by c10d), running chunks of ModelJobs for the replica pool.
// Test hooks (documented in --help): a fault plan that makes chosen chunk runs throw, and a per-step delay.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/lora.h"
#include "model/parallel_layout.h"
#include "server/job/job_request.h"
#include "server/replica/chunk_executor.h"
#include "server/replica/model_job.h"

namespace skyreels::model {
class RankGroup;
class AdapterBank;
class AdapterCatalogue;
struct ActiveAdapter;
class SkyReelsV2Transformer;
}

namespace skyreels::server {

// "--fault-inject REPLICA@N[+][:KIND][,...]": the N-th chunk run (1-based) on replica REPLICA fails after its first
// step; with '+', that run and every later one on that replica. KIND: "error" (default: a device error, counted
// against the replica), "oom" (an out-of-memory error, as LibTorch raises it: the request's fault), "dead" (a device
// error, and every re-test of the replica fails too), "kill" (the whole process dies by SIGKILL, as the kernel's OOM
// killer or a preemption ends it: what a chunk that crashes every process running it looks like from outside).
// Also read from $SKYREELS_FAULT_INJECT; either needs --enable-test-hooks (app/server_flags.cpp).
// On a replica of several devices, "REPLICA@N[+][:KIND]#R" puts the fault on rank R (default 0), and KIND may also be
// "stall": rank R stops answering its peers for longer than --collective-timeout-seconds, then fails.
enum class FaultKind { Error, OutOfMemory, Dead, Kill, Stall };
struct FaultRule {
  std::string replica;
  int64_t nth = 1;
  bool and_later = false;
  FaultKind kind = FaultKind::Error;
  int64_t rank = 0;
};
std::vector<FaultRule> parse_fault_rules(const std::string& text);  // throws std::invalid_argument

// Whether an exception from a forward is an allocation failure: c10::OutOfMemoryError (LibTorch 2.x), std::bad_alloc,
// or a c10::Error whose message is LibTorch's CPU or CUDA out-of-memory message (LibTorch 1.13).
bool is_out_of_memory(const std::exception& e);

struct ReplicaOptions {
  std::string name;    // metric label, e.g. "cpu:0", "cuda:1"; a group's: its devices' names joined by '+'
  std::string device;  // torch device, e.g. "cpu", "cuda:1" (a group's rank 0)
  // A replica of several devices (--parallel): rank r runs on rank_devices[r]; the scheduler sees one replica.
  model::ParallelLayout layout;
  std::vector<std::string> rank_devices;
  std::chrono::milliseconds collective_timeout{120000};  // how long a rank waits for its peers in one exchange
  bool shard_weights = false;  // --shard-weights: each rank keeps 1/ranks of every block's weights
  std::string dtype = "auto";
  std::string model_path;
  std::vector<model::LoraSpec> loras;  // merged into the weights at load (--lora)
  int threads = 0;  // intra-op threads for this replica's worker thread; 0 = leave as is
  std::vector<FaultRule> faults;
  std::chrono::milliseconds step_delay{0};  // test hook: sleep after every denoising step
  std::chrono::milliseconds block_delay{
      0};  // test hook: sleep at every stop check (after each block, before each step)
  // After every transformer call: token-blocks computed, saved by the exact savings, saved by the step cache.
  std::function<void(int64_t computed, int64_t saved_exact, int64_t saved_cache)> on_transformer_work;
  // Once the weights are loaded (and merged with any LoRA), with the seconds it took; warm-up not included.
  std::function<void(double seconds)> on_loaded;
  // Adapters chosen per request (--lora-dir): the catalogue every replica shares, and how many this replica keeps on
  // its device (its own AdapterBank). Null: requests with loras are refused.
  std::shared_ptr<const model::AdapterCatalogue> adapters;
  size_t max_resident_adapters = 4;
  // After a chunk's adapters were read from disk onto this replica: how many were read, how many are resident now.
  std::function<void(int64_t loaded, int64_t resident)> on_adapter_load;
};

struct ReplicaInfo {
  std::string device;
  std::string dtype;
  int threads = 0;
};

class ModelReplica : public ChunkExecutor {
 public:
  explicit ModelReplica(ReplicaOptions options);
  ~ModelReplica() override;
  std::string name() const override { return options_.name; }
  void start() override;  // loads the weights on this replica's device and runs one warm-up forward
  ChunkResult run(const ChunkWork& work, const ChunkCallbacks& callbacks) override;
  void probe() override;  // the warm-up forward again (a replica taken out comes back when it passes)
  const ReplicaOptions& options() const { return options_; }
  AdapterResidency adapter_residency() const override;

 private:
  // The job's adapters on this replica's device (loaded into its bank when not resident).
  std::vector<model::ActiveAdapter> activate_adapters(const std::vector<AdapterChoice>& loras);
  const FaultRule* fault_due(int64_t run, int64_t rank = 0) const;
  void warm_up() const;
  void warm_up_rank(const model::SkyReelsV2Transformer& transformer, model::RankGroup* ulysses,
                    model::RankGroup* all) const;
  [[noreturn]] void throw_fault(const FaultRule& rule, int64_t run_number);
  bool dead_ = false;  // a "dead" fault fired: re-tests fail too
  ReplicaOptions options_;
  std::unique_ptr<model::SkyReelsV2Transformer> model_;
  // A group's ranks on other devices than rank 0's: the transformer once per such device ("rank R" per rank with
  // --shard-weights, each holding its own shard).
  std::map<std::string, std::unique_ptr<model::SkyReelsV2Transformer>> rank_models_;
  const model::SkyReelsV2Transformer& model_of_rank(int64_t rank) const;
  // Runs a loop on every rank of the group (rank 0 on this thread with `hooks`).
  at::Tensor on_every_rank(const RankLoop& loop, const model::StepHooks& hooks, int64_t run_number);
  std::unique_ptr<model::AdapterBank> bank_;  // with options_.adapters, once the model is loaded
  mutable std::mutex residency_mu_;           // guards residency_, a copy the status reads without the bank's lock
  AdapterResidency residency_;
  int64_t runs_ = 0;
};

// Splits --devices into replicas: "auto" (every CUDA device, else one CPU replica), "cpu", "cuda:0,cuda:1",
// repeats such as "cpu,cpu". CPU devices share the cores: each gets max(1, cores / cpu devices) threads. With a
// `layout` of several ranks, consecutive devices form one replica each (a device count that is not a multiple of
// the ranks is refused: std::invalid_argument naming --devices).
std::vector<ReplicaOptions> plan_replicas(const std::string& devices, int cores, int cuda_devices,
                                          const model::ParallelLayout& layout = {});

// CUDA devices this LibTorch sees (0 on CPU-only builds).
int cuda_device_count();

}  // namespace skyreels::server
