#include "server/metrics.h"

#include "server/job/job_request.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string_view>

namespace skyreels::server {

namespace {

// Buckets (seconds) cover the tiny CPU demo model (milliseconds) up to 14B chunks on one GPU (many minutes).
const prometheus::Histogram::BucketBoundaries kQueueWait = {0.01, 0.1, 0.5, 1,   2,    5,    10,  30,
                                                            60,   120, 300, 600, 1200, 1800, 3600};
const prometheus::Histogram::BucketBoundaries kChunk = {0.05, 0.25, 1,   5,   10,  20,  30,  45,
                                                        60,   90,   120, 180, 300, 600, 1200};
const prometheus::Histogram::BucketBoundaries kStep = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30};
// A local SQLite commit takes about a millisecond, a PostgreSQL round trip a few; a chunk's latents are megabytes.
const prometheus::Histogram::BucketBoundaries kStoreCall = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                            0.1,    0.25,  0.5,    1,     2.5,  5,     10};

// A job from submission to its end, and to its first chunk: seconds (tiny demo jobs) to hours (a long 14B video).
const prometheus::Histogram::BucketBoundaries kJob = {0.1, 0.5, 1,    5,    10,   30,   60,    120,  300,
                                                      600, 1200, 1800, 3600, 7200, 14400, 28800, 86400};
// Loading weights: milliseconds (demo) to minutes (a 14B checkpoint from a network volume).
const prometheus::Histogram::BucketBoundaries kLoad = {0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600};
// gRPC calls: sub-millisecond reads to streams that last as long as a job.
const prometheus::Histogram::BucketBoundaries kRpc = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5,  1,
                                                      2.5,    5,     10,    30,   60,   300,  1800, 3600};

// grpc::StatusCode as go-grpc-prometheus (codes.Code.String()) names it in grpc_code.
const char* grpc_code_name(int code) {
  static const char* const kNames[] = {"OK",
                                       "Canceled",
                                       "Unknown",
                                       "InvalidArgument",
                                       "DeadlineExceeded",
                                       "NotFound",
                                       "AlreadyExists",
                                       "PermissionDenied",
                                       "ResourceExhausted",
                                       "FailedPrecondition",
                                       "Aborted",
                                       "OutOfRange",
                                       "Unimplemented",
                                       "Internal",
                                       "Unavailable",
                                       "DataLoss",
                                       "Unauthenticated"};
  return code >= 0 && code < 17 ? kNames[code] : "Unknown";
}

double seconds_since(WallClock::time_point t) {
  return std::max(0.0, std::chrono::duration<double>(WallClock::now() - t).count());
}

const char* outcome_label(JobState state) {
  switch (state) {
    case JobState::Succeeded:
      return "succeeded";
    case JobState::Cancelled:
      return "cancelled";
    case JobState::DeadlineExceeded:
      return "deadline_exceeded";
    default:
      return "failed";
  }
}

}  // namespace

std::pair<std::string, int> split_host_port(const std::string& text, const std::string& flag) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument(flag + ": '" + text + "' is not HOST:PORT");
  std::string host = text.substr(0, colon);
  const std::string port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 ||
      std::stoi(port) > 65535) {
    throw std::invalid_argument(flag + ": '" + text + "' has no valid port");
  }
  return {host.empty() ? "0.0.0.0" : host, std::stoi(port)};
}

Metrics::Metrics(const std::vector<std::string>& replica_names, const std::string& version, const std::string& loras)
    : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  auto& r = *registry_;
  submitted_ = &BuildCounter().Name("skyreels_jobs_submitted_total").Help("Jobs accepted").Register(r).Add({});
  previews_made_ = &BuildCounter()
                        .Name("skyreels_previews_total")
                        .Help("Previews of running chunks made by this pod's replicas (preview_every)")
                        .Register(r)
                        .Add({});
  preview_bytes_ = &BuildCounter()
                        .Name("skyreels_preview_bytes_total")
                        .Help("PNG bytes of the previews made (each watcher is sent at most every one)")
                        .Register(r)
                        .Add({});
  previews_dropped_ = &BuildCounter()
                           .Name("skyreels_previews_dropped_total")
                           .Help("Previews a watcher skipped because it was still sending an older one")
                           .Register(r)
                           .Add({});
  auto& finished = BuildCounter().Name("skyreels_jobs_finished_total").Help("Jobs ended, by outcome").Register(r);
  for (const char* o : {"succeeded", "failed", "cancelled", "deadline_exceeded"})
    finished_[o] = &finished.Add({{"outcome", o}});
  auto& job_seconds = BuildHistogram()
                          .Name("skyreels_job_duration_seconds")
                          .Help("Jobs from submission to their end, by outcome")
                          .Register(r);
  for (const char* o : {"succeeded", "failed", "cancelled", "deadline_exceeded"})
    job_seconds_[o] = &job_seconds.Add({{"outcome", o}}, kJob);
  first_chunk_seconds_ = &BuildHistogram()
                              .Name("skyreels_time_to_first_chunk_seconds")
                              .Help("Jobs from submission to their first chunk's result")
                              .Register(r)
                              .Add({}, kJob);
  auto& load = BuildHistogram()
                   .Name("skyreels_model_load_seconds")
                   .Help("Loading a model component's weights (each replica's transformer, the VAE, the text encoder, "
                         "the image encoder)")
                   .Register(r);
  for (const char* c : {kComponentTransformer, kComponentVae, kComponentTextEncoder, kComponentImageEncoder})
    load_seconds_[c] = &load.Add({{"component", c}}, kLoad);
  auto& vae = BuildHistogram()
                  .Name("skyreels_vae_seconds")
                  .Help("VAE calls: encode (conditioning frames to latents), decode (a chunk's latents for its MP4)")
                  .Register(r);
  for (const char* op : {"encode", "decode"}) vae_seconds_[op] = &vae.Add({{"op", op}}, kChunk);
  rpc_started_family_ = &BuildCounter()
                             .Name("grpc_server_started_total")
                             .Help("RPCs started on the server, by type, service and method")
                             .Register(r);
  rpc_handled_family_ = &BuildCounter()
                             .Name("grpc_server_handled_total")
                             .Help("RPCs completed on the server, by type, service, method and status code")
                             .Register(r);
  rpc_seconds_family_ = &BuildHistogram()
                             .Name("grpc_server_handling_seconds")
                             .Help("Time from an RPC's start to its status, by type, service and method")
                             .Register(r);
  auto& webhooks = BuildCounter()
                       .Name("skyreels_webhook_deliveries_total")
                       .Help("Webhook delivery attempts, by outcome: delivered, failed (retried later), abandoned")
                       .Register(r);
  for (const char* outcome : {"delivered", "failed", "abandoned"}) webhook_attempts_[outcome] = &webhooks.Add({{"outcome", outcome}});
  http_requests_family_ = &BuildCounter()
                              .Name("skyreels_http_requests_total")
                              .Help("HTTP requests answered (--http-listen), by route template and status code")
                              .Register(r);
  http_seconds_family_ = &BuildHistogram()
                              .Name("skyreels_http_request_duration_seconds")
                              .Help("Time from an HTTP request's end to its response's start, by route template")
                              .Register(r);
  auto& rejected =
      BuildCounter().Name("skyreels_jobs_rejected_total").Help("Submissions refused, by reason").Register(r);
  for (const char* reason : {kRejectInvalidArgument, kRejectQueueFull, kRejectUnauthenticated, kRejectDraining,
                             kRejectClientLimit, kRejectEncoderBusy}) {
    rejected_[reason] = &rejected.Add({{"reason", reason}});
  }
  running_ =
      &BuildGauge().Name("skyreels_jobs_running").Help("Jobs with a chunk started and not ended").Register(r).Add({});
  queue_depth_ = &BuildGauge().Name("skyreels_queue_depth").Help("Jobs accepted and not started").Register(r).Add({});
  queue_wait_ = &BuildHistogram()
                     .Name("skyreels_queue_wait_seconds")
                     .Help("Time from acceptance to the first chunk starting")
                     .Register(r)
                     .Add({}, kQueueWait);
  auto& chunk = BuildHistogram().Name("skyreels_chunk_duration_seconds").Help("Chunk run time, by replica").Register(r);
  auto& step =
      BuildHistogram().Name("skyreels_step_duration_seconds").Help("Denoising row time, by replica").Register(r);
  auto& busy = BuildGauge().Name("skyreels_replica_busy").Help("1 while the replica runs a chunk").Register(r);
  auto& healthy =
      BuildGauge().Name("skyreels_replica_healthy").Help("1 while the replica is loaded and not taken out").Register(r);
  auto& recoveries = BuildCounter()
                         .Name("skyreels_replica_recoveries_total")
                         .Help("Times a replica taken out passed its re-test and came back")
                         .Register(r);
  auto& adapter_loads = BuildCounter()
                            .Name("skyreels_adapter_loads_total")
                            .Help("LoRA adapters (--lora-dir) read from disk onto a replica's device")
                            .Register(r);
  auto& adapters_resident = BuildGauge()
                                .Name("skyreels_adapters_resident")
                                .Help("LoRA adapters a replica keeps on its device (at most --max-resident-adapters)")
                                .Register(r);
  adapter_jobs_family_ = &BuildCounter()
                              .Name("skyreels_adapter_jobs_total")
                              .Help("Jobs accepted that use a LoRA adapter, by adapter")
                              .Register(r);
  for (const auto& name : replica_names) {
    adapter_loads_[name] = &adapter_loads.Add({{"replica", name}});
    adapters_resident_[name] = &adapters_resident.Add({{"replica", name}});
    recoveries_[name] = &recoveries.Add({{"replica", name}});
    chunk_seconds_[name] = &chunk.Add({{"replica", name}}, kChunk);
    step_seconds_[name] = &step.Add({{"replica", name}}, kStep);
    busy_[name] = &busy.Add({{"replica", name}});
    healthy_[name] = &healthy.Add({{"replica", name}});
    ready_[name] = false;
  }
  frames_ = &BuildCounter().Name("skyreels_frames_generated_total").Help("Video frames produced").Register(r).Add({});
  handoffs_ = &BuildCounter()
                   .Name("skyreels_chunk_handoffs_total")
                   .Help("Chunks run on another replica than the job's previous chunk")
                   .Register(r)
                   .Add({});
  retries_ = &BuildCounter()
                  .Name("skyreels_chunk_retries_total")
                  .Help("Chunk attempts repeated after a fault")
                  .Register(r)
                  .Add({});
  replicas_ready_ =
      &BuildGauge().Name("skyreels_replicas_ready").Help("Replicas loaded, warmed and healthy").Register(r).Add({});
  video_chunks_ = &BuildCounter()
                       .Name("skyreels_video_chunks_encoded_total")
                       .Help("Chunks decoded by the VAE into MP4 (only for jobs that asked for MP4)")
                       .Register(r)
                       .Add({});
  video_jobs_ = &BuildGauge()
                     .Name("skyreels_video_jobs_pending")
                     .Help("Jobs whose MP4 is wanted and not complete")
                     .Register(r)
                     .Add({});
  streams_open_ = &BuildGauge()
                       .Name("skyreels_streams_open")
                       .Help("Open WatchJob, DownloadResult and Generate streams")
                       .Register(r)
                       .Add({});
  auto& streams_rejected = BuildCounter()
                               .Name("skyreels_streams_rejected_total")
                               .Help("Streams refused with RESOURCE_EXHAUSTED, by cap")
                               .Register(r);
  for (const char* reason : {kStreamRejectTotal, kStreamRejectPerClient}) {
    streams_rejected_[reason] = &streams_rejected.Add({{"reason", reason}});
  }
  text_encode_seconds_ = &BuildHistogram()
                              .Name("skyreels_text_encode_seconds")
                              .Help("Text prompt encodes (UMT5), in the submitting call")
                              .Register(r)
                              .Add({}, kStep);
  text_cache_hits_ = &BuildCounter()
                          .Name("skyreels_text_embedding_cache_hits_total")
                          .Help("Texts whose embeddings came from the text encoder's cache (not encoded again)")
                          .Register(r)
                          .Add({});
  text_cache_misses_ = &BuildCounter()
                            .Name("skyreels_text_embedding_cache_misses_total")
                            .Help("Texts encoded by the text encoder (not in its cache)")
                            .Register(r)
                            .Add({});
  text_cache_bytes_ = &BuildGauge()
                           .Name("skyreels_text_embedding_cache_bytes")
                           .Help("Bytes of embeddings held by the text encoder's cache")
                           .Register(r)
                           .Add({});
  auto& store = BuildHistogram()
                    .Name("skyreels_job_store_seconds")
                    .Help("Job store calls (SQLite, PostgreSQL), by operation")
                    .Register(r);
  for (const char* op : kJobStoreOps) store_seconds_[op] = &store.Add({{"op", op}}, kStoreCall);
  auto& token_blocks = BuildCounter()
                           .Name("skyreels_transformer_token_blocks_total")
                           .Help("Transformer work in token-blocks (tokens x blocks): computed, or saved by the exact "
                                 "savings (saved_exact) or the step cache (saved_cache)")
                           .Register(r);
  token_blocks_computed_ = &token_blocks.Add({{"kind", "computed"}});
  token_blocks_saved_exact_ = &token_blocks.Add({{"kind", "saved_exact"}});
  token_blocks_saved_cache_ = &token_blocks.Add({{"kind", "saved_cache"}});
  lease_takeovers_ = &BuildCounter()
                          .Name("skyreels_lease_takeovers_total")
                          .Help("Jobs taken over from a pod whose lease ran out")
                          .Register(r)
                          .Add({});
  global_queue_depth_ = &BuildGauge()
                             .Name("skyreels_global_queue_depth")
                             .Help("Jobs queued in the whole job store (the same on every pod sharing it)")
                             .Register(r)
                             .Add({});
  std::map<std::string, std::string> build_labels = {{"version", version}};
  if (!loras.empty()) build_labels["loras"] = loras;  // FILE:SCALE,... of the adapters merged at load
  BuildGauge().Name("skyreels_build_info").Help("Build information").Register(r).Add(build_labels).Set(1);
}

Metrics::~Metrics() { stop(); }

std::string Metrics::render() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

void Metrics::rejected(const std::string& reason) {
  auto it = rejected_.find(reason);
  if (it != rejected_.end()) it->second->Increment();
}

void Metrics::set_streams_open(int64_t open) { streams_open_->Set(static_cast<double>(open)); }

void Metrics::text_encoded(double seconds) { text_encode_seconds_->Observe(seconds); }

void Metrics::text_embedding_cache(uint64_t hits, uint64_t misses, size_t bytes) {
  text_cache_hits_->Increment(static_cast<double>(hits));
  text_cache_misses_->Increment(static_cast<double>(misses));
  text_cache_bytes_->Set(static_cast<double>(bytes));
}

void Metrics::stream_rejected(const std::string& reason) {
  auto it = streams_rejected_.find(reason);
  if (it != streams_rejected_.end()) it->second->Increment();
}

void Metrics::job_submitted(const JobSnapshot& job) {
  submitted_->Increment();
  if (!job.description) return;
  std::lock_guard<std::mutex> lock(rpc_mu_);
  for (const AdapterChoice& a : job.description->params.loras) {
    adapter_jobs_family_->Add({{"adapter", a.name}}).Increment();  // names come from --lora-dir: a bounded set
  }
}

void Metrics::adapters_loaded(const std::string& replica, int64_t loaded, int64_t resident) {
  if (auto it = adapter_loads_.find(replica); it != adapter_loads_.end()) {
    it->second->Increment(static_cast<double>(loaded));
  }
  if (auto it = adapters_resident_.find(replica); it != adapters_resident_.end()) {
    it->second->Set(static_cast<double>(resident));
  }
}

void Metrics::preview_made(int64_t bytes) {
  previews_made_->Increment();
  preview_bytes_->Increment(static_cast<double>(bytes));
}

void Metrics::previews_dropped(int64_t count) { previews_dropped_->Increment(static_cast<double>(count)); }

void Metrics::job_started(const JobSnapshot&, double queue_wait_seconds) { queue_wait_->Observe(queue_wait_seconds); }

void Metrics::job_finished(const JobSnapshot& job) {
  finished_.at(outcome_label(job.state))->Increment();
  job_seconds_.at(outcome_label(job.state))->Observe(seconds_since(job.created));
}

void Metrics::chunk_finished(const JobSnapshot& job, const std::string& replica, int64_t chunk, double seconds,
                             int64_t frames) {
  if (chunk == 0) first_chunk_seconds_->Observe(seconds_since(job.created));
  auto it = chunk_seconds_.find(replica);
  if (it != chunk_seconds_.end()) it->second->Observe(seconds);
  frames_->Increment(static_cast<double>(frames));
}

void Metrics::chunk_failed(const JobSnapshot&, const std::string&, int64_t, const std::string&, bool will_retry) {
  if (will_retry) retries_->Increment();
}

void Metrics::step(const std::string& replica, double seconds) {
  auto it = step_seconds_.find(replica);
  if (it != step_seconds_.end()) it->second->Observe(seconds);
}

void Metrics::handoff(const JobSnapshot&, const std::string&, const std::string&) { handoffs_->Increment(); }

void Metrics::replica_changed(const ReplicaStatus& replica) {
  auto busy = busy_.find(replica.name);
  if (busy != busy_.end()) busy->second->Set(replica.busy ? 1 : 0);
  auto healthy = healthy_.find(replica.name);
  if (healthy != healthy_.end()) healthy->second->Set(replica.healthy ? 1 : 0);
  std::lock_guard<std::mutex> lock(ready_mu_);
  ready_[replica.name] = replica.loaded && replica.healthy;
  int ready = 0;
  for (const auto& [name, ok] : ready_) ready += ok ? 1 : 0;
  replicas_ready_->Set(ready);
}

void Metrics::replica_recovered(const ReplicaStatus& replica) {
  auto it = recoveries_.find(replica.name);
  if (it != recoveries_.end()) it->second->Increment();
}

void Metrics::video_chunk_encoded() { video_chunks_->Increment(); }

void Metrics::model_loaded(const std::string& component, double seconds) {
  const auto it = load_seconds_.find(component);
  if (it != load_seconds_.end()) it->second->Observe(seconds);
}

void Metrics::vae_call(const char* op, double seconds) {
  const auto it = vae_seconds_.find(std::string_view(op));
  if (it != vae_seconds_.end()) it->second->Observe(seconds);
}

Metrics::RpcSeries& Metrics::rpc_series_locked(const std::string& type, const std::string& service,
                                               const std::string& method) {
  std::string key = type + " " + service + " " + method;
  auto it = rpc_.find(key);
  if (it != rpc_.end()) return it->second;
  if (rpc_.size() >= kMaxRpcSeries && type != "unknown") return rpc_series_locked("unknown", "unknown", "unknown");
  const std::map<std::string, std::string> labels = {
      {"grpc_type", type}, {"grpc_service", service}, {"grpc_method", method}};
  RpcSeries series{labels, &rpc_started_family_->Add(labels), &rpc_seconds_family_->Add(labels, kRpc), {}};
  return rpc_.emplace(std::move(key), std::move(series)).first->second;
}

void Metrics::rpc_started(const std::string& type, const std::string& service, const std::string& method) {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  rpc_series_locked(type, service, method).started->Increment();
}

void Metrics::webhook_attempted(const std::string& outcome) {
  if (auto it = webhook_attempts_.find(outcome); it != webhook_attempts_.end()) it->second->Increment();
}

void Metrics::http_handled(const std::string& route, int status, double seconds) {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  auto counter = http_requests_.find({route, status});
  if (counter == http_requests_.end()) {
    counter = http_requests_
                  .emplace(std::make_pair(route, status),
                           &http_requests_family_->Add({{"route", route}, {"code", std::to_string(status)}}))
                  .first;
  }
  counter->second->Increment();
  auto histogram = http_seconds_.find(route);
  if (histogram == http_seconds_.end()) {
    histogram = http_seconds_.emplace(route, &http_seconds_family_->Add({{"route", route}}, kRpc)).first;
  }
  histogram->second->Observe(seconds);
}

void Metrics::rpc_handled(const std::string& type, const std::string& service, const std::string& method, int code,
                          double seconds) {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  RpcSeries& series = rpc_series_locked(type, service, method);
  series.seconds->Observe(seconds);
  auto handled = series.handled.find(code);
  if (handled == series.handled.end()) {
    std::map<std::string, std::string> labels = series.labels;  // "unknown" ones when past kMaxRpcSeries
    labels["grpc_code"] = grpc_code_name(code);
    handled = series.handled.emplace(code, &rpc_handled_family_->Add(labels)).first;
  }
  handled->second->Increment();
}
void Metrics::transformer_work(int64_t computed, int64_t saved_exact, int64_t saved_cache) {
  token_blocks_computed_->Increment(static_cast<double>(computed));
  token_blocks_saved_exact_->Increment(static_cast<double>(saved_exact));
  token_blocks_saved_cache_->Increment(static_cast<double>(saved_cache));
}

void Metrics::video_jobs_pending(int64_t jobs) { video_jobs_->Set(static_cast<double>(jobs)); }

void Metrics::queue_changed(int64_t queued, int64_t running) {
  queue_depth_->Set(static_cast<double>(queued));
  running_->Set(static_cast<double>(running));
  if (!global_depth_from_store_) global_queue_depth_->Set(static_cast<double>(queued));  // single pod: the same
}

void Metrics::store_call(const char* op, double seconds) {
  const auto it = store_seconds_.find(std::string_view(op));
  if (it != store_seconds_.end()) it->second->Observe(seconds);
}

StoreCallReport Metrics::store_call_report() {
  return [this](const char* op, double seconds) { store_call(op, seconds); };
}

void Metrics::lease_takeover(const std::string& /*replica*/) { lease_takeovers_->Increment(); }

void Metrics::set_global_queue_depth(int64_t jobs) {
  global_depth_from_store_ = true;
  global_queue_depth_->Set(static_cast<double>(jobs));
}

// ---- the /metrics listener ------------------------------------------------------------------------------------

void Metrics::serve(const std::string& host_port) {
  const auto [host, port] = split_host_port(host_port, "--metrics-listen");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    throw std::runtime_error("--metrics-listen: cannot resolve '" + host + "': " + gai_strerror(rc));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      listen_fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0) throw std::runtime_error("--metrics-listen: cannot listen on " + host_port + ": " + error);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  thread_ = std::thread([this] { accept_loop(); });
  spdlog::info("event=metrics_listening address={}:{} path=/metrics", host, port_);
}

void Metrics::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();  // the loop closes every client connection on its way out
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

namespace {

using MonoClock = std::chrono::steady_clock;

// One scrape connection: the request read so far, then the response left to send; closed at its deadline whatever
// the client does (a client sending one byte a second cannot hold it).
struct ScrapeConnection {
  int fd = -1;
  MonoClock::time_point deadline;
  std::string request;
  std::string response;
  size_t sent = 0;
  bool responding = false;
};

std::string http_response(const std::string& request_line, const std::function<std::string()>& render) {
  std::string status = "404 Not Found";
  std::string body = "not found: only GET /metrics is served here\n";
  std::string type = "text/plain; charset=utf-8";
  if (request_line.rfind("GET /metrics ", 0) == 0 || request_line.rfind("GET /metrics?", 0) == 0) {
    status = "200 OK";
    body = render();
    type = "text/plain; version=0.0.4; charset=utf-8";
  } else if (request_line.rfind("GET ", 0) != 0) {
    status = "405 Method Not Allowed";
    body = "only GET\n";
  }
  return "HTTP/1.1 " + status + "\r\nContent-Type: " + type + "\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// Reads what is there; true when the connection should stay open.
bool read_request(ScrapeConnection& c, const std::function<std::string()>& render) {
  char buffer[2048];
  const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  if (n == 0 && c.request.empty()) return false;
  c.request.append(buffer, static_cast<size_t>(n));
  // Complete: the blank line, the size limit, or the client closed its side after its request (answered anyway).
  const bool complete = c.request.find("\r\n\r\n") != std::string::npos || n == 0;
  if (!complete && c.request.size() < kMaxScrapeRequestBytes) return true;
  c.response = http_response(c.request.substr(0, c.request.find("\r\n")), render);
  c.responding = true;
  return true;
}

// Sends what the socket takes; true while there is more to send.
bool write_response(ScrapeConnection& c) {
  const ssize_t n = ::send(c.fd, c.response.data() + c.sent, c.response.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  c.sent += static_cast<size_t>(n);
  return c.sent < c.response.size();
}

}  // namespace

// One thread, many connections: poll() over the listener and every open scrape, each with its own total deadline.
// Scrapes never wait for each other, and at most kMaxScrapeConnections are open (further ones are closed at once).
void Metrics::accept_loop() {
  std::vector<ScrapeConnection> open;
  const std::function<std::string()> render_fn = [this] { return render(); };
  auto close_at = [&](size_t i) {
    ::close(open[i].fd);
    open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (!stopping_) {
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    for (const auto& c : open) fds.push_back({c.fd, static_cast<short>(c.responding ? POLLOUT : POLLIN), 0});
    if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) break;
    const auto now = MonoClock::now();
    for (size_t i = open.size(); i-- > 0;) {
      ScrapeConnection& c = open[i];
      const short revents = fds[i + 1].revents;
      bool keep = now < c.deadline;
      if (keep && (revents & (POLLERR | POLLHUP | POLLNVAL)) && !(revents & POLLIN)) keep = false;
      if (keep && !c.responding && (revents & POLLIN)) keep = read_request(c, render_fn);
      if (keep && c.responding && (revents & POLLOUT)) keep = write_response(c);
      if (!keep) close_at(i);
    }
    if (fds[0].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0 && open.size() >= kMaxScrapeConnections) {
        ::close(fd);  // a scraper retries; a flood does not grow this list
      } else if (fd >= 0) {
        open.push_back({fd, now + kScrapeDeadline, {}, {}, 0, false});
      }
    }
  }
  for (size_t i = open.size(); i-- > 0;) close_at(i);
}

}  // namespace skyreels::server
