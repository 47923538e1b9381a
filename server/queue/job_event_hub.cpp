#include "server/queue/job_event_hub.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace skyreels::server {

namespace {

constexpr size_t kMaxStepEvents = 64;  // per job: watchers only need the latest progress
constexpr size_t kMaxStepJobs = 4096;  // jobs with step events kept (those of other pods' chunks too)

}  // namespace

JobEventHub::JobEventHub(SchedulerShared& shared, LeaseStore& leases, JobStore& store, std::chrono::milliseconds poll,
                         ForeignChange foreign_change)
    : shared_(shared), leases_(leases), store_(store), poll_(poll), foreign_change_(std::move(foreign_change)) {}

JobEventHub::~JobEventHub() { join(); }

void JobEventHub::start() { listener_ = std::thread([this] { listen_loop(); }); }

void JobEventHub::join() {
  if (listener_.joinable()) listener_.join();
}

// ---- the event log ----------------------------------------------------------------------------------------------

uint64_t JobEventHub::append(const std::string& job_id, const JobEvent& event) {
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

// Step events of a job, this pod's or another's (from publish_step), bounded per job and in number of jobs.
void JobEventHub::keep_step_locked(const std::string& job_id, const JobEvent& event) {
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

const JobEvent* JobEventHub::latest_step_locked(const std::string& job_id) const {
  auto it = steps_.find(job_id);
  return it == steps_.end() || it->second.empty() ? nullptr : &it->second.back();
}

// The job's latest preview replaces the one before (watchers skip to it): one image per job, for at most `max_jobs`
// jobs (the oldest goes). Serials are this pod's, increasing across jobs, so that an entry evicted and made again
// never repeats one. A job's entry goes when it ends.
void JobEventHub::keep_preview(const std::string& job_id, const std::string& replica, ChunkPreviewImage image,
                               size_t max_jobs) {
  SchedulerEvent made = SchedulerEvent::about(SchedulerEventKind::PreviewMade, job_id);
  made.replica = replica;
  made.bytes = static_cast<int64_t>(image.png.size());
  auto shared = std::make_shared<const ChunkPreviewImage>(std::move(image));
  {
    std::lock_guard<std::mutex> lock(previews_mu_);
    auto it = previews_.find(job_id);
    if (it == previews_.end()) {
      if (previews_.size() >= max_jobs) {
        previews_.erase(std::min_element(previews_.begin(), previews_.end(), [](const auto& a, const auto& b) {
          return a.second.serial < b.second.serial;
        }));
      }
      it = previews_.emplace(job_id, LatestPreview{}).first;
    }
    it->second.serial = ++preview_serial_;
    ++it->second.count;
    it->second.image = std::move(shared);
  }
  wake_waiters(false);
  events_.publish(made);
}

void JobEventHub::drop_preview(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(previews_mu_);
  previews_.erase(job_id);
}

std::optional<LatestPreview> JobEventHub::latest_preview(const std::string& id, uint64_t after_serial) const {
  std::lock_guard<std::mutex> lock(previews_mu_);
  const auto it = previews_.find(id);
  if (it == previews_.end() || !it->second.image || it->second.serial <= after_serial) return std::nullopt;
  return it->second;
}

// ---- changes ----------------------------------------------------------------------------------------------------

void JobEventHub::changed(const std::string& job_id) {
  wake_waiters(true);
  events_.publish(SchedulerEvent::about(SchedulerEventKind::JobChanged, job_id));
}

// Step progress: no replica has new work, no lease needs renewing.
void JobEventHub::stepped(const std::string& job_id) {
  wake_waiters(false);
  events_.publish(SchedulerEvent::about(SchedulerEventKind::StepProgress, job_id));
}

void JobEventHub::wake_waiters(bool replicas) {
  std::lock_guard<std::mutex> lock(shared_.mu);
  ++shared_.change_count;
  if (replicas) shared_.work.notify_all();
  shared_.changed.notify_all();
}

uint64_t JobEventHub::change_count() const {
  std::lock_guard<std::mutex> lock(shared_.mu);
  return shared_.change_count;
}

bool JobEventHub::wait_for_change(std::optional<uint64_t> seen, Clock::time_point until) const {
  std::unique_lock<std::mutex> lock(shared_.mu);
  shared_.changed.wait_until(lock, std::min(until, Clock::now() + poll_), [&] {
    return (seen && shared_.change_count != *seen) || shared_.stopping;
  });
  return !shared_.stopping;
}

// ---- the store's notifications: the one loop that follows job changes -----------------------------------------

void JobEventHub::keep_heard_steps(const JobChanges& changes) {
  if (changes.steps.empty()) return;
  std::lock_guard<std::mutex> lock(shared_.mu);
  for (const auto& [id, stored] : changes.steps) {
    try {
      keep_step_locked(id, decode_stored_event(stored));
    } catch (const std::exception&) {  // not a step we can read: the job id still wakes its watchers
    }
  }
}

// One wait on the store's change notifications (another pod's changes; a listener re-made after a lost connection).
void JobEventHub::hear_other_pods(std::unique_ptr<ChangeListener>& listener, Clock::time_point& last_poll) {
  try {
    const bool remade = !listener;
    if (!listener) listener = leases_.listen();
    const JobChanges changes = listener->wait(poll_);
    keep_heard_steps(changes);
    for (const std::string& id : changes.job_ids) {
      changed(id);
      foreign_change_(id);
    }
    if (changes.missed) last_poll = Clock::time_point{};  // the waiters look again now
    if (changes.missed || remade) {
      // Changes may have gone unheard (a new listener hears only what comes after it): consumers re-read.
      events_.publish(SchedulerEvent{SchedulerEventKind::ChangesMissed});
    }
  } catch (const StoreError& e) {
    listener.reset();
    spdlog::warn("event=store_listen_failed error=\"{}\"", e.what());
    std::unique_lock<std::mutex> lock(shared_.mu);
    shared_.wake.wait_for(lock, poll_, [&] { return shared_.stopping; });
  }
}

// The safety net: a lease that expires (its holder died or paused) makes a chunk claimable without any notification,
// and notifications are hints, so every waiter, watcher and idle replica looks again now and then (LookAgain). What
// the other consumers follow (commits, ends) always sends a change, and a lost listener publishes ChangesMissed.
void JobEventHub::look_again_everywhere() {
  wake_waiters(true);
  events_.publish(SchedulerEvent{SchedulerEventKind::LookAgain});
}

void JobEventHub::listen_loop() {
  std::unique_ptr<ChangeListener> listener;
  auto last_poll = Clock::now();
  while (true) {
    {
      std::lock_guard<std::mutex> lock(shared_.mu);
      if (shared_.stopping) return;
    }
    if (leases_.shared()) {
      hear_other_pods(listener, last_poll);
    } else {
      // Nobody else writes to this store: every change was made, and announced, here. Only the safety net is left.
      std::unique_lock<std::mutex> lock(shared_.mu);
      shared_.wake.wait_for(lock, poll_, [&] { return shared_.stopping; });
    }
    if (Clock::now() - last_poll >= 5 * poll_) {
      last_poll = Clock::now();
      look_again_everywhere();
    }
  }
}

// ---- watchers ---------------------------------------------------------------------------------------------------

std::optional<StoredJob> JobEventHub::find(const std::string& id, const std::string& owner) const {
  std::optional<StoredJob> job = leases_.load_job(id, false);  // the state, not the request
  if (!job || job->owner != owner) return std::nullopt;
  return job;
}

// The stored events after `after_sequence`, this pod's steps among them, and the end: the job's own, or the one this
// server answers with once it stopped serving (abort_all; the job stays in the store).
void JobEventHub::add_events_after(const std::string& id, uint64_t after_sequence,
                                   const std::vector<StoredEvent>& stored, EventBatch& batch) const {
  for (const StoredEvent& s : stored) {
    if (s.sequence > after_sequence) batch.events.push_back(decode_stored_event(s));
  }
  std::lock_guard<std::mutex> lock(shared_.mu);
  if (auto it = steps_.find(id); it != steps_.end()) {
    for (const JobEvent& e : it->second) {
      if (e.sequence > after_sequence) batch.events.push_back(e);
    }
  }
  std::sort(batch.events.begin(), batch.events.end(),
            [](const JobEvent& a, const JobEvent& b) { return a.sequence < b.sequence; });
}

EventBatch JobEventHub::wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                                    Clock::time_point until) const {
  while (true) {
    const uint64_t seen = change_count();
    EventBatch batch;
    std::optional<StoredJob> job;
    std::vector<StoredEvent> stored;
    try {
      job = find(id, owner);
      if (job) stored = store_.load_events(id);
    } catch (const StoreError& e) {
      // The store is away (a restart, a failover): watchers wait for it rather than hear NOT_FOUND.
      spdlog::warn("job={} event=store_read_failed error=\"{}\"", id, e.what());
      if (Clock::now() >= until || !wait_for_change(std::nullopt, until)) return batch;
      continue;
    }
    if (!job) {
      batch.found = false;
      return batch;
    }
    add_events_after(id, after_sequence, stored, batch);
    const bool terminal = is_terminal(parse_job_state(job->state));
    batch.finished = terminal && std::any_of(stored.begin(), stored.end(), [](const StoredEvent& s) {
                       return decode_stored_event(s).type == EventType::Finished;
                     });
    {
      std::lock_guard<std::mutex> lock(shared_.mu);
      if (shared_.aborted && !terminal) {
        JobEvent end;
        end.type = EventType::Finished;
        end.message = *shared_.aborted;
        end.time = from_wall_ms(leases_.now_ms());
        end.sequence = std::max<uint64_t>(stored.empty() ? 0 : stored.back().sequence, after_sequence) + 1;
        batch.events.push_back(end);
        batch.finished = true;
      }
    }
    if (!batch.events.empty() || batch.finished || Clock::now() >= until) return batch;
    if (!wait_for_change(seen, until)) return batch;
  }
}

}  // namespace skyreels::server
