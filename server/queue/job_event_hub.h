// The job event hub: each job's event log (stored events, and the step progress and previews kept in memory), its
// waiters, and the one stream of scheduler events (event_stream.h) that metrics, webhooks, the MP4 encoder and the
// watchers consume. Changes reach it two ways: from this pod's scheduler as it makes them, and from the store's one
// ChangeListener for those other pods commit (a lost listener is re-made and published as ChangesMissed). It is the
// only loop in the server that follows job changes.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "server/queue/event_stream.h"
#include "server/queue/job_types.h"
#include "server/queue/scheduler_shared.h"
#include "server/store/job_lease.h"

namespace skyreels::server {

class JobEventHub final {
 public:
  // A job another pod changed (it may be a cancel): the runner renews a chunk of it running here at once.
  using ForeignChange = std::function<void(const std::string& job_id)>;
  // `poll`: how often waiters look again without a notification (a lease expiring sends none).
  JobEventHub(SchedulerShared& shared, LeaseStore& leases, JobStore& store, std::chrono::milliseconds poll,
              ForeignChange foreign_change);
  ~JobEventHub();
  void start();
  void join();  // after shared.stopping is set and shared.wake notified

  // The event log. append() stores the event under a fresh sequence number (0 when the store failed) and tells the
  // job's watchers.
  uint64_t append(const std::string& job_id, const JobEvent& event);
  void keep_step_locked(const std::string& job_id, const JobEvent& event);
  const JobEvent* latest_step_locked(const std::string& job_id) const;
  // Keeps the job's latest preview and publishes PreviewMade (made by `replica`).
  void keep_preview(const std::string& job_id, const std::string& replica, ChunkPreviewImage image, size_t max_jobs);
  void drop_preview(const std::string& job_id);
  std::optional<LatestPreview> latest_preview(const std::string& id, uint64_t after_serial) const;

  // Changes: changed() wakes waiters and idle replicas and publishes JobChanged; stepped() (progress) wakes waiters
  // and publishes StepProgress.
  void changed(const std::string& job_id);
  void stepped(const std::string& job_id);
  // The stream every scheduler event is published on (this pod's and, as JobChanged, other pods').
  EventStream& events() { return events_; }

  // Waiters.
  EventBatch wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                         Clock::time_point until) const;
  uint64_t change_count() const;
  // Waits until a change after `seen` (with `seen` empty: only stopping), stopping, `until` or one poll period;
  // false when stopping.
  bool wait_for_change(std::optional<uint64_t> seen, Clock::time_point until) const;

 private:
  void wake_waiters(bool replicas);
  void listen_loop();
  void hear_other_pods(std::unique_ptr<ChangeListener>& listener, Clock::time_point& last_poll);
  void keep_heard_steps(const JobChanges& changes);
  void look_again_everywhere();
  std::optional<StoredJob> find(const std::string& id, const std::string& owner) const;
  void add_events_after(const std::string& id, uint64_t after_sequence, const std::vector<StoredEvent>& stored,
                        EventBatch& batch) const;

  SchedulerShared& shared_;
  LeaseStore& leases_;
  JobStore& store_;
  const std::chrono::milliseconds poll_;
  ForeignChange foreign_change_;
  // Under shared_.mu:
  std::map<std::string, std::deque<JobEvent>> steps_;  // step events of chunks run here or elsewhere (bounded)
  EventStream events_;
  std::thread listener_;
  // Previews have a lock of their own: nothing else is read with them.
  mutable std::mutex previews_mu_;
  std::map<std::string, LatestPreview> previews_;  // the latest preview of jobs running here (bounded)
  uint64_t preview_serial_ = 0;
};

}  // namespace skyreels::server
