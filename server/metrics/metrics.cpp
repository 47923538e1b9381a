#include "server/metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <chrono>

#include "server/job/job_request.h"

namespace skyreels::server {

namespace {

// grpc::StatusCode as go-grpc-prometheus (codes.Code.String()) names it in grpc_code.
const char* grpc_code_name(int code) {
  static const char* const kNames[] = {
      "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
      "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
      "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
      "DataLoss", "Unauthenticated"};
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

Metrics::Metrics(const std::vector<std::string>& replica_names, const std::string& version, const std::string& loras)
    : families_(replica_names) {
  for (const auto& name : replica_names) ready_[name] = false;
  MetricLabels build_labels = {{"version", version}};
  if (!loras.empty()) build_labels["loras"] = loras;  // FILE:SCALE,... of the adapters merged at load
  families_.add_gauge(MetricId::BuildInfo, build_labels).Set(1);
}

Metrics::~Metrics() = default;

std::string Metrics::render() const { return families_.render(); }

// The series made at start; a label value that has none (an unknown reason or replica) is not counted.
void Metrics::count(MetricId id, std::string_view value, double by) {
  if (prometheus::Counter* c = families_.counter(id, value)) c->Increment(by);
}

void Metrics::set(MetricId id, double value, std::string_view label_value) {
  if (prometheus::Gauge* g = families_.gauge(id, label_value)) g->Set(value);
}

void Metrics::observe(MetricId id, double seconds, std::string_view value) {
  if (prometheus::Histogram* h = families_.histogram(id, value)) h->Observe(seconds);
}

// ---- ApiMetrics ---------------------------------------------------------------------------------------------------

void Metrics::rejected(const std::string& reason) { count(MetricId::JobsRejected, reason); }

void Metrics::stream_rejected(const std::string& reason) { count(MetricId::StreamsRejected, reason); }

void Metrics::set_streams_open(int64_t open) { set(MetricId::StreamsOpen, static_cast<double>(open)); }

void Metrics::text_encoded(double seconds) { observe(MetricId::TextEncodeSeconds, seconds); }

void Metrics::previews_dropped(int64_t count_dropped) {
  count(MetricId::PreviewsDropped, {}, static_cast<double>(count_dropped));
}

void Metrics::vae_call(const char* op, double seconds) { observe(MetricId::VaeSeconds, seconds, op); }

Metrics::RpcSeries& Metrics::rpc_series_locked(const std::string& type, const std::string& service,
                                               const std::string& method) {
  std::string key = type + " " + service + " " + method;
  auto it = rpc_.find(key);
  if (it != rpc_.end()) return it->second;
  if (rpc_.size() >= kMaxRpcSeries && type != "unknown") return rpc_series_locked("unknown", "unknown", "unknown");
  const MetricLabels labels = {{"grpc_type", type}, {"grpc_service", service}, {"grpc_method", method}};
  RpcSeries series{labels,
                   &families_.add_counter(MetricId::RpcStarted, labels),
                   &families_.add_histogram(MetricId::RpcHandlingSeconds, labels),
                   {}};
  return rpc_.emplace(std::move(key), std::move(series)).first->second;
}

void Metrics::rpc_started(const std::string& type, const std::string& service, const std::string& method) {
  std::lock_guard<std::mutex> lock(on_demand_mu_);
  rpc_series_locked(type, service, method).started->Increment();
}

void Metrics::rpc_handled(const std::string& type, const std::string& service, const std::string& method, int code,
                          double seconds) {
  std::lock_guard<std::mutex> lock(on_demand_mu_);
  RpcSeries& series = rpc_series_locked(type, service, method);
  series.seconds->Observe(seconds);
  auto handled = series.handled.find(code);
  if (handled == series.handled.end()) {
    MetricLabels labels = series.labels;  // "unknown" ones when past kMaxRpcSeries
    labels["grpc_code"] = grpc_code_name(code);
    handled = series.handled.emplace(code, &families_.add_counter(MetricId::RpcHandled, labels)).first;
  }
  handled->second->Increment();
}

// ---- MediaMetrics and WebhookMetrics ------------------------------------------------------------------------------

void Metrics::text_embedding_cache(uint64_t hits, uint64_t misses, size_t bytes) {
  count(MetricId::TextCacheHits, {}, static_cast<double>(hits));
  count(MetricId::TextCacheMisses, {}, static_cast<double>(misses));
  set(MetricId::TextCacheBytes, static_cast<double>(bytes));
}

void Metrics::video_chunk_encoded() { count(MetricId::VideoChunksEncoded); }

void Metrics::video_jobs_pending(int64_t jobs) { set(MetricId::VideoJobsPending, static_cast<double>(jobs)); }

void Metrics::webhook_attempted(const std::string& outcome) { count(MetricId::WebhookDeliveries, outcome); }

// ---- the scheduler's events --------------------------------------------------------------------------------------

void Metrics::consume(const SchedulerEvent& event) {
  switch (event.kind) {
    case SchedulerEventKind::JobSubmitted:
      if (event.job) job_submitted(*event.job);
      return;
    case SchedulerEventKind::JobStarted:
      observe(MetricId::QueueWait, event.seconds);
      return;
    case SchedulerEventKind::JobFinished:
      if (event.job) job_finished(*event.job);
      return;
    case SchedulerEventKind::ChunkFinished:
      chunk_finished(event);
      return;
    case SchedulerEventKind::ChunkFailed:
      if (event.will_retry) count(MetricId::ChunkRetries);
      return;
    case SchedulerEventKind::StepTimed:
      observe(MetricId::StepDuration, event.seconds, event.replica);
      return;
    case SchedulerEventKind::PreviewMade:
      count(MetricId::Previews);
      count(MetricId::PreviewBytes, {}, static_cast<double>(event.bytes));
      return;
    case SchedulerEventKind::Handoff:
      count(MetricId::ChunkHandoffs);
      return;
    case SchedulerEventKind::ReplicaChanged:
      if (event.replica_status) replica_changed(*event.replica_status);
      return;
    case SchedulerEventKind::ReplicaRecovered:
      count(MetricId::ReplicaRecoveries, event.replica);
      return;
    case SchedulerEventKind::LeaseTakeover:
      count(MetricId::LeaseTakeovers);
      return;
    case SchedulerEventKind::QueueChanged:
      queue_changed(event.queued, event.running);
      return;
    case SchedulerEventKind::ChunkStarted:  // counted when they finish or fail
    case SchedulerEventKind::StepProgress:  // StepTimed times the steps
    case SchedulerEventKind::JobChanged:    // other pods' changes: their own metrics count them
    case SchedulerEventKind::ChangesMissed:
    case SchedulerEventKind::LookAgain:
      return;
  }
}

void Metrics::job_submitted(const JobSnapshot& job) {
  count(MetricId::JobsSubmitted);
  if (!job.description) return;
  std::lock_guard<std::mutex> lock(on_demand_mu_);
  for (const AdapterChoice& a : job.description->params.loras) {
    families_.add_counter(MetricId::AdapterJobs, {{"adapter", a.name}}).Increment();  // from --lora-dir: bounded
  }
}

void Metrics::job_finished(const JobSnapshot& job) {
  count(MetricId::JobsFinished, outcome_label(job.state));
  observe(MetricId::JobDuration, seconds_since(job.created), outcome_label(job.state));
}

void Metrics::chunk_finished(const SchedulerEvent& event) {
  if (event.chunk == 0 && event.job) observe(MetricId::TimeToFirstChunk, seconds_since(event.job->created));
  observe(MetricId::ChunkDuration, event.seconds, event.replica);
  count(MetricId::FramesGenerated, {}, static_cast<double>(event.frames));
}

void Metrics::replica_changed(const ReplicaStatus& replica) {
  set(MetricId::ReplicaBusy, replica.busy ? 1 : 0, replica.name);
  set(MetricId::ReplicaHealthy, replica.healthy ? 1 : 0, replica.name);
  std::lock_guard<std::mutex> lock(ready_mu_);
  ready_[replica.name] = replica.loaded && replica.healthy;
  int ready = 0;
  for (const auto& [name, ok] : ready_) ready += ok ? 1 : 0;
  set(MetricId::ReplicasReady, ready);
}

void Metrics::queue_changed(int64_t queued, int64_t running) {
  set(MetricId::QueueDepth, static_cast<double>(queued));
  set(MetricId::JobsRunning, static_cast<double>(running));
  if (!global_depth_from_store_) set(MetricId::GlobalQueueDepth, static_cast<double>(queued));  // single pod: same
}

// ---- the assembly's reports ---------------------------------------------------------------------------------------

void Metrics::model_loaded(const std::string& component, double seconds) {
  observe(MetricId::ModelLoadSeconds, seconds, component);
}

void Metrics::transformer_work(int64_t computed, int64_t saved_exact, int64_t saved_cache) {
  count(MetricId::TransformerTokenBlocks, "computed", static_cast<double>(computed));
  count(MetricId::TransformerTokenBlocks, "saved_exact", static_cast<double>(saved_exact));
  count(MetricId::TransformerTokenBlocks, "saved_cache", static_cast<double>(saved_cache));
}

void Metrics::adapters_loaded(const std::string& replica, int64_t loaded, int64_t resident) {
  count(MetricId::AdapterLoads, replica, static_cast<double>(loaded));
  set(MetricId::AdaptersResident, static_cast<double>(resident), replica);
}

void Metrics::http_handled(const std::string& route, int status, double seconds) {
  std::lock_guard<std::mutex> lock(on_demand_mu_);
  auto counter = http_requests_.find({route, status});
  if (counter == http_requests_.end()) {
    prometheus::Counter& made =
        families_.add_counter(MetricId::HttpRequests, {{"route", route}, {"code", std::to_string(status)}});
    counter = http_requests_.emplace(std::make_pair(route, status), &made).first;
  }
  counter->second->Increment();
  auto histogram = http_seconds_.find(route);
  if (histogram == http_seconds_.end()) {
    prometheus::Histogram& made = families_.add_histogram(MetricId::HttpRequestDuration, {{"route", route}});
    histogram = http_seconds_.emplace(route, &made).first;
  }
  histogram->second->Observe(seconds);
}

void Metrics::store_call(const char* op, double seconds) { observe(MetricId::JobStoreSeconds, seconds, op); }

StoreCallReport Metrics::store_call_report() {
  return [this](const char* op, double seconds) { store_call(op, seconds); };
}

void Metrics::set_global_queue_depth(int64_t jobs) {
  global_depth_from_store_ = true;
  set(MetricId::GlobalQueueDepth, static_cast<double>(jobs));
}

void Metrics::set_test_hooks_enabled(bool enabled) { set(MetricId::TestHooksEnabled, enabled ? 1 : 0); }

}  // namespace skyreels::server
