#include "server/queue/replica_pool.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

namespace skyreels::server {

struct ReplicaPool::Replica {
  std::unique_ptr<ChunkExecutor> exec;
  std::string name;
  bool load_done = false;
  bool loaded = false;
  bool healthy = false;
  bool busy = false;
  int consecutive_failures = 0;
  int64_t chunks_run = 0;
  int64_t failures = 0;
  int64_t recoveries = 0;
  std::string error;
  std::optional<Clock::time_point> retest_at;  // taken out: when to re-test it
  Clock::duration backoff{};                   // the wait before that re-test
  std::thread thread;
};

namespace {

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Runs `f`, returning the message of whatever it threw (empty: it returned).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
  return "";
}

}  // namespace

ReplicaPool::ReplicaPool(std::vector<std::unique_ptr<ChunkExecutor>> executors, SchedulerOptions options,
                         EventStream* events)
    : options_(options), events_(events) {
  if (executors.empty()) throw std::invalid_argument("replica pool: at least one replica is required");
  for (auto& exec : executors) {
    auto replica = std::make_unique<Replica>();
    replica->name = exec->name();
    replica->exec = std::move(exec);
    replicas_.push_back(std::move(replica));
  }
}

ReplicaPool::~ReplicaPool() { stop(); }

void ReplicaPool::start(ChunkSource& source) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (source_ != nullptr) return;
    source_ = &source;
  }
  for (size_t i = 0; i < replicas_.size(); ++i) {
    replicas_[i]->thread = std::thread([this, i] { worker(i); });
  }
}

void ReplicaPool::stop() {
  ChunkSource* source = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) source = source_;  // interrupted once: the destructor's stop() may follow the owner's
    stopping_ = true;
    retest_cv_.notify_all();
  }
  if (source != nullptr) source->interrupt();
  for (auto& replica : replicas_) {
    if (replica->thread.joinable()) replica->thread.join();
  }
}

// ---- worker threads -------------------------------------------------------------------------------------------

void ReplicaPool::worker(size_t index) {
  Replica& replica = *replicas_[index];
  load(replica);
  if (!replica.loaded) return;  // never re-tested: a replica that cannot load stays out (liveness restarts the pod)
  while (true) {
    bool healthy = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ && !replica.healthy) return;
      healthy = replica.healthy;
    }
    if (!healthy) {
      wait_and_probe(replica);
      continue;
    }
    std::optional<ChunkAssignment> assignment = source_->next_chunk(index);
    if (!assignment) return;
    const auto t0 = Clock::now();
    ChunkResult result = run_chunk(replica, *assignment);
    const double seconds = seconds_between(t0, Clock::now());
    source_->chunk_done(index, std::move(*assignment), std::move(result), seconds);
  }
}

void ReplicaPool::load(Replica& replica) {
  const std::string error = error_of([&] { replica.exec->start(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    replica.load_done = true;
    replica.loaded = error.empty();
    replica.healthy = replica.loaded;
    replica.error = error;
    if (!error.empty()) spdlog::error("replica={} event=load_failed error=\"{}\"", replica.name, error);
    update_liveness_locked(Clock::now());
    publish_locked(replica);
  }
  source_->replicas_changed();
}

void ReplicaPool::wait_and_probe(Replica& replica) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    const Clock::time_point due = replica.retest_at.value_or(Clock::now());
    retest_cv_.wait_until(lock, due, [&] { return stopping_; });
    if (stopping_) return;
  }
  const std::string error = error_of([&] { replica.exec->probe(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    if (error.empty()) {
      replica.healthy = true;
      replica.consecutive_failures = 0;
      replica.backoff = Clock::duration::zero();
      replica.retest_at.reset();
      ++replica.recoveries;
      spdlog::info("replica={} event=recovered recoveries={}", replica.name, replica.recoveries);
      publish_status_locked(SchedulerEventKind::ReplicaRecovered, replica);
    } else {
      // The cap is never below the first back-off.
      const auto cap = std::max(options_.retest_backoff, options_.retest_backoff_max);
      replica.backoff = std::min<Clock::duration>(replica.backoff * 2, cap);
      replica.retest_at = now + replica.backoff;
      replica.error = error;
      spdlog::warn("replica={} event=retest_failed next_in_seconds={:.3f} error=\"{}\"", replica.name,
                   std::chrono::duration<double>(replica.backoff).count(), error);
    }
    update_liveness_locked(now);
    publish_locked(replica);
  }
  source_->replicas_changed();
}

ChunkResult ReplicaPool::run_chunk(Replica& replica, const ChunkAssignment& assignment) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    replica.busy = true;
    publish_locked(replica);
  }
  // The source's callbacks, plus what the pool learns from them: step durations, and whether a stop was asked for.
  bool stop_asked = false;
  Clock::time_point last_step = Clock::now();
  ChunkCallbacks callbacks;
  callbacks.on_step = [&](int64_t row, int64_t rows) {
    const auto now = Clock::now();
    if (events_) {
      SchedulerEvent step{SchedulerEventKind::StepTimed};
      step.replica = replica.name;
      step.seconds = seconds_between(last_step, now);
      events_->publish(step);
    }
    last_step = now;
    if (assignment.callbacks.on_step) assignment.callbacks.on_step(row, rows);
  };
  callbacks.on_preview = assignment.callbacks.on_preview;
  callbacks.should_stop = [&] {
    const bool stop = assignment.callbacks.should_stop && assignment.callbacks.should_stop();
    stop_asked = stop_asked || stop;
    return stop;
  };

  ChunkResult result;
  const std::string error = error_of([&] { result = replica.exec->run(assignment.work, callbacks); });
  if (!error.empty()) {
    result = ChunkResult{};
    result.outcome = ChunkOutcome::Failed;
    result.error = error;
  } else if (result.outcome == ChunkOutcome::Stopped && !stop_asked) {
    result.outcome = ChunkOutcome::Failed;  // an executor that stops on its own has failed
    if (result.error.empty()) result.error = "chunk stopped without a request";
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    replica.busy = false;
    count_result_locked(replica, result);
    publish_locked(replica);
  }
  return result;
}

// ---- health -----------------------------------------------------------------------------------------------------

void ReplicaPool::count_result_locked(Replica& replica, const ChunkResult& result) {
  switch (result.outcome) {
    case ChunkOutcome::Succeeded:
      ++replica.chunks_run;
      replica.consecutive_failures = 0;
      break;
    case ChunkOutcome::Rejected:   // the replica works; the request does not
    case ChunkOutcome::NotStored:  // the replica worked; the store did not
      replica.consecutive_failures = 0;
      break;
    case ChunkOutcome::ResourceExhausted:  // the request's fault: the replica keeps its count
    case ChunkOutcome::Stopped:
      break;
    case ChunkOutcome::Failed:
      ++replica.failures;
      ++replica.consecutive_failures;
      replica.error = result.error;
      if (replica.healthy && replica.consecutive_failures >= options_.replica_failure_limit) {
        take_out_locked(replica, Clock::now());
      }
      break;
  }
}

void ReplicaPool::take_out_locked(Replica& replica, Clock::time_point now) {
  replica.healthy = false;
  replica.backoff = std::chrono::duration_cast<Clock::duration>(options_.retest_backoff);
  replica.retest_at = now + replica.backoff;
  spdlog::error("replica={} event=taken_out consecutive_failures={} retest_in_seconds={:.3f} error=\"{}\"",
                replica.name, replica.consecutive_failures, std::chrono::duration<double>(replica.backoff).count(),
                replica.error);
  update_liveness_locked(now);
}

void ReplicaPool::update_liveness_locked(Clock::time_point now) {
  if (any_healthy_locked() || !all_loaded_locked()) {
    if (unhealthy_since_) spdlog::info("event=replica_available_again");
    unhealthy_since_.reset();
  } else if (!unhealthy_since_) {
    unhealthy_since_ = now;
    spdlog::error("event=no_healthy_replica liveness_grace_seconds={:.1f}",
                  std::chrono::duration<double>(options_.liveness_grace).count());
  }
}

// ---- status -----------------------------------------------------------------------------------------------------

const std::string& ReplicaPool::name(size_t replica) const { return replicas_.at(replica)->name; }

bool ReplicaPool::all_loaded_locked() const {
  return std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
}

bool ReplicaPool::any_healthy_locked() const {
  return std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
}

bool ReplicaPool::all_loaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_loaded_locked();
}

bool ReplicaPool::any_healthy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return any_healthy_locked();
}

bool ReplicaPool::healthy(size_t replica) const {
  std::lock_guard<std::mutex> lock(mu_);
  return replicas_.at(replica)->healthy;
}

bool ReplicaPool::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !unhealthy_since_ || Clock::now() - *unhealthy_since_ < options_.liveness_grace;
}

std::vector<ReplicaStatus> ReplicaPool::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReplicaStatus> out;
  out.reserve(replicas_.size());
  for (const auto& r : replicas_) out.push_back(status_locked(*r));
  return out;
}

ReplicaStatus ReplicaPool::status(size_t replica) const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_locked(*replicas_.at(replica));
}

ReplicaStatus ReplicaPool::status_locked(const Replica& replica) const {
  ReplicaStatus s;
  s.name = replica.name;
  s.loaded = replica.loaded;
  s.healthy = replica.healthy;
  s.busy = replica.busy;
  s.chunks_run = replica.chunks_run;
  s.failures = replica.failures;
  s.recoveries = replica.recoveries;
  s.error = replica.error;
  s.adapters = replica.exec->adapter_residency();
  return s;
}

void ReplicaPool::publish_locked(const Replica& replica) {
  publish_status_locked(SchedulerEventKind::ReplicaChanged, replica);
}

void ReplicaPool::publish_status_locked(SchedulerEventKind kind, const Replica& replica) {
  if (events_ == nullptr) return;
  SchedulerEvent event{kind};
  event.replica = replica.name;
  event.replica_status = status_locked(replica);
  events_->publish(event);
}

}  // namespace skyreels::server
