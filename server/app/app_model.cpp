// The model side of the assembly: the transformer checkpoint and the adapters checked before any replica loads, the
// replicas planned, the work limits derived from the model and the devices' memory, the optional model parts (text
// encoder, VAE / MP4 encoder, image encoder) loaded, and what the service knows of them all (ServiceConfig).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "model/adapter_bank.h"
#include "model/magcache_ratios.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/runtime.h"
#include "model/parallel_layout.h"
#include "model/transformer_loader.h"
#include "server/app/app_steps.h"
#include "server/job/limits.h"
#include "server/replica/demo_model.h"

namespace skyreels::server::assembly {

namespace {

// --max-chunk-tokens and --max-job-work: the flags, else derived from the model and the smallest replica's share of
// its device's memory (replicas on one device share it).
void set_work_limits(const Options& o, const skyreels::model::TransformerConfig& config,
                     const std::vector<ReplicaOptions>& plans, int64_t parameter_count, ServerLimits& limits) {
  const bool bf16 = skyreels::runtime::resolve_dtype_name(o.dtype, plans.front().device) == "bfloat16";
  ModelFootprint footprint;
  footprint.dim = config.num_attention_heads * config.attention_head_dim;
  footprint.ffn_dim = config.ffn_dim;
  footprint.parameter_count = parameter_count;
  footprint.weight_bytes = bf16 ? 2 : 4;
  footprint.activation_bytes = bf16 ? 2 : 4;
  uint64_t memory = 0;
  bool known = true;
  for (const auto& plan : plans) {
    const auto sharing =
        std::count_if(plans.begin(), plans.end(), [&](const auto& p) { return p.device == plan.device; });
    const uint64_t share = device_memory_bytes(plan.device) / static_cast<uint64_t>(sharing);
    if (share == 0) known = false;
    if (memory == 0 || share < memory) memory = share;
  }
  limits.kv_cache_bytes =
      o.kv_cache_bytes >= 0 ? o.kv_cache_bytes : default_kv_cache_bytes(footprint, known ? memory : 0);
  const int64_t derived_tokens = default_max_chunk_tokens(footprint, known ? memory : 0, limits.kv_cache_bytes);
  limits.max_chunk_tokens = o.max_chunk_tokens > 0 ? o.max_chunk_tokens : derived_tokens;
  limits.max_job_work =
      o.max_job_work > 0 ? o.max_job_work : default_max_job_work(limits.max_chunk_tokens, o.max_steps);
  limits.max_chunks = o.max_chunks;
  spdlog::info(
      "event=work_limits max_chunk_tokens={}{} max_job_work={}{} max_chunks={} device_memory_gb={:.1f} "
      "activation_bytes_per_token={} kv_cache_bytes={}{}",
      limits.max_chunk_tokens, o.max_chunk_tokens > 0 ? "" : " (derived)", limits.max_job_work,
      o.max_job_work > 0 ? "" : " (derived)", limits.max_chunks, known ? static_cast<double>(memory) / 1e9 : 0.0,
      activation_bytes_per_token(footprint), limits.kv_cache_bytes, o.kv_cache_bytes >= 0 ? "" : " (derived)");
}

// --lora-dir: every adapter file's header and SHA-256, checked against the model (not its tensors: bounded time and
// memory for a directory of any size).
std::shared_ptr<const skyreels::model::AdapterCatalogue> catalogue_adapters(
    const Options& o, const skyreels::model::TransformerConfig& config) {
  if (o.lora_dir.empty()) return nullptr;
  const auto t0 = Clock::now();
  skyreels::model::AdapterCatalogueOptions options;
  options.strict = o.strict_adapters;
  std::shared_ptr<const skyreels::model::AdapterCatalogue> catalogue;
  try {
    catalogue = std::make_shared<const skyreels::model::AdapterCatalogue>(o.lora_dir, config, options);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--lora-dir: ") + e.what());
  }
  const std::vector<skyreels::model::AdapterInfo> adapters = catalogue->adapters();
  int64_t available = 0;
  for (const auto& a : adapters) {
    available += a.available;
    if (a.available) {
      spdlog::info("event=adapter name={} sha256={} format={} rank={} parameters={}", a.name, a.sha256, a.format,
                   a.rank, a.parameters);
    } else {
      spdlog::warn("event=adapter_unavailable name={} reason=\"{}\"", a.name, a.reason);
    }
  }
  spdlog::info("event=adapters_catalogued dir={} adapters={} available={} seconds={:.3f}", o.lora_dir,
               adapters.size(), available, std::chrono::duration<double>(Clock::now() - t0).count());
  return catalogue;
}

}  // namespace

std::unique_ptr<CheckedModel> check_model(const Options& o) {
  auto m = std::make_unique<CheckedModel>();
  m->path = o.model;
  if (o.demo) {
    m->demo_dir.path = make_private_temp_dir("skyreels-demo");
    write_tiny_model(m->demo_dir.path);
    m->path = m->demo_dir.path;
    spdlog::info("event=demo_model path={} (random weights, fixed seed)", m->path);
  }
  if (!o.tokenizer.empty() && o.text_encoder.empty()) throw UsageError("--tokenizer needs --text-encoder");
  m->mapped = skyreels::model::map_transformer_checkpoint(m->path);
  if (!o.image_processor.empty() && o.image_encoder.empty()) throw UsageError("--image-processor needs --image-encoder");
  if (m->mapped.config.has_image_branch()) {
    // Every job of an I2V checkpoint is i2v: without its encoders it could run none.
    if (o.image_encoder.empty() || o.vae.empty()) {
      throw UsageError("--model: " + m->path + " is an image-to-video (I2V, CLIP image branch) checkpoint; its jobs "
                       "need --image-encoder (the CLIP image encoder) and --vae (which encodes the condition video)");
    }
  } else if (!o.image_encoder.empty()) {
    throw UsageError("--image-encoder: the model " + m->path + " has no image branch (it is not an I2V checkpoint); "
                     "its image-to-video runs on the diffusion-forcing pipeline with --vae alone");
  }
  // Adapters too: a bad one stops the start here, naming its key, not in every replica.
  for (const auto& spec : o.loras) m->adapters.push_back(skyreels::model::read_lora(spec));
  skyreels::model::check_loras(m->adapters, skyreels::model::transformer_parameter_specs(m->mapped.config));
  for (const auto& a : m->adapters) {
    const auto r = skyreels::model::lora_report(a);
    spdlog::info("event=lora path={} scale={} format={} parameters={} max_rank={} ignored_keys={}", r.path, r.scale,
                 r.format, r.parameters, r.max_rank, r.ignored);
  }
  m->catalogue = catalogue_adapters(o, m->mapped.config);
  if (!o.magcache_ratios.empty()) {
    try {
      m->magcache_ratios =
          skyreels::model::load_magcache_ratios(o.magcache_ratios, skyreels::model::magcache_model_signature(m->mapped))
              .cond;
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--magcache-ratios: ") + e.what());
    }
    spdlog::info("event=magcache_ratios path={} steps={}", o.magcache_ratios, m->magcache_ratios.size());
  }
  return m;
}

void rescan_adapters(const skyreels::model::AdapterCatalogue& catalogue) {
  try {
    const auto t0 = Clock::now();
    const skyreels::model::CatalogueChanges c = catalogue.rescan();
    spdlog::info("event=adapters_rescanned added={} changed={} removed={} seconds={:.3f}", c.added, c.changed,
                 c.removed, std::chrono::duration<double>(Clock::now() - t0).count());
  } catch (const std::exception& e) {
    spdlog::error("event=adapters_rescan_failed error=\"{}\" (the adapters as last read stay listed)", e.what());
  }
}

Replicas make_replicas(const Options& o, const CheckedModel& model,
                       const std::shared_ptr<std::atomic<Metrics*>>& work_sink) {
  Replicas r;
  skyreels::model::ParallelLayout layout;
  try {
    layout = skyreels::model::parse_parallel_layout(o.parallel);
    r.plans = plan_replicas(o.devices, skyreels::runtime::available_cores(), cuda_device_count(), layout);
    skyreels::model::check_parallel_layout(layout, static_cast<int64_t>(r.plans.size()) * layout.ranks(),
                                           model.mapped.config.num_attention_heads, o.shard_weights);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  r.faults = parse_fault_rules(o.fault_inject);
  for (const auto& f : r.faults) {
    if (f.rank >= layout.ranks()) {
      throw UsageError("--fault-inject: rank " + std::to_string(f.rank) + " of replica '" + f.replica +
                       "' does not exist (--parallel " + layout.text() + " has " + std::to_string(layout.ranks()) +
                       " ranks)");
    }
  }
  for (auto& plan : r.plans) {
    plan.collective_timeout = std::chrono::seconds(o.collective_timeout_seconds);
    plan.shard_weights = o.shard_weights;
    plan.on_transformer_work = [work_sink](int64_t computed, int64_t exact, int64_t cache) {
      if (Metrics* m = work_sink->load()) m->transformer_work(computed, exact, cache);
    };
    plan.on_loaded = [work_sink](double seconds) {
      if (Metrics* m = work_sink->load()) m->model_loaded(kComponentTransformer, seconds);
    };
    plan.on_adapter_load = [work_sink, name = plan.name](int64_t loaded, int64_t resident) {
      if (Metrics* m = work_sink->load()) m->adapters_loaded(name, loaded, resident);
    };
    plan.dtype = o.dtype;
    plan.model_path = model.path;
    plan.loras = o.loras;
    plan.adapters = model.catalogue;
    plan.max_resident_adapters = static_cast<size_t>(o.max_resident_adapters);
    plan.faults = r.faults;
    plan.step_delay = std::chrono::milliseconds(o.step_delay_ms);
    plan.block_delay = std::chrono::milliseconds(o.block_delay_ms);
    r.names.push_back(plan.name);
    r.descriptions.push_back({plan.name, plan.device, plan.threads, plan.rank_devices, plan.layout.text()});
    r.executors.push_back(std::make_unique<ModelReplica>(plan));
  }
  for (const auto& f : r.faults) {
    if (f.replica == kVideoEncoderFaultName) continue;  // the VAE/MP4 worker's rules, given to VideoEncoder below
    if (std::find(r.names.begin(), r.names.end(), f.replica) == r.names.end()) {
      throw UsageError("--fault-inject: no replica named '" + f.replica + "'");
    }
  }
  return r;
}

// What the transport knows of the model, the limits and the optional parts.
ServiceConfig service_config(const Options& o, const CheckedModel& model, const Replicas& replicas,
                             const ApiKeys& keys, TextEncoderFn text_encoder, VideoEncoder* video,
                             Metrics& metrics) {
  const auto& config = model.mapped.config;
  ServiceConfig c;
  c.version = SKYREELS_VERSION;
  c.limits.max_frames = o.max_frames;
  c.limits.max_height = o.max_height;
  c.limits.max_width = o.max_width;
  c.limits.max_steps = o.max_steps;
  set_work_limits(o, config, replicas.plans, model.mapped.report.parameter_count, c.limits);
  c.model.config = config;
  c.model.pipelines.clear();
  for (const auto kind : {skyreels::model::PipelineKind::kDiffusionForcing, skyreels::model::PipelineKind::kTextToVideo,
                          skyreels::model::PipelineKind::kImageToVideo}) {
    try {
      skyreels::model::check_pipeline_fits(kind, config);
      c.model.pipelines.emplace_back(skyreels::model::pipeline_kind_name(kind));
    } catch (const std::invalid_argument&) {
    }
  }
  c.model.default_pipeline = skyreels::model::pipeline_kind_name(skyreels::model::default_pipeline(config));
  c.model.first_last_frame = config.pos_embed_seq_len.has_value();
  c.model.magcache_ratios = model.magcache_ratios;
  c.adapters = model.catalogue;
  c.max_resident_adapters = static_cast<size_t>(o.max_resident_adapters);
  ModelSummary& summary = c.summary;
  summary.source = o.demo ? "demo" : o.model;
  summary.dtype = skyreels::runtime::resolve_dtype_name(o.dtype, replicas.plans.front().device);
  summary.parameter_count = model.mapped.report.parameter_count;
  for (const auto& a : model.adapters) {
    const auto r = skyreels::model::lora_report(a);
    summary.loras.push_back({r.path, r.scale, r.format, r.parameters, r.max_rank});
  }
  c.replicas = replicas.descriptions;
  c.api_keys = &keys;
  c.text_encoder = std::move(text_encoder);
  c.vae_available = video != nullptr;
  if (video) {
    c.vae = video->vae();  // image / video conditioning
    c.want_video = [video](const JobSnapshot& job) { video->want(job); };
    c.wait_video = [video](const std::string& id, int64_t chunk, Clock::time_point until) {
      return video->wait_segment(id, chunk, until);
    };
  }
  c.metrics = &metrics;
  c.transport = o.transport;
  c.test_hooks_enabled = o.enable_test_hooks;
  c.test_hooks = active_test_hooks(o);
  return c;
}

ModelParts load_model_parts(const Options& o, const CheckedModel& model, const Replicas& replicas, JobStore& store,
                            Metrics& metrics) {
  ModelParts parts;
  const std::string encoders_device = o.vae_device.empty() ? replicas.plans.front().device : o.vae_device;
  const auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  if (!o.text_encoder.empty()) {
    const auto t0 = Clock::now();
    parts.text_encoder = load_text_encoder(o.text_encoder, o.tokenizer, replicas.plans.front().device, o.dtype,
                                           model.mapped.config.text_dim, &metrics);
    metrics.model_loaded(kComponentTextEncoder, seconds_since(t0));
  }
  if (!o.vae.empty()) {
    const auto t0 = Clock::now();
    parts.video = std::make_unique<VideoEncoder>(o.vae, encoders_device, store, &metrics, 1024, replicas.faults);
    metrics.model_loaded(kComponentVae, seconds_since(t0));
  }
  if (!o.image_encoder.empty()) {
    const auto t0 = Clock::now();
    parts.image_encoder = load_image_encoder(o.image_encoder, o.image_processor, encoders_device, o.dtype,
                                             model.mapped.config.image_dim.value_or(0));
    metrics.model_loaded(kComponentImageEncoder, seconds_since(t0));
  }
  return parts;
}

}  // namespace skyreels::server::assembly
