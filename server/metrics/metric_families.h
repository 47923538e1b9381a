// Every Prometheus family the server exports, declared once: name, type, help, label names, buckets and which series
// exist from the start. Registration (metric_registry.*) is derived from this table, and tests check it against the
// operations contract of docs/ARCHITECTURE.md. No prometheus-cpp here.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace skyreels::server {

// Components of skyreels_model_load_seconds.
inline constexpr const char* kComponentTransformer = "transformer";
inline constexpr const char* kComponentVae = "vae";
inline constexpr const char* kComponentTextEncoder = "text_encoder";
inline constexpr const char* kComponentImageEncoder = "image_encoder";

// One row of the table each; the table lists them in this order.
enum class MetricId : size_t {
  JobsSubmitted,
  JobsFinished,
  JobsRejected,
  JobsRunning,
  QueueDepth,
  QueueWait,
  ChunkDuration,
  StepDuration,
  FramesGenerated,
  ReplicaBusy,
  ReplicaHealthy,
  ChunkHandoffs,
  ChunkRetries,
  ReplicasReady,
  ReplicaRecoveries,
  VideoChunksEncoded,
  VideoJobsPending,
  BuildInfo,
  StreamsOpen,
  StreamsRejected,
  TextEncodeSeconds,
  TextCacheHits,
  TextCacheMisses,
  TextCacheBytes,
  JobStoreSeconds,
  LeaseTakeovers,
  GlobalQueueDepth,
  TransformerTokenBlocks,
  JobDuration,
  TimeToFirstChunk,
  ModelLoadSeconds,
  VaeSeconds,
  RpcStarted,
  RpcHandled,
  RpcHandlingSeconds,
  HttpRequests,
  HttpRequestDuration,
  WebhookDeliveries,
  Previews,
  PreviewBytes,
  PreviewsDropped,
  AdapterLoads,
  AdaptersResident,
  AdapterJobs,
  TestHooksEnabled,
  Count
};

enum class MetricType { Counter, Gauge, Histogram };

// Which series a family has from the first scrape on (at zero, so that rate() and absent() work at once).
enum class Series {
  Single,    // one series without labels
  Values,    // one per value of `values` (its one label); other values are not counted
  Replicas,  // one per replica (label `replica`); other replicas are not counted
  OnDemand,  // made as they are reported, by code that bounds the label values (RPC methods, routes, adapters)
};

struct MetricFamily {
  MetricId id;
  const char* name;
  MetricType type;
  const char* help;
  std::vector<std::string> labels;  // names, as the contract lists them
  Series series = Series::Single;
  std::vector<std::string> values;  // Series::Values
  std::vector<double> buckets;      // histograms
};

// The table, indexed by MetricId.
const std::vector<MetricFamily>& metric_families();
const MetricFamily& metric_family(MetricId id);
const char* metric_type_name(MetricType type);  // "counter", "gauge", "histogram"

}  // namespace skyreels::server
