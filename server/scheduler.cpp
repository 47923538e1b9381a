#include "server/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>
#include <set>

#include "server/dispatch_policy.h"
#include "server/fingerprint.h"

namespace skyreels::server {


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
  TransformerWork work;  // of the chunks done
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
  bool active() const { return !is_terminal(state); }
};

// What this scheduler handed to one replica of the pool: pending until its worker picks it up, then running.
struct Scheduler::Slot {
  bool assigned = false;  // a chunk is pending or running here
  std::optional<ChunkAssignment> pending;
  std::string job_id;
  int64_t chunk = -1;
  double work = 0;
  Clock::time_point started;
  double expected_seconds = 0;
  std::condition_variable cv;  // a chunk is pending, or the pool stops
};

ReplicaPoolOptions replica_pool_options(const SchedulerOptions& options) {
  ReplicaPoolOptions pool;
  pool.failure_limit = options.replica_failure_limit;
  pool.retest_backoff = options.retest_backoff;
  pool.retest_backoff_max = options.retest_backoff_max;
  pool.liveness_grace = options.liveness_grace;
  return pool;
}

namespace {

double seconds_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

}  // namespace

Scheduler::Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> replicas, SchedulerOptions options,
                     SchedulerObserver* observer, JobStore* store)
    : options_(options),
      observer_(observer),
      store_(store),
      pool_(std::move(replicas), replica_pool_options(options), observer) {
  for (size_t i = 0; i < pool_.size(); ++i) slots_.push_back(std::make_unique<Slot>());
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
    timer_cv_.notify_all();
    changed_.notify_all();
  }
  pool_.stop();  // running chunks see should_stop(); workers end in next_chunk()
  if (timer_.joinable()) timer_.join();
}

void Scheduler::start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return;
    started_ = true;
  }
  pool_.start(*this);
  timer_ = std::thread([this] { timer_loop(); });
}

bool Scheduler::all_loaded() const { return pool_.all_loaded(); }

bool Scheduler::live() const { return pool_.live(); }

bool Scheduler::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pool_.all_loaded() && pool_.any_healthy() && !draining_ && !stopping_;
}

// ---- the pool's side (ChunkSource) ----------------------------------------------------------------------------

std::optional<ChunkAssignment> Scheduler::next_chunk(size_t replica) {
  std::unique_lock<std::mutex> lock(mu_);
  Slot& slot = *slots_[replica];
  if (!slot.pending) dispatch_locked();  // this replica is free now (chunk_done may have handed it one already)
  slot.cv.wait(lock, [&] { return slot.pending.has_value() || interrupted_; });
  if (!slot.pending) return std::nullopt;
  ChunkAssignment assignment = std::move(*slot.pending);
  slot.pending.reset();
  return assignment;
}

void Scheduler::chunk_done(size_t replica, ChunkAssignment assignment, ChunkResult result, double seconds) {
  if (result.outcome == ChunkOutcome::Succeeded && store_ != nullptr && !result.bytes.empty()) {
    // Outside the lock: a chunk's result is megabytes. Chunks of one job never run concurrently and the job's
    // other rows do not hold chunks_done, so nothing races this commit.
    try {
      store_->commit_chunk(assignment.work.job_id, {assignment.work.chunk_index, pool_.name(replica),
                                                    assignment.work.attempt + 1, std::move(result.bytes)});
    } catch (const StoreError& e) {
      result.outcome = ChunkOutcome::NotStored;
      result.error = e.what();
    }
  }
  result.bytes.clear();
  std::lock_guard<std::mutex> lock(mu_);
  complete_locked(replica, result, seconds);
  dispatch_locked();
}

void Scheduler::replicas_changed() {
  std::lock_guard<std::mutex> lock(mu_);
  dispatch_locked();
  changed_.notify_all();
}

void Scheduler::interrupt() {
  std::lock_guard<std::mutex> lock(mu_);
  interrupted_ = true;
  for (auto& slot : slots_) slot->cv.notify_all();
}

void Scheduler::timer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    timer_cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (stopping_) break;
    dispatch_locked();  // expires deadlines, refreshes queue positions and estimates
    gc_locked();
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

void Scheduler::fail_waiting_jobs_locked(const std::string& reason) {
  for (auto& [id, job] : jobs_) {
    if (job->active() && !job->chunk_running) finish_locked(*job, JobState::Failed, ErrorKind::Unavailable, reason);
  }
}

policy::JobKey Scheduler::key_locked(const Job& job) const {
  const auto share = clients_.find(job.spec.client);
  return {job.spec.priority, job.fair_key(), job.order, share == clients_.end() ? 0 : share->second.service};
}

void Scheduler::sort_for_dispatch_locked(std::vector<Job*>& jobs) const {
  std::sort(jobs.begin(), jobs.end(),
            [this](const Job* a, const Job* b) { return policy::dispatch_before(key_locked(*a), key_locked(*b)); });
}

// A client that becomes active (its first unfinished job) starts at client_share_start; its later jobs start within
// its own share.
void Scheduler::start_shares_locked(Job& job) {
  std::vector<int64_t> own_jobs, active_clients;
  std::set<std::string> active;
  for (const auto* jobs : {&jobs_, &reserving_}) {
    for (const auto& [id, other] : *jobs) {
      if (!other->active() || other.get() == &job) continue;
      if (other->spec.client == job.spec.client) own_jobs.push_back(other->fair_key());
      active.insert(other->spec.client);
    }
  }
  job.vbase = policy::fair_share_start(own_jobs);
  if (!active.count(job.spec.client)) {
    for (const std::string& client : active) {
      const auto share = clients_.find(client);
      active_clients.push_back(share == clients_.end() ? 0 : share->second.service);
    }
    const auto own = clients_.find(job.spec.client);
    clients_[job.spec.client].service =
        policy::client_share_start(own == clients_.end() ? -1 : own->second.service, active_clients);
  }
  clients_[job.spec.client].weight = job.spec.client_weight;
}

// Clients without an unfinished job are forgotten once they would start from the active clients' least service
// anyway (bounded: anonymous clients are peer addresses).
void Scheduler::forget_idle_clients_locked() {
  std::set<std::string> active;
  int64_t least = std::numeric_limits<int64_t>::max();
  for (const auto* jobs : {&jobs_, &reserving_}) {
    for (const auto& [id, job] : *jobs) {
      if (job->active()) active.insert(job->spec.client);
    }
  }
  for (const std::string& client : active) {
    const auto share = clients_.find(client);
    if (share != clients_.end()) least = std::min(least, share->second.service);
  }
  for (auto it = clients_.begin(); it != clients_.end();) {
    const bool idle = !active.count(it->first);
    if (idle && (it->second.service <= least || clients_.size() > kMaxIdleClients)) {
      it = clients_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<policy::ReplicaView> Scheduler::replica_views_locked(Clock::time_point now) const {
  std::vector<policy::ReplicaView> views(slots_.size());
  for (size_t r = 0; r < slots_.size(); ++r) {
    const Slot& slot = *slots_[r];
    policy::ReplicaView& v = views[r];
    v.healthy = pool_.healthy(r);
    v.idle = v.healthy && !slot.assigned;
    if (slot.assigned) {
      v.remaining_seconds = policy::remaining_seconds(slot.expected_seconds, seconds_since(slot.started, now));
    }
  }
  return views;
}

void Scheduler::dispatch_locked() {
  if (!started_ || stopping_) return;
  const auto now = Clock::now();
  expire_locked(now);
  if (pool_.all_loaded() && !pool_.any_healthy()) fail_waiting_jobs_locked("no healthy replica");

  std::vector<policy::ReplicaView> views = replica_views_locked(now);
  auto any_idle = [&] { return std::any_of(views.begin(), views.end(), [](const auto& v) { return v.idle; }); };
  if (any_idle()) {
    std::vector<Job*> ready;
    for (auto& [id, job] : jobs_) {
      if (job->active() && !job->chunk_running && !job->cancel_requested && !job->aborted) ready.push_back(job.get());
    }
    // Each assignment charges its client, which can reorder the rest: sort again after each one.
    while (!ready.empty() && any_idle()) {
      sort_for_dispatch_locked(ready);
      auto it = ready.begin();
      int chosen = -1;
      for (; it != ready.end(); ++it) {
        chosen = choose_replica_locked(**it, views);
        if (chosen >= 0) break;
      }
      if (it == ready.end()) break;
      assign_locked(**it, static_cast<size_t>(chosen), now);
      views[static_cast<size_t>(chosen)].idle = false;
      ready.erase(it);
    }
  }
  update_positions_locked(now);
  notify_queue_locked();
}

int Scheduler::choose_replica_locked(const Job& job, std::vector<policy::ReplicaView> views) const {
  for (const auto& [id, other] : jobs_) {
    if (other.get() != &job && other->active() && !other->chunk_running && other->holder >= 0) {
      views[static_cast<size_t>(other->holder)].held_by_other_job = true;
    }
  }
  return policy::choose_replica({job.holder, job.avoid}, views, options_.handoff_cost_seconds, have_estimate_locked());
}

void Scheduler::assign_locked(Job& job, size_t index, Clock::time_point now) {
  Slot& slot = *slots_[index];
  const std::string& replica = pool_.name(index);
  const int64_t chunk = job.chunks_done;
  const double work = job.spec.chunk_work[static_cast<size_t>(chunk)];
  slot.assigned = true;
  slot.job_id = job.id;
  slot.chunk = chunk;
  slot.work = work;
  slot.started = now;
  slot.expected_seconds = estimate_seconds_locked(work);
  ClientShare& share = clients_[job.spec.client];
  share.service += policy::charge_chunk(share.weight);  // charged as it starts: the next idle replica sees it

  const bool handoff = job.holder >= 0 && job.holder != static_cast<int>(index);
  const JobSnapshot before = snapshot_locked(job);
  if (handoff) {
    ++job.handoffs;
    const std::string& from = pool_.name(static_cast<size_t>(job.holder));
    spdlog::info("job={} event=handoff chunk={} from={} to={}", job.id, chunk, from, replica);
    if (observer_) observer_->handoff(before, from, replica);
  }
  if (job.state == JobState::Queued) {
    job.state = JobState::Running;
    job.started = WallClock::now();
    if (observer_) observer_->job_started(snapshot_locked(job), seconds_since(job.created_mono, now));
    persist_update_locked(job);
  } else if (handoff) {
    persist_update_locked(job);
  }
  job.chunk_running = true;
  job.rows_in_chunk = 0;
  job.position = 0;
  job.eta = -1;

  ChunkAssignment assignment;
  assignment.work.job_id = job.id;
  assignment.work.chunk_index = chunk;
  assignment.work.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  assignment.work.attempt = job.attempts;
  assignment.work.handoff = handoff;
  assignment.work.payload = job.spec.payload.get();
  assignment.payload = job.spec.payload;
  assignment.callbacks = callbacks_for_locked(job, index, chunk);
  slot.pending = std::move(assignment);

  JobEvent event;
  event.type = EventType::ChunkStarted;
  event.chunk = chunk;
  event.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
  event.replica = replica;
  event.handoff = handoff;
  event.attempt = job.attempts;
  push_event_locked(job, std::move(event));
  spdlog::info("job={} event=chunk_started chunk={}/{} replica={} attempt={} handoff={}", job.id, chunk,
               job.spec.chunk_work.size(), replica, job.attempts, handoff);
  if (observer_) observer_->chunk_started(snapshot_locked(job), replica, chunk);
  slot.cv.notify_one();
}

// Step events and stop checks of one running chunk. `job` is never collected while its chunk runs.
ChunkCallbacks Scheduler::callbacks_for_locked(Job& job, size_t replica, int64_t chunk) {
  ChunkCallbacks callbacks;
  Job* running = &job;
  const std::string name = pool_.name(replica);
  callbacks.on_step = [this, running, name, chunk](int64_t row, int64_t rows) {
    std::lock_guard<std::mutex> lock(mu_);
    running->rows_in_chunk = row;
    JobEvent event;
    event.type = EventType::Step;
    event.chunk = chunk;
    event.chunk_count = static_cast<int64_t>(running->spec.chunk_work.size());
    event.replica = name;
    event.step = row;
    event.steps = rows;
    event.progress = running->rows_total > 0 ? static_cast<double>(running->rows_before_chunk + row) /
                                                   static_cast<double>(running->rows_total)
                                             : 0.0;
    push_event_locked(*running, std::move(event));
  };
  callbacks.should_stop = [this, running] {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_requested_locked(*running, Clock::now());
  };
  return callbacks;
}

void Scheduler::complete_locked(size_t index, const ChunkResult& result, double seconds) {
  Slot& slot = *slots_[index];
  const std::string& replica = pool_.name(index);
  Job& job = *jobs_.at(slot.job_id);
  const int64_t chunk = slot.chunk;
  const double work = slot.work;
  slot.assigned = false;
  slot.job_id.clear();
  job.chunk_running = false;
  const std::string& error = result.error;
  const bool stop = stop_requested_locked(job, Clock::now());

  switch (result.outcome) {
    case ChunkOutcome::Succeeded: {
      seconds_per_work_ = policy::update_seconds_per_work(seconds_per_work_, seconds, work);
      ++job.chunks_done;
      job.holder = static_cast<int>(index);
      job.avoid = -1;
      job.attempts = 0;
      job.chunk_replicas.push_back(replica);
      job.rows_before_chunk += job.spec.chunk_rows.empty() ? 0 : job.spec.chunk_rows[static_cast<size_t>(chunk)];
      job.rows_in_chunk = 0;
      JobEvent event;
      event.type = EventType::ChunkFinished;
      event.chunk = chunk;
      event.chunk_count = static_cast<int64_t>(job.spec.chunk_work.size());
      event.replica = replica;
      event.seconds = seconds;
      event.work = result.work;
      job.work += result.work;
      push_event_locked(job, std::move(event));
      spdlog::info("job={} event=chunk_finished chunk={} replica={} seconds={:.3f}", job.id, chunk, replica, seconds);
      if (observer_) observer_->chunk_finished(snapshot_locked(job), replica, chunk, seconds, result.frames_generated);
      if (job.chunks_done == static_cast<int64_t>(job.spec.chunk_work.size())) {
        finish_locked(job, JobState::Succeeded, ErrorKind::None, "");
      }
      break;
    }
    case ChunkOutcome::ResourceExhausted:
      // The request did not fit in the device's memory: its fault, not the replica's.
      spdlog::warn("job={} event=chunk_out_of_memory chunk={} replica={} error=\"{}\"", job.id, chunk, replica, error);
      if (!stop) finish_locked(job, JobState::Failed, ErrorKind::ResourceExhausted, error);
      break;
    case ChunkOutcome::NotStored:
      spdlog::error("job={} event=chunk_not_stored chunk={} error=\"{}\"", job.id, chunk, error);
      if (!stop) {
        finish_locked(job, JobState::Failed, ErrorKind::Internal,
                      "chunk " + std::to_string(chunk) + " could not be stored: " + error);
      }
      break;
    case ChunkOutcome::Rejected:
      spdlog::warn("job={} event=chunk_rejected chunk={} replica={} error=\"{}\"", job.id, chunk, replica, error);
      if (!stop) finish_locked(job, JobState::Failed, ErrorKind::InvalidArgument, error);
      break;
    case ChunkOutcome::Failed: {
      ++job.attempts;
      const bool retry = !stop && policy::should_retry(job.attempts, options_.chunk_retries, pool_.any_healthy());
      spdlog::warn("job={} event=chunk_failed chunk={} replica={} attempt={} retry={} error=\"{}\"", job.id, chunk,
                   replica, job.attempts - 1, retry, error);
      if (observer_) observer_->chunk_failed(snapshot_locked(job), replica, chunk, error, retry);
      if (retry) {
        ++job.retries;
        job.avoid = static_cast<int>(index);
        job.rows_in_chunk = 0;
        JobEvent event;
        event.type = EventType::ChunkRetry;
        event.chunk = chunk;
        event.replica = replica;
        event.attempt = job.attempts - 1;
        event.message = error;
        push_event_locked(job, std::move(event));
        persist_update_locked(job);
      } else if (!stop) {
        finish_locked(job, JobState::Failed, ErrorKind::Internal,
                      "chunk " + std::to_string(chunk) + " failed " + std::to_string(job.attempts) +
                          " time(s); last error on replica " + replica + ": " + error);
      }
      break;
    }
    case ChunkOutcome::Stopped:  // the pool turned a Stopped nobody asked for into Failed
      break;
  }
  // Stop requests end the job whatever the chunk's outcome (a chunk that completed anyway is kept).
  if (job.active() && stop) end_stopped_job_locked(job);
  changed_.notify_all();
}

void Scheduler::end_stopped_job_locked(Job& job) {
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
      store_->append_event(job.id, {event.sequence, encode_stored_event(event)});
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
  if (snap.deadline) s.deadline_ms = wall_ms(*snap.deadline);
  s.idempotency_key = job.spec.idempotency_key;
  s.fingerprint = job.spec.fingerprint;
  s.fingerprint_v2 = job.spec.fingerprint_v2;
  s.state = job_state_name(job.state);
  s.error_kind = error_kind_name(job.error_kind);
  s.error = job.error;
  s.created_ms = wall_ms(job.created);
  s.started_ms = wall_ms(job.started);
  s.finished_ms = wall_ms(job.finished);
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
  sort_for_dispatch_locked(waiting);
  int64_t healthy = 0;
  double soonest_free = std::numeric_limits<double>::infinity();
  for (const policy::ReplicaView& r : replica_views_locked(now)) {
    if (!r.healthy) continue;
    ++healthy;
    soonest_free = std::min(soonest_free, r.idle ? 0.0 : r.remaining_seconds);
  }
  int64_t position = 0;
  double work_ahead = 0;
  for (Job* job : waiting) {
    if (job->state == JobState::Queued) {
      ++position;
      const double eta =
          policy::queue_eta(soonest_free, estimate_seconds_locked(work_ahead), healthy, have_estimate_locked());
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
  }  forget_idle_clients_locked();
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
  s.work = job.work;
  s.handoffs = job.handoffs;
  s.retries = job.retries;
  s.error_kind = job.error_kind;
  s.error = job.error;
  s.last_sequence = job.next_sequence - 1;
  s.payload = job.spec.payload;
  s.description = job.spec.description;
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
  if (pool_.all_loaded() && !pool_.any_healthy()) {
    throw AdmissionError(AdmissionError::Reason::Unavailable, "no healthy replica");
  }
  int64_t active = 0, mine = 0;
  double work = 0;  // of the chunks next in line, for the retry hint
  auto count = [&](const Job& job) {
    if (!job.active()) return;
    ++active;
    if (job.spec.client == client) ++mine;
    work += job.spec.chunk_work[static_cast<size_t>(job.chunks_done)];
  };
  for (const auto& [id, job] : jobs_) count(*job);
  for (const auto& [id, job] : reserving_) count(*job);  // admitted already, being stored
  auto retry_after = [&] {
    const auto statuses = pool_.status();
    const auto healthy = std::count_if(statuses.begin(), statuses.end(), [](const auto& r) { return r.healthy; });
    return policy::retry_after_seconds(estimate_seconds_locked(work), healthy, have_estimate_locked());
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
  std::unique_lock<std::mutex> lock(mu_);
  if (std::optional<SubmitResult> known = known_key_locked(spec, lock)) return *known;
  check_admission_locked(spec.client, spec.client_max_jobs);
  Job& job = reserve_locked(std::move(spec));
  if (store_ == nullptr) return publish_locked(job.id);

  // Acknowledged only once committed (a SIGKILL after this answer cannot lose the job), but stored without the lock:
  // a request may be megabytes, and every other call would wait for it.
  const std::string id = job.id;
  StoredJob stored = stored_locked(job);
  stored.request = std::move(job.spec.durable_request);
  job.spec.durable_request.clear();
  lock.unlock();
  std::string store_error;
  try {
    store_->insert_job(std::move(stored));
  } catch (const StoreError& e) {
    store_error = e.what();
  }
  lock.lock();
  if (!store_error.empty()) {
    spdlog::error("job={} event=store_insert_failed error=\"{}\"", id, store_error);
    release_locked(id);
    throw AdmissionError(AdmissionError::Reason::Unavailable, "the job could not be stored: " + store_error, 1.0);
  }
  return publish_locked(id);
}

std::optional<SubmitResult> Scheduler::known_key_locked(const JobSpec& spec, std::unique_lock<std::mutex>& lock) {
  while (true) {
    if (draining_ || stopping_) {
      throw AdmissionError(AdmissionError::Reason::Draining, "server is draining: no new jobs are accepted");
    }
    if (spec.idempotency_key.empty()) return std::nullopt;
    auto it = idempotency_.find({spec.owner, spec.idempotency_key});
    if (it == idempotency_.end()) return std::nullopt;
    if (reserving_.count(it->second)) {
      changed_.wait(lock);  // the first submission is being stored: its outcome decides
      continue;
    }
    const Job* existing = find_locked(it->second, spec.owner);
    if (existing == nullptr) return std::nullopt;
    if (!same_fingerprint(existing->spec.fingerprint, existing->spec.fingerprint_v2, spec.fingerprint,
                          spec.fingerprint_v2)) {
      throw AdmissionError(AdmissionError::Reason::IdempotencyConflict,
                           "idempotency_key: already used by job " + existing->id + " with a different request");
    }
    return SubmitResult{snapshot_locked(*existing), true};
  }
}

Scheduler::Job& Scheduler::reserve_locked(JobSpec spec) {
  auto job = std::make_unique<Job>();
  job->id = new_job_id();
  while (jobs_.count(job->id) || reserving_.count(job->id)) job->id = new_job_id();
  job->order = next_seq_++;
  job->created = WallClock::now();
  job->created_mono = Clock::now();
  for (int64_t rows : spec.chunk_rows) job->rows_total += rows;
  job->spec = std::move(spec);
  start_shares_locked(*job);
  if (!job->spec.idempotency_key.empty()) idempotency_[{job->spec.owner, job->spec.idempotency_key}] = job->id;
  Job& ref = *job;
  reserving_[ref.id] = std::move(job);
  return ref;
}

SubmitResult Scheduler::publish_locked(const std::string& id) {
  auto node = reserving_.extract(id);
  Job& job = *node.mapped();
  jobs_[id] = std::move(node.mapped());
  spdlog::info("job={} event=submitted chunks={} priority={} owner={}", id, job.spec.chunk_work.size(),
               job.spec.priority, job.spec.owner.empty() ? "-" : job.spec.owner);
  if (observer_) observer_->job_submitted(snapshot_locked(job));
  update_positions_locked(Clock::now());  // the first Queued event, before any ChunkStarted
  dispatch_locked();
  changed_.notify_all();  // a submission waiting on the same key
  return {snapshot_locked(job), false};
}

void Scheduler::release_locked(const std::string& id) {
  auto node = reserving_.extract(id);
  const JobSpec& spec = node.mapped()->spec;
  if (!spec.idempotency_key.empty()) idempotency_.erase({spec.owner, spec.idempotency_key});
  changed_.notify_all();  // a submission waiting on the same key tries on its own
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
    if (s.deadline_ms) job->spec.deadline = mono(from_wall_ms(*s.deadline_ms));
    job->spec.idempotency_key = s.idempotency_key;
    job->spec.fingerprint = s.fingerprint;
    job->spec.fingerprint_v2 = s.fingerprint_v2;
    job->spec.payload = r.payload;
    job->spec.description = r.description;
    job->spec.chunk_work = r.chunk_work.empty() ? std::vector<double>(static_cast<size_t>(s.chunk_count), 1.0)
                                                : r.chunk_work;
    job->spec.chunk_rows = r.chunk_rows;
    job->created = from_wall_ms(s.created_ms);
    job->created_mono = mono(job->created);
    if (s.started_ms) job->started = from_wall_ms(s.started_ms);
    job->state = parse_job_state(s.state);
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
        job->events.push_back(decode_stored_event(stored_event));
        if (job->events.back().type == EventType::ChunkFinished) job->work += job->events.back().work;
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
      job->finished = from_wall_ms(s.finished_ms);
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
    const bool jobs_left = std::any_of(jobs_.begin(), jobs_.end(), [](const auto& entry) {
      return entry.second->active() || entry.second->chunk_running;
    });
    return !jobs_left && reserving_.empty();
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

std::vector<ReplicaStatus> Scheduler::replicas() const { return pool_.status(); }

int64_t Scheduler::queued_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_locked(JobState::Queued);
}

int64_t Scheduler::running_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_locked(JobState::Running);
}

}  // namespace skyreels::server
