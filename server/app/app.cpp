// skyreels-server's assembly: the store, the replicas, the encoders, the scheduler, the transports, signals and the
// drain, in the order they start. Its flags are server_flags.h's; `main` is server/main.cpp.
//
// Shutdown (SIGTERM or SIGINT): readiness turns NOT_SERVING at once and new jobs are refused (UNAVAILABLE); jobs
// already accepted, queued ones included, keep running until they are all done or --drain-timeout-seconds passes;
// then whatever is left is stopped at its next denoising step and ends FAILED/UNAVAILABLE ("drain timeout"). After
// the last job ends, reads (GetJob, WatchJob, DownloadResult) are still answered for a short grace period so clients
// can collect results, then the gRPC server shuts down and the process exits 0. A second signal skips the wait.
#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "model/adapter_bank.h"
#include "model/pipeline_t2v_i2v.h"
#include "model/runtime.h"
#include "model/transformer_loader.h"
#include "server/api/auth.h"
#include "server/app/app.h"
#include "server/app/host_port.h"
#include "server/app/server_flags.h"
#include "server/replica/demo_model.h"
#include "server/media/encoders.h"
#include "server/store/job_store_timed.h"
#include "server/job/limits.h"
#include "server/metrics/metrics.h"
#include "server/replica/replica.h"
#include "server/queue/restore_job.h"
#include "server/queue/scheduler.h"
#include "server/api/interceptors.h"
#include "server/api/probes.h"
#include "server/api/service.h"
#include "server/http/http_api.h"
#include "server/http/http_server.h"
#include "server/http/metrics_port.h"
#include "server/webhook/webhook_sender.h"

#ifndef SKYREELS_VERSION
#define SKYREELS_VERSION "dev"
#endif

namespace {

using namespace skyreels::server;

using Options = ServerOptions;

// After the drain ends, how long running chunks get to stop (they check after every transformer block).
constexpr auto kFinalWait = std::chrono::seconds(5);

std::chrono::milliseconds to_millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::string read_file(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(flag + ": cannot read '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// SIGTERM / SIGINT, counted; SIGHUP calls on_reload (re-reads the API key file).
struct Signals {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  int last = 0;
  std::function<void()> on_reload;  // set under mu
};

// The TLS certificate and key are re-read by gRPC's file watcher (a renewed certificate is served without a restart);
// both files are read once here first so that a wrong path fails the start.
constexpr unsigned kTlsRefreshSeconds = 10;

std::shared_ptr<grpc::ServerCredentials> tls_credentials(const Options& o) {
  read_file(o.tls_key, "--tls-key");
  read_file(o.tls_cert, "--tls-cert");
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(o.tls_key, o.tls_cert, kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  return grpc::experimental::TlsServerCredentials(options);
}

bool is_loopback_address(const std::string& listen, const char* flag) {
  const std::string host = split_host_port(listen, flag).first;
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// Configurations that work but expose more than an operator may think.
void warn_about_exposure(const Options& o) {
  if (o.api_keys.empty() && !is_loopback_address(o.listen, "--listen")) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"no --api-keys: any client that reaches this address can "
        "submit, watch, cancel and download every job\"",
        o.listen);
  }
  if (o.api_keys.empty() && !o.http_listen.empty() && !is_loopback_address(o.http_listen, "--http-listen")) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"no --api-keys: any client that reaches this HTTP address can "
        "submit, watch, cancel and download every job\"",
        o.http_listen);
  }
  if (!o.api_keys.empty() && o.tls_cert.empty()) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"--api-keys without --tls-cert: keys travel in plaintext; "
        "terminate TLS in front of this port or pass --tls-cert/--tls-key\"",
        o.listen);
  }
}

// A handler, not a blocked mask and sigwait: libraries start threads before main (LibTorch 2.x, OpenMP), and a
// process signal may land on any thread that does not block it. The handler only writes the signal number into a
// pipe (async-signal-safe); a watcher thread reads it and counts it.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_shutdown_signal(int sig) {
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

void reload(Signals& signals) {
  std::function<void()> on_reload;
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    on_reload = signals.on_reload;
  }
  if (!on_reload) return;
  try {
    on_reload();
    spdlog::info("event=reloaded signal=SIGHUP");
  } catch (const std::exception& e) {
    spdlog::error("event=reload_failed error=\"{}\" (the previous keys stay in use)", e.what());
  }
}

void watch_signals(Signals& signals) {
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_shutdown_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  std::thread([&signals] {
    while (true) {
      unsigned char byte = 0;
      const ssize_t n = ::read(g_signal_pipe[0], &byte, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n != 1) return;
      if (byte == SIGHUP) {
        reload(signals);
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(signals.mu);
        ++signals.count;
        signals.last = byte;
      }
      signals.cv.notify_all();
      spdlog::info("event=signal signal={}", static_cast<int>(byte));
    }
  }).detach();
}

void wait_for(Signals& signals, int count, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(signals.mu);
  signals.cv.wait_for(lock, timeout, [&] { return signals.count >= count; });
}

int signal_count(Signals& signals) {
  std::lock_guard<std::mutex> lock(signals.mu);
  return signals.count;
}

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

struct TempDir {
  std::string path;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// The job store first: a store that cannot be used stops the start before a model is loaded.
std::unique_ptr<JobStore> open_store(const Options& o) {
  const std::string spec =
      o.job_store.empty() ? "sqlite:" + (std::filesystem::path(o.data_dir) / "jobs.sqlite").string() : o.job_store;
  std::unique_ptr<JobStore> store = with_leases(open_job_store(spec));
  spdlog::info("event=job_store store={} durable={}", store->describe(), store->durable());
  return store;
}

// The transformer checkpoint (or the demo's tiny one) and the LoRA adapters, checked before any replica loads.
struct CheckedModel {
  TempDir demo_dir;  // the demo's weights, removed once every replica holds them
  std::string path;
  skyreels::model::MappedTransformerCheckpoint mapped;
  std::vector<skyreels::model::LoraAdapter> adapters;  // only checked here: the replicas read their own copies
  std::shared_ptr<const skyreels::model::AdapterCatalogue> catalogue;  // --lora-dir, shared by every replica
};

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
  int64_t available = 0;
  for (const auto& a : catalogue->adapters()) {
    available += a.available;
    if (a.available) {
      spdlog::info("event=adapter name={} sha256={} format={} rank={} parameters={}", a.name, a.sha256, a.format,
                   a.rank, a.parameters);
    } else {
      spdlog::warn("event=adapter_unavailable name={} reason=\"{}\"", a.name, a.reason);
    }
  }
  spdlog::info("event=adapters_catalogued dir={} adapters={} available={} seconds={:.3f}", o.lora_dir,
               catalogue->adapters().size(), available, std::chrono::duration<double>(Clock::now() - t0).count());
  return catalogue;
}

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
  return m;
}

// One ModelReplica per planned device. Metrics come later (`work_sink`); replicas only report once they run chunks.
struct Replicas {
  std::vector<ReplicaOptions> plans;
  std::vector<FaultRule> faults;
  std::vector<std::unique_ptr<ChunkExecutor>> executors;
  std::vector<std::string> names;
  std::vector<ReplicaDescription> descriptions;
};

Replicas make_replicas(const Options& o, const CheckedModel& model,
                       const std::shared_ptr<std::atomic<Metrics*>>& work_sink) {
  Replicas r;
  r.plans = plan_replicas(o.devices, skyreels::runtime::available_cores(), cuda_device_count());
  r.faults = parse_fault_rules(o.fault_inject);
  for (auto& plan : r.plans) {
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
    r.descriptions.push_back({plan.name, plan.device, plan.threads});
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

SchedulerOptions scheduling_options(const Options& o) {
  SchedulerOptions scheduling;
  scheduling.max_jobs = o.max_queue;
  scheduling.max_jobs_per_client = o.transport.max_jobs_per_client;
  scheduling.chunk_retries = static_cast<int>(o.chunk_retries);
  scheduling.chunk_takeover_limit = static_cast<int>(o.chunk_takeover_limit);
  scheduling.replica_failure_limit = static_cast<int>(o.replica_failure_limit);
  scheduling.handoff_cost_seconds = o.handoff_cost_seconds;
  scheduling.retention = std::chrono::seconds(o.result_ttl_seconds);
  scheduling.max_retained_jobs = o.max_retained_jobs;
  scheduling.retest_backoff = to_millis(o.replica_retest_seconds);
  scheduling.retest_backoff_max = std::max(scheduling.retest_backoff, to_millis(o.replica_retest_max_seconds));
  scheduling.liveness_grace = std::chrono::seconds(o.liveness_grace_seconds);
  return scheduling;
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
  for (int i = 0; i < 3; ++i) c.model.patch_size[i] = config.patch_size[static_cast<size_t>(i)];
  c.model.text_dim = config.text_dim;
  c.model.num_frame_per_block = config.num_frame_per_block;
  c.model.latent_channels = config.out_channels;
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
  c.adapters = model.catalogue;
  c.max_resident_adapters = static_cast<size_t>(o.max_resident_adapters);
  ModelSummary& summary = c.summary;
  summary.source = o.demo ? "demo" : o.model;
  summary.dtype = skyreels::runtime::resolve_dtype_name(o.dtype, replicas.plans.front().device);
  summary.parameter_count = model.mapped.report.parameter_count;
  summary.num_layers = config.num_layers;
  summary.num_attention_heads = config.num_attention_heads;
  summary.attention_head_dim = config.attention_head_dim;
  summary.text_dim = config.text_dim;
  summary.ffn_dim = config.ffn_dim;
  summary.in_channels = config.in_channels;
  summary.out_channels = config.out_channels;
  summary.patch_size = {config.patch_size[0], config.patch_size[1], config.patch_size[2]};
  summary.inject_sample_info = config.inject_sample_info;
  summary.num_frame_per_block = config.num_frame_per_block;
  summary.image_dim = config.image_dim.value_or(0);
  for (const auto& a : model.adapters) {
    const auto r = skyreels::model::lora_report(a);
    summary.loras.push_back({r.path, r.scale, r.format, r.parameters, r.max_rank});
  }
  if (model.catalogue) {
    for (const auto& a : model.catalogue->adapters()) {
      summary.adapters.push_back({a.name, a.sha256, a.format, a.reason, a.rank, a.parameters, a.available});
    }
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
  return c;
}

// The one job queue over the store; payloads are re-created from the store (after a restart, where expired leases
// are taken over; on another pod; after this server evicted them).
std::unique_ptr<JobQueue> make_queue(const Options& o, Replicas& replicas, JobStore& store,
                                     const ServiceConfig& service_config, SchedulerObserver& observers) {
  PodOptions pod;
  pod.scheduling = scheduling_options(o);
  pod.pod = o.pod_name;
  pod.lease_ttl = to_millis(o.lease_seconds);
  auto loader = [&service_config](const StoredJob& job, std::vector<StoredChunk> chunks) {
    return restore_job(job, std::move(chunks), service_config.model, service_config.limits,
                       job_parts(service_config, service_config.text_encoder));
  };
  auto jobs = std::make_unique<Scheduler>(std::move(replicas.executors), pod, store, loader, &observers);
  spdlog::info("event=scheduler store={} shared={} pod={} lease_seconds={}", store.describe(),
               store.leases()->shared(), o.pod_name, o.lease_seconds);
  return jobs;
}

std::unique_ptr<grpc::Server> start_grpc(const Options& o, grpc::Service& service, int64_t max_request_bytes,
                                         Metrics& metrics, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!o.tls_cert.empty()) credentials = tls_credentials(o);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, credentials, port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_request_bytes));
  builder.SetMaxSendMessageSize(16 << 20);
  grpc::ResourceQuota quota("skyreels-server");
  quota.SetMaxThreads(o.transport.max_threads());  // streams never take the last 64 threads
  builder.SetResourceQuota(quota);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(make_malformed_request_interceptor());
  interceptors.push_back(make_rpc_metrics_interceptor(metrics));  // after it: counts the status clients get
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) throw std::runtime_error("--listen: cannot listen on " + o.listen);
  return server;
}

// What the health service says, for the HTTP probes too.
struct Health {
  std::atomic<bool> ready{false};
  std::atomic<bool> live{true};
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Webhook deliveries (--webhook-secret-file, --webhook-allow-hosts), from the job store's event logs.
std::unique_ptr<WebhookSender> make_webhooks(const Options& o, JobStore& store, Metrics& metrics) {
  if (o.webhook_secret_file.empty()) return nullptr;
  WebhookOptions options;
  options.secret = read_webhook_secret(o.webhook_secret_file);
  options.allow_hosts = split_list(o.webhook_allow_hosts);
  options.takeover_grace = std::chrono::seconds(o.webhook_takeover_seconds);
  spdlog::info("event=webhooks allow_hosts=\"{}\"", o.webhook_allow_hosts);
  return std::make_unique<WebhookSender>(store, std::move(options), &metrics);
}

// The HTTP door (--http-listen): its calls go into the gRPC service over the in-process channel.
std::unique_ptr<http::HttpServer> start_http(const Options& o, grpc::Server& server, const Health& health,
                                             Metrics& metrics, const ServiceConfig& service) {
  if (o.http_listen.empty()) return nullptr;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  http::HttpApiConfig config;
  config.ready = [&health] { return health.ready.load(); };
  config.live = [&health] { return health.live.load(); };
  config.metrics = [&metrics] { return metrics.render(); };
  config.observe = [&metrics](const std::string& route, int status, double seconds) {
    metrics.http_handled(route, status, seconds);
  };
  config.vae_available = service.vae_available;
  config.result_ttl_seconds = o.result_ttl_seconds;
  auto api = std::make_shared<http::HttpApi>(server.InProcessChannel(arguments), std::move(config));
  http::HttpOptions options;
  options.listen = o.http_listen;
  if (!o.tls_cert.empty()) {
    options.tls_cert = read_file(o.tls_cert, "--tls-cert");
    options.tls_key = read_file(o.tls_key, "--tls-key");
  }
  options.max_body_bytes = service.max_request_bytes;
  options.max_connections = static_cast<unsigned>(o.transport.max_streams);
  options.max_connections_per_client = static_cast<unsigned>(o.transport.max_streams_per_client);
  options.idle_timeout_seconds = static_cast<unsigned>(o.http_idle_timeout_seconds);
  auto listener = std::make_unique<http::HttpServer>(
      options, [api](const http::Request& r) { return api->handle(r); }, &http::HttpApi::refuse);
  spdlog::info("event=http_listening address={} port={} tls={}", o.http_listen, listener->port(), !o.tls_cert.empty());
  return listener;
}

// Until a signal: readiness follows the queue and whether unary calls are answered, liveness the replicas.
void serve_until_signal(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, TempDir& demo_dir,
                        Health& state) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  UnaryProbe unary(server);
  bool ready = false, live = true;
  while (signal_count(signals) == 0) {
    if (!demo_dir.path.empty() && jobs.all_loaded()) {
      // Every replica has its (mapped or copied) weights: the files can go now, even if the process is killed later.
      std::error_code ec;
      std::filesystem::remove_all(demo_dir.path, ec);
      demo_dir.path.clear();
    }
    const bool now_ready = jobs.ready() && unary.answered();
    if (now_ready != ready) {
      health->SetServingStatus("", now_ready);
      state.ready = now_ready;
      spdlog::info("event=readiness serving={}", now_ready);
      ready = now_ready;
    }
    if (const bool now_live = jobs.live(); now_live != live) {
      health->SetServingStatus("liveness", now_live);
      state.live = now_live;
      if (now_live) {
        spdlog::info("event=liveness serving=true");
      } else {
        spdlog::error(
            "event=liveness serving=false reason=\"no healthy replica for {} s\" (the pod should be restarted)",
            o.liveness_grace_seconds);
      }
      live = now_live;
    }
    wait_for(signals, 1, std::chrono::milliseconds(100));
  }
}

// Readiness off, no new jobs; admitted ones finish within the drain timeout, else they stop (kept in the store).
void drain(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, VideoEncoder* video,
           Health& state) {
  state.ready = false;
  spdlog::info("event=draining signal={} queued={} running={} timeout_seconds={}", signals.last, jobs.queued_jobs(),
               jobs.running_jobs(), o.drain_timeout_seconds);
  server.GetHealthCheckService()->SetServingStatus("", false);
  jobs.begin_drain();
  const auto drain_deadline = Clock::now() + std::chrono::seconds(o.drain_timeout_seconds);
  bool idle = false;
  while (!(idle = jobs.wait_idle(std::min(drain_deadline, Clock::now() + std::chrono::milliseconds(100))))) {
    if (Clock::now() >= drain_deadline || signal_count(signals) >= 2) break;
  }
  if (!idle) {
    const std::string reason = signal_count(signals) >= 2 ? "server stopped (second signal)" : "drain timeout";
    spdlog::warn("event=drain_abort reason=\"{}\" queued={} running={}", reason, jobs.queued_jobs(),
                 jobs.running_jobs());
    jobs.abort_all(reason);
    // Running chunks stop after their current transformer block; a block that does not end in time is abandoned.
    if (!jobs.wait_idle(Clock::now() + kFinalWait)) {
      spdlog::error("event=exit forced=true reason=\"{} chunk(s) still running {} s after the drain ended\"",
                    jobs.running_jobs(), std::chrono::duration_cast<std::chrono::seconds>(kFinalWait).count());
      spdlog::default_logger()->flush();
      std::_Exit(0);  // the workers are inside a forward: destructors would wait for them
    }
  } else if (signal_count(signals) < 2) {
    // MP4s trail the latents by one VAE decode; then let clients that follow a job fetch its result.
    if (video) video->wait_idle(drain_deadline);
    wait_for(signals, 2, std::chrono::milliseconds(1500));
  }
}

// The model's parts besides the transformer, each loaded once when its flag names it, its load time reported.
struct ModelParts {
  TextEncoderFn text_encoder;
  std::unique_ptr<VideoEncoder> video;
  std::shared_ptr<const ImageEncoder> image_encoder;
};

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

int serve(const Options& o, Signals& signals) {
  std::unique_ptr<JobStore> store = open_store(o);
  const std::unique_ptr<CheckedModel> model = check_model(o);
  auto work_sink = std::make_shared<std::atomic<Metrics*>>(nullptr);
  Replicas replicas = make_replicas(o, *model, work_sink);

  // ---- metrics and the optional model parts ----
  Metrics metrics(replicas.names, SKYREELS_VERSION, skyreels::model::describe_loras(o.loras));
  work_sink->store(&metrics);
  const std::shared_ptr<void> unsink(nullptr, [work_sink](void*) { work_sink->store(nullptr); });
  store = std::make_unique<TimedJobStore>(std::move(store), metrics.store_call_report());  // before its first use
  ModelParts parts = load_model_parts(o, *model, replicas, *store, metrics);
  const TextEncoderFn& text_encoder = parts.text_encoder;
  const std::unique_ptr<VideoEncoder>& video = parts.video;
  const std::shared_ptr<const ImageEncoder>& image_encoder = parts.image_encoder;
  std::unique_ptr<WebhookSender> webhooks = make_webhooks(o, *store, metrics);
  const std::unique_ptr<http::HttpServer> metrics_port =
      http::serve_metrics(o.metrics_listen, [&metrics] { return metrics.render(); });
  ObserverList observers;
  if (webhooks) observers.add(webhooks.get());
  observers.add(&metrics);
  if (video) observers.add(video.get());

  // ---- the queue and the transport ----
  ApiKeys keys;
  if (!o.api_keys.empty()) {
    keys = ApiKeys::load(o.api_keys);
    spdlog::info("event=api_keys_loaded count={}", keys.size());
  }
  warn_about_exposure(o);
  ServiceConfig config = service_config(o, *model, replicas, keys, text_encoder, video.get(), metrics);
  config.image_encoder = image_encoder;
  if (webhooks) {
    config.check_webhook = [hosts = split_list(o.webhook_allow_hosts)](const std::string& url,
                                                                       const std::vector<std::string>& events) {
      std::string why = check_webhook_url(url, hosts);
      return why.empty() ? check_webhook_events(events) : why;
    };
  }
  // The service and the drain see only the JobQueue seam.
  std::unique_ptr<JobQueue> jobs = make_queue(o, replicas, *store, config, observers);
  // MP4s follow every commit the queue sees, also those of chunks another pod ran.
  if (video) {
    video->follow_with([&jobs](const std::string& id, const std::string& owner) { return jobs->get(id, owner); },
                       &jobs->changes());
  }
  struct StopFollowing {  // destroyed before `jobs`, however serve() ends
    VideoEncoder* video;
    WebhookSender* webhooks;
    ~StopFollowing() {
      if (video) video->follow_with({}, nullptr);
      if (webhooks) webhooks->stop_following();
    }
  } stop_following{video.get(), webhooks.get()};
  jobs->start();
  if (webhooks) webhooks->start(&jobs->changes());
  auto service = make_video_service(*jobs, config);
  int port = 0;
  const std::unique_ptr<grpc::Server> server = start_grpc(o, *service, config.max_request_bytes, metrics, &port);
  server->GetHealthCheckService()->SetServingStatus("", false);
  server->GetHealthCheckService()->SetServingStatus("liveness", true);
  spdlog::info("event=listening address={} port={} tls={} api_keys={} replicas={} version={}", o.listen, port,
               !o.tls_cert.empty(), keys.enabled(), replicas.names.size(), SKYREELS_VERSION);
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    signals.on_reload = [&keys] {
      keys.reload();
      spdlog::info("event=api_keys_loaded count={}", keys.size());
    };
  }

  Health health;
  std::unique_ptr<http::HttpServer> http_server = start_http(o, *server, health, metrics, config);
  serve_until_signal(o, signals, *jobs, *server, model->demo_dir, health);
  drain(o, signals, *jobs, *server, video.get(), health);
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    signals.on_reload = nullptr;  // `keys` goes out of scope with this function
  }
  spdlog::info("event=shutdown");
  http_server.reset();  // its calls go through the gRPC server
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}

}  // namespace

namespace skyreels::server {

int server_main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  Options options;
  try {
    bool print_flags = false;
    std::vector<char*> args{argv[0]};
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::cout << server_usage();
        return 0;
      }
      if (a == "--version") {
        std::cout << "skyreels-server " << SKYREELS_VERSION << "\n";
        return 0;
      }
      if (a == "--print-flags") {
        print_flags = true;
      } else {
        args.push_back(argv[i]);
      }
    }
    options = parse_server_flags(static_cast<int>(args.size()), args.data(), nullptr, !print_flags);
    if (print_flags) {
      std::cout << print_server_flags(options);
      return 0;
    }
  } catch (const UsageError& e) {
    std::cerr << "skyreels-server: " << e.what() << "\n\n" << server_usage();
    return 2;
  }
  const auto level = spdlog::level::from_str(options.log_level);
  spdlog::set_level(level == spdlog::level::off && options.log_level != "off" ? spdlog::level::info : level);

  Signals signals;
  try {
    watch_signals(signals);
    return serve(options, signals);
  } catch (const UsageError& e) {
    std::cerr << "skyreels-server: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    spdlog::critical("event=fatal error=\"{}\"", e.what());
    std::cerr << "skyreels-server: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace skyreels::server
