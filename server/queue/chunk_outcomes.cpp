#include "server/queue/chunk_runner.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

#include "server/policy/dispatch_policy.h"

// The chunk runner's other half: what a running chunk reports (steps, previews), how its outcome settles (commit,
// retry, the job's end), the heartbeat and the housekeeping.
namespace skyreels::server {

namespace {

constexpr size_t kPreviewJobsPerReplica = 4;  // jobs whose latest preview is kept, per replica of this pod
constexpr auto kStepPublishPeriod = std::chrono::milliseconds(500);  // step progress to other pods, coalesced

bool deadline_passed(const StoredJob& job, int64_t now_ms) { return job.deadline_ms && *job.deadline_ms <= now_ms; }

}  // namespace

bool ChunkRunner::stop_requested(const Running& run) const {
  if (run.lost || run.cancel || deadline_passed(run.job, leases_.now_ms())) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return hard_stop_;
}

void ChunkRunner::push_step(Running& run, int64_t row, int64_t rows) {
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
    hub_.keep_step_locked(run.job.id, event);
  }
  hub_.stepped(run.job.id);
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

// The preview goes to the hub (the job's latest, kPreviewJobsPerReplica jobs per replica of this pod), which
// publishes it.
void ChunkRunner::push_preview(const Running& run, ChunkPreviewImage image) {
  hub_.keep_preview(run.job.id, run.replica, std::move(image), kPreviewJobsPerReplica * pool_.size());
}

void ChunkRunner::chunk_done(size_t replica, ChunkAssignment /*assignment*/, ChunkResult result, double seconds) {
  std::string job_id;
  try {
    job_id = settle(replica, std::move(result), seconds);
  } catch (const StoreError& e) {
    // Whatever was not stored is redone: the lease expires and the chunk is claimed again (a retry).
    spdlog::error("replica={} event=chunk_settle_failed error=\"{}\"", lease_name(replica), e.what());
  }
  if (!job_id.empty()) hub_.changed(job_id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++change_count_;
    work_.notify_all();
    changed_.notify_all();
  }
  report_queue();
}

// The chunk's result, its ChunkFinished (and the job's Finished after the last chunk), committed under its lease.
void ChunkRunner::commit_result(const Running& run, ChunkResult& result, double seconds) {
  const std::string& id = run.job.id;
  const int64_t chunk = run.lease.chunk_index;
  const bool last = chunk + 1 == run.lease.chunk_count;
  JobEvent finished_chunk;
  finished_chunk.type = EventType::ChunkFinished;
  finished_chunk.chunk = chunk;
  finished_chunk.chunk_count = run.lease.chunk_count;
  finished_chunk.replica = run.replica;
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
    commit = leases_.commit(run.lease, {chunk, run.replica, run.attempt + 1, std::move(result.bytes)}, events);
  } catch (const StoreError& e) {
    // A shared store that cannot be reached: the lease expires and a replica (maybe this one) runs the chunk again.
    // A store of this server's own (a full disk, an I/O error) will not heal by waiting: the job fails.
    spdlog::error("job={} event=commit_failed chunk={} error=\"{}\"", id, chunk, e.what());
    if (!leases_.shared()) not_stored = e.what();
  }
  if (!not_stored.empty()) {
    finish(id, JobState::Failed, ErrorKind::Internal,
           "chunk " + std::to_string(chunk) + " could not be stored: " + not_stored);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (commit.committed) {
    // Only the payload this chunk ran on holds its result (a submit on this pod may have cached another since).
    auto it = cache_.find(id);
    const bool ran_here = it != cache_.end() && it->second->payload == run.payload;
    if (ran_here && !last) it->second->chunks_held = chunk + 1;
    seconds_per_chunk_ = policy::update_seconds_per_work(seconds_per_chunk_, seconds, 1.0);
    if (last) {
      retire_now_ = true;
      heartbeat_cv_.notify_all();
    }
    if (it != cache_.end() && (last || !ran_here)) cache_.erase(it);
  } else {
    cache_.erase(id);
    spdlog::warn("job={} event=commit_fenced chunk={} replica={} token={}", id, chunk, run.replica,
                 run.lease.token);
  }
  if (commit.committed) {
    spdlog::info("job={} event=chunk_finished chunk={} replica={} seconds={:.3f}", id, chunk, run.replica, seconds);
  }
  if (commit.committed) {
    StoredJob after = run.job;
    after.chunks_done = chunk + 1;
    if (last) after.state = job_state_name(JobState::Succeeded);
    SchedulerEvent finished = SchedulerEvent::about(SchedulerEventKind::ChunkFinished, snapshot_of(after));
    finished.replica = run.replica;
    finished.chunk = chunk;
    finished.seconds = seconds;
    finished.frames = result.frames_generated;
    events_.publish(finished);
    if (last) events_.publish(SchedulerEvent::about(SchedulerEventKind::JobFinished, *finished.job));
  }
}

std::string ChunkRunner::settle(size_t replica, ChunkResult result, double seconds) {
  std::shared_ptr<Running> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    run = running_.at(replica);
    running_.erase(replica);
  }
  const std::string& id = run->job.id;
  const int64_t chunk = run->lease.chunk_index;
  bool stop = stop_requested(*run);
  if (result.outcome == ChunkOutcome::Stopped && !stop) {
    result.outcome = ChunkOutcome::Failed;
    if (result.error.empty()) result.error = "chunk stopped without a request";
  }

  if (result.outcome == ChunkOutcome::Succeeded && !run->lost) {
    commit_result(*run, result, seconds);
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

void ChunkRunner::fail_or_retry(const Running& run, const std::string& error) {
  const bool retry = policy::should_retry(run.failures + 1, options_.scheduling.chunk_retries, pool_.any_healthy());
  spdlog::warn("job={} event=chunk_failed chunk={} replica={} attempt={} retry={} error=\"{}\"", run.job.id,
               run.lease.chunk_index, run.replica, run.attempt, retry, error);
  SchedulerEvent failed = SchedulerEvent::about(SchedulerEventKind::ChunkFailed, snapshot_of(run.job));
  failed.replica = run.replica;
  failed.chunk = run.lease.chunk_index;
  failed.error = error;
  failed.will_retry = retry;
  events_.publish(failed);
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
  hub_.append(run.job.id, event);
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
void ChunkRunner::finish(const std::string& job_id, JobState state, ErrorKind kind, const std::string& error) {
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
    hub_.append(job_id, event);
    hub_.drop_preview(job_id);
    spdlog::log(state == JobState::Succeeded ? spdlog::level::info : spdlog::level::warn,
                "job={} event=finished state={} chunks_done={} error=\"{}\"", job_id, job_state_name(state),
                job->chunks_done, error);
    events_.publish(SchedulerEvent::about(SchedulerEventKind::JobFinished, snapshot_of(*job)));
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
  hub_.changed(job_id);
  report_queue();
}

void ChunkRunner::replicas_changed() {
  std::lock_guard<std::mutex> lock(mu_);
  ++change_count_;
  work_.notify_all();
  changed_.notify_all();
}

void ChunkRunner::interrupt() {
  std::lock_guard<std::mutex> lock(mu_);
  interrupted_ = true;
  hard_stop_ = true;
  work_.notify_all();
}

void ChunkRunner::heartbeat_loop() {
  const auto period = std::max<std::chrono::milliseconds>(options_.lease_ttl / 3, std::chrono::milliseconds(10));
  auto next_housekeeping = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!shared_.stopping) {
    heartbeat_cv_.wait_for(lock, period, [&] { return shared_.stopping || renew_now_ || retire_now_; });
    if (shared_.stopping) break;
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
void ChunkRunner::housekeeping() {
  try {
    for (const std::string& id : leases_.expire_deadlines()) {
      JobEvent event;
      event.type = EventType::Finished;
      event.message = "deadline passed while queued";
      hub_.append(id, event);
      spdlog::warn("job={} event=finished state=DEADLINE_EXCEEDED reason=\"deadline passed while queued\"", id);
      hub_.changed(id);
    }
    retire_finished();
    drop_removed();
    report_queue();
  } catch (const StoreError& e) {
    spdlog::warn("event=housekeeping_failed error=\"{}\"", e.what());
  }
}

void ChunkRunner::retire_finished() {
  const auto& o = options_.scheduling;
  const int64_t before = leases_.now_ms() - std::chrono::duration_cast<std::chrono::milliseconds>(o.retention).count();
  for (const LeaseStore::Retired& job : leases_.finished_to_retire(before, o.max_retained_jobs)) {
    store_.drop_job(job.job_id, job.expired ? "its results were kept --result-ttl-seconds " +
                                                  std::to_string(o.retention.count())
                                            : "more than --max-retained-jobs " + std::to_string(o.max_retained_jobs) +
                                                  " finished jobs");
    hub_.changed(job.job_id);  // watchers find it gone
  }
}

void ChunkRunner::drop_removed() {
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ids.assign(removed_.begin(), removed_.end());
  }
  for (const std::string& id : ids) {
    const std::optional<StoredJob> job = leases_.load_job(id, false);
    if (job && !is_terminal(parse_job_state(job->state))) continue;
    if (job) {
      store_.drop_job(id, "deleted by its client");
      hub_.changed(id);  // watchers and the feed's followers find it gone
    }
    std::lock_guard<std::mutex> lock(mu_);
    removed_.erase(id);
  }
}

}  // namespace skyreels::server
