#include "server/replica/replica.h"

#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <torch/version.h>

#include "model/adapter_bank.h"
#include "model/rank_group.h"
#include "model/diffusion_forcing.h"
#include "model/runtime.h"
#include "model/transformer_loader.h"
#include "model/video_mp4.h"
#include "server/replica/model_job.h"

namespace skyreels::server {

namespace {

struct InjectedFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool contains(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

// Gives the allocator's free memory back to the system after a failed chunk (the tensors are gone by now).
void release_memory() {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace

std::vector<FaultRule> parse_fault_rules(const std::string& text) {
  std::vector<FaultRule> rules;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const auto at = item.rfind('@');
    if (at == std::string::npos || at == 0) {
      throw std::invalid_argument("--fault-inject: '" + item + "' is not REPLICA@N or REPLICA@N+");
    }
    FaultRule rule;
    rule.replica = item.substr(0, at);
    std::string n = item.substr(at + 1);
    if (const auto hash = n.find('#'); hash != std::string::npos) {  // the rank of a group it hits
      const std::string rank = n.substr(hash + 1);
      n = n.substr(0, hash);
      if (rank.empty() || rank.size() > 2 || rank.find_first_not_of("0123456789") != std::string::npos) {
        throw std::invalid_argument("--fault-inject: '" + item + "': #R must name a rank (0 to 99)");
      }
      rule.rank = std::stoll(rank);
    }
    if (const auto colon = n.find(':'); colon != std::string::npos) {
      const std::string kind = n.substr(colon + 1);
      n = n.substr(0, colon);
      if (kind == "error") {
        rule.kind = FaultKind::Error;
      } else if (kind == "oom") {
        rule.kind = FaultKind::OutOfMemory;
      } else if (kind == "dead") {
        rule.kind = FaultKind::Dead;
      } else if (kind == "kill") {
        rule.kind = FaultKind::Kill;
      } else if (kind == "stall") {
        rule.kind = FaultKind::Stall;
      } else {
        throw std::invalid_argument("--fault-inject: '" + item + "': kind '" + kind +
                                    "' is not error, oom, dead, kill or stall");
      }
    }
    if (!n.empty() && n.back() == '+') {
      rule.and_later = true;
      n.pop_back();
    }
    try {
      size_t used = 0;
      rule.nth = std::stoll(n, &used);
      if (used != n.size() || rule.nth < 1) throw std::invalid_argument(n);
    } catch (const std::exception&) {
      throw std::invalid_argument("--fault-inject: '" + item + "': N must be a positive integer");
    }
    rules.push_back(rule);
  }
  return rules;
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
#if TORCH_VERSION_MAJOR >= 2
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
#endif
  if (dynamic_cast<const c10::Error*>(&e) == nullptr) return false;
  const std::string what = e.what();
  return contains(what, "DefaultCPUAllocator: can't allocate memory") || contains(what, "CUDA out of memory");
}

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

namespace {

// Consecutive devices as one replica of layout.ranks() ranks each.
std::vector<ReplicaOptions> group_replicas(const std::vector<ReplicaOptions>& devices,
                                           const model::ParallelLayout& layout) {
  const auto ranks = static_cast<size_t>(layout.ranks());
  if (devices.size() % ranks != 0) {
    throw std::invalid_argument("--devices: " + std::to_string(devices.size()) + " device(s) cannot be grouped into " +
                                "replicas of " + std::to_string(ranks) + " (--parallel " + layout.text() +
                                "); give a multiple of " + std::to_string(ranks) + " devices");
  }
  std::vector<ReplicaOptions> groups;
  for (size_t first = 0; first < devices.size(); first += ranks) {
    ReplicaOptions g = devices[first];
    g.layout = layout;
    g.name.clear();
    for (size_t r = first; r < first + ranks; ++r) {
      g.name += (g.name.empty() ? "" : "+") + devices[r].name;
      g.rank_devices.push_back(devices[r].device);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

std::vector<ReplicaOptions> plan_replicas(const std::string& devices, int cores, int cuda_devices,
                                          const model::ParallelLayout& layout) {
  std::vector<std::string> tokens;
  if (trim(devices) == "auto") {
    for (int i = 0; i < cuda_devices; ++i) tokens.push_back("cuda:" + std::to_string(i));
    if (tokens.empty()) tokens.push_back("cpu");
  } else {
    std::stringstream in(devices);
    std::string item;
    while (std::getline(in, item, ',')) tokens.push_back(trim(item));
  }
  if (tokens.empty()) throw std::invalid_argument("--devices: empty list");

  std::vector<ReplicaOptions> replicas;
  std::map<std::string, int> seen;
  int cpu_replicas = 0;
  for (const auto& token : tokens) {
    ReplicaOptions r;
    if (token == "cpu") {
      r.device = "cpu";
      r.name = "cpu:" + std::to_string(cpu_replicas++);
    } else if (token == "cuda" || token.rfind("cuda:", 0) == 0) {
      int index = 0;
      if (token != "cuda") {
        const std::string n = token.substr(5);
        if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) {
          throw std::invalid_argument("--devices: '" + token + "' is not cuda:N");
        }
        index = std::stoi(n);
      }
      if (index >= cuda_devices) {
        throw std::invalid_argument("--devices: cuda:" + std::to_string(index) + " does not exist (" +
                                    std::to_string(cuda_devices) + " CUDA device(s) visible)");
      }
      r.device = "cuda:" + std::to_string(index);
      const int repeat = seen[r.device]++;
      r.name = repeat == 0 ? r.device : r.device + "/" + std::to_string(repeat);
    } else {
      throw std::invalid_argument("--devices: '" + token + "' is not auto, cpu or cuda:N");
    }
    replicas.push_back(r);
  }
  // CPU replicas split the cores evenly; CUDA replicas need one host thread each.
  const int per_cpu = std::max(1, cores / std::max(1, cpu_replicas));
  for (auto& r : replicas) r.threads = r.device == "cpu" ? per_cpu : 1;
  if (layout.single()) return replicas;
  return group_replicas(replicas, layout);
}

ModelReplica::ModelReplica(ReplicaOptions options) : options_(std::move(options)) {}
ModelReplica::~ModelReplica() = default;

void ModelReplica::start() {
  // Intra-op threads are per calling thread in LibTorch's OpenMP backend: set them on this worker thread.
  if (options_.threads > 0) at::set_num_threads(options_.threads);
  c10::InferenceMode inference;
  model::TransformerLoadOptions load;
  load.device = options_.device;
  load.dtype = options_.dtype;
  load.loras = options_.loras;
  spdlog::info("replica={} event=loading device={} dtype={} threads={} model={}", options_.name, options_.device,
               options_.dtype, options_.threads, options_.model_path);
  model::LoadedTransformer loaded = model::load_transformer(options_.model_path, load);
  model_ = std::move(loaded.model);
  if (options_.shard_weights) {  // every rank its own instance, holding its shard of the blocks
    const int64_t ranks = options_.layout.ranks();
    model_->shard_blocks(0, ranks);
    for (int64_t r = 1; r < ranks; ++r) {
      load.device = options_.rank_devices.at(static_cast<size_t>(r));
      auto rank_model = model::load_transformer(options_.model_path, load).model;
      rank_model->shard_blocks(r, ranks);
      rank_models_["rank" + std::to_string(r)] = std::move(rank_model);
    }
    spdlog::info("replica={} event=weights_sharded ranks={} rank0_weight_bytes={}", options_.name, ranks,
                 model_->held_weight_bytes());
  }
  for (const std::string& device : options_.rank_devices) {  // a group: once more per other device
    if (options_.shard_weights || device == options_.device || rank_models_.count(device)) continue;
    load.device = device;
    rank_models_[device] = model::load_transformer(options_.model_path, load).model;
  }
  if (!options_.layout.single()) {
    model::check_parallel_layout(options_.layout, options_.layout.ranks(), model_->config().num_attention_heads);
    spdlog::info("replica={} event=group ranks={} parallel={}", options_.name, options_.layout.ranks(),
                 options_.layout.text());
  }
  if (options_.on_loaded) options_.on_loaded(loaded.report.seconds);
  if (options_.adapters) {
    bank_ = std::make_unique<model::AdapterBank>(options_.adapters, model_->device(), model_->compute_dtype(),
                                                 options_.max_resident_adapters);
    std::lock_guard<std::mutex> lock(residency_mu_);
    residency_.serves = true;
  }
  const auto t0 = std::chrono::steady_clock::now();
  warm_up();
  spdlog::info("replica={} event=ready load_seconds={:.3f} warmup_seconds={:.3f} parameters={}", options_.name,
               loaded.report.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               loaded.report.parameter_count);
}

void ModelReplica::probe() {
  if (!model_) throw std::logic_error("replica " + options_.name + " has no model loaded");
  if (dead_) throw InjectedFault("injected fault (--fault-inject ...:dead): re-test of replica " + options_.name);
  c10::InferenceMode inference;
  warm_up();
}

const model::SkyReelsV2Transformer& ModelReplica::model_of_rank(int64_t rank) const {
  if (options_.rank_devices.empty() || rank == 0) return *model_;
  if (options_.shard_weights) return *rank_models_.at("rank" + std::to_string(rank));
  const std::string& device = options_.rank_devices.at(static_cast<size_t>(rank));
  return device == options_.device ? *model_ : *rank_models_.at(device);
}

at::Tensor ModelReplica::on_every_rank(const RankLoop& loop, const model::StepHooks& hooks, int64_t run_number) {
  // Every transformer call is counted once: by the first sequence rank of each guidance half.
  std::mutex calls_mutex;
  auto count_call = [&](const model::TransformerCallReport& call) {
    const std::lock_guard<std::mutex> lock(calls_mutex);
    if (hooks.on_call) hooks.on_call(call);
  };
  at::Tensor result;
  model::run_on_ranks(options_.layout, options_.collective_timeout, [&](int64_t rank, const model::RankGroups& g) {
    if (rank == 0) {
      model::StepHooks first = hooks;
      first.on_call = count_call;
      result = loop(*model_, first, &g);
      return;
    }
    // The other ranks: this replica's thread settings, and only their own faults (rank 0 polls the stop).
    if (options_.threads > 0) at::set_num_threads(options_.threads);
    c10::InferenceMode inference;
    model::StepHooks mine;
    mine.on_step = [&, rank](int64_t, int64_t, int64_t) {
      if (const FaultRule* fault = fault_due(run_number, rank)) throw_fault(*fault, run_number);
    };
    if (g.reports_calls()) mine.on_call = count_call;
    loop(model_of_rank(rank), mine, &g);
  });
  return result;
}

// One forward on the smallest input: the first real chunk does not pay for lazy initialisation, and a re-test shows
// whether the device works again (a group's: every rank's, through its exchanges).
void ModelReplica::warm_up() const {
  if (!options_.layout.single()) {
    model::run_on_ranks(options_.layout, options_.collective_timeout, [&](int64_t rank, const model::RankGroups& g) {
      c10::InferenceMode inference;
      warm_up_rank(model_of_rank(rank), g.ulysses, g.all);
    });
    return;
  }
  warm_up_rank(*model_, nullptr, nullptr);
}

void ModelReplica::warm_up_rank(const model::SkyReelsV2Transformer& transformer, model::RankGroup* ulysses,
                                model::RankGroup* all) const {
  const auto& config = transformer.config();
  const auto device = transformer.device();
  model::TransformerForwardArgs args;
  args.hidden_states =
      at::zeros({1, config.in_channels, config.patch_size[0], config.patch_size[1], config.patch_size[2]},
                at::TensorOptions().device(device).dtype(transformer.compute_dtype()));
  args.timestep = at::zeros({1, config.patch_size[0]}, at::TensorOptions().device(device).dtype(at::kLong));
  args.encoder_hidden_states =
      at::zeros({1, 1, config.text_dim}, at::TensorOptions().device(device).dtype(transformer.compute_dtype()));
  if (config.inject_sample_info) args.fps = at::ones({1}, at::TensorOptions().device(device).dtype(at::kLong));
  if (config.has_image_branch()) {  // an I2V model attends to image tokens (a first-last-frame one: exactly its count)
    args.encoder_hidden_states_image = at::zeros({1, config.pos_embed_seq_len.value_or(1), *config.image_dim},
                                                 at::TensorOptions().device(device).dtype(transformer.compute_dtype()));
  }
  args.sequence_parallel = ulysses;
  args.weight_ranks = all;
  transformer.forward(args);
}

AdapterResidency ModelReplica::adapter_residency() const {
  std::lock_guard<std::mutex> lock(residency_mu_);
  return residency_;
}

std::vector<model::ActiveAdapter> ModelReplica::activate_adapters(const std::vector<AdapterChoice>& loras) {
  std::vector<model::ActiveAdapter> active;
  if (loras.empty()) return active;
  if (!bank_) throw std::invalid_argument("loras: replica " + options_.name + " has no adapters (--lora-dir)");
  const int64_t loads_before = bank_->loads();
  // The file each was accepted with (its recorded SHA-256): one changed since then fails the job naming it.
  for (const AdapterChoice& a : loras) active.push_back({bank_->acquire(a.name, a.sha256), a.scale.value_or(1.0)});
  AdapterResidency now{bank_->resident(), bank_->loads(), true};
  {
    std::lock_guard<std::mutex> lock(residency_mu_);
    residency_ = now;
  }
  if (now.loads > loads_before) {
    spdlog::info("replica={} event=adapters_loaded loads={} resident={}", options_.name, now.loads,
                 now.resident.size());
    if (options_.on_adapter_load) {
      options_.on_adapter_load(now.loads - loads_before, static_cast<int64_t>(now.resident.size()));
    }
  }
  return active;
}

const FaultRule* ModelReplica::fault_due(int64_t run, int64_t rank) const {
  for (const auto& rule : options_.faults) {
    if (rule.replica != options_.name || rule.rank != rank) continue;
    if (run == rule.nth || (rule.and_later && run > rule.nth)) return &rule;
  }
  return nullptr;
}

ChunkResult ModelReplica::run(const ChunkWork& work, const ChunkCallbacks& callbacks) {
  if (!model_) throw std::logic_error("replica " + options_.name + " has no model loaded");
  auto* job = dynamic_cast<ModelJob*>(work.payload);
  if (job == nullptr) throw std::logic_error("replica " + options_.name + ": the job payload is not a ModelJob");
  const int64_t run_number = ++runs_;
  const FaultRule* fault = fault_due(run_number);

  c10::InferenceMode inference;
  model::StepHooks hooks;
  // Polled before every row and after every transformer block: a cancel, deadline or drain acts within one block.
  hooks.cancelled = [this, &callbacks] {
    if (options_.block_delay.count() > 0) std::this_thread::sleep_for(options_.block_delay);
    return callbacks.should_stop();
  };
  hooks.on_step = [&](int64_t, int64_t row, int64_t rows) {
    if (fault) throw_fault(*fault, run_number);
    if (options_.step_delay.count() > 0) std::this_thread::sleep_for(options_.step_delay);
    callbacks.on_step(row + 1, rows);
  };
  // Encoded here, on the replica's thread, only on the rows preview_every selects (the PNG is the measured cost).
  hooks.on_preview = [&callbacks](const model::ChunkPreview& p) {
    if (!callbacks.on_preview) return;
    const at::Tensor strip = model::preview_strip(p);
    const std::vector<uint8_t> png = video::encode_png(strip, model::kPreviewPngCompression);
    ChunkPreviewImage image;
    image.chunk = p.chunk;
    image.step = p.row + 1;
    image.steps = p.rows;
    image.frame_begin = p.first_frame;
    image.frame_end = p.first_frame + p.x0.size(2);
    image.frame_width = p.x0.size(4);
    image.frame_height = p.x0.size(3);
    image.png.assign(png.begin(), png.end());
    callbacks.on_preview(std::move(image));
  };
  // What the chunk's transformer calls computed against the uncached plan (logged per chunk, counted in metrics).
  struct {
    int64_t full = 0, computed = 0, exact = 0, cache = 0;
  } work_done;
  hooks.on_call = [this, &work_done](const model::TransformerCallReport& call) {
    work_done.full += call.token_blocks_full;
    work_done.computed += call.token_blocks_computed;
    work_done.exact += call.token_blocks_saved_exact;
    work_done.cache += call.token_blocks_saved_cache;
    if (options_.on_transformer_work) {
      options_.on_transformer_work(call.token_blocks_computed, call.token_blocks_saved_exact,
                                   call.token_blocks_saved_cache);
    }
  };
  std::string bytes;  // the chunk's result, for the job store
  std::vector<model::ActiveAdapter> adapters;
  try {
    adapters = activate_adapters(job->params().loras);
  } catch (const std::exception& e) {
    // An adapter file replaced (or unreadable) since the start: the job's fault, not the replica's; never another video.
    return {ChunkOutcome::Rejected, e.what(), 0, {}, {}};
  }
  const bool spread = std::any_of(options_.rank_devices.begin(), options_.rank_devices.end(),
                                  [&](const std::string& d) { return d != options_.device; });
  if (spread && !adapters.empty()) {
    return {ChunkOutcome::Rejected,
            "loras: replica " + options_.name + " spreads one video over several CUDA devices; adapters per request "
            "are not supported there yet",
            0, {}, {}};
  }
  const RankRunner ranks = [&](const RankLoop& loop) { return on_every_rank(loop, hooks, run_number); };
  try {
    bytes = job->run_chunk(*model_, work.chunk_index, hooks, adapters, options_.layout.single() ? nullptr : &ranks);
    spdlog::info("replica={} event=chunk_work chunk={} token_blocks_full={} computed={} saved_exact={} saved_cache={}",
                 options_.name, work.chunk_index, work_done.full, work_done.computed, work_done.exact,
                 work_done.cache);
  } catch (const model::GenerationCancelled&) {
    return {ChunkOutcome::Stopped, "", 0, {}, {}};
  } catch (const std::invalid_argument& e) {
    // The model refuses this request's inputs (validation missed a case): the job's fault, not the replica's.
    return {ChunkOutcome::Rejected, e.what(), 0, {}, {}};
  } catch (const std::exception& e) {
    if (!is_out_of_memory(e)) throw;  // counts against the replica
    // Out of memory: this request is too large for the device. Its tensors are freed by now; hand the memory back.
    release_memory();
    return {
        ChunkOutcome::ResourceExhausted,
        std::string("out of memory on replica ") + options_.name + " (the request is too large for it): " + e.what(),
        0, {}, {}};
  }
  ChunkResult done{ChunkOutcome::Succeeded, "", job->chunk_pixel_frames(work.chunk_index), std::move(bytes), {}};
  done.work = {work_done.full, work_done.computed, work_done.exact, work_done.cache};
  return done;
}

void ModelReplica::throw_fault(const FaultRule& rule, int64_t run_number) {
  const std::string where = "replica " + options_.name + ", chunk run " + std::to_string(run_number);
  switch (rule.kind) {
    case FaultKind::OutOfMemory:
      // The message LibTorch 1.13's CPU allocator raises, so that the real classifier is exercised.
      throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                       "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes "
                       "(injected fault, --fault-inject ...:oom, " +
                           where + ")");
    case FaultKind::Dead:
      dead_ = true;
      throw InjectedFault("injected fault (--fault-inject ...:dead) on " + where);
    case FaultKind::Kill:
      spdlog::error("replica={} event=injected_kill run={}", options_.name, run_number);
      ::kill(::getpid(), SIGKILL);
      break;
    case FaultKind::Stall:  // silent past the peers' timeout, then gone
      std::this_thread::sleep_for(options_.collective_timeout + std::chrono::seconds(1));
      break;
    case FaultKind::Error:
      break;
  }
  throw InjectedFault("injected fault (--fault-inject) on " + where);
}

}  // namespace skyreels::server
