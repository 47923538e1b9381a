#include "server/queue/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <set>
#include <stdexcept>

#include "server/policy/dispatch_policy.h"
#include "server/job/fingerprint.h"
#include "server/job/job_request.h"
#include "server/store/job_lease_local.h"

namespace skyreels::server {

namespace {

constexpr size_t kMaxStepEvents = 64;  // per job: watchers only need the latest progress
constexpr size_t kMaxStepJobs = 4096;  // jobs with step events kept (those of other pods' chunks too)
constexpr size_t kPreviewJobsPerReplica = 4;  // jobs whose latest preview is kept, per replica of this pod
constexpr auto kStepPublishPeriod = std::chrono::milliseconds(500);  // step progress to other pods, coalesced
constexpr size_t kMaxDescriptions = 4096;  // small structs; a pod is asked about far fewer jobs at a time

// Wall-clock times are the store's (LeaseStore::now_ms): every pod stamps and compares on one clock.
int64_t deadline_ms(const std::optional<Clock::time_point>& deadline, int64_t now_ms) {
  return now_ms + std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
}

bool deadline_passed(const StoredJob& job, int64_t now_ms) { return job.deadline_ms && *job.deadline_ms <= now_ms; }

}  // namespace

// A chunk running on one of this pod's replicas, under its lease.
struct Scheduler::Running {
  ChunkLease lease;
  StoredJob job;  // as it was when the chunk was claimed (without the request)
  std::string replica;  // lease name
  std::shared_ptr<JobPayload> payload;  // the one this chunk runs on (the cache may hold another meanwhile)
  int attempt = 0;   // earlier attempts of the chunk, failures and takeovers
  int failures = 0;  // of those, the chunk's own errors (bounded by chunk_retries)
  int64_t rows_total = 0, rows_before = 0;
  // Sequence numbers reserved for this chunk's steps: one store call per chunk for its planned rows, another when a
  // chunk reports more rows than planned. (first row, its number) per reservation, ascending.
  std::vector<std::pair<int64_t, uint64_t>> step_numbers;
  int64_t steps_reserved = 0;  // rows numbered so far
  Clock::time_point last_published{};  // the worker's own: its last step sent to other pods
  std::atomic<bool> lost{false};    // the store says another replica holds the chunk now
  std::atomic<bool> cancel{false};  // some pod asked to cancel the job
  double progress = 0;
  Clock::time_point started = Clock::now();
  size_t index = 0;  // the replica
};

// A job's payload kept on this pod after its chunk ran here: the next chunk continues from it without a reload.
struct Scheduler::Cached {
  std::shared_ptr<JobPayload> payload;
  std::shared_ptr<const JobDescription> description;
  int64_t chunks_held = 0;  // chunks the payload holds the results of
  int holder = -1;          // the replica of this server that ran its last chunk (-1: none yet)
  std::vector<int64_t> chunk_rows;
  Clock::time_point used;
};

namespace {

LeaseStore& leases_of(JobStore& store) {
  LeaseStore* leases = store.leases();
  if (leases == nullptr) throw std::invalid_argument("Scheduler: the job store " + store.describe() + " has no leases");
  return *leases;
}

std::string finished_event() {
  JobEvent done;
  done.type = EventType::Finished;
  return encode_stored_event(done);
}

}  // namespace

std::unique_ptr<JobStore> with_leases(std::unique_ptr<JobStore> store) {
  if (store->leases() != nullptr) return store;
  return std::make_unique<LocalLeaseStore>(std::move(store), finished_event());
}

std::unique_ptr<JobStore> with_leases(JobStore& borrowed) {
  return std::make_unique<LocalLeaseStore>(borrowed, finished_event());
}

Scheduler::Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> executors, PodOptions options, JobStore& store,
                     JobLoader loader, SchedulerObserver* observer)
    : options_(std::move(options)),
      store_(store),
      leases_(leases_of(store)),
      loader_(std::move(loader)),
      observer_(observer),
      pool_(std::move(executors),
            ReplicaPoolOptions{options_.scheduling.replica_failure_limit, options_.scheduling.retest_backoff,
                               options_.scheduling.retest_backoff_max, options_.scheduling.liveness_grace},
            observer) {}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    hard_stop_ = true;
    heartbeat_cv_.notify_all();
  }
  pool_.stop();  // running chunks see hard_stop_ and give their leases back in chunk_done
  if (listener_.joinable()) listener_.join();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (store_health_.joinable()) store_health_.join();
}

void Scheduler::start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return;
    started_ = true;
  }
  listener_ = std::thread([this] { listen_loop(); });
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  store_health_ = std::thread([this] { store_health_loop(); });
  pool_.start(*this);
}

bool Scheduler::all_loaded() const { return pool_.all_loaded(); }
bool Scheduler::live() const { return pool_.live(); }

bool Scheduler::ready() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_ || stopping_) return false;
  }
  return pool_.all_loaded() && pool_.any_healthy() && store_answers_;
}

// The store's health as readiness sees it, from a check of its own (a statement under a short deadline, not TCP):
// a store that stops answering turns readiness off after kStoreChecksToFail checks, one answer turns it on again.
// ready() only reads the result, so probes never wait for the store.
void Scheduler::store_health_loop() {
  int failures = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
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
    heartbeat_cv_.wait_for(lock, kStoreCheckPeriod, [&] { return stopping_; });
  }
}

// On a shared store the pod's name tells its replicas from other pods' ("pod-1/cpu:0"); alone, "cpu:0".
std::string Scheduler::lease_name(size_t replica) const {
  return leases_.shared() ? options_.pod + "/" + pool_.name(replica) : pool_.name(replica);
}

// The gauges of queued and running work (the store's queue, this server's chunks).
void Scheduler::report_queue() {
  if (observer_ == nullptr) return;
  try {
    observer_->queue_changed(leases_.queue_depth(), running_jobs());
  } catch (const StoreError&) {  // metrics only: the next report catches up
  }
}

// ---- the pool's side: claim, run, commit ------------------------------------------------------------------------

// How long a running chunk still needs, by this server's average chunk time.
double Scheduler::remaining_locked(const Running& run, Clock::time_point now) const {
  return policy::remaining_seconds(seconds_per_chunk_, std::chrono::duration<double>(now - run.started).count());
}

// Draining on a shared store stops claiming (the other pods continue the queue); a server that is the only one
// finishes what it admitted. abort_all and the destructor stop claiming everywhere.
bool Scheduler::claiming_locked() const { return !hard_stop_ && (!draining_ || !leases_.shared()); }

std::vector<std::string> Scheduler::pass_over_locked(size_t replica, const std::vector<bool>& healthy,
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

std::optional<ChunkAssignment> Scheduler::next_chunk(size_t replica) {
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

std::optional<ChunkAssignment> Scheduler::prepare(size_t replica, const ChunkLease& lease) {
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
  // A job that was never retried (the stored count covers every pod) has no retry events to read.
  Attempts attempts = job->retries == 0 ? Attempts{} : attempts_of(job->id, lease.chunk_index);
  if (lease.takeover) {
    ++attempts.takeovers;
    spdlog::warn("job={} event=lease_takeover chunk={} from={} to={} takeovers={}", job->id, lease.chunk_index,
                 lease.previous_replica, name, attempts.takeovers);
    if (observer_) observer_->lease_takeover(name);
    JobEvent retry;
    retry.type = EventType::ChunkRetry;
    retry.chunk = lease.chunk_index;
    retry.attempt = attempts.total() - 1;
    retry.takeover = true;
    retry.message = "the lease of the replica running the chunk expired";
    append(job->id, retry);
  }
  if (!policy::should_take_over(attempts.takeovers, options_.scheduling.chunk_takeover_limit)) {
    finish(job->id, JobState::Failed, ErrorKind::Internal,
           "the processes running chunk " + std::to_string(lease.chunk_index) + " died " +
               std::to_string(attempts.takeovers) + " times");
    return std::nullopt;
  }
  if (!policy::should_retry(attempts.failures, options_.scheduling.chunk_retries, true)) {  // this replica is healthy
    finish(job->id, JobState::Failed, ErrorKind::Internal,
           "chunk " + std::to_string(lease.chunk_index) + " failed " + std::to_string(attempts.failures) +
               " time(s)");
    return std::nullopt;
  }
  const int attempt = attempts.total();
  std::string error;
  const std::shared_ptr<Cached> cached = payload_for(*job, lease, error);
  if (!cached) {
    finish(job->id, JobState::Failed, ErrorKind::Internal, "the job cannot be resumed: " + error);
    return std::nullopt;
  }

  auto run = std::make_shared<Running>();
  run->lease = lease;
  run->job = *job;
  run->job.request.clear();
  run->replica = name;
  run->index = replica;
  run->payload = cached->payload;
  run->attempt = attempt;
  run->failures = attempts.failures;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto& rows = cached->chunk_rows;
    for (size_t c = 0; c < rows.size(); ++c) {
      run->rows_total += rows[c];
      if (static_cast<int64_t>(c) < lease.chunk_index) run->rows_before += rows[c];
    }
    running_[replica] = run;
    avoid_.erase(job->id);
    cached->holder = static_cast<int>(replica);  // its payload stays here once the chunk commits
  }

  JobEvent started;
  started.type = EventType::ChunkStarted;
  started.chunk = lease.chunk_index;
  started.chunk_count = lease.chunk_count;
  started.replica = name;
  started.handoff = lease.handoff;
  started.attempt = attempt;
  append(job->id, started);
  const auto& rows = cached->chunk_rows;
  if (lease.chunk_index < static_cast<int64_t>(rows.size()) && rows[static_cast<size_t>(lease.chunk_index)] > 0) {
    try {  // after ChunkStarted's number, before ChunkFinished's: steps sort between them on every pod
      const int64_t planned = rows[static_cast<size_t>(lease.chunk_index)];
      run->step_numbers.push_back({1, leases_.reserve_sequences(job->id, planned)});
      run->steps_reserved = planned;
    } catch (const StoreError&) {
      run->steps_reserved = 0;  // progress only: this chunk reports none
    }
  }
  spdlog::info("job={} event=chunk_started chunk={}/{} replica={} attempt={} handoff={} token={}", job->id,
               lease.chunk_index, lease.chunk_count, name, attempt, lease.handoff, lease.token);
  if (observer_) {
    const JobSnapshot s = snapshot(*job);
    if (lease.chunk_index == 0 && attempt == 0) {
      observer_->job_started(s, static_cast<double>(leases_.now_ms() - job->created_ms) / 1000.0);
    }
    if (lease.handoff) observer_->handoff(s, lease.previous_replica, name);
    observer_->chunk_started(s, name, lease.chunk_index);
  }

  report_queue();
  ChunkAssignment assignment;
  assignment.work.job_id = job->id;
  assignment.work.chunk_index = lease.chunk_index;
  assignment.work.chunk_count = lease.chunk_count;
  assignment.work.attempt = attempt;
  assignment.work.handoff = lease.handoff;
  assignment.work.payload = cached->payload.get();
  assignment.payload = cached->payload;
  Running* r = run.get();
  assignment.callbacks.on_step = [this, r](int64_t row, int64_t of) { push_step(*r, row, of); };
  assignment.callbacks.should_stop = [this, r] { return stop_requested(*r); };
  assignment.callbacks.on_preview = [this, r](ChunkPreviewImage image) { push_preview(*r, std::move(image)); };
  return assignment;
}

// The payload this pod already holds when the job's previous chunk ran here, else one re-created from the store.
std::shared_ptr<Scheduler::Cached> Scheduler::payload_for(const StoredJob& job, const ChunkLease& lease,
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
Scheduler::Attempts Scheduler::attempts_of(const std::string& job_id, int64_t chunk) const {
  const std::vector<StoredEvent> events = store_.load_events(job_id);
  Attempts attempts;
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    const JobEvent e = decode_stored_event(*it);
    if (e.type == EventType::Queued || (e.type == EventType::ChunkFinished && e.chunk < chunk)) break;
    if (e.type == EventType::ChunkRetry && e.chunk == chunk) ++(e.takeover ? attempts.takeovers : attempts.failures);
  }
  return attempts;
}

bool Scheduler::stop_requested(const Running& run) const {
  if (run.lost || run.cancel || deadline_passed(run.job, leases_.now_ms())) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return hard_stop_;
}

void Scheduler::push_step(Running& run, int64_t row, int64_t rows) {
  JobEvent event;
  event.type = EventType::Step;
  event.chunk = run.lease.chunk_index;
  event.chunk_count = run.lease.chunk_count;
  event.replica = run.replica;
  event.step = row;
  event.steps = rows;
  event.progress = run.rows_total > 0 ? static_cast<double>(run.rows_before + row) / static_cast<double>(run.rows_total)
                                      : 0.0;
  if (row < 1) return;
  if (row > run.steps_reserved) {
    try {
      const int64_t more = std::max<int64_t>(rows, row) - run.steps_reserved;
      run.step_numbers.push_back({run.steps_reserved + 1, leases_.reserve_sequences(run.job.id, more)});
      run.steps_reserved += more;
    } catch (const StoreError&) {
      return;  // no number for it: progress only, the chunk goes on
    }
  }
  const auto range = std::prev(std::upper_bound(run.step_numbers.begin(), run.step_numbers.end(),
                                                std::make_pair(row, std::numeric_limits<uint64_t>::max())));
  event.sequence = range->second + static_cast<uint64_t>(row - range->first);
  event.time = from_wall_ms(leases_.now_ms());
  {
    std::lock_guard<std::mutex> lock(mu_);
    run.progress = event.progress;
    keep_step_locked(run.job.id, event);
  }
  stepped(run.job.id);
  if (!leases_.shared()) return;  // no other pod to tell
  const auto now = Clock::now();
  if (row == rows || now - run.last_published >= kStepPublishPeriod) {
    run.last_published = now;
    try {
      leases_.publish_step(run.job.id, StoredEvent{event.sequence, encode_stored_event(event)});
    } catch (const StoreError&) {  // progress only
    }
  }
}

// The job's latest preview replaces the one before (watchers skip to it): one image per job, for at most
// kPreviewJobsPerReplica jobs per replica (the oldest goes). Serials are this pod's, increasing across jobs, so that
// an entry evicted and made again never repeats one. A job's entry goes when it ends.
void Scheduler::push_preview(const Running& run, ChunkPreviewImage image) {
  if (observer_) observer_->preview_made(static_cast<int64_t>(image.png.size()));
  auto shared = std::make_shared<const ChunkPreviewImage>(std::move(image));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = previews_.find(run.job.id);
    if (it == previews_.end()) {
      if (previews_.size() >= kPreviewJobsPerReplica * pool_.size()) {
        previews_.erase(std::min_element(previews_.begin(), previews_.end(), [](const auto& a, const auto& b) {
          return a.second.serial < b.second.serial;
        }));
      }
      it = previews_.emplace(run.job.id, LatestPreview{}).first;
    }
    it->second.serial = ++preview_serial_;
    ++it->second.count;
    it->second.image = std::move(shared);
  }
  stepped(run.job.id);
}

std::optional<LatestPreview> Scheduler::latest_preview(const std::string& id, uint64_t after_serial) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = previews_.find(id);
  if (it == previews_.end() || !it->second.image || it->second.serial <= after_serial) return std::nullopt;
  return it->second;
}

// Step events of a job, this pod's or another's (from publish_step), bounded per job and in number of jobs.
void Scheduler::keep_step_locked(const std::string& job_id, const JobEvent& event) {
  auto it = steps_.find(job_id);
  if (it == steps_.end()) {
    if (steps_.size() >= kMaxStepJobs) {  // the job whose latest step is oldest goes
      auto oldest = std::min_element(steps_.begin(), steps_.end(), [](const auto& a, const auto& b) {
        return a.second.empty() || (!b.second.empty() && a.second.back().time < b.second.back().time);
      });
      steps_.erase(oldest);
    }
    it = steps_.emplace(job_id, std::deque<JobEvent>{}).first;
  }
  auto& steps = it->second;  // ascending by sequence
  const auto at = std::lower_bound(steps.begin(), steps.end(), event.sequence,
                                   [](const JobEvent& e, uint64_t sequence) { return e.sequence < sequence; });
  if (at != steps.end() && at->sequence == event.sequence) return;  // our own notification coming back
  steps.insert(at, event);
  while (steps.size() > kMaxStepEvents) steps.pop_front();
}

void Scheduler::chunk_done(size_t replica, ChunkAssignment /*assignment*/, ChunkResult result, double seconds) {
  std::string job_id;
  try {
    job_id = settle(replica, std::move(result), seconds);
  } catch (const StoreError& e) {
    // Whatever was not stored is redone: the lease expires and the chunk is claimed again (a retry).
    spdlog::error("replica={} event=chunk_settle_failed error=\"{}\"", lease_name(replica), e.what());
  }
  if (!job_id.empty()) changed(job_id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++change_count_;
    work_.notify_all();
    changed_.notify_all();
  }
  report_queue();
}

std::string Scheduler::settle(size_t replica, ChunkResult result, double seconds) {
  std::shared_ptr<Running> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    run = running_.at(replica);
    running_.erase(replica);
  }
  const std::string& id = run->job.id;
  const int64_t chunk = run->lease.chunk_index;
  const bool last = chunk + 1 == run->lease.chunk_count;
  bool stop = stop_requested(*run);
  if (result.outcome == ChunkOutcome::Stopped && !stop) {
    result.outcome = ChunkOutcome::Failed;
    if (result.error.empty()) result.error = "chunk stopped without a request";
  }

  if (result.outcome == ChunkOutcome::Succeeded && !run->lost) {
    JobEvent finished_chunk;
    finished_chunk.type = EventType::ChunkFinished;
    finished_chunk.chunk = chunk;
    finished_chunk.chunk_count = run->lease.chunk_count;
    finished_chunk.replica = run->replica;
    finished_chunk.seconds = seconds;
    finished_chunk.work = result.work;
    finished_chunk.time = from_wall_ms(leases_.now_ms());
    std::vector<std::string> events{encode_stored_event(finished_chunk)};
    if (last) {
      JobEvent done;
      done.type = EventType::Finished;
      done.time = from_wall_ms(leases_.now_ms());
      events.push_back(encode_stored_event(done));
    }
    LeaseCommit commit;
    std::string not_stored;
    try {
      commit = leases_.commit(run->lease, {chunk, run->replica, run->attempt + 1, std::move(result.bytes)}, events);
    } catch (const StoreError& e) {
      // A shared store that cannot be reached: the lease expires and a replica (maybe this one) runs the chunk again.
      // A store of this server's own (a full disk, an I/O error) will not heal by waiting: the job fails.
      spdlog::error("job={} event=commit_failed chunk={} error=\"{}\"", id, chunk, e.what());
      if (!leases_.shared()) not_stored = e.what();
    }
    if (!not_stored.empty()) {
      finish(id, JobState::Failed, ErrorKind::Internal,
             "chunk " + std::to_string(chunk) + " could not be stored: " + not_stored);
      return id;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (commit.committed) {
      // Only the payload this chunk ran on holds its result (a submit on this pod may have cached another since).
      auto it = cache_.find(id);
      const bool ran_here = it != cache_.end() && it->second->payload == run->payload;
      if (ran_here && !last) it->second->chunks_held = chunk + 1;
      seconds_per_chunk_ = policy::update_seconds_per_work(seconds_per_chunk_, seconds, 1.0);
      if (last) {
        retire_now_ = true;
        heartbeat_cv_.notify_all();
      }
      if (it != cache_.end() && (last || !ran_here)) cache_.erase(it);
    } else {
      cache_.erase(id);
      spdlog::warn("job={} event=commit_fenced chunk={} replica={} token={}", id, chunk, run->replica,
                   run->lease.token);
    }
    if (commit.committed) {
      spdlog::info("job={} event=chunk_finished chunk={} replica={} seconds={:.3f}", id, chunk, run->replica, seconds);
    }
    if (commit.committed && observer_) {
      StoredJob after = run->job;
      after.chunks_done = chunk + 1;
      if (last) after.state = job_state_name(JobState::Succeeded);
      const JobSnapshot s = snapshot(after);
      observer_->chunk_finished(s, run->replica, chunk, seconds, result.frames_generated);
      if (last) observer_->job_finished(s);
    }
  } else if (run->lost) {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.erase(id);
    spdlog::warn("job={} event=lease_lost chunk={} replica={}", id, chunk, run->replica);
  } else if (stop) {
    if (run->cancel) {
      finish(id, JobState::Cancelled, ErrorKind::Cancelled, "cancelled by the client");
    } else if (deadline_passed(run->job, leases_.now_ms())) {
      finish(id, JobState::DeadlineExceeded, ErrorKind::DeadlineExceeded, "deadline passed while running");
    } else {
      leases_.release(run->lease);  // this pod stops: another one continues the job, not as a retry
      std::lock_guard<std::mutex> lock(mu_);
      cache_.erase(id);
    }
  } else if (result.outcome == ChunkOutcome::Failed) {
    fail_or_retry(*run, result.error);
  } else if (result.outcome == ChunkOutcome::Rejected) {
    spdlog::warn("job={} event=chunk_rejected chunk={} replica={} error=\"{}\"", id, chunk, run->replica,
                 result.error);
    finish(id, JobState::Failed, ErrorKind::InvalidArgument, result.error);
  } else if (result.outcome == ChunkOutcome::ResourceExhausted) {
    spdlog::warn("job={} event=chunk_out_of_memory chunk={} replica={} error=\"{}\"", id, chunk, run->replica,
                 result.error);
    finish(id, JobState::Failed, ErrorKind::ResourceExhausted, result.error);
  } else if (result.outcome == ChunkOutcome::NotStored) {
    spdlog::error("job={} event=chunk_not_stored chunk={} error=\"{}\"", id, chunk, result.error);
    finish(id, JobState::Failed, ErrorKind::Internal,
           "chunk " + std::to_string(chunk) + " could not be stored: " + result.error);
  }
  return id;
}

void Scheduler::fail_or_retry(const Running& run, const std::string& error) {
  const bool retry = policy::should_retry(run.failures + 1, options_.scheduling.chunk_retries, pool_.any_healthy());
  spdlog::warn("job={} event=chunk_failed chunk={} replica={} attempt={} retry={} error=\"{}\"", run.job.id,
               run.lease.chunk_index, run.replica, run.attempt, retry, error);
  if (observer_) observer_->chunk_failed(snapshot(run.job), run.replica, run.lease.chunk_index, error, retry);
  if (!retry) {
    finish(run.job.id, JobState::Failed, ErrorKind::Internal,
           "chunk " + std::to_string(run.lease.chunk_index) + " failed " + std::to_string(run.failures + 1) +
               " time(s); last error on replica " + run.replica + ": " + error);
    return;
  }
  JobEvent event;
  event.type = EventType::ChunkRetry;
  event.chunk = run.lease.chunk_index;
  event.replica = run.replica;
  event.attempt = run.attempt;
  event.message = error;
  append(run.job.id, event);
  try {
    if (std::optional<StoredJob> job = leases_.load_job(run.job.id, false)) {
      ++job->retries;
      store_.update_job(*job);
    }
  } catch (const StoreError& e) {
    spdlog::error("job={} event=store_update_failed error=\"{}\"", run.job.id, e.what());
  }
  leases_.release(run.lease);
  std::lock_guard<std::mutex> lock(mu_);
  cache_.erase(run.job.id);  // the failed chunk may have left the payload half-advanced
  avoid_[run.job.id] = run.index;
}

// Ends a job in the store (whichever pod gets there first), with its Finished event.
void Scheduler::finish(const std::string& job_id, JobState state, ErrorKind kind, const std::string& error) {
  try {
    std::optional<StoredJob> job = leases_.load_job(job_id, false);
    if (!job || is_terminal(parse_job_state(job->state))) return;
    job->state = job_state_name(state);
    job->error_kind = error_kind_name(kind);
    job->error = error;
    job->finished_ms = leases_.now_ms();
    try {
      store_.update_job(*job);
    } catch (const StoreError& e) {
      // A shared store keeps the job as it was (another pod, or this one, ends it later). This server's own store
      // holds the end in memory (written through when it can be): its watchers hear it now.
      spdlog::error("job={} event=store_update_failed state={} error=\"{}\"", job_id, job_state_name(state),
                    e.what());
      if (leases_.shared()) throw;
    }
    JobEvent event;
    event.type = EventType::Finished;
    event.message = error;
    append(job_id, event);
    {
      std::lock_guard<std::mutex> lock(mu_);
      previews_.erase(job_id);
    }
    spdlog::log(state == JobState::Succeeded ? spdlog::level::info : spdlog::level::warn,
                "job={} event=finished state={} chunks_done={} error=\"{}\"", job_id, job_state_name(state),
                job->chunks_done, error);
    if (observer_) observer_->job_finished(snapshot(*job));
  } catch (const StoreError& e) {
    spdlog::error("job={} event=finish_failed state={} error=\"{}\"", job_id, job_state_name(state), e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.erase(job_id);
    avoid_.erase(job_id);
    retire_now_ = true;
    heartbeat_cv_.notify_all();
  }
  changed(job_id);
  report_queue();
}

uint64_t Scheduler::append(const std::string& job_id, const JobEvent& event) {
  JobEvent stamped = event;
  stamped.time = from_wall_ms(leases_.now_ms());
  try {
    const std::vector<uint64_t> seq = leases_.append_events(job_id, {encode_stored_event(stamped)});
    changed(job_id);  // this server's watchers at once (other pods' through the store, or their next poll)
    return seq.empty() ? 0 : seq.front();
  } catch (const StoreError& e) {
    spdlog::error("job={} event=store_event_failed error=\"{}\"", job_id, e.what());
    return 0;
  }
}

void Scheduler::replicas_changed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++change_count_;
  work_.notify_all();
  changed_.notify_all();
}

void Scheduler::interrupt() {
  std::lock_guard<std::mutex> lock(mu_);
  interrupted_ = true;
  hard_stop_ = true;
  work_.notify_all();
}

// ---- store notifications, heartbeats, housekeeping -----------------------------------------------------------

void Scheduler::changed(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  ++change_count_;
  work_.notify_all();
  changed_.notify_all();
  notify_subscribers_locked(job_id);
}

// A change that may be a cancel (a client's here, or anything another pod wrote): a chunk of the job running here
// renews its lease at once, which is where it learns of a cancel. Not for this pod's own events: a renewal per event
// is a store call per event.
void Scheduler::changed_maybe_cancelled(const std::string& job_id) {
  changed(job_id);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [replica, run] : running_) {
    if (run->job.id == job_id) {
      renew_now_ = true;  // a cancel from another pod reaches this chunk at its next step, not its next heartbeat
      heartbeat_cv_.notify_all();
    }
  }
}

void Scheduler::notify_subscribers_locked(const std::string& job_id) {
  auto it = listeners_.find(job_id);
  if (it != listeners_.end()) {
    for (auto& [token, notify] : it->second) notify();
  }
}

// Step progress: only the job's watchers hear it (no replica has new work, no lease needs renewing).
void Scheduler::stepped(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  ++change_count_;
  changed_.notify_all();
  notify_subscribers_locked(job_id);
}

// One wait on the store's change notifications (another pod's changes; a listener re-made after a lost connection).
void Scheduler::hear_other_pods(std::unique_ptr<ChangeListener>& listener, Clock::time_point& last_poll) {
  try {
    if (!listener) listener = leases_.listen();
    const JobChanges changes = listener->wait(options_.poll);
    if (!changes.steps.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, stored] : changes.steps) {
        try {
          keep_step_locked(id, decode_stored_event(stored));
        } catch (const std::exception&) {  // not a step we can read: the job id still wakes its watchers
        }
      }
    }
    for (const std::string& id : changes.job_ids) changed_maybe_cancelled(id);
    if (changes.missed) last_poll = Clock::time_point{};
  } catch (const StoreError& e) {
    listener.reset();
    spdlog::warn("event=store_listen_failed error=\"{}\"", e.what());
    std::unique_lock<std::mutex> lock(mu_);
    heartbeat_cv_.wait_for(lock, options_.poll, [&] { return stopping_; });
  }
}

void Scheduler::listen_loop() {
  std::unique_ptr<ChangeListener> listener;
  auto last_poll = Clock::now();
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
    }
    if (leases_.shared()) {
      hear_other_pods(listener, last_poll);
    } else {
      // Nobody else writes to this store: every change was made, and announced, here. Only the poll below is left.
      std::unique_lock<std::mutex> lock(mu_);
      heartbeat_cv_.wait_for(lock, options_.poll, [&] { return stopping_; });
    }
    // Fallback: notifications are hints (an expiring lease sends none), so every waiter looks again now and then.
    if (Clock::now() - last_poll >= 5 * options_.poll) {
      last_poll = Clock::now();
      std::vector<std::string> watched;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& [id, listeners] : listeners_) watched.push_back(id);
      }
      for (const std::string& id : watched) changed(id);
      std::lock_guard<std::mutex> lock(mu_);
      ++change_count_;
      work_.notify_all();
      changed_.notify_all();
    }
  }
}

void Scheduler::heartbeat_loop() {
  const auto period = std::max<std::chrono::milliseconds>(options_.lease_ttl / 3, std::chrono::milliseconds(10));
  auto next_housekeeping = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    heartbeat_cv_.wait_for(lock, period, [&] { return stopping_ || renew_now_ || retire_now_; });
    if (stopping_) break;
    renew_now_ = false;
    const bool retire = retire_now_;
    retire_now_ = false;
    std::vector<std::shared_ptr<Running>> runs;
    for (auto& [replica, run] : running_) runs.push_back(run);
    lock.unlock();
    for (auto& run : runs) {
      try {
        const LeaseRenewal renewal = leases_.renew(run->lease, options_.lease_ttl);
        if (!renewal.held) run->lost = true;
        if (renewal.cancel_requested) run->cancel = true;
      } catch (const StoreError& e) {
        spdlog::warn("job={} event=lease_renew_failed error=\"{}\"", run->job.id, e.what());
      }
    }
    if (retire || Clock::now() >= next_housekeeping) {
      housekeeping();
      next_housekeeping = Clock::now() + 5 * options_.poll;
    }
    lock.lock();
  }
}

// Deadlines of jobs no replica runs are enforced by whichever pod looks first; the metrics see the global queue.
void Scheduler::housekeeping() {
  try {
    for (const std::string& id : leases_.expire_deadlines()) {
      JobEvent event;
      event.type = EventType::Finished;
      event.message = "deadline passed while queued";
      append(id, event);
      spdlog::warn("job={} event=finished state=DEADLINE_EXCEEDED reason=\"deadline passed while queued\"", id);
      changed(id);
    }
    retire_finished();
    drop_removed();
    if (observer_) observer_->queue_changed(leases_.queue_depth(), running_jobs());
  } catch (const StoreError& e) {
    spdlog::warn("event=housekeeping_failed error=\"{}\"", e.what());
  }
}

void Scheduler::retire_finished() {
  const auto& o = options_.scheduling;
  const int64_t before = leases_.now_ms() - std::chrono::duration_cast<std::chrono::milliseconds>(o.retention).count();
  for (const LeaseStore::Retired& job : leases_.finished_to_retire(before, o.max_retained_jobs)) {
    store_.drop_job(job.job_id, job.expired ? "its results were kept --result-ttl-seconds " +
                                                  std::to_string(o.retention.count())
                                            : "more than --max-retained-jobs " + std::to_string(o.max_retained_jobs) +
                                                  " finished jobs");
    changed(job.job_id);  // watchers find it gone
  }
}

// ---- the transport's side -----------------------------------------------------------------------------------

void Scheduler::admit_here() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_ || stopping_) {
      throw AdmissionError(AdmissionError::Reason::Draining, "server is draining: no new jobs are accepted");
    }
  }
  // While replicas load, jobs queue for them.
  if (pool_.all_loaded() && !pool_.any_healthy()) {
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
  auto cached = std::make_shared<Cached>();
  cached->payload = spec.payload;
  cached->description = spec.description;
  cached->chunk_rows = spec.chunk_rows;
  cached->used = Clock::now();
  std::string tried;
  auto forget_tried = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cache_.find(tried); it != cache_.end() && it->second == cached) cache_.erase(it);
  };
  auto next_id = [&] {
    forget_tried();
    tried = new_job_id();
    std::lock_guard<std::mutex> lock(mu_);
    cache_.emplace(tried, cached);
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
  append(outcome.job_id, queued);
  std::optional<JobSnapshot> snap = get(outcome.job_id, spec.owner);
  if (!snap) throw AdmissionError(AdmissionError::Reason::Unavailable, "the job store lost the job", 1.0);
  spdlog::info("job={} event=submitted chunks={} priority={} owner={}", outcome.job_id, snap->chunk_count,
               snap->priority, spec.owner);
  if (observer_) observer_->job_submitted(*snap);
  changed(outcome.job_id);
  report_queue();
  return {*snap, false};
}

std::optional<StoredJob> Scheduler::find(const std::string& id, const std::string& owner) const {
  std::optional<StoredJob> job = leases_.load_job(id, false);  // every read and wait: the state, not the request
  if (!job || job->owner != owner) return std::nullopt;
  return job;
}

JobSnapshot Scheduler::snapshot(const StoredJob& job) const {
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

std::optional<JobSnapshot> Scheduler::get(const std::string& id, const std::string& owner) const {
  std::optional<StoredJob> job = find(id, owner);  // StoreError: the transport answers UNAVAILABLE
  if (!job) return std::nullopt;
  const std::vector<StoredEvent> events = store_.load_events(id);
  JobSnapshot s = snapshot(*job);
  s.description = description_of(*job);
  for (const StoredEvent& stored : events) {
    s.last_sequence = std::max(s.last_sequence, stored.sequence);
    const JobEvent e = decode_stored_event(stored);
    if (e.type == EventType::ChunkFinished) {
      s.chunk_replicas.push_back(e.replica);
      s.work += e.work;
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (const auto& [replica, run] : running_) {
    if (run->job.id == id && run->progress > s.progress) s.progress = run->progress;
  }
  if (auto it = steps_.find(id); it != steps_.end() && !it->second.empty()) {
    s.last_sequence = std::max(s.last_sequence, it->second.back().sequence);
    if (!is_terminal(s.state)) s.progress = std::max(s.progress, it->second.back().progress);  // another pod's chunk
  }
  if (auto it = cache_.find(id); it != cache_.end()) s.payload = it->second->payload;
  if (aborted_ && !is_terminal(s.state)) {
    s.state = JobState::Failed;
    s.error_kind = ErrorKind::Unavailable;
    s.error = *aborted_;
  }
  const bool running_here = std::any_of(running_.begin(), running_.end(),
                                        [&](const auto& r) { return r.second->job.id == id; });
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
  s.eta_seconds = policy::queue_eta(std::max(soonest_free, 0.0),
                                    static_cast<double>(place.ahead) * seconds_per_chunk_, healthy_count,
                                    seconds_per_chunk_ > 0);
}

double Scheduler::retry_after() const {
  int64_t unfinished = 0;
  try {
    unfinished = leases_.admission_counts("").unfinished;
  } catch (const StoreError&) {
  }
  double per_chunk = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    per_chunk = seconds_per_chunk_;
  }
  int64_t healthy = 0;
  for (size_t i = 0; i < pool_.size(); ++i) healthy += pool_.healthy(i) ? 1 : 0;
  return policy::retry_after_seconds(static_cast<double>(unfinished) * per_chunk, healthy, per_chunk > 0);
}

std::shared_ptr<const JobDescription> Scheduler::description_of(const StoredJob& job) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cache_.find(job.id); it != cache_.end() && it->second->description) return it->second->description;
    if (auto it = descriptions_.find(job.id); it != descriptions_.end()) return it->second;
  }
  const std::optional<StoredJob> with_request = leases_.load_job(job.id);
  if (!with_request) return nullptr;
  std::shared_ptr<const JobDescription> description = loader_(*with_request, {}).description;
  if (!description) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
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
  for (const StoredJob& job : leases_.jobs_of(owner)) out.push_back(snapshot(job));  // StoreError: UNAVAILABLE
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) {
    for (JobSnapshot& s : out) {
      if (is_terminal(s.state)) continue;
      s.state = JobState::Failed;
      s.error_kind = ErrorKind::Unavailable;
      s.error = *aborted_;
    }
  }
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
    changed(id);  // watchers find it gone
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    removed_.insert(id);
  }
  return job;
}

void Scheduler::drop_removed() {
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ids.assign(removed_.begin(), removed_.end());
  }
  for (const std::string& id : ids) {
    const std::optional<StoredJob> job = leases_.load_job(id, false);
    if (job && !is_terminal(parse_job_state(job->state))) continue;
    if (job) store_.drop_job(id, "deleted by its client");
    std::lock_guard<std::mutex> lock(mu_);
    removed_.erase(id);
  }
}

std::optional<JobSnapshot> Scheduler::cancel(const std::string& id, const std::string& owner) {
  const CancelState state = leases_.request_cancel(id, owner);  // StoreError: UNAVAILABLE
  if (state == CancelState::Unknown) return std::nullopt;
  changed_maybe_cancelled(id);  // a chunk running here stops at its next step
  // Nobody runs it: end it here. Running: the pod running it sees the request at its next step (a notification
  // makes it renew at once) and ends the job.
  if (state == CancelState::Idle) finish(id, JobState::Cancelled, ErrorKind::Cancelled, "cancelled by the client");
  return get(id, owner);
}

EventBatch Scheduler::wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                                      Clock::time_point until) const {
  while (true) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = change_count_;
    }
    EventBatch batch;
    std::optional<StoredJob> job;
    std::vector<StoredEvent> stored;
    bool unreadable = false;
    try {
      job = find(id, owner);
      if (job) stored = store_.load_events(id);
    } catch (const StoreError& e) {
      // The store is away (a restart, a failover): watchers wait for it rather than hear NOT_FOUND.
      spdlog::warn("job={} event=store_read_failed error=\"{}\"", id, e.what());
      unreadable = true;
    }
    if (unreadable) {
      if (Clock::now() >= until) return batch;
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_until(lock, std::min(until, Clock::now() + options_.poll), [&] { return stopping_; });
      if (stopping_) return batch;
      continue;
    }
    if (!job) {
      batch.found = false;
      return batch;
    }
    for (const StoredEvent& s : stored) {
      if (s.sequence > after_sequence) batch.events.push_back(decode_stored_event(s));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = steps_.find(id); it != steps_.end()) {
        for (const JobEvent& e : it->second) {
          if (e.sequence > after_sequence) batch.events.push_back(e);
        }
      }
    }
    std::sort(batch.events.begin(), batch.events.end(),
              [](const JobEvent& a, const JobEvent& b) { return a.sequence < b.sequence; });
    batch.finished = is_terminal(parse_job_state(job->state)) &&
                     std::any_of(stored.begin(), stored.end(), [](const StoredEvent& s) {
                       return decode_stored_event(s).type == EventType::Finished;
                     });
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_ && !is_terminal(parse_job_state(job->state))) {
        // This server stopped serving: its watchers hear the end it answers with (the job stays in the store).
        JobEvent end;
        end.type = EventType::Finished;
        end.message = *aborted_;
        end.time = from_wall_ms(leases_.now_ms());
        end.sequence = std::max<uint64_t>(stored.empty() ? 0 : stored.back().sequence, after_sequence) + 1;
        batch.events.push_back(end);
        batch.finished = true;
      }
    }
    if (!batch.events.empty() || batch.finished || Clock::now() >= until) return batch;
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_until(lock, std::min(until, Clock::now() + options_.poll),
                        [&] { return change_count_ != seen || stopping_; });
    if (stopping_) return batch;
  }
}

uint64_t Scheduler::subscribe(const std::string& id, std::function<void()> notify) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t token = next_listener_++;
  listeners_[id][token] = std::move(notify);
  return token;
}

void Scheduler::unsubscribe(const std::string& id, uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = listeners_.find(id);
  if (it == listeners_.end()) return;
  it->second.erase(token);
  if (it->second.empty()) listeners_.erase(it);
}

std::optional<JobSnapshot> Scheduler::wait_chunks(const std::string& id, const std::string& owner,
                                                      int64_t chunks_seen, Clock::time_point until) const {
  while (true) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = change_count_;
    }
    std::optional<JobSnapshot> s;
    try {
      s = get(id, owner);
    } catch (const StoreError&) {
      if (Clock::now() >= until) throw;
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_until(lock, std::min(until, Clock::now() + options_.poll), [&] { return stopping_; });
      continue;
    }
    if (!s || s->chunks_done > chunks_seen || is_terminal(s->state) || Clock::now() >= until) return s;
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_until(lock, std::min(until, Clock::now() + options_.poll),
                        [&] { return change_count_ != seen || stopping_; });
    if (stopping_) return s;
  }
}

void Scheduler::begin_drain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
  spdlog::info("event=drain_started running_chunks={}", running_.size());
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

bool Scheduler::wait_idle(Clock::time_point until) const {
  const bool shared = leases_.shared();
  auto idle = [&] {
    if (!running_.empty()) return false;
    if (shared || hard_stop_) return true;  // nothing more runs here
    try {
      return leases_.admission_counts("").unfinished == 0;
    } catch (const StoreError&) {
      return false;
    }
  };
  std::unique_lock<std::mutex> lock(mu_);
  while (!idle()) {
    if (Clock::now() >= until) return false;
    changed_.wait_until(lock, std::min(until, Clock::now() + options_.poll));
  }
  return true;
}

void Scheduler::abort_all(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  hard_stop_ = true;
  draining_ = true;
  aborted_ = reason;
  ++change_count_;
  changed_.notify_all();
  spdlog::warn("event=abort_all running_chunks={} reason=\"{}\" (their leases go back to the store)", running_.size(),
               reason);
}

std::vector<ReplicaStatus> Scheduler::replicas() const { return pool_.status(); }

int64_t Scheduler::queued_jobs() const {
  try {
    return leases_.queue_depth();
  } catch (const StoreError&) {
    return 0;
  }
}

int64_t Scheduler::running_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(running_.size());
}

}  // namespace skyreels::server
