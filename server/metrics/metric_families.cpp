#include "server/metrics/metric_families.h"

#include <stdexcept>

#include "server/api/api_metrics.h"
#include "server/store/job_store_timed.h"

namespace skyreels::server {

namespace {

using Buckets = std::vector<double>;

// Buckets (seconds) cover the tiny CPU demo model (milliseconds) up to 14B chunks on one GPU (many minutes).
const Buckets kQueueWait = {0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600};
const Buckets kChunk = {0.05, 0.25, 1, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200};
const Buckets kStep = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30};
// A local SQLite commit takes about a millisecond, a PostgreSQL round trip a few; a chunk's latents are megabytes.
const Buckets kStoreCall = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
// A job from submission to its end, and to its first chunk: seconds (tiny demo jobs) to hours (a long 14B video).
const Buckets kJob = {0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400};
// Loading weights: milliseconds (demo) to minutes (a 14B checkpoint from a network volume).
const Buckets kLoad = {0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600};
// gRPC calls and HTTP requests: sub-millisecond reads to streams that last as long as a job.
const Buckets kRpc = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600};

const std::vector<std::string> kOutcomes = {"succeeded", "failed", "cancelled", "deadline_exceeded"};
const std::vector<std::string> kRpcLabels = {"grpc_type", "grpc_service", "grpc_method"};

constexpr MetricType kCounter = MetricType::Counter;
constexpr MetricType kGauge = MetricType::Gauge;
constexpr MetricType kHistogram = MetricType::Histogram;

MetricFamily single(MetricId id, const char* name, MetricType type, const char* help, Buckets buckets = {}) {
  return {id, name, type, help, {}, Series::Single, {}, std::move(buckets)};
}

// skyreels_job_store_seconds' `op` values: every JobStore call, then every LeaseStore call (job_store_timed.h).
std::vector<std::string> store_ops() {
  std::vector<std::string> ops(std::begin(kJobStoreOps), std::end(kJobStoreOps));
  ops.insert(ops.end(), std::begin(kLeaseStoreOps), std::end(kLeaseStoreOps));
  return ops;
}

MetricFamily by_value(MetricId id, const char* name, MetricType type, const char* help, const char* label,
                      std::vector<std::string> values, Buckets buckets = {}) {
  return {id, name, type, help, {label}, Series::Values, std::move(values), std::move(buckets)};
}

MetricFamily by_replica(MetricId id, const char* name, MetricType type, const char* help, Buckets buckets = {}) {
  return {id, name, type, help, {"replica"}, Series::Replicas, {}, std::move(buckets)};
}

MetricFamily on_demand(MetricId id, const char* name, MetricType type, const char* help,
                       std::vector<std::string> labels, Buckets buckets = {}) {
  return {id, name, type, help, std::move(labels), Series::OnDemand, {}, std::move(buckets)};
}

std::vector<MetricFamily> job_families() {
  using M = MetricId;
  return {
      single(M::JobsSubmitted, "skyreels_jobs_submitted_total", kCounter, "Jobs accepted"),
      by_value(M::JobsFinished, "skyreels_jobs_finished_total", kCounter, "Jobs ended, by outcome", "outcome",
               kOutcomes),
      by_value(M::JobsRejected, "skyreels_jobs_rejected_total", kCounter, "Submissions refused, by reason", "reason",
               {kRejectInvalidArgument, kRejectQueueFull, kRejectUnauthenticated, kRejectDraining, kRejectClientLimit,
                kRejectEncoderBusy}),
      single(M::JobsRunning, "skyreels_jobs_running", kGauge, "Jobs with a chunk started and not ended"),
      single(M::QueueDepth, "skyreels_queue_depth", kGauge, "Jobs accepted and not started"),
      single(M::QueueWait, "skyreels_queue_wait_seconds", kHistogram,
             "Time from acceptance to the first chunk starting", kQueueWait),
      by_replica(M::ChunkDuration, "skyreels_chunk_duration_seconds", kHistogram, "Chunk run time, by replica", kChunk),
      by_replica(M::StepDuration, "skyreels_step_duration_seconds", kHistogram, "Denoising row time, by replica",
                 kStep),
      single(M::FramesGenerated, "skyreels_frames_generated_total", kCounter, "Video frames produced"),
      by_replica(M::ReplicaBusy, "skyreels_replica_busy", kGauge, "1 while the replica runs a chunk"),
      by_replica(M::ReplicaHealthy, "skyreels_replica_healthy", kGauge,
                 "1 while the replica is loaded and not taken out"),
      single(M::ChunkHandoffs, "skyreels_chunk_handoffs_total", kCounter,
             "Chunks run on another replica than the job's previous chunk"),
      single(M::ChunkRetries, "skyreels_chunk_retries_total", kCounter, "Chunk attempts repeated after a fault"),
      single(M::ReplicasReady, "skyreels_replicas_ready", kGauge, "Replicas loaded, warmed and healthy"),
      by_replica(M::ReplicaRecoveries, "skyreels_replica_recoveries_total", kCounter,
                 "Times a replica taken out passed its re-test and came back"),
      single(M::VideoChunksEncoded, "skyreels_video_chunks_encoded_total", kCounter,
             "Chunks decoded by the VAE into MP4 (only for jobs that asked for MP4)"),
      single(M::VideoJobsPending, "skyreels_video_jobs_pending", kGauge, "Jobs whose MP4 is wanted and not complete"),
      on_demand(M::BuildInfo, "skyreels_build_info", kGauge, "Build information", {"version", "loras"}),
  };
}

std::vector<MetricFamily> service_families() {
  using M = MetricId;
  return {
      single(M::StreamsOpen, "skyreels_streams_open", kGauge, "Open WatchJob, DownloadResult and Generate streams"),
      by_value(M::StreamsRejected, "skyreels_streams_rejected_total", kCounter,
               "Streams refused with RESOURCE_EXHAUSTED, by cap", "reason",
               {kStreamRejectTotal, kStreamRejectPerClient}),
      single(M::TextEncodeSeconds, "skyreels_text_encode_seconds", kHistogram,
             "Text prompt encodes (UMT5), in the submitting call", kStep),
      single(M::TextCacheHits, "skyreels_text_embedding_cache_hits_total", kCounter,
             "Texts whose embeddings came from the text encoder's cache (not encoded again)"),
      single(M::TextCacheMisses, "skyreels_text_embedding_cache_misses_total", kCounter,
             "Texts encoded by the text encoder (not in its cache)"),
      single(M::TextCacheBytes, "skyreels_text_embedding_cache_bytes", kGauge,
             "Bytes of embeddings held by the text encoder's cache"),
      by_value(M::JobStoreSeconds, "skyreels_job_store_seconds", kHistogram,
               "Job store calls (SQLite, PostgreSQL), records and leases, by operation", "op",
               store_ops(), kStoreCall),
      single(M::LeaseTakeovers, "skyreels_lease_takeovers_total", kCounter,
             "Jobs taken over from a pod whose lease ran out"),
      single(M::GlobalQueueDepth, "skyreels_global_queue_depth", kGauge,
             "Jobs queued in the whole job store (the same on every pod sharing it)"),
      by_value(M::TransformerTokenBlocks, "skyreels_transformer_token_blocks_total", kCounter,
               "Transformer work in token-blocks (tokens x blocks): computed, or saved by the exact savings "
               "(saved_exact) or the step cache (saved_cache)",
               "kind", {"computed", "saved_exact", "saved_cache"}),
  };
}

std::vector<MetricFamily> slo_families() {
  using M = MetricId;
  return {
      by_value(M::JobDuration, "skyreels_job_duration_seconds", kHistogram,
               "Jobs from submission to their end, by outcome", "outcome", kOutcomes, kJob),
      single(M::TimeToFirstChunk, "skyreels_time_to_first_chunk_seconds", kHistogram,
             "Jobs from submission to their first chunk's result", kJob),
      by_value(M::ModelLoadSeconds, "skyreels_model_load_seconds", kHistogram,
               "Loading a model component's weights (each replica's transformer, the VAE, the text encoder, the image "
               "encoder)",
               "component", {kComponentTransformer, kComponentVae, kComponentTextEncoder, kComponentImageEncoder},
               kLoad),
      by_value(M::VaeSeconds, "skyreels_vae_seconds", kHistogram,
               "VAE calls: encode (conditioning frames to latents), decode (a chunk's latents for its MP4)", "op",
               {"encode", "decode"}, kChunk),
  };
}

std::vector<MetricFamily> transport_families() {
  using M = MetricId;
  std::vector<std::string> handled_labels = kRpcLabels;
  handled_labels.push_back("grpc_code");
  return {
      on_demand(M::RpcStarted, "grpc_server_started_total", kCounter,
                "RPCs started on the server, by type, service and method", kRpcLabels),
      on_demand(M::RpcHandled, "grpc_server_handled_total", kCounter,
                "RPCs completed on the server, by type, service, method and status code", handled_labels),
      on_demand(M::RpcHandlingSeconds, "grpc_server_handling_seconds", kHistogram,
                "Time from an RPC's start to its status, by type, service and method", kRpcLabels, kRpc),
      on_demand(M::HttpRequests, "skyreels_http_requests_total", kCounter,
                "HTTP requests answered (--http-listen), by route template and status code", {"route", "code"}),
      on_demand(M::HttpRequestDuration, "skyreels_http_request_duration_seconds", kHistogram,
                "Time from an HTTP request's end to its response's start, by route template", {"route"}, kRpc),
      by_value(M::WebhookDeliveries, "skyreels_webhook_deliveries_total", kCounter,
               "Webhook delivery attempts, by outcome: delivered, failed (retried later), abandoned", "outcome",
               {"delivered", "failed", "abandoned"}),
  };
}

std::vector<MetricFamily> preview_and_adapter_families() {
  using M = MetricId;
  return {
      single(M::Previews, "skyreels_previews_total", kCounter,
             "Previews of running chunks made by this pod's replicas (preview_every)"),
      single(M::PreviewBytes, "skyreels_preview_bytes_total", kCounter,
             "PNG bytes of the previews made (each watcher is sent at most every one)"),
      single(M::PreviewsDropped, "skyreels_previews_dropped_total", kCounter,
             "Previews a watcher skipped because it was still sending an older one"),
      by_replica(M::AdapterLoads, "skyreels_adapter_loads_total", kCounter,
                 "LoRA adapters (--lora-dir) read from disk onto a replica's device"),
      by_replica(M::AdaptersResident, "skyreels_adapters_resident", kGauge,
                 "LoRA adapters a replica keeps on its device (at most --max-resident-adapters)"),
      on_demand(M::AdapterJobs, "skyreels_adapter_jobs_total", kCounter,
                "Jobs accepted that use a LoRA adapter, by adapter", {"adapter"}),
  };
}

std::vector<MetricFamily> process_families() {
  using M = MetricId;
  return {
      single(M::TestHooksEnabled, "skyreels_test_hooks_enabled", kGauge,
             "1 when the server runs with --enable-test-hooks (fault injection and delays allowed: never in "
             "production)"),
  };
}

std::vector<MetricFamily> build_table() {
  std::vector<MetricFamily> table;
  for (auto part : {job_families(), service_families(), slo_families(), transport_families(),
                    preview_and_adapter_families(), process_families()}) {
    for (MetricFamily& family : part) table.push_back(std::move(family));
  }
  // MetricId indexes the table: a row out of place would report into another family.
  if (table.size() != static_cast<size_t>(MetricId::Count)) throw std::logic_error("metric table: rows missing");
  for (size_t i = 0; i < table.size(); ++i) {
    if (static_cast<size_t>(table[i].id) != i) throw std::logic_error(std::string("metric table: ") + table[i].name);
  }
  return table;
}

}  // namespace

const std::vector<MetricFamily>& metric_families() {
  static const std::vector<MetricFamily> table = build_table();
  return table;
}

const MetricFamily& metric_family(MetricId id) { return metric_families().at(static_cast<size_t>(id)); }

const char* metric_type_name(MetricType type) {
  switch (type) {
    case MetricType::Counter:
      return "counter";
    case MetricType::Gauge:
      return "gauge";
    case MetricType::Histogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace skyreels::server
