#include "server/queue/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

#include "server/policy/dispatch_policy.h"
#include "server/job/fingerprint.h"
#include "server/job/job_request.h"
#include "server/store/job_lease_local.h"

namespace skyreels::server {

namespace {

constexpr size_t kMaxDescriptions = 4096;  // small structs; a pod is asked about far fewer jobs at a time

// Wall-clock times are the store's (LeaseStore::now_ms): every pod stamps and compares on one clock.
int64_t deadline_ms(const std::optional<Clock::time_point>& deadline, int64_t now_ms) {
  return now_ms + std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
}

std::string finished_event() {
  JobEvent done;
  done.type = EventType::Finished;
  return encode_stored_event(done);
}

}  // namespace

std::unique_ptr<LeaseStore> with_leases(std::unique_ptr<JobStore> store) {
  return lease_store_over(std::move(store), finished_event());
}

std::unique_ptr<LeaseStore> with_leases(JobStore& borrowed) {
  return std::make_unique<LocalLeaseStore>(borrowed, finished_event());
}

Scheduler::Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> executors, PodOptions options, JobStore& store,
                     LeaseStore& leases, JobLoader loader)
    : options_(std::move(options)),
      store_(store),
      leases_(leases),
      loader_(std::move(loader)),
      hub_(shared_, leases_, store_, options_.poll,
           [this](const std::string& job_id) { runner_.renew_if_running(job_id); }),
      runner_(std::move(executors), options_, shared_, hub_, store_, leases_, loader_, hub_.events()) {}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    shared_.stopping = true;
    shared_.hard_stop = true;
    shared_.wake.notify_all();
  }
  runner_.stop();  // running chunks see hard_stop and give their leases back
  hub_.join();
  if (store_health_.joinable()) store_health_.join();
}


void Scheduler::start() {
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    if (started_) return;
    started_ = true;
  }
  hub_.start();
  store_health_ = std::thread([this] { store_health_loop(); });
  runner_.start();
}

bool Scheduler::all_loaded() const { return runner_.pool().all_loaded(); }
bool Scheduler::live() const { return runner_.pool().live(); }

bool Scheduler::ready() const {
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    if (shared_.draining || shared_.stopping) return false;
  }
  return runner_.pool().all_loaded() && runner_.pool().any_healthy() && store_answers_;
}

// The store's health as readiness sees it, from a check of its own (a statement under a short deadline, not TCP):
// a store that stops answering turns readiness off after kStoreChecksToFail checks, one answer turns it on again.
// ready() only reads the result, so probes never wait for the store.
void Scheduler::store_health_loop() {
  int failures = 0;
  std::unique_lock<std::mutex> lock(shared_.mu);
  while (!shared_.stopping) {
    lock.unlock();
    bool answered = false;
    {
      StoreCallDeadline deadline(Clock::now() + kStoreCheckTimeout);
      answered = leases_.reachable();
    }
    failures = answered ? 0 : failures + 1;
    const bool now = failures < kStoreChecksToFail;
    if (now != store_answers_.exchange(now)) {
      if (now) {
        spdlog::info("event=job_store_health answering=true");
      } else {
        spdlog::error("event=job_store_health answering=false checks_failed={} check_timeout_ms={}", failures,
                      kStoreCheckTimeout.count());
      }
    }
    lock.lock();
    shared_.wake.wait_for(lock, kStoreCheckPeriod, [&] { return shared_.stopping; });
  }
}

// ---- the transport's side -----------------------------------------------------------------------------------

void Scheduler::admit_here() const {
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    if (shared_.draining || shared_.stopping) {
      throw AdmissionError(AdmissionError::Reason::Draining, "server is draining: no new jobs are accepted");
    }
  }
  // While replicas load, jobs queue for them.
  if (runner_.pool().all_loaded() && !runner_.pool().any_healthy()) {
    throw AdmissionError(AdmissionError::Reason::Unavailable, "no healthy replica", 1.0);
  }
}

AdmissionError Scheduler::queue_full(int64_t admitted) const {
  return AdmissionError(AdmissionError::Reason::QueueFull,
                        "queue full: " + std::to_string(admitted) + " jobs admitted (--max-queue " +
                            std::to_string(options_.scheduling.max_jobs) + ")",
                        retry_after());
}

AdmissionError Scheduler::client_queue_full(int64_t unfinished, int64_t cap) const {
  return AdmissionError(AdmissionError::Reason::ClientQueueFull,
                        "client queue full: this client has " + std::to_string(unfinished) +
                            " unfinished jobs (per-client cap " + std::to_string(cap) + ")",
                        retry_after());
}

int64_t Scheduler::client_cap(const JobSpec& spec) const {
  return spec.client_max_jobs > 0 ? spec.client_max_jobs : options_.scheduling.max_jobs_per_client;
}

// The early check (before text encoding): submit() checks the limits again, atomically with its insert.
void Scheduler::admit(const JobSpec& spec) const {
  admit_here();
  AdmissionCounts counts;
  try {
    counts = leases_.admission_counts(spec.client);
  } catch (const StoreError& e) {
    throw AdmissionError(AdmissionError::Reason::Unavailable, std::string("job store unavailable: ") + e.what(), 1.0);
  }
  if (counts.unfinished >= options_.scheduling.max_jobs) throw queue_full(counts.unfinished);
  const int64_t cap = client_cap(spec);
  if (cap > 0 && counts.unfinished_for_client >= cap) throw client_queue_full(counts.unfinished_for_client, cap);
}

void Scheduler::check_admission(const JobSpec& spec) const {
  // A key may name an existing job, which passes (submit() deduplicates it in the store): leave those to submit().
  if (!spec.idempotency_key.empty()) return;
  admit(spec);
}

SubmitResult Scheduler::submit(JobSpec spec) {
  if (spec.chunk_work.empty()) throw std::invalid_argument("submit: a job needs at least one chunk");
  admit_here();  // the store checks the queue limits with the insert
  StoredJob job;
  job.owner = spec.owner;
  job.client = spec.client;
  job.client_weight = spec.client_weight;
  job.priority = spec.priority;
  if (spec.deadline) job.deadline_ms = deadline_ms(spec.deadline, leases_.now_ms());
  job.idempotency_key = spec.idempotency_key;
  job.fingerprint = spec.fingerprint;
  job.fingerprint_v2 = spec.fingerprint_v2;
  if (spec.description) {
    for (const AdapterChoice& a : spec.description->params.loras) job.adapters.push_back(a.name);
  }
  job.state = job_state_name(JobState::Queued);
  job.created_ms = leases_.now_ms();
  job.chunk_count = static_cast<int64_t>(spec.chunk_work.size());
  job.request = std::move(spec.durable_request);
  // This server prepared the payload: cached under each id the insert tries, before the job exists in the store,
  // so that a replica claiming chunk 0 at once finds it (and the placement rule sees the job).
  auto cached = std::make_shared<ChunkRunner::Cached>();
  cached->payload = spec.payload;
  cached->description = spec.description;
  cached->chunk_rows = spec.chunk_rows;
  cached->used = Clock::now();
  std::string tried;
  auto forget_tried = [&] {
    std::lock_guard<std::mutex> lock(shared_.mu);
    runner_.forget_payload_locked(tried, cached);
  };
  auto next_id = [&] {
    forget_tried();
    tried = new_job_id();
    std::lock_guard<std::mutex> lock(shared_.mu);
    runner_.hold_payload_locked(tried, cached);
    return tried;
  };
  InsertOutcome outcome;
  try {
    AdmissionLimits limits;
    limits.max_unfinished = options_.scheduling.max_jobs;
    limits.max_for_client = client_cap(spec);
    outcome = insert_with_fresh_ids(leases_, job, limits, next_id);
  } catch (const StoreError& e) {
    forget_tried();
    spdlog::error("event=store_insert_failed error=\"{}\"", e.what());
    throw AdmissionError(AdmissionError::Reason::Unavailable, std::string("the job could not be stored: ") + e.what(),
                         1.0);
  }
  if (!outcome.inserted) forget_tried();  // refused, or deduplicated to another job
  if (outcome.refused == InsertOutcome::Refusal::QueueFull) throw queue_full(outcome.unfinished);
  if (outcome.refused == InsertOutcome::Refusal::IdTaken) {
    throw AdmissionError(AdmissionError::Reason::Unavailable, "no free job id after " + std::to_string(kIdAttempts) +
                         " attempts", 1.0);
  }
  if (outcome.refused == InsertOutcome::Refusal::ClientQueueFull) {
    throw client_queue_full(outcome.unfinished, client_cap(spec));
  }
  if (!outcome.inserted) {
    if (!same_fingerprint(outcome.fingerprint, outcome.fingerprint_v2, spec.fingerprint, spec.fingerprint_v2)) {
      throw AdmissionError(AdmissionError::Reason::IdempotencyConflict,
                           "idempotency_key: already used by job " + outcome.job_id + " with a different request");
    }
    std::optional<JobSnapshot> existing = get(outcome.job_id, spec.owner);
    if (!existing) throw AdmissionError(AdmissionError::Reason::Unavailable, "the deduplicated job is gone", 1.0);
    return {*existing, true};
  }
  JobEvent queued;
  queued.type = EventType::Queued;
  queued.chunk_count = static_cast<int64_t>(spec.chunk_work.size());
  hub_.append(outcome.job_id, queued);
  std::optional<JobSnapshot> snap = get(outcome.job_id, spec.owner);
  if (!snap) throw AdmissionError(AdmissionError::Reason::Unavailable, "the job store lost the job", 1.0);
  spdlog::info("job={} event=submitted chunks={} priority={} owner={}", outcome.job_id, snap->chunk_count,
               snap->priority, spec.owner);
  hub_.events().publish(SchedulerEvent::about(SchedulerEventKind::JobSubmitted, *snap));
  hub_.changed(outcome.job_id);
  runner_.report_queue();
  return {*snap, false};
}

std::optional<StoredJob> Scheduler::find(const std::string& id, const std::string& owner) const {
  std::optional<StoredJob> job = leases_.load_job(id, false);  // every read and wait: the state, not the request
  if (!job || job->owner != owner) return std::nullopt;
  return job;
}

std::optional<JobSnapshot> Scheduler::get(const std::string& id, const std::string& owner) const {
  std::optional<StoredJob> job = find(id, owner);  // StoreError: the transport answers UNAVAILABLE
  if (!job) return std::nullopt;
  const std::vector<StoredEvent> events = store_.load_events(id);
  JobSnapshot s = snapshot_of(*job);
  s.description = description_of(*job);
  for (const StoredEvent& stored : events) {
    s.last_sequence = std::max(s.last_sequence, stored.sequence);
    const JobEvent e = decode_stored_event(stored);
    if (e.type == EventType::ChunkFinished) {
      s.chunk_replicas.push_back(e.replica);
      s.work += e.work;
    }
  }
  std::unique_lock<std::mutex> lock(shared_.mu);
  const bool running_here = runner_.describe_locked(id, s);
  if (const JobEvent* step = hub_.latest_step_locked(id)) {
    s.last_sequence = std::max(s.last_sequence, step->sequence);
    if (!is_terminal(s.state)) s.progress = std::max(s.progress, step->progress);  // another pod's chunk
  }
  answer_aborted_locked(s);
  lock.unlock();
  if (!is_terminal(s.state) && !running_here) place_in_queue(s);
  return s;
}

// Where a job that waits for a replica stands, and when it should start (policy::queue_eta over this server's
// replicas and chunk times).
void Scheduler::place_in_queue(JobSnapshot& s) const {
  LeaseStore::QueuePlace place;
  try {
    place = leases_.queue_place(s.id);
  } catch (const StoreError&) {
    return;  // a nicety of reads: the snapshot stays without a position
  }
  if (place.position == 0) return;
  s.queue_position = place.position;
  s.eta_seconds = runner_.queue_eta(place.ahead);
}

double Scheduler::retry_after() const {
  int64_t unfinished = 0;
  try {
    unfinished = leases_.admission_counts("").unfinished;
  } catch (const StoreError&) {
  }
  const double per_chunk = runner_.seconds_per_chunk();
  int64_t healthy = 0;
  for (size_t i = 0; i < runner_.pool().size(); ++i) healthy += runner_.pool().healthy(i) ? 1 : 0;
  return policy::retry_after_seconds(static_cast<double>(unfinished) * per_chunk, healthy, per_chunk > 0);
}

std::shared_ptr<const JobDescription> Scheduler::description_of(const StoredJob& job) const {
  {
    std::lock_guard<std::mutex> lock(shared_.mu);
    if (auto held = runner_.description_locked(job.id)) return held;
    if (auto it = descriptions_.find(job.id); it != descriptions_.end()) return it->second;
  }
  const std::optional<StoredJob> with_request = leases_.load_job(job.id);
  if (!with_request) return nullptr;
  std::shared_ptr<const JobDescription> description = loader_(*with_request, {}).description;
  if (!description) return nullptr;
  std::lock_guard<std::mutex> lock(shared_.mu);
  if (descriptions_.size() >= kMaxDescriptions) descriptions_.erase(descriptions_.begin());
  descriptions_[job.id] = description;
  return description;
}

std::optional<int64_t> Scheduler::result_size(const std::string& id, const std::string& owner, JobStore::Blob kind,
                                              int64_t index) const {
  if (!find(id, owner)) return std::nullopt;
  return store_.blob_size(id, kind, index);
}

std::optional<std::string> Scheduler::result_range(const std::string& id, const std::string& owner,
                                                   JobStore::Blob kind, int64_t index, int64_t offset,
                                                   int64_t length) const {
  if (!find(id, owner)) return std::nullopt;
  return store_.load_blob_range(id, kind, index, offset, length);
}

std::vector<JobSnapshot> Scheduler::list(const std::string& owner) const {
  std::vector<JobSnapshot> out;
  for (const StoredJob& job : leases_.jobs_of(owner)) out.push_back(snapshot_of(job));  // StoreError: UNAVAILABLE
  std::lock_guard<std::mutex> lock(shared_.mu);
  for (JobSnapshot& s : out) answer_aborted_locked(s);
  return out;
}

std::optional<std::string> Scheduler::dropped(const std::string& id, const std::string& owner) const {
  return store_.dropped_reason(id, owner);
}

std::optional<JobSnapshot> Scheduler::remove(const std::string& id, const std::string& owner) {
  std::optional<JobSnapshot> job = get(id, owner);
  if (!job) return std::nullopt;
  if (!is_terminal(job->state)) job = cancel(id, owner);
  if (!job) return std::nullopt;
  if (is_terminal(job->state)) {
    store_.drop_job(id, "deleted by its client");
    hub_.changed(id);  // watchers find it gone
  } else {
    runner_.remove_when_ended(id);
  }
  return job;
}

std::optional<JobSnapshot> Scheduler::cancel(const std::string& id, const std::string& owner) {
  const CancelState state = leases_.request_cancel(id, owner);  // StoreError: UNAVAILABLE
  if (state == CancelState::Unknown) return std::nullopt;
  hub_.changed(id);
  runner_.renew_if_running(id);  // a chunk running here stops at its next step
  // Nobody runs it: end it here. Running: the pod running it sees the request at its next step (a notification
  // makes it renew at once) and ends the job.
  if (state == CancelState::Idle) {
    runner_.finish(id, JobState::Cancelled, ErrorKind::Cancelled, "cancelled by the client");
  }
  return get(id, owner);
}

std::optional<JobSnapshot> Scheduler::wait_chunks(const std::string& id, const std::string& owner,
                                                  int64_t chunks_seen, Clock::time_point until) const {
  while (true) {
    const uint64_t seen = hub_.change_count();
    std::optional<JobSnapshot> s;
    try {
      s = get(id, owner);
    } catch (const StoreError&) {
      if (Clock::now() >= until) throw;
      hub_.wait_for_change(std::nullopt, until);
      continue;
    }
    if (!s || s->chunks_done > chunks_seen || is_terminal(s->state) || Clock::now() >= until) return s;
    if (!hub_.wait_for_change(seen, until)) return s;
  }
}

EventBatch Scheduler::wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                                  Clock::time_point until) const {
  return hub_.wait_events(id, owner, after_sequence, until);
}

// The watchers' consumer: what makes a watcher read the job's events again.
static bool wakes_watchers(SchedulerEventKind kind) {
  switch (kind) {
    case SchedulerEventKind::JobChanged:
    case SchedulerEventKind::StepProgress:
    case SchedulerEventKind::PreviewMade:
    case SchedulerEventKind::LookAgain:
      return true;
    case SchedulerEventKind::JobSubmitted:  // each of these comes with a JobChanged
    case SchedulerEventKind::JobStarted:
    case SchedulerEventKind::ChunkStarted:
    case SchedulerEventKind::Handoff:
    case SchedulerEventKind::ChunkFinished:
    case SchedulerEventKind::ChunkFailed:
    case SchedulerEventKind::JobFinished:
    case SchedulerEventKind::StepTimed:  // about replicas and the queue, not a job
    case SchedulerEventKind::LeaseTakeover:
    case SchedulerEventKind::ReplicaChanged:
    case SchedulerEventKind::ReplicaRecovered:
    case SchedulerEventKind::QueueChanged:
    case SchedulerEventKind::ChangesMissed:  // LookAgain follows within a poll period
      return false;
  }
  return false;
}

uint64_t Scheduler::subscribe(const std::string& id, std::function<void()> notify) {
  return hub_.events().subscribe(
      [notify = std::move(notify)](const SchedulerEvent& event) {
        if (wakes_watchers(event.kind)) notify();
      },
      id);
}

void Scheduler::unsubscribe(const std::string& /*id*/, uint64_t token) { hub_.events().unsubscribe(token); }

std::optional<LatestPreview> Scheduler::latest_preview(const std::string& id, uint64_t after_serial) const {
  return hub_.latest_preview(id, after_serial);
}

void Scheduler::begin_drain() {
  std::lock_guard<std::mutex> lock(shared_.mu);
  shared_.draining = true;
  spdlog::info("event=drain_started running_chunks={}", runner_.running_locked());
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(shared_.mu);
  return shared_.draining;
}

bool Scheduler::wait_idle(Clock::time_point until) const {
  const bool shared = leases_.shared();
  auto idle = [&] {
    if (runner_.running_locked() != 0) return false;
    if (shared || shared_.hard_stop) return true;  // nothing more runs here
    try {
      return leases_.admission_counts("").unfinished == 0;
    } catch (const StoreError&) {
      return false;
    }
  };
  std::unique_lock<std::mutex> lock(shared_.mu);
  while (!idle()) {
    if (Clock::now() >= until) return false;
    shared_.changed.wait_until(lock, std::min(until, Clock::now() + options_.poll));
  }
  return true;
}

void Scheduler::abort_all(const std::string& reason) {
  std::lock_guard<std::mutex> lock(shared_.mu);
  shared_.hard_stop = true;
  shared_.draining = true;
  shared_.aborted = reason;
  ++shared_.change_count;
  shared_.changed.notify_all();
  spdlog::warn("event=abort_all running_chunks={} reason=\"{}\" (their leases go back to the store)",
               runner_.running_locked(), reason);
}

// This server stopped serving (abort_all): it answers for its unfinished jobs as ended, while the store keeps them.
void Scheduler::answer_aborted_locked(JobSnapshot& s) const {
  if (!shared_.aborted || is_terminal(s.state)) return;
  s.state = JobState::Failed;
  s.error_kind = ErrorKind::Unavailable;
  s.error = *shared_.aborted;
}

std::vector<ReplicaStatus> Scheduler::replicas() const { return runner_.pool().status(); }

int64_t Scheduler::queued_jobs() const {
  try {
    return leases_.queue_depth();
  } catch (const StoreError&) {
    return 0;
  }
}

int64_t Scheduler::running_jobs() const { return runner_.running_jobs(); }

}  // namespace skyreels::server
