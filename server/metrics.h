// Prometheus metrics of the operations contract (docs/ARCHITECTURE.md), served on their own port at /metrics.
//
// The exposition is our own minimal HTTP/1.1 listener around prometheus-cpp's TextSerializer rather than the
// civetweb Exposer: the Exposer cannot start its threads next to OpenBLAS's static TLS on this platform
// (build-notes P3) and takes 2 s to stop (P8); a 100-line listener has neither problem.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/store/job_store_timed.h"
#include "server/media/media_metrics.h"
#include "server/queue/job_types.h"
#include "server/webhook/webhook_metrics.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace skyreels::server {

// Rejection reasons (label values of skyreels_jobs_rejected_total).
inline constexpr const char* kRejectInvalidArgument = "invalid_argument";
inline constexpr const char* kRejectQueueFull = "queue_full";
inline constexpr const char* kRejectUnauthenticated = "unauthenticated";
inline constexpr const char* kRejectDraining = "draining";
inline constexpr const char* kRejectClientLimit = "client_limit";  // per-client job cap or max_priority
inline constexpr const char* kRejectEncoderBusy = "encoder_busy";  // --max-concurrent-encodes reached
// Components of skyreels_model_load_seconds.
inline constexpr const char* kComponentTransformer = "transformer";
inline constexpr const char* kComponentVae = "vae";
inline constexpr const char* kComponentTextEncoder = "text_encoder";
inline constexpr const char* kComponentImageEncoder = "image_encoder";
// At most this many (type, service, method) series of the grpc_server_* metrics; later ones count as "unknown".
inline constexpr size_t kMaxRpcSeries = 64;
// Reasons of skyreels_streams_rejected_total.
inline constexpr const char* kStreamRejectTotal = "total";
inline constexpr const char* kStreamRejectPerClient = "per_client";

// The /metrics listener's bounds: every connection is closed this long after it was accepted, whatever the client
// sends; at most this many are open at once; a request (line and headers) may be this long.
inline constexpr std::chrono::seconds kScrapeDeadline{5};
inline constexpr size_t kMaxScrapeConnections = 64;
inline constexpr size_t kMaxScrapeRequestBytes = 16384;

class Metrics : public SchedulerObserver, public MediaMetrics, public WebhookMetrics {
 public:
  // `loras`: the adapters in effect (model::describe_loras); when non-empty, skyreels_build_info gets a `loras` label.
  Metrics(const std::vector<std::string>& replica_names, const std::string& version, const std::string& loras = "");
  ~Metrics() override;

  // Binds HOST:PORT (port 0 picks a free one) and serves GET /metrics on a thread. Throws std::runtime_error.
  void serve(const std::string& host_port);
  int port() const { return port_; }
  void stop();
  std::string render() const;

  void rejected(const std::string& reason);
  void set_streams_open(int64_t open);
  void text_encoded(double seconds);
  // One encoder call of the text embedding cache: rows served from it, rows encoded, bytes it holds now.
  void text_embedding_cache(uint64_t hits, uint64_t misses, size_t bytes) override;
  void stream_rejected(const std::string& reason);
  // The SLO side: one model component's load (kComponent*), one VAE call ("encode": conditioning frames to latents,
  // "decode": a chunk's latents to frames for its MP4).
  void model_loaded(const std::string& component, double seconds);
  void vae_call(const char* op, double seconds) override;
  // One RPC, as go-grpc-prometheus counts it: started, then handled with its code (grpc::StatusCode) and duration.
  // `type` is unary / client_stream / server_stream / bidi_stream; `service` and `method` as in "/service/method".
  void rpc_started(const std::string& type, const std::string& service, const std::string& method);
  // One webhook delivery attempt ended: outcome delivered, failed (a retry follows) or abandoned.
  void webhook_attempted(const std::string& outcome) override;
  // One HTTP request answered (--http-listen): `route` is the route's template ("/v1/videos/{id}"), never a path.
  void http_handled(const std::string& route, int status, double seconds);
  void rpc_handled(const std::string& type, const std::string& service, const std::string& method, int code,
                   double seconds);

  // SchedulerObserver
  void job_submitted(const JobSnapshot&) override;
  void job_started(const JobSnapshot&, double queue_wait_seconds) override;
  void job_finished(const JobSnapshot& job) override;
  void chunk_finished(const JobSnapshot&, const std::string& replica, int64_t chunk, double seconds,
                      int64_t frames) override;
  void chunk_failed(const JobSnapshot&, const std::string& replica, int64_t chunk, const std::string& error,
                    bool will_retry) override;
  void step(const std::string& replica, double seconds) override;
  // Previews of running chunks (preview_every): made by this pod's replicas, and skipped by a watcher that was still
  // writing an older one (a slow watcher drops previews, never events).
  void preview_made(int64_t bytes) override;
  void previews_dropped(int64_t count);
  void handoff(const JobSnapshot&, const std::string& from, const std::string& to) override;
  void replica_changed(const ReplicaStatus& replica) override;
  void replica_recovered(const ReplicaStatus& replica) override;
  // The VAE worker (server/encoders.*): one chunk's MP4 made; jobs with MP4 work left.
  // One transformer call's token-blocks (tokens x blocks): computed, saved exactly, saved by the step cache.
  void transformer_work(int64_t computed, int64_t saved_exact, int64_t saved_cache);
  // `loaded` LoRA adapters (--lora-dir) were read onto `replica`, which now keeps `resident` of them.
  void adapters_loaded(const std::string& replica, int64_t loaded, int64_t resident);
  void video_chunk_encoded() override;
  void video_jobs_pending(int64_t jobs) override;
  // Also sets skyreels_global_queue_depth to `queued` until set_global_queue_depth() is first called.
  void queue_changed(int64_t queued, int64_t running) override;

  // The job store (skyreels_job_store_seconds): one call of `op` (a kJobStoreOps name) took `seconds`.
  void store_call(const char* op, double seconds);
  // The TimedJobStore report that feeds store_call(); valid while this Metrics lives.
  StoreCallReport store_call_report();
  // A chunk whose lease ran out on another pod (that pod died or stalled) was taken over by `replica` of this one.
  void lease_takeover(const std::string& replica) override;
  // Jobs queued in the whole store (PostgreSQL: the same value on every pod). The first call makes the store the
  // source: from then on queue_changed() no longer mirrors this pod's own queue into it.
  void set_global_queue_depth(int64_t jobs);

 private:
  void accept_loop();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* submitted_;
  prometheus::Counter* previews_made_;
  prometheus::Counter* preview_bytes_;
  prometheus::Counter* previews_dropped_;
  std::map<std::string, prometheus::Counter*> finished_;
  std::map<std::string, prometheus::Histogram*> job_seconds_;  // by outcome
  prometheus::Histogram* first_chunk_seconds_;
  std::map<std::string, prometheus::Histogram*> load_seconds_;  // by component
  std::map<std::string, prometheus::Histogram*, std::less<>> vae_seconds_;  // by op
  struct RpcSeries {
    std::map<std::string, std::string> labels;
    prometheus::Counter* started;
    prometheus::Histogram* seconds;
    std::map<int, prometheus::Counter*> handled;  // by code
  };
  RpcSeries& rpc_series_locked(const std::string& type, const std::string& service, const std::string& method);
  prometheus::Family<prometheus::Counter>* rpc_started_family_;
  prometheus::Family<prometheus::Counter>* rpc_handled_family_;
  prometheus::Family<prometheus::Histogram>* rpc_seconds_family_;
  std::mutex rpc_mu_;
  std::map<std::string, prometheus::Counter*> webhook_attempts_;  // by outcome
  prometheus::Family<prometheus::Counter>* http_requests_family_;
  prometheus::Family<prometheus::Histogram>* http_seconds_family_;
  std::map<std::pair<std::string, int>, prometheus::Counter*> http_requests_;  // by (route, status), under rpc_mu_
  std::map<std::string, prometheus::Histogram*> http_seconds_;                 // by route, under rpc_mu_
  std::map<std::string, RpcSeries> rpc_;  // by "type service method" 
  std::map<std::string, prometheus::Counter*> rejected_;
  prometheus::Gauge* running_;
  prometheus::Gauge* queue_depth_;
  prometheus::Histogram* queue_wait_;
  std::map<std::string, prometheus::Histogram*> chunk_seconds_;
  std::map<std::string, prometheus::Histogram*> step_seconds_;
  prometheus::Counter* frames_;
  std::map<std::string, prometheus::Gauge*> busy_;
  std::map<std::string, prometheus::Gauge*> healthy_;
  prometheus::Counter* handoffs_;
  prometheus::Counter* retries_;
  prometheus::Gauge* replicas_ready_;
  std::map<std::string, prometheus::Counter*> recoveries_;
  std::map<std::string, prometheus::Counter*> adapter_loads_;    // by replica
  std::map<std::string, prometheus::Gauge*> adapters_resident_;  // by replica
  prometheus::Family<prometheus::Counter>* adapter_jobs_family_;  // by adapter, under rpc_mu_
  prometheus::Counter* video_chunks_;
  prometheus::Gauge* video_jobs_;
  prometheus::Gauge* streams_open_;
  prometheus::Histogram* text_encode_seconds_;
  prometheus::Counter* text_cache_hits_;
  prometheus::Counter* text_cache_misses_;
  prometheus::Gauge* text_cache_bytes_;
  std::map<std::string, prometheus::Counter*> streams_rejected_;
  std::map<std::string, prometheus::Histogram*, std::less<>> store_seconds_;
  prometheus::Counter* lease_takeovers_;
  prometheus::Counter* token_blocks_computed_;
  prometheus::Counter* token_blocks_saved_exact_;
  prometheus::Counter* token_blocks_saved_cache_;
  prometheus::Gauge* global_queue_depth_;
  std::atomic<bool> global_depth_from_store_{false};
  std::mutex ready_mu_;
  std::map<std::string, bool> ready_;

  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// Splits "HOST:PORT" / "[V6]:PORT"; throws std::invalid_argument naming `flag`.
std::pair<std::string, int> split_host_port(const std::string& text, const std::string& flag);

}  // namespace skyreels::server
