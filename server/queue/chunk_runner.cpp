#include "server/queue/chunk_runner.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <set>
#include <stdexcept>

#include "server/job/job_request.h"
#include "server/policy/dispatch_policy.h"

namespace skyreels::server {

namespace {


bool deadline_passed(const StoredJob& job, int64_t now_ms) { return job.deadline_ms && *job.deadline_ms <= now_ms; }

}  // namespace

JobSnapshot snapshot_of(const StoredJob& job) {
  JobSnapshot s;
  s.id = job.id;
  s.owner = job.owner;
  s.state = parse_job_state(job.state);
  s.priority = job.priority;
  s.idempotency_key = job.idempotency_key;
  s.created = from_wall_ms(job.created_ms);
  if (job.started_ms > 0) s.started = from_wall_ms(job.started_ms);
  if (job.finished_ms > 0) s.finished = from_wall_ms(job.finished_ms);
  if (job.deadline_ms) s.deadline = from_wall_ms(*job.deadline_ms);
  s.chunk_count = job.chunk_count;
  s.chunks_done = job.chunks_done;
  s.handoffs = job.handoffs;
  s.retries = job.retries;
  s.error_kind = parse_error_kind(job.error_kind);
  s.error = job.error;
  s.progress = job.chunk_count > 0 ? static_cast<double>(job.chunks_done) / static_cast<double>(job.chunk_count) : 0;
  if (s.state == JobState::Succeeded) s.progress = 1.0;
  return s;
}

ChunkRunner::ChunkRunner(std::vector<std::unique_ptr<ChunkExecutor>> executors, const PodOptions& options,
                         SchedulerShared& shared, JobEventHub& hub, JobStore& store, LeaseStore& leases,
                         JobLoader loader, EventStream& events)
    : options_(options),
      shared_(shared),
      hub_(hub),
      store_(store),
      leases_(leases),
      loader_(std::move(loader)),
      events_(events),
      pool_(std::move(executors), options_.scheduling, &events),
      mu_(shared.mu),
      work_(shared.work),
      changed_(shared.changed),
      heartbeat_cv_(shared.wake),
      change_count_(shared.change_count),
      draining_(shared.draining),
      hard_stop_(shared.hard_stop) {}

ChunkRunner::~ChunkRunner() { stop(); }

void ChunkRunner::start() {
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  pool_.start(*this);
}

void ChunkRunner::stop() {
  pool_.stop();  // running chunks see hard_stop and give their leases back in chunk_done
  if (heartbeat_.joinable()) heartbeat_.join();
}

// A change that may be a cancel (a client's here, or anything another pod wrote): a chunk of the job running here
// renews its lease at once, which is where it learns of a cancel. Not for this pod's own events: a renewal per event
// is a store call per event.
void ChunkRunner::renew_if_running(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [replica, run] : running_) {
    if (run->job.id == job_id) {
      renew_now_ = true;  // a cancel from another pod reaches this chunk at its next step, not its next heartbeat
      heartbeat_cv_.notify_all();
    }
  }
}

void ChunkRunner::remove_when_ended(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  removed_.insert(job_id);
}

void ChunkRunner::hold_payload_locked(const std::string& job_id, std::shared_ptr<Cached> cached) {
  cache_.emplace(job_id, std::move(cached));
}

void ChunkRunner::forget_payload_locked(const std::string& job_id, const std::shared_ptr<Cached>& cached) {
  if (auto it = cache_.find(job_id); it != cache_.end() && it->second == cached) cache_.erase(it);
}

std::shared_ptr<const JobDescription> ChunkRunner::description_locked(const std::string& job_id) const {
  auto it = cache_.find(job_id);
  return it == cache_.end() ? nullptr : it->second->description;
}

bool ChunkRunner::describe_locked(const std::string& job_id, JobSnapshot& s) const {
  bool running_here = false;
  for (const auto& [replica, run] : running_) {
    if (run->job.id != job_id) continue;
    running_here = true;
    if (run->progress > s.progress) s.progress = run->progress;
  }
  if (auto it = cache_.find(job_id); it != cache_.end()) s.payload = it->second->payload;
  return running_here;
}

int64_t ChunkRunner::running_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(running_.size());
}

double ChunkRunner::seconds_per_chunk() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seconds_per_chunk_;
}

double ChunkRunner::queue_eta(int64_t ahead) const {
  std::vector<bool> healthy(pool_.size());
  for (size_t i = 0; i < healthy.size(); ++i) healthy[i] = pool_.healthy(i);
  std::lock_guard<std::mutex> lock(mu_);
  double soonest_free = -1;
  int64_t healthy_count = 0;
  const auto now = Clock::now();
  for (size_t i = 0; i < healthy.size(); ++i) {
    if (!healthy[i]) continue;
    ++healthy_count;
    auto run = running_.find(i);
    const double free_in = run == running_.end() ? 0.0 : remaining_locked(*run->second, now);
    soonest_free = soonest_free < 0 ? free_in : std::min(soonest_free, free_in);
  }
  return policy::queue_eta(std::max(soonest_free, 0.0), static_cast<double>(ahead) * seconds_per_chunk_,
                           healthy_count, seconds_per_chunk_ > 0);
}

// On a shared store the pod's name tells its replicas from other pods' ("pod-1/cpu:0"); alone, "cpu:0".
std::string ChunkRunner::lease_name(size_t replica) const {
  return leases_.shared() ? options_.pod + "/" + pool_.name(replica) : pool_.name(replica);
}

// The gauges of queued and running work (the store's queue, this server's chunks).
void ChunkRunner::report_queue() {
  try {
    SchedulerEvent queue{SchedulerEventKind::QueueChanged};
    queue.queued = leases_.queue_depth();
    queue.running = running_jobs();
    events_.publish(queue);
  } catch (const StoreError&) {  // metrics only: the next report catches up
  }
}

// ---- the pool's side: claim, run, commit ------------------------------------------------------------------------

// How long a running chunk still needs, by this server's average chunk time.
double ChunkRunner::remaining_locked(const Running& run, Clock::time_point now) const {
  return policy::remaining_seconds(seconds_per_chunk_, std::chrono::duration<double>(now - run.started).count());
}

// Draining on a shared store stops claiming (the other pods continue the queue); a server that is the only one
// finishes what it admitted. abort_all and the destructor stop claiming everywhere.
bool ChunkRunner::claiming_locked() const { return !hard_stop_ && (!draining_ || !leases_.shared()); }

std::vector<std::string> ChunkRunner::pass_over_locked(size_t replica, const std::vector<bool>& healthy,
                                                     const std::vector<std::vector<std::string>>& resident) const {
  struct Waiting {
    std::string id;
    policy::JobPlacement placement;
    std::vector<std::string> adapters;  // the job's (--lora-dir), when this server holds its payload
  };
  std::set<std::string> running;
  for (const auto& [r, run] : running_) running.insert(run->job.id);
  // A job running on another replica here is passed over too: its chunk may commit while this replica's claim is in
  // the store, and its next chunk belongs to that replica, idle once it commits (settle() forgets the run before it
  // commits or releases, so every replica looks again after that change).
  std::vector<std::string> pass_over;
  for (const auto& [r, run] : running_) {
    if (r != replica) pass_over.push_back(run->job.id);
  }
  std::vector<Waiting> waiting;
  // Every job whose payload this server holds (a first chunk too: it goes to the first idle replica, as a scheduler
  // that pushes would place it); jobs this server knows nothing of are the store's order alone.
  for (const auto& [id, cached] : cache_) {
    if (running.count(id)) continue;
    Waiting w{id, {cached->holder, -1}, {}};
    if (cached->description) {
      for (const AdapterChoice& a : cached->description->params.loras) w.adapters.push_back(a.name);
    }
    w.placement.adapters = !w.adapters.empty();
    waiting.push_back(std::move(w));
  }
  for (const auto& [id, avoid] : avoid_) {
    if (running.count(id)) continue;
    auto it = std::find_if(waiting.begin(), waiting.end(), [&](const Waiting& w) { return w.id == id; });
    if (it == waiting.end()) it = waiting.insert(waiting.end(), {id, {-1, -1}, {}});
    it->placement.avoid = static_cast<int>(avoid);
  }
  if (waiting.empty()) return pass_over;
  const auto now = Clock::now();
  std::vector<policy::ReplicaView> views(healthy.size());
  for (size_t i = 0; i < views.size(); ++i) {
    auto run = running_.find(i);
    views[i].healthy = healthy[i];
    views[i].idle = healthy[i] && run == running_.end();
    if (run != running_.end()) views[i].remaining_seconds = remaining_locked(*run->second, now);
    if (i < resident.size()) views[i].resident_adapters = static_cast<int>(resident[i].size());
  }
  // Of the job's adapters, how many each replica would load first.
  auto with_adapters = [&](const Waiting& w, std::vector<policy::ReplicaView> seen) {
    for (size_t i = 0; i < seen.size() && i < resident.size(); ++i) {
      seen[i].missing_adapters = static_cast<int>(std::count_if(w.adapters.begin(), w.adapters.end(), [&](const auto& a) {
        return std::find(resident[i].begin(), resident[i].end(), a) == resident[i].end();
      }));
    }
    return seen;
  };
  // Jobs no replica holds yet go to the idle replicas in order, as a scheduler that pushes would place them: those no
  // waiting job has affinity to first, by index. This replica takes one only when that many jobs wait for it.
  size_t fresh = 0;
  for (const Waiting& w : waiting) fresh += w.placement.holder < 0 && w.placement.avoid < 0 ? 1 : 0;
  auto holds = [&](size_t i) {
    return std::any_of(waiting.begin(), waiting.end(),
                       [&](const Waiting& w) { return w.placement.holder == static_cast<int>(i); });
  };
  auto ranks_before = [&](size_t i) {  // idle replica i is offered fresh jobs before this one
    if (holds(i) != holds(replica)) return !holds(i);
    return i < replica;
  };
  size_t rank = 0;
  for (size_t i = 0; i < views.size(); ++i) rank += i != replica && views[i].idle && ranks_before(i) ? 1 : 0;
  const bool take_fresh = rank < fresh;
  for (const Waiting& w : waiting) {
    if (w.placement.holder < 0 && w.placement.avoid < 0 && !w.placement.adapters) {
      if (!take_fresh) pass_over.push_back(w.id);
      continue;
    }
    std::vector<policy::ReplicaView> seen = with_adapters(w, views);
    for (const Waiting& other : waiting) {
      if (other.id != w.id && other.placement.holder >= 0) {
        seen[static_cast<size_t>(other.placement.holder)].held_by_other_job = true;
      }
    }
    const int chosen = policy::choose_replica(w.placement, seen, options_.scheduling.handoff_cost_seconds,
                                              seconds_per_chunk_ > 0);
    if (chosen != static_cast<int>(replica)) pass_over.push_back(w.id);
  }
  return pass_over;
}

std::optional<ChunkAssignment> ChunkRunner::next_chunk(size_t replica) {
  while (true) {
    uint64_t seen = 0;
    std::vector<bool> healthy(pool_.size());
    for (size_t i = 0; i < healthy.size(); ++i) healthy[i] = pool_.healthy(i);
    // Read before the scheduler's lock, as health is (the pool has its own).
    std::vector<std::vector<std::string>> resident(pool_.size());
    bool serves_adapters = false;
    for (size_t i = 0; i < resident.size(); ++i) {
      AdapterResidency adapters = pool_.status(i).adapters;
      resident[i] = std::move(adapters.resident);
      if (i == replica) serves_adapters = adapters.serves;
    }
    std::vector<std::string> pass_over;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return interrupted_ || claiming_locked(); });
      if (interrupted_) return std::nullopt;
      seen = change_count_;
      pass_over = pass_over_locked(replica, healthy, resident);
    }
    std::optional<ChunkLease> lease;
    try {
      lease = leases_.claim(lease_name(replica), options_.lease_ttl, pass_over,
                            serves_adapters ? &resident[replica] : nullptr);
    } catch (const StoreError& e) {
      spdlog::warn("replica={} event=claim_failed error=\"{}\"", lease_name(replica), e.what());
    }
    if (lease) {
      std::optional<ChunkAssignment> assignment;
      try {
        assignment = prepare(replica, *lease);
      } catch (const StoreError& e) {
        // The store went away mid-claim: the lease expires and some replica claims the chunk again.
        spdlog::warn("job={} event=claim_prepare_failed error=\"{}\"", lease->job_id, e.what());
        std::lock_guard<std::mutex> lock(mu_);
        running_.erase(replica);
      }
      if (assignment) return assignment;
      continue;  // the claimed chunk ended its job (deadline, unreadable request): look again at once
    }
    std::unique_lock<std::mutex> lock(mu_);
    work_.wait_for(lock, options_.poll, [&] { return interrupted_ || change_count_ != seen; });
  }
}

std::optional<ChunkAssignment> ChunkRunner::prepare(size_t replica, const ChunkLease& lease) {
  const std::string name = lease_name(replica);
  std::optional<StoredJob> job;
  try {
    job = leases_.load_job(lease.job_id);
  } catch (const StoreError& e) {
    spdlog::warn("job={} event=claim_load_failed error=\"{}\"", lease.job_id, e.what());
  }
  if (!job) {
    leases_.release(lease);
    return std::nullopt;
  }
  if (deadline_passed(*job, leases_.now_ms())) {
    finish(job->id, JobState::DeadlineExceeded, ErrorKind::DeadlineExceeded, "deadline passed while queued");
    return std::nullopt;
  }
  const std::optional<Attempts> attempts = attempts_allowed(*job, lease, name);
  if (!attempts) return std::nullopt;
  std::string error;
  const std::shared_ptr<Cached> cached = payload_for(*job, lease, error);
  if (!cached) {
    finish(job->id, JobState::Failed, ErrorKind::Internal, "the job cannot be resumed: " + error);
    return std::nullopt;
  }
  const std::shared_ptr<Running> run = start_run(replica, *job, lease, *attempts, cached);
  announce_start(*run, *job, *cached);
  report_queue();
  return assignment_for(run, *cached);
}

// The chunk's earlier attempts (a takeover of a dead holder's lease counts one here), or nullopt when they used up
// the retries and the job ended.
std::optional<ChunkRunner::Attempts> ChunkRunner::attempts_allowed(const StoredJob& job, const ChunkLease& lease,
                                                                  const std::string& name) {
  // A job that was never retried (the stored count covers every pod) has no retry events to read.
  Attempts attempts = job.retries == 0 ? Attempts{} : attempts_of(job.id, lease.chunk_index);
  if (lease.takeover) {
    ++attempts.takeovers;
    spdlog::warn("job={} event=lease_takeover chunk={} from={} to={} takeovers={}", job.id, lease.chunk_index,
                 lease.previous_replica, name, attempts.takeovers);
    SchedulerEvent takeover{SchedulerEventKind::LeaseTakeover};
    takeover.replica = name;
    events_.publish(takeover);
    JobEvent retry;
    retry.type = EventType::ChunkRetry;
    retry.chunk = lease.chunk_index;
    retry.attempt = attempts.total() - 1;
    retry.takeover = true;
    retry.message = "the lease of the replica running the chunk expired";
    hub_.append(job.id, retry);
  }
  if (!policy::should_take_over(attempts.takeovers, options_.scheduling.chunk_takeover_limit)) {
    finish(job.id, JobState::Failed, ErrorKind::Internal,
           "the processes running chunk " + std::to_string(lease.chunk_index) + " died " +
               std::to_string(attempts.takeovers) + " times");
    return std::nullopt;
  }
  if (!policy::should_retry(attempts.failures, options_.scheduling.chunk_retries, true)) {  // this replica is healthy
    finish(job.id, JobState::Failed, ErrorKind::Internal,
           "chunk " + std::to_string(lease.chunk_index) + " failed " + std::to_string(attempts.failures) +
               " time(s)");
    return std::nullopt;
  }
  return attempts;
}

// The chunk runs here from now on: the placement rule and the heartbeat see it.
std::shared_ptr<ChunkRunner::Running> ChunkRunner::start_run(size_t replica, const StoredJob& job,
                                                             const ChunkLease& lease, const Attempts& attempts,
                                                             const std::shared_ptr<Cached>& cached) {
  auto run = std::make_shared<Running>();
  run->lease = lease;
  run->job = job;
  run->job.request.clear();
  run->replica = lease_name(replica);
  run->index = replica;
  run->payload = cached->payload;
  run->attempt = attempts.total();
  run->failures = attempts.failures;
  std::lock_guard<std::mutex> lock(mu_);
  const auto& rows = cached->chunk_rows;
  for (size_t c = 0; c < rows.size(); ++c) {
    run->rows_total += rows[c];
    if (static_cast<int64_t>(c) < lease.chunk_index) run->rows_before += rows[c];
  }
  running_[replica] = run;
  avoid_.erase(job.id);
  cached->holder = static_cast<int>(replica);  // its payload stays here once the chunk commits
  return run;
}

// ChunkStarted, the sequence numbers of the chunk's steps, the log line and the scheduler events.
void ChunkRunner::announce_start(Running& run, const StoredJob& job, const Cached& cached) {
  const ChunkLease& lease = run.lease;
  const std::string& name = run.replica;
  const int attempt = run.attempt;
  JobEvent started;
  started.type = EventType::ChunkStarted;
  started.chunk = lease.chunk_index;
  started.chunk_count = lease.chunk_count;
  started.replica = name;
  started.handoff = lease.handoff;
  started.attempt = attempt;
  hub_.append(job.id, started);
  const auto& rows = cached.chunk_rows;
  if (lease.chunk_index < static_cast<int64_t>(rows.size()) && rows[static_cast<size_t>(lease.chunk_index)] > 0) {
    try {  // after ChunkStarted's number, before ChunkFinished's: steps sort between them on every pod
      const int64_t planned = rows[static_cast<size_t>(lease.chunk_index)];
      run.step_numbers.push_back({1, leases_.reserve_sequences(job.id, planned)});
      run.steps_reserved = planned;
    } catch (const StoreError&) {
      run.steps_reserved = 0;  // progress only: this chunk reports none
    }
  }
  spdlog::info("job={} event=chunk_started chunk={}/{} replica={} attempt={} handoff={} token={}", job.id,
               lease.chunk_index, lease.chunk_count, name, attempt, lease.handoff, lease.token);
  const JobSnapshot s = snapshot_of(job);
  if (lease.chunk_index == 0 && attempt == 0) {
    SchedulerEvent first = SchedulerEvent::about(SchedulerEventKind::JobStarted, s);
    first.seconds = static_cast<double>(leases_.now_ms() - job.created_ms) / 1000.0;
    events_.publish(first);
  }
  if (lease.handoff) {
    SchedulerEvent moved = SchedulerEvent::about(SchedulerEventKind::Handoff, s);
    moved.replica = name;
    moved.from_replica = lease.previous_replica;
    events_.publish(moved);
  }
  SchedulerEvent chunk = SchedulerEvent::about(SchedulerEventKind::ChunkStarted, s);
  chunk.replica = name;
  chunk.chunk = lease.chunk_index;
  events_.publish(chunk);
}

ChunkAssignment ChunkRunner::assignment_for(const std::shared_ptr<Running>& run, const Cached& cached) {
  ChunkAssignment assignment;
  assignment.work.job_id = run->job.id;
  assignment.work.chunk_index = run->lease.chunk_index;
  assignment.work.chunk_count = run->lease.chunk_count;
  assignment.work.attempt = run->attempt;
  assignment.work.handoff = run->lease.handoff;
  assignment.work.payload = cached.payload.get();
  assignment.payload = cached.payload;
  Running* r = run.get();
  assignment.callbacks.on_step = [this, r](int64_t row, int64_t of) { push_step(*r, row, of); };
  assignment.callbacks.should_stop = [this, r] { return stop_requested(*r); };
  assignment.callbacks.on_preview = [this, r](ChunkPreviewImage image) { push_preview(*r, std::move(image)); };
  return assignment;
}

// The payload this pod already holds when the job's previous chunk ran here, else one re-created from the store.
std::shared_ptr<ChunkRunner::Cached> ChunkRunner::payload_for(const StoredJob& job, const ChunkLease& lease,
                                                                   std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(job.id);
    if (it != cache_.end() && it->second->chunks_held == lease.chunk_index) {
      it->second->used = Clock::now();
      return it->second;
    }
    if (it != cache_.end()) cache_.erase(it);  // another pod ran chunks since: its results are in the store
  }
  RestoredJob restored;
  try {
    std::vector<StoredChunk> chunks = store_.load_chunks(job.id);
    if (static_cast<int64_t>(chunks.size()) < lease.chunk_index) {
      throw std::runtime_error("the store holds " + std::to_string(chunks.size()) + " chunk results, chunk " +
                               std::to_string(lease.chunk_index) + " needs them all");
    }
    chunks.resize(static_cast<size_t>(std::min<int64_t>(lease.chunk_index, static_cast<int64_t>(chunks.size()))));
    restored = loader_(job, std::move(chunks));
  } catch (const std::exception& e) {
    restored.error = e.what();
  }
  if (!restored.payload) {
    error = restored.error;
    return nullptr;
  }
  auto cached = std::make_shared<Cached>();
  cached->payload = restored.payload;
  cached->description = restored.description;
  cached->chunks_held = lease.chunk_index;
  cached->chunk_rows = restored.chunk_rows;
  cached->used = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  cache_[job.id] = cached;
  // Bounded: payloads hold latents on a device. Keep the most recently used, at most two per replica.
  while (cache_.size() > 2 * pool_.size()) {
    auto oldest = cache_.end();
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      const bool in_use = std::any_of(running_.begin(), running_.end(),
                                      [&](const auto& r) { return r.second->job.id == it->first; });
      if (!in_use && it->first != job.id && (oldest == cache_.end() || it->second->used < oldest->second->used)) {
        oldest = it;
      }
    }
    if (oldest == cache_.end()) break;
    cache_.erase(oldest);
  }
  return cached;
}

// Earlier attempts of a chunk: its ChunkRetry events, errors and takeovers apart.
// Read from the end back to the previous chunk's end: a long video's earlier events are never decoded again.
ChunkRunner::Attempts ChunkRunner::attempts_of(const std::string& job_id, int64_t chunk) const {
  const std::vector<StoredEvent> events = store_.load_events(job_id);
  Attempts attempts;
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    const JobEvent e = decode_stored_event(*it);
    if (e.type == EventType::Queued || (e.type == EventType::ChunkFinished && e.chunk < chunk)) break;
    if (e.type == EventType::ChunkRetry && e.chunk == chunk) ++(e.takeover ? attempts.takeovers : attempts.failures);
  }
  return attempts;
}

}  // namespace skyreels::server
