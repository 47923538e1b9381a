// Prometheus metrics of the operations contract (docs/ARCHITECTURE.md): the sink every layer below reports into.
// Metrics consumes the queue's stream of scheduler events (queue/event_stream.h) and implements the small
// interfaces the other layers declare (ApiMetrics of api/, MediaMetrics of media/, WebhookMetrics of webhook/,
// StoreCallReport of store/); the families themselves are the
// table of metric_families.h. render() is the exposition; the process serves it on the metrics port with the same
// HTTP listener as the HTTP port (app/), so nothing here listens.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/api/api_metrics.h"
#include "server/media/media_metrics.h"
#include "server/metrics/metric_families.h"
#include "server/metrics/metric_registry.h"
#include "server/queue/scheduler_event.h"
#include "server/store/job_store_timed.h"
#include "server/webhook/webhook_metrics.h"

namespace skyreels::server {

// At most this many (type, service, method) series of the grpc_server_* metrics; later ones count as "unknown".
inline constexpr size_t kMaxRpcSeries = 64;

class Metrics : public ApiMetrics, public MediaMetrics, public WebhookMetrics {
 public:
  // `loras`: the adapters in effect (model::describe_loras); when non-empty, skyreels_build_info gets a `loras` label.
  Metrics(const std::vector<std::string>& replica_names, const std::string& version, const std::string& loras = "");
  ~Metrics() override;

  std::string render() const;

  // ApiMetrics
  void rejected(const std::string& reason) override;
  void stream_rejected(const std::string& reason) override;
  void set_streams_open(int64_t open) override;
  void text_encoded(double seconds) override;
  void previews_dropped(int64_t count) override;
  // ApiMetrics and MediaMetrics: one VAE call, "encode" (conditioning frames to latents) or "decode" (a chunk's
  // latents to frames for its MP4).
  void vae_call(const char* op, double seconds) override;
  void rpc_started(const std::string& type, const std::string& service, const std::string& method) override;
  void rpc_handled(const std::string& type, const std::string& service, const std::string& method, int code,
                   double seconds) override;

  // MediaMetrics
  void text_embedding_cache(uint64_t hits, uint64_t misses, size_t bytes) override;
  void video_chunk_encoded() override;
  void video_jobs_pending(int64_t jobs) override;

  // WebhookMetrics: one delivery attempt ended, outcome delivered, failed (a retry follows) or abandoned.
  void webhook_attempted(const std::string& outcome) override;

  // The scheduler's events (subscribe it to JobQueue::events()). QueueChanged also sets skyreels_global_queue_depth
  // to its `queued` until set_global_queue_depth() is first called.
  void consume(const SchedulerEvent& event);

  // The assembly's reports (app/): one model component's load (kComponent*); one transformer call's token-blocks
  // (tokens x blocks) computed, saved exactly, saved by the step cache; `loaded` LoRA adapters (--lora-dir) read onto
  // `replica`, which now keeps `resident` of them; one HTTP request answered (--http-listen), `route` being the
  // route's template ("/v1/videos/{id}"), never a path.
  void model_loaded(const std::string& component, double seconds);
  void transformer_work(int64_t computed, int64_t saved_exact, int64_t saved_cache);
  void adapters_loaded(const std::string& replica, int64_t loaded, int64_t resident);
  void http_handled(const std::string& route, int status, double seconds);

  // The job store (skyreels_job_store_seconds): one call of `op` (a kJobStoreOps name) took `seconds`.
  void store_call(const char* op, double seconds);
  // The TimedJobStore report that feeds store_call(); valid while this Metrics lives.
  StoreCallReport store_call_report();
  // Jobs queued in the whole store (PostgreSQL: the same value on every pod). The first call makes the store the
  // source: from then on queue_changed() no longer mirrors this pod's own queue into it.
  void set_global_queue_depth(int64_t jobs);
  // --enable-test-hooks (skyreels_test_hooks_enabled 1): an alert on it catches a test server among production pods.
  void set_test_hooks_enabled(bool enabled);

 private:
  struct RpcSeries {
    MetricLabels labels;
    prometheus::Counter* started;
    prometheus::Histogram* seconds;
    std::map<int, prometheus::Counter*> handled;  // by code
  };
  RpcSeries& rpc_series_locked(const std::string& type, const std::string& service, const std::string& method);
  void job_submitted(const JobSnapshot& job);
  void job_finished(const JobSnapshot& job);
  void chunk_finished(const SchedulerEvent& event);
  void replica_changed(const ReplicaStatus& replica);
  void queue_changed(int64_t queued, int64_t running);
  void count(MetricId id, std::string_view value = {}, double by = 1);
  void set(MetricId id, double value, std::string_view label_value = {});
  void observe(MetricId id, double seconds, std::string_view value = {});

  MetricRegistry families_;
  std::mutex on_demand_mu_;               // the series made on demand (RPC, HTTP, adapter jobs)
  std::map<std::string, RpcSeries> rpc_;  // by "type service method"
  std::map<std::pair<std::string, int>, prometheus::Counter*> http_requests_;  // by (route, status)
  std::map<std::string, prometheus::Histogram*> http_seconds_;                 // by route
  std::atomic<bool> global_depth_from_store_{false};
  std::mutex ready_mu_;
  std::map<std::string, bool> ready_;
};

}  // namespace skyreels::server
