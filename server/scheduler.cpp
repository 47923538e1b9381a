#include "server/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "server/dispatch_policy.h"

namespace skyreels::server {

const char* job_state_name(JobState state) {
  switch (state) {
    case JobState::Queued:
      return "queued";
    case JobState::Running:
      return "running";
    case JobState::Succeeded:
      return "succeeded";
    case JobState::Failed:
      return "failed";
    case JobState::Cancelled:
      return "cancelled";
    case JobState::DeadlineExceeded:
      return "deadline_exceeded";
  }
  return "unknown";
}

bool is_terminal(JobState state) { return state != JobState::Queued && state != JobState::Running; }

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::None:
      return "";
    case ErrorKind::Internal:
      return "internal";
    case ErrorKind::Unavailable:
      return "unavailable";
    case ErrorKind::Cancelled:
      return "cancelled";
    case ErrorKind::DeadlineExceeded:
      return "deadline_exceeded";
    case ErrorKind::InvalidArgument:
      return "invalid_argument";
    case ErrorKind::ResourceExhausted:
      return "resource_exhausted";
  }
  return "";
}

namespace {

JobState parse_state(const std::string& name) {
  for (JobState s : {JobState::Queued, JobState::Running, JobState::Succeeded, JobState::Failed, JobState::Cancelled,
                     JobState::DeadlineExceeded}) {
    if (name == job_state_name(s)) return s;
  }
  return JobState::Failed;
}

ErrorKind parse_error_kind(const std::string& name) {
  for (ErrorKind k : {ErrorKind::Internal, ErrorKind::Unavailable, ErrorKind::Cancelled, ErrorKind::DeadlineExceeded,
                      ErrorKind::InvalidArgument, ErrorKind::ResourceExhausted}) {
    if (name == error_kind_name(k)) return k;
  }
  return ErrorKind::None;
}

int64_t to_ms(WallClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}
int64_t to_ms(const std::optional<WallClock::time_point>& t) { return t ? to_ms(*t) : 0; }
WallClock::time_point from_ms(int64_t ms) { return WallClock::time_point(std::chrono::milliseconds(ms)); }

// Chunk-level events as the store keeps them (step events stay in memory).
std::string encode_event(const JobEvent& e) {
  nlohmann::json j = {{"type", static_cast<int>(e.type)}, {"time_ms", to_ms(e.time)}, {"chunk", e.chunk},
                      {"chunk_count", e.chunk_count},     {"replica", e.replica},     {"attempt", e.attempt},
                      {"handoff", e.handoff},             {"seconds", e.seconds},     {"position", e.position},
                      {"eta_seconds", e.eta_seconds},     {"message", e.message}};
  return j.dump();
}

JobEvent decode_event(const StoredEvent& stored) {
  const auto j = nlohmann::json::parse(stored.data);
  JobEvent e;
  e.sequence = stored.sequence;
  e.type = static_cast<EventType>(j.at("type").get<int>());
  e.time = from_ms(j.at("time_ms").get<int64_t>());
  e.chunk = j.at("chunk").get<int64_t>();
  e.chunk_count = j.at("chunk_count").get<int64_t>();
  e.replica = j.at("replica").get<std::string>();
  e.attempt = j.at("attempt").get<int>();
  e.handoff = j.at("handoff").get<bool>();
  e.seconds = j.at("seconds").get<double>();
  e.position = j.at("position").get<int64_t>();
  e.eta_seconds = j.at("eta_seconds").get<double>();
  e.message = j.at("message").get<std::string>();
  return e;
}

}  // namespace

std::string new_job_id() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "j-%016llx", static_cast<unsigned long long>(rng()));
  return buffer;
}

struct Scheduler::Job {
  std::string id;
  JobSpec spec;
  JobState state = JobState::Queued;
  uint64_t order = 0;  // submission order (ties)
  int64_t vbase = 0;   // fair-share start: the least attained service among active jobs at submission
  WallClock::time_point created;
  Clock::time_point created_mono;
  std::optional<WallClock::time_point> started, finished;
  std::optional<Clock::time_point> finished_mono;
  int64_t chunks_done = 0;
  bool chunk_running = false;
  int attempts = 0;  // failed attempts of the current chunk
  int holder = -1;   // replica that ran the previous chunk
  int avoid = -1;    // replica that just failed the current chunk
  std::vector<std::string> chunk_replicas;
  int handoffs = 0;
  int retries = 0;
  bool cancel_requested = false;
  bool aborted = false;
  std::string abort_reason;
  ErrorKind error_kind = ErrorKind::None;
  std::string error;
  std::vector<JobEvent> events;  // ascending sequence; after a restart only the stored (chunk-level) ones
  uint64_t next_sequence = 1;
  int64_t position = 0;
  double eta = -1;
  int64_t rows_total = 0;
  int64_t rows_before_chunk = 0;  // rows of the chunks already done
  int64_t rows_in_chunk = 0;      // rows done in the running chunk
  // Woken on each of this job's events and when it is dropped; shared so that a waiter keeps it alive if the job is
  // garbage-collected while it waits.
  std::shared_ptr<std::condition_variable> watchers = std::make_shared<std::condition_variable>();
  std::map<uint64_t, std::function<void()>> listeners;  // subscribe(): watchers that hold no thread

  int64_t fair_key() const { return vbase + chunks_done; }
  policy::JobKey key() const { return {spec.priority, fair_key(), order}; }
  bool active() const { return !is_terminal(state); }
};

struct Scheduler::Assignment {
  ChunkWork work;
  std::shared_ptr<JobPayload> payload;  // keeps the payload alive while the chunk runs
};

struct Scheduler::Replica {
  std::unique_ptr<ChunkExecutor> exec;
  std::string name;
  bool load_done = false;
  bool loaded = false;
  bool healthy = false;
  bool busy = false;
  std::string job_id;
  int64_t chunk = -1;
  double work = 0;
  Clock::time_point chunk_started;
  Clock::time_point last_step;
  double expected_seconds = 0;
  int consecutive_failures = 0;
  int64_t chunks_run = 0;
  int64_t failures = 0;
  int64_t recoveries = 0;
  std::string error;
  std::optional<Assignment> pending;
  bool probe_pending = false;                  // a re-test is due on the worker thread
  std::optional<Clock::time_point> retest_at;  // taken out: when to re-test it
  Clock::duration backoff{};                   // the wait before the next re-test
  std::condition_variable cv;
  std::thread thread;
};

Scheduler::Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> replicas, SchedulerOptions options,
                     SchedulerObserver* observer, JobStore* store)
    : options_(options), observer_(observer), store_(store) {
  if (replicas.empty()) throw std::invalid_argument("scheduler: at least one replica is required");
  for (auto& exec : replicas) {
    auto replica = std::make_unique<Replica>();
    replica->name = exec->name();
    replica->exec = std::move(exec);
    replicas_.push_back(std::move(replica));
  }
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // from here on a durable store keeps unfinished jobs as they are (persisting_locked)
    for (auto& [id, job] : jobs_) {
      if (job->active() && !job->chunk_running) {
        finish_locked(*job, JobState::Failed, ErrorKind::Unavailable, "server stopped");
      }
    }
    for (auto& replica : replicas_) replica->cv.notify_all();
    timer_cv_.notify_all();
    changed_.notify_all();
  }
  for (auto& replica : replicas_) {
    if (replica->thread.joinable()) replica->thread.join();
  }
  if (timer_.joinable()) timer_.join();
}

void Scheduler::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return;
  started_ = true;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    replicas_[i]->thread = std::thread([this, i] { worker(i); });
  }
  timer_ = std::thread([this] { timer_loop(); });
}

bool Scheduler::all_loaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
}

bool Scheduler::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !unhealthy_since_ || Clock::now() - *unhealthy_since_ < options_.liveness_grace;
}

bool Scheduler::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  const bool loaded = std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
  const bool any_healthy = std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
  return loaded && any_healthy && !draining_ && !stopping_;
}

// ---- worker threads -------------------------------------------------------------------------------------------

void Scheduler::worker(size_t index) {
  Replica& replica = *replicas_[index];
  std::string load_error;
  try {
    replica.exec->start();
  } catch (const std::exception& e) {
    load_error = e.what();
  } catch (...) {
    load_error = "unknown exception";
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    replica.load_done = true;
    replica.loaded = load_error.empty();
    replica.healthy = replica.loaded;
    replica.error = load_error;
    if (!load_error.empty()) spdlog::error("replica={} event=load_failed error=\"{}\"", replica.name, load_error);
    update_liveness_locked(Clock::now());
    if (observer_) observer_->replica_changed(replica_status_locked(replica));
    changed_.notify_all();
    dispatch_locked();
  }
  if (!load_error.empty()) return;

  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    replica.cv.wait(lock, [&] { return replica.pending.has_value() || replica.probe_pending || stopping_; });
    if (stopping_ && !replica.pending) break;
    if (replica.probe_pending) {
      run_probe(replica, lock);
      continue;
    }
    Assignment assignment = std::move(*replica.pending);
    replica.pending.reset();
    Job* job = jobs_.at(assignment.work.job_id).get();  // never collected while its chunk runs

    ChunkCallbacks callbacks;
    callbacks.on_step = [this, job, &replica](int64_t row, int64_t rows) {
      std::lock_guard<std::mutex> step_lock(mu_);
      const auto now = Clock::now();
      if (observer_) observer_->step(replica.name, std::chrono::duration<double>(now - replica.last_step).count());
      replica.last_step = now;
      job->rows_in_chunk = row;
      JobEvent event;
      event.type = EventType::Step;
      event.chunk = replica.chunk;
      event.chunk_count = static_cast<int64_t>(job->spec.chunk_work.size());
      event.replica = replica.name;
      event.step = row;
      event.steps = rows;
      event.progress = job->rows_total > 0
                           ? static_cast<double>(job->rows_before_chunk + row) / static_cast<double>(job->rows_total)
                           : 0.0;
      push_event_locked(*job, std::move(event));
    };
    callbacks.should_stop = [this, job] {
      std::lock_guard<std::mutex> stop_lock(mu_);
      return stop_requested_locked(*job, Clock::now());
    };

    lock.unlock();
    const auto t0 = Clock::now();
    ChunkResult result;
    try {
      result = replica.exec->run(assignment.work, callbacks);
    } catch (const std::exception& e) {
      result.outcome = ChunkOutcome::Failed;
      result.error = e.what();
    } catch (...) {
      result.outcome = ChunkOutcome::Failed;
      result.error = "unknown exception";
    }
    if (result.outcome == ChunkOutcome::Succeeded && store_ != nullptr && !result.bytes.empty()) {
      // Outside the lock: a chunk's result is megabytes. Chunks of one job never run concurrently and the job's
      // other rows do not hold chunks_done, so nothing races this commit.
      try {
        store_->commit_chunk(assignment.work.job_id, {assignment.work.chunk_index, replica.name,
                                                      assignment.work.attempt + 1, std::move(result.bytes)});
      } catch (const StoreError& e) {
        result.outcome = ChunkOutcome::NotStored;
        result.error = e.what();
      }
    }
    result.bytes.clear();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    lock.lock();
    complete_locked(index, result, seconds);
    dispatch_locked();
  }
}

void Scheduler::timer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    // Every 100 ms, or sooner when a replica's re-test is due.
    auto wake = Clock::now() + std::chrono::milliseconds(100);
    for (const auto& r : replicas_) {
      if (r->retest_at) wake = std::min(wake, *r->retest_at);
    }
    timer_cv_.wait_until(lock, wake);
    if (stopping_) break;
    const auto now = Clock::now();
    schedule_retests_locked(now);
    update_liveness_locked(now);
    dispatch_locked();  // expires deadlines, refreshes queue positions and estimates
    gc_locked();
  }
}

// ---- re-tests of replicas taken out -----------------------------------------------------------------------------

void Scheduler::schedule_retests_locked(Clock::time_point now) {
  for (auto& r : replicas_) {
    if (r->loaded && !r->healthy && !r->busy && !r->probe_pending && r->retest_at && now >= *r->retest_at) {
      r->probe_pending = true;
      r->retest_at.reset();
      r->cv.notify_one();
    }
  }
}

void Scheduler::run_probe(Replica& replica, std::unique_lock<std::mutex>& lock) {
  lock.unlock();
  std::string error;
  try {
    replica.exec->probe();
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception";
  }
  lock.lock();
  replica.probe_pending = false;
  const auto now = Clock::now();
  if (error.empty()) {
    replica.healthy = true;
    replica.consecutive_failures = 0;
    replica.backoff = Clock::duration::zero();
    ++replica.recoveries;
    spdlog::info("replica={} event=recovered recoveries={}", replica.name, replica.recoveries);
    if (observer_) observer_->replica_recovered(replica_status_locked(replica));
  } else {
    replica.backoff = std::min<Clock::duration>(replica.backoff * 2, options_.retest_backoff_max);
    replica.retest_at = now + replica.backoff;
    timer_cv_.notify_all();  // the timer wakes at the re-test time, not at its next 100 ms tick
    replica.error = error;
    spdlog::warn("replica={} event=retest_failed next_in_seconds={:.3f} error=\"{}\"", replica.name,
                 std::chrono::duration<double>(replica.backoff).count(), error);
  }
  update_liveness_locked(now);
  if (observer_) observer_->replica_changed(replica_status_locked(replica));
  changed_.notify_all();
  dispatch_locked();
}

void Scheduler::update_liveness_locked(Clock::time_point now) {
  const bool all_done = std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
  const bool any_healthy = std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
  if (any_healthy || !all_done) {
    if (unhealthy_since_) spdlog::info("event=replica_available_again");
    unhealthy_since_.reset();
  } else if (!unhealthy_since_) {
    unhealthy_since_ = now;
    spdlog::error("event=no_healthy_replica liveness_grace_seconds={:.1f}",
                  std::chrono::duration<double>(options_.liveness_grace).count());
  }
}

// ---- policy ---------------------------------------------------------------------------------------------------

bool Scheduler::stop_requested_locked(const Job& job, Clock::time_point now) const {
  return job.cancel_requested || job.aborted || stopping_ || (job.spec.deadline && now >= *job.spec.deadline);
}

double Scheduler::estimate_seconds_locked(double work) const { return seconds_per_work_ * work; }

void Scheduler::expire_locked(Clock::time_point now) {
  for (auto& [id, job] : jobs_) {
    if (job->active() && !job->chunk_running && job->spec.deadline && now >= *job->spec.deadline) {
      finish_locked(*job, JobState::DeadlineExceeded, ErrorKind::DeadlineExceeded,
                    job->state == JobState::Queued ? "deadline passed while queued" : "deadline passed between chunks");
    }
  }
}

void Scheduler::dispatch_locked() {
  if (!started_ || stopping_) return;
  const auto now = Clock::now();
  expire_locked(now);

  const bool all_done = std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
  const bool any_healthy = std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
  if (all_done && !any_healthy) {
    for (auto& [id, job] : jobs_) {
      if (job->active() && !job->chunk_running) {
        finish_locked(*job, JobState::Failed, ErrorKind::Unavailable, "no healthy replica");
      }
    }
  }

  std::vector<size_t> idle;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    const Replica& r = *replicas_[i];
    if (r.loaded && r.healthy && !r.busy) idle.push_back(i);
  }
  if (!idle.empty()) {
    std::vector<Job*> ready;
    for (auto& [id, job] : jobs_) {
      if (job->active() && !job->chunk_running && !job->cancel_requested && !job->aborted) ready.push_back(job.get());
    }
    std::sort(ready.begin(), ready.end(),
              [](const Job* a, const Job* b) { return policy::dispatch_before(a->key(), b->key()); });
    for (Job* job : ready) {
      if (idle.empty()) break;
      const int chosen = choose_replica_locked(*job, idle, now);
      if (chosen < 0) continue;
      assign_locked(*job, static_cast<size_t>(chosen), now);
      idle.erase(std::find(idle.begin(), idle.end(), static_cast<size_t>(chosen)));
    }
  }
  update_positions_locked(now);
  notify_queue_locked();
}

int Scheduler::choose_replica_locked(Job& job, const std::vector<size_t>& idle, Clock::time_point now) const {
  std::vector<policy::ReplicaView> views(replicas_.size());
  for (size_t r = 0; r < replicas_.size(); ++r) {
    const Replica& replica = *replicas_[r];
    policy::ReplicaView& v = views[r];
    v.healthy = replica.healthy;
    v.idle = std::find(idle.begin(), idle.end(), r) != idle.end();
    if (replica.busy) {
      const double elapsed = std::chrono::duration<double>(now - replica.chunk_started).count();
      v.remaining_seconds = std::max(0.0, replica.expected_seconds - elapsed);
    }
  }
  for (const auto& [id, other] : jobs_) {
    if (other.get() != &job && other->active() && !other->chunk_running && other->holder >= 0) {
      views[static_cast<size_t>(other->holder)].held_by_other_job = true;
    }
  }
  return policy::choose_replica({job.holder, job.avoid}, views, options_.handoff_cost_seconds, seconds_per_work_ > 0);
}

void Scheduler::assign_locked(Job& job, size_t index, Clock::time_point now) {
  Replica& replica = *replicas_[index];
  const int64_t chunk = job.chunks_done;
  const double work = job.spec.chunk_work[static_cast<size_t>(chunk)];
  replica.busy = true;
  replica.job_id = job.id;
  replica.chunk = chunk;
  replica.work = work;
  replica.chunk_started = now;
  replica.last_step = now;
  replica.expected_seconds = estimate_seconds_locked(work);

  const bool handoff = job.holder >= 0 && job.holder != static_cast<int>(index);
  const JobSnapshot before = snapshot_locked(job);
  if (handoff) {
    ++job.handoffs;
    spdlog::info("job={} event=handoff chunk={} from={} to={}", job.id, chunk,
                 replicas_[static_cast<size_t>(job.holder)]->name, replica.name);
    if (observer_) observer_->handoff(before, replicas_[static_cast<size_t>(job.holder)]->name, replica.name);
  }
  if (job.state == JobState::Queued) {
    job.state = JobState::Running;
    job.started = WallClock::now();
    const double waited = std::chrono::duration<double>(now - job.created_mono).count();
    if (observer_) observer_->job_started(snapshot_locked(job), waited);
    persist_update_locked(job);
  } else if (handoff) {
    persist_update_locked(job);
  }
  job.chunk_running = true;
  job.rows_in_chunk = 0;
  job.position = 0;
  job.eta = -1;

  Assignment assignment;
  assignment.work.job_id = job.id;
  assignment.work.chunk_index = chunk;
  assignment.work.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  assignment.work.attempt = job.attempts;
  assignment.work.handoff = handoff;
  assignment.work.payload = job.spec.payload.get();
  assignment.payload = job.spec.payload;
  replica.pending = std::move(assignment);

  JobEvent event;
  event.type = EventType::ChunkStarted;
  event.chunk = chunk;
  event.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  event.replica = replica.name;
  event.handoff = handoff;
  event.attempt = job.attempts;
  push_event_locked(job, std::move(event));
  spdlog::info("job={} event=chunk_started chunk={}/{} replica={} attempt={} handoff={}", job.id, chunk,
               job.spec.chunk_work.size(), replica.name, job.attempts, handoff);
  if (observer_) {
    observer_->chunk_started(snapshot_locked(job), replica.name, chunk);
    observer_->replica_changed(replica_status_locked(replica));
  }
  replica.cv.notify_one();
}

void Scheduler::complete_locked(size_t index, const ChunkResult& result, double seconds) {
  Replica& replica = *replicas_[index];
  Job& job = *jobs_.at(replica.job_id);
  const int64_t chunk = replica.chunk;
  replica.busy = false;
  replica.job_id.clear();
  job.chunk_running = false;
  const auto now = Clock::now();

  ChunkOutcome outcome = result.outcome;
  std::string error = result.error;
  const bool stop = stop_requested_locked(job, now);
  if (outcome == ChunkOutcome::Stopped && !stop) {
    outcome = ChunkOutcome::Failed;  // an executor that stops on its own has failed
    if (error.empty()) error = "chunk stopped without a request";
  }

  if (outcome == ChunkOutcome::Succeeded) {
    replica.consecutive_failures = 0;
    ++replica.chunks_run;
    if (replica.work > 0) {
      const double sample = seconds / replica.work;
      seconds_per_work_ = seconds_per_work_ == 0 ? sample : 0.7 * seconds_per_work_ + 0.3 * sample;
    }
    ++job.chunks_done;
    job.holder = static_cast<int>(index);
    job.avoid = -1;
    job.attempts = 0;
    job.chunk_replicas.push_back(replica.name);
    job.rows_before_chunk += job.spec.chunk_rows.empty() ? 0 : job.spec.chunk_rows[static_cast<size_t>(chunk)];
    job.rows_in_chunk = 0;
    JobEvent event;
    event.type = EventType::ChunkFinished;
    event.chunk = chunk;
    event.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
    event.replica = replica.name;
    event.seconds = seconds;
    push_event_locked(job, std::move(event));
    spdlog::info("job={} event=chunk_finished chunk={} replica={} seconds={:.3f}", job.id, chunk, replica.name,
                 seconds);
    if (observer_)
      observer_->chunk_finished(snapshot_locked(job), replica.name, chunk, seconds, result.frames_generated);
    if (job.chunks_done == static_cast<int64_t>(job.spec.chunk_work.size())) {
      finish_locked(job, JobState::Succeeded, ErrorKind::None, "");
    }
  } else if (outcome == ChunkOutcome::ResourceExhausted) {
    // The request did not fit in the device's memory: its fault, not the replica's (which keeps its count).
    spdlog::warn("job={} event=chunk_out_of_memory chunk={} replica={} error=\"{}\"", job.id, chunk, replica.name,
                 error);
    if (!stop) finish_locked(job, JobState::Failed, ErrorKind::ResourceExhausted, error);
  } else if (outcome == ChunkOutcome::NotStored) {
    replica.consecutive_failures = 0;  // the replica worked; the store did not
    spdlog::error("job={} event=chunk_not_stored chunk={} error=\"{}\"", job.id, chunk, error);
    if (!stop) finish_locked(job, JobState::Failed, ErrorKind::Internal, "chunk " + std::to_string(chunk) +
                                                                             " could not be stored: " + error);
  } else if (outcome == ChunkOutcome::Rejected) {
    replica.consecutive_failures = 0;  // the replica works; the request does not
    spdlog::warn("job={} event=chunk_rejected chunk={} replica={} error=\"{}\"", job.id, chunk, replica.name, error);
    if (!stop) finish_locked(job, JobState::Failed, ErrorKind::InvalidArgument, error);
  } else if (outcome == ChunkOutcome::Failed) {
    ++replica.failures;
    ++replica.consecutive_failures;
    replica.error = error;
    ++job.attempts;
    if (replica.healthy && replica.consecutive_failures >= options_.replica_failure_limit) {
      replica.healthy = false;
      replica.backoff = std::chrono::duration_cast<Clock::duration>(options_.retest_backoff);
      replica.retest_at = now + replica.backoff;
      timer_cv_.notify_all();
      spdlog::error("replica={} event=taken_out consecutive_failures={} retest_in_seconds={:.3f} error=\"{}\"",
                    replica.name, replica.consecutive_failures, std::chrono::duration<double>(replica.backoff).count(),
                    error);
      update_liveness_locked(now);
    }
    const bool any_healthy = std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
    const bool retry = !stop && job.attempts <= options_.chunk_retries && any_healthy;
    spdlog::warn("job={} event=chunk_failed chunk={} replica={} attempt={} retry={} error=\"{}\"", job.id, chunk,
                 replica.name, job.attempts - 1, retry, error);
    if (observer_) observer_->chunk_failed(snapshot_locked(job), replica.name, chunk, error, retry);
    if (retry) {
      ++job.retries;
      job.avoid = static_cast<int>(index);
      job.rows_in_chunk = 0;
      JobEvent event;
      event.type = EventType::ChunkRetry;
      event.chunk = chunk;
      event.replica = replica.name;
      event.attempt = job.attempts - 1;
      event.message = error;
      push_event_locked(job, std::move(event));
      persist_update_locked(job);
    } else if (!stop) {
      finish_locked(job, JobState::Failed, ErrorKind::Internal,
                    "chunk " + std::to_string(chunk) + " failed " + std::to_string(job.attempts) +
                        " time(s); last error on replica " + replica.name + ": " + error);
    }
  }
  // Stop requests end the job whatever the chunk's outcome (a chunk that completed anyway is kept).
  if (job.active() && stop) {
    if (job.aborted) {
      finish_locked(job, JobState::Failed, ErrorKind::Unavailable, job.abort_reason);
    } else if (stopping_) {
      finish_locked(job, JobState::Failed, ErrorKind::Unavailable, "server stopped");
    } else if (job.cancel_requested) {
      finish_locked(job, JobState::Cancelled, ErrorKind::Cancelled, "cancelled by the client");
    } else {
      finish_locked(job, JobState::DeadlineExceeded, ErrorKind::DeadlineExceeded, "deadline passed while running");
    }
  }
  if (observer_) observer_->replica_changed(replica_status_locked(replica));
  changed_.notify_all();
}

void Scheduler::finish_locked(Job& job, JobState state, ErrorKind kind, const std::string& error) {
  job.state = state;
  job.error_kind = kind;
  job.error = error;
  job.finished = WallClock::now();
  job.finished_mono = Clock::now();
  job.position = 0;
  job.eta = -1;
  persist_update_locked(job);
  JobEvent event;
  event.type = EventType::Finished;
  event.message = error;
  push_event_locked(job, std::move(event));
  if (state == JobState::Succeeded) {
    spdlog::info("job={} event=finished state={} chunks={} handoffs={} retries={}", job.id, job_state_name(state),
                 job.chunks_done, job.handoffs, job.retries);
  } else {
    spdlog::warn("job={} event=finished state={} chunks_done={} error=\"{}\"", job.id, job_state_name(state),
                 job.chunks_done, error);
  }
  if (observer_) observer_->job_finished(snapshot_locked(job));
  changed_.notify_all();
}

void Scheduler::push_event_locked(Job& job, JobEvent event) {
  event.sequence = job.next_sequence++;
  event.time = WallClock::now();
  if (event.type != EventType::Step && persisting_locked()) {
    try {
      store_->append_event(job.id, {event.sequence, encode_event(event)});
    } catch (const StoreError& e) {
      spdlog::error("job={} event=store_event_failed sequence={} error=\"{}\"", job.id, event.sequence, e.what());
    }
  }
  job.events.push_back(std::move(event));
  wake_watchers_locked(job);
}

bool Scheduler::persisting_locked() const {
  // A stop of a durable server leaves unfinished jobs as they are stored: the next start resumes them.
  return store_ != nullptr && !((stopping_ || keep_unfinished_) && store_->durable());
}

StoredJob Scheduler::stored_locked(const Job& job) const {
  StoredJob s;
  s.id = job.id;
  s.order = job.order;
  s.vbase = job.vbase;
  s.owner = job.spec.owner;
  s.client = job.spec.client;
  s.priority = job.spec.priority;
  const JobSnapshot snap = snapshot_locked(job);
  if (snap.deadline) s.deadline_ms = to_ms(*snap.deadline);
  s.idempotency_key = job.spec.idempotency_key;
  s.fingerprint = job.spec.fingerprint;
  s.state = job_state_name(job.state);
  s.error_kind = error_kind_name(job.error_kind);
  s.error = job.error;
  s.created_ms = to_ms(job.created);
  s.started_ms = to_ms(job.started);
  s.finished_ms = to_ms(job.finished);
  s.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  s.chunks_done = job.chunks_done;
  s.retries = job.retries;
  s.handoffs = job.handoffs;
  return s;
}

void Scheduler::persist_update_locked(const Job& job) {
  if (!persisting_locked()) return;
  try {
    store_->update_job(stored_locked(job));
  } catch (const StoreError& e) {
    spdlog::error("job={} event=store_update_failed error=\"{}\"", job.id, e.what());
  }
}

void Scheduler::wake_watchers_locked(Job& job) {
  job.watchers->notify_all();
  for (const auto& [token, notify] : job.listeners) notify();
}

void Scheduler::update_positions_locked(Clock::time_point now) {
  std::vector<Job*> waiting;  // every job waiting for a replica, in dispatch order
  for (auto& [id, job] : jobs_) {
    if (job->active() && !job->chunk_running) waiting.push_back(job.get());
  }
  std::sort(waiting.begin(), waiting.end(),
            [](const Job* a, const Job* b) { return policy::dispatch_before(a->key(), b->key()); });
  int64_t healthy = 0;
  double soonest_free = std::numeric_limits<double>::infinity();
  for (const auto& r : replicas_) {
    if (!r->healthy) continue;
    ++healthy;
    const double remaining =
        r->busy ? std::max(0.0, r->expected_seconds - std::chrono::duration<double>(now - r->chunk_started).count())
                : 0.0;
    soonest_free = std::min(soonest_free, remaining);
  }
  int64_t position = 0;
  double work_ahead = 0;
  for (Job* job : waiting) {
    if (job->state == JobState::Queued) {
      ++position;
      const double eta =
          policy::queue_eta(soonest_free, estimate_seconds_locked(work_ahead), healthy, seconds_per_work_ > 0);
      const bool moved = position != job->position;
      job->position = position;
      job->eta = eta;
      if (moved) {
        JobEvent event;
        event.type = EventType::Queued;
        event.position = position;
        event.eta_seconds = eta;
        push_event_locked(*job, std::move(event));
      }
    }
    work_ahead += job->spec.chunk_work[static_cast<size_t>(job->chunks_done)];
  }
}

int64_t Scheduler::count_locked(JobState state) const {
  return std::count_if(jobs_.begin(), jobs_.end(), [state](const auto& entry) { return entry.second->state == state; });
}

void Scheduler::notify_queue_locked() {
  if (observer_) observer_->queue_changed(count_locked(JobState::Queued), count_locked(JobState::Running));
}

void Scheduler::gc_locked() {
  const auto now = Clock::now();
  std::vector<Job*> finished;
  for (auto& [id, job] : jobs_) {
    if (!job->active() && !job->chunk_running) finished.push_back(job.get());
  }
  std::sort(finished.begin(), finished.end(),
            [](const Job* a, const Job* b) { return *a->finished_mono < *b->finished_mono; });
  const int64_t excess = static_cast<int64_t>(finished.size()) - options_.max_retained_jobs;
  for (size_t i = 0; i < finished.size(); ++i) {
    Job* job = finished[i];
    const bool expired = now - *job->finished_mono > options_.retention;
    if (static_cast<int64_t>(i) >= excess && !expired) continue;
    if (!job->spec.idempotency_key.empty()) idempotency_.erase({job->spec.owner, job->spec.idempotency_key});
    if (store_ != nullptr) {
      try {
        store_->drop_job(job->id, expired ? "its results were kept --result-ttl-seconds " +
                                                std::to_string(options_.retention.count())
                                          : "more than --max-retained-jobs " +
                                                std::to_string(options_.max_retained_jobs) + " finished jobs");
      } catch (const StoreError& e) {
        spdlog::error("job={} event=store_remove_failed error=\"{}\"", job->id, e.what());
      }
    }
    wake_watchers_locked(*job);  // they find the job gone
    jobs_.erase(job->id);
  }
}

// ---- snapshots and queries ------------------------------------------------------------------------------------

JobSnapshot Scheduler::snapshot_locked(const Job& job) const {
  JobSnapshot s;
  s.id = job.id;
  s.owner = job.spec.owner;
  s.state = job.state;
  s.priority = job.spec.priority;
  s.idempotency_key = job.spec.idempotency_key;
  s.created = job.created;
  s.started = job.started;
  s.finished = job.finished;
  if (job.spec.deadline) {
    s.deadline = job.created + std::chrono::duration_cast<WallClock::duration>(*job.spec.deadline - job.created_mono);
  }
  s.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  s.chunks_done = job.chunks_done;
  s.queue_position = job.state == JobState::Queued ? job.position : 0;
  s.eta_seconds = job.state == JobState::Queued ? job.eta : -1;
  if (job.state == JobState::Succeeded) {
    s.progress = 1.0;
  } else if (job.rows_total > 0) {
    s.progress = static_cast<double>(job.rows_before_chunk + job.rows_in_chunk) / static_cast<double>(job.rows_total);
  }
  s.chunk_replicas = job.chunk_replicas;
  s.handoffs = job.handoffs;
  s.retries = job.retries;
  s.error_kind = job.error_kind;
  s.error = job.error;
  s.last_sequence = job.next_sequence - 1;
  s.payload = job.spec.payload;
  s.description = job.spec.description;
  return s;
}

ReplicaStatus Scheduler::replica_status_locked(const Replica& replica) const {
  ReplicaStatus s;
  s.name = replica.name;
  s.loaded = replica.loaded;
  s.healthy = replica.healthy;
  s.busy = replica.busy;
  s.chunks_run = replica.chunks_run;
  s.failures = replica.failures;
  s.recoveries = replica.recoveries;
  s.error = replica.error;
  return s;
}

Scheduler::Job* Scheduler::find_locked(const std::string& id, const std::string& owner) const {
  auto it = jobs_.find(id);
  if (it == jobs_.end() || it->second->spec.owner != owner) return nullptr;
  return it->second.get();
}

void Scheduler::check_admission(const JobSpec& spec) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!spec.idempotency_key.empty() && !draining_ && idempotency_.count({spec.owner, spec.idempotency_key})) return;
  check_admission_locked(spec.client, spec.client_max_jobs);
}

void Scheduler::check_admission_locked(const std::string& client, int64_t client_max_jobs) const {
  if (draining_ || stopping_) {
    throw AdmissionError(AdmissionError::Reason::Draining, "server is draining: no new jobs are accepted");
  }
  const bool all_done = std::all_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->load_done; });
  const bool any_healthy = std::any_of(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
  if (all_done && !any_healthy) {
    throw AdmissionError(AdmissionError::Reason::Unavailable, "no healthy replica");
  }
  int64_t active = 0, mine = 0;
  double work = 0;  // of the chunks next in line, for the retry hint
  for (const auto& [id, job] : jobs_) {
    if (!job->active()) continue;
    ++active;
    if (job->spec.client == client) ++mine;
    work += job->spec.chunk_work[static_cast<size_t>(job->chunks_done)];
  }
  // Hint: about when the next job should end (each healthy replica ends roughly one chunk per estimate).
  auto retry_after = [&] {
    if (seconds_per_work_ <= 0) return 1.0;
    const auto healthy = std::count_if(replicas_.begin(), replicas_.end(), [](const auto& r) { return r->healthy; });
    return std::max(1.0, estimate_seconds_locked(work) / static_cast<double>(std::max<int64_t>(1, healthy)));
  };
  if (active >= options_.max_jobs) {
    throw AdmissionError(AdmissionError::Reason::QueueFull,
                         "queue full: " + std::to_string(active) + " jobs admitted (--max-queue " +
                             std::to_string(options_.max_jobs) + ")",
                         retry_after());
  }
  const int64_t cap = client_max_jobs > 0 ? client_max_jobs : options_.max_jobs_per_client;
  if (cap > 0 && mine >= cap) {
    throw AdmissionError(AdmissionError::Reason::ClientQueueFull,
                         "client queue full: this client has " + std::to_string(mine) +
                             " unfinished jobs (per-client cap " + std::to_string(cap) + ")",
                         retry_after());
  }
}

SubmitResult Scheduler::submit(JobSpec spec) {
  if (spec.chunk_work.empty()) throw std::invalid_argument("scheduler: a job needs at least one chunk");
  if (!spec.chunk_rows.empty() && spec.chunk_rows.size() != spec.chunk_work.size()) {
    throw std::invalid_argument("scheduler: chunk_rows and chunk_work differ in size");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_ || stopping_) {
    throw AdmissionError(AdmissionError::Reason::Draining, "server is draining: no new jobs are accepted");
  }
  if (!spec.idempotency_key.empty()) {
    auto it = idempotency_.find({spec.owner, spec.idempotency_key});
    if (it != idempotency_.end()) {
      Job* existing = find_locked(it->second, spec.owner);
      if (existing != nullptr) {
        if (existing->spec.fingerprint != spec.fingerprint) {
          throw AdmissionError(AdmissionError::Reason::IdempotencyConflict,
                               "idempotency_key: already used by job " + existing->id + " with a different request");
        }
        return {snapshot_locked(*existing), true};
      }
    }
  }
  check_admission_locked(spec.client, spec.client_max_jobs);

  auto job = std::make_unique<Job>();
  job->id = new_job_id();
  while (jobs_.count(job->id)) job->id = new_job_id();
  job->order = next_seq_++;
  job->created = WallClock::now();
  job->created_mono = Clock::now();
  int64_t least = std::numeric_limits<int64_t>::max();
  for (const auto& [id, other] : jobs_) {
    if (other->active()) least = std::min(least, other->fair_key());
  }
  job->vbase = least == std::numeric_limits<int64_t>::max() ? 0 : least;
  for (int64_t rows : spec.chunk_rows) job->rows_total += rows;
  job->spec = std::move(spec);
  Job& ref = *job;
  if (store_ != nullptr) {
    // Acknowledged only once committed: a SIGKILL after this answer cannot lose the job.
    StoredJob stored = stored_locked(ref);
    stored.request = std::move(ref.spec.durable_request);
    ref.spec.durable_request.clear();
    try {
      store_->insert_job(std::move(stored));
    } catch (const StoreError& e) {
      spdlog::error("job={} event=store_insert_failed error=\"{}\"", ref.id, e.what());
      throw AdmissionError(AdmissionError::Reason::Unavailable, std::string("the job could not be stored: ") + e.what(),
                           1.0);
    }
  }
  jobs_[ref.id] = std::move(job);
  if (!ref.spec.idempotency_key.empty()) idempotency_[{ref.spec.owner, ref.spec.idempotency_key}] = ref.id;
  spdlog::info("job={} event=submitted chunks={} priority={} owner={}", ref.id, ref.spec.chunk_work.size(),
               ref.spec.priority, ref.spec.owner.empty() ? "-" : ref.spec.owner);
  if (observer_) observer_->job_submitted(snapshot_locked(ref));
  update_positions_locked(Clock::now());  // the first Queued event, before any ChunkStarted
  dispatch_locked();
  return {snapshot_locked(ref), false};
}

void Scheduler::restore(std::vector<RestoredJob> restored) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto wall_now = WallClock::now();
  const auto mono_now = Clock::now();
  auto mono = [&](WallClock::time_point t) {
    return mono_now + std::chrono::duration_cast<Clock::duration>(t - wall_now);
  };
  for (RestoredJob& r : restored) {
    const StoredJob& s = r.stored;
    auto job = std::make_unique<Job>();
    job->id = s.id;
    job->order = s.order;
    next_seq_ = std::max(next_seq_, s.order + 1);
    job->vbase = s.vbase;
    job->spec.owner = s.owner;
    job->spec.client = s.client;
    job->spec.priority = s.priority;
    if (s.deadline_ms) job->spec.deadline = mono(from_ms(*s.deadline_ms));
    job->spec.idempotency_key = s.idempotency_key;
    job->spec.fingerprint = s.fingerprint;
    job->spec.payload = r.payload;
    job->spec.description = r.description;
    job->spec.chunk_work = r.chunk_work.empty() ? std::vector<double>(static_cast<size_t>(s.chunk_count), 1.0)
                                                : r.chunk_work;
    job->spec.chunk_rows = r.chunk_rows;
    job->created = from_ms(s.created_ms);
    job->created_mono = mono(job->created);
    if (s.started_ms) job->started = from_ms(s.started_ms);
    job->state = parse_state(s.state);
    job->error_kind = parse_error_kind(s.error_kind);
    job->error = s.error;
    job->chunks_done = std::min<int64_t>(s.chunks_done, static_cast<int64_t>(job->spec.chunk_work.size()));
    job->retries = s.retries;
    job->handoffs = s.handoffs;
    for (const auto& c : r.chunks) job->chunk_replicas.push_back(c.replica);
    int64_t most_rows = 0;
    for (size_t i = 0; i < job->spec.chunk_rows.size(); ++i) {
      job->rows_total += job->spec.chunk_rows[i];
      if (static_cast<int64_t>(i) < job->chunks_done) job->rows_before_chunk += job->spec.chunk_rows[i];
      most_rows = std::max(most_rows, job->spec.chunk_rows[i]);
    }
    for (const auto& stored_event : r.events) {
      try {
        job->events.push_back(decode_event(stored_event));
      } catch (const std::exception& e) {
        spdlog::warn("job={} event=stored_event_unreadable sequence={} error=\"{}\"", s.id, stored_event.sequence,
                     e.what());
      }
      job->next_sequence = std::max(job->next_sequence, stored_event.sequence + 1);
    }
    if (job->active()) {
      // Step events were never stored: the numbers they took before the restart (at most one chunk's rows after
      // the last stored event) are skipped, so that a client resuming with after_sequence misses nothing.
      job->next_sequence += static_cast<uint64_t>(most_rows) + 1;
      const bool in_flight = !job->events.empty() && job->events.back().type == EventType::ChunkStarted &&
                             job->events.back().chunk == job->chunks_done;
      const bool all_done = job->chunks_done == static_cast<int64_t>(job->spec.chunk_work.size());
      Job& ref = *job;
      jobs_[s.id] = std::move(job);
      if (all_done) {
        finish_locked(ref, JobState::Succeeded, ErrorKind::None, "");  // killed between its last commit and its end
      } else if (!r.payload) {
        finish_locked(ref, JobState::Failed, ErrorKind::Internal, "could not resume after a restart: " + r.error);
      } else if (in_flight) {
        ++ref.retries;
        ++ref.attempts;
        JobEvent event;
        event.type = EventType::ChunkRetry;
        event.chunk = ref.chunks_done;
        event.replica = ref.events.back().replica;
        event.attempt = ref.attempts - 1;
        event.message = "the server restarted while the chunk ran";
        push_event_locked(ref, std::move(event));
        persist_update_locked(ref);
      }
      spdlog::info("job={} event=restored state={} chunks_done={}/{} in_flight={}", s.id, job_state_name(ref.state),
                   ref.chunks_done, ref.spec.chunk_work.size(), in_flight);
    } else {
      job->finished = from_ms(s.finished_ms);
      job->finished_mono = mono(*job->finished);
      jobs_[s.id] = std::move(job);
    }
    if (!s.idempotency_key.empty()) idempotency_[{s.owner, s.idempotency_key}] = s.id;
  }
  notify_queue_locked();
}

std::optional<JobSnapshot> Scheduler::get(const std::string& id, const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Job* job = find_locked(id, owner);
  if (job == nullptr) return std::nullopt;
  return snapshot_locked(*job);
}

std::optional<std::string> Scheduler::dropped(const std::string& id, const std::string& owner) const {
  if (store_ == nullptr) return std::nullopt;
  try {
    return store_->dropped_reason(id, owner);
  } catch (const StoreError& e) {
    spdlog::warn("event=store_read_failed error=\"{}\"", e.what());
    return std::nullopt;
  }
}

std::optional<std::string> Scheduler::chunk_result(const std::string& id, const std::string& owner,
                                                  int64_t index) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (store_ == nullptr || find_locked(id, owner) == nullptr) return std::nullopt;
  }
  return store_->load_chunk_bytes(id, index);  // outside the lock: megabytes
}

std::optional<std::string> Scheduler::segment(const std::string& id, const std::string& owner, int64_t index) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (store_ == nullptr || find_locked(id, owner) == nullptr) return std::nullopt;
  }
  return store_->load_segment(id, index);
}

std::vector<JobSnapshot> Scheduler::list(const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const Job*> owned;
  for (const auto& [id, job] : jobs_) {
    if (job->spec.owner == owner) owned.push_back(job.get());
  }
  std::sort(owned.begin(), owned.end(), [](const Job* a, const Job* b) { return a->order < b->order; });
  std::vector<JobSnapshot> out;
  out.reserve(owned.size());
  for (const Job* job : owned) out.push_back(snapshot_locked(*job));
  return out;
}

std::optional<JobSnapshot> Scheduler::cancel(const std::string& id, const std::string& owner) {
  std::lock_guard<std::mutex> lock(mu_);
  Job* job = find_locked(id, owner);
  if (job == nullptr) return std::nullopt;
  if (job->active() && !job->cancel_requested) {
    job->cancel_requested = true;
    spdlog::info("job={} event=cancel_requested running={}", job->id, job->chunk_running);
    if (!job->chunk_running) {
      finish_locked(*job, JobState::Cancelled, ErrorKind::Cancelled, "cancelled by the client");
      dispatch_locked();
    }
  }
  return snapshot_locked(*job);
}

EventBatch Scheduler::wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                                  Clock::time_point until) const {
  std::unique_lock<std::mutex> lock(mu_);
  EventBatch batch;
  while (true) {
    const Job* job = find_locked(id, owner);
    if (job == nullptr) {
      batch.found = false;
      return batch;
    }
    const auto first = std::upper_bound(job->events.begin(), job->events.end(), after_sequence,
                                        [](uint64_t seq, const JobEvent& e) { return seq < e.sequence; });
    batch.events.insert(batch.events.end(), first, job->events.end());
    batch.finished = !job->active();
    if (!batch.events.empty() || batch.finished) return batch;
    const auto watchers = job->watchers;  // the job may be dropped while we wait
    if (watchers->wait_until(lock, until) == std::cv_status::timeout) return batch;
  }
}

uint64_t Scheduler::subscribe(const std::string& id, const std::string& owner, std::function<void()> notify) {
  std::lock_guard<std::mutex> lock(mu_);
  Job* job = find_locked(id, owner);
  if (job == nullptr) return 0;
  const uint64_t token = next_listener_++;
  job->listeners[token] = std::move(notify);
  return token;
}

void Scheduler::unsubscribe(const std::string& id, uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(id);
  if (it != jobs_.end()) it->second->listeners.erase(token);
}

std::optional<JobSnapshot> Scheduler::wait_chunks(const std::string& id, const std::string& owner, int64_t chunks_seen,
                                                  Clock::time_point until) const {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    const Job* job = find_locked(id, owner);
    if (job == nullptr) return std::nullopt;
    if (job->chunks_done > chunks_seen || !job->active()) return snapshot_locked(*job);
    const auto watchers = job->watchers;  // a chunk's end and the job's end are events of the job
    if (watchers->wait_until(lock, until) == std::cv_status::timeout) return snapshot_locked(*job);
  }
}

void Scheduler::begin_drain() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!draining_)
    spdlog::info("event=drain_started queued={} running={}", count_locked(JobState::Queued),
                 count_locked(JobState::Running));
  draining_ = true;
  changed_.notify_all();
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

bool Scheduler::wait_idle(Clock::time_point until) const {
  std::unique_lock<std::mutex> lock(mu_);
  return changed_.wait_until(lock, until, [&] {
    return std::none_of(jobs_.begin(), jobs_.end(),
                        [](const auto& entry) { return entry.second->active() || entry.second->chunk_running; });
  });
}

void Scheduler::abort_all(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (store_ != nullptr && store_->durable()) {
    keep_unfinished_ = true;  // the jobs end here, and stay unfinished in the store: the next start resumes them
    spdlog::info("event=abort_keeps_stored_jobs store={}", store_->describe());
  }
  for (auto& [id, job] : jobs_) {
    if (!job->active()) continue;
    job->aborted = true;
    job->abort_reason = reason;
    if (!job->chunk_running) finish_locked(*job, JobState::Failed, ErrorKind::Unavailable, reason);
  }
  notify_queue_locked();
}

std::vector<ReplicaStatus> Scheduler::replicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReplicaStatus> out;
  for (const auto& r : replicas_) out.push_back(replica_status_locked(*r));
  return out;
}

int64_t Scheduler::queued_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_locked(JobState::Queued);
}

int64_t Scheduler::running_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_locked(JobState::Running);
}

}  // namespace skyreels::server
