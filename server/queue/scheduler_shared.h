// What the scheduler's three roles (chunk_runner.h, job_event_hub.h, the Scheduler facade) share: one lock over all
// their state, its condition variables, and the pod's lifecycle. One lock, not one per role: several reads join the
// roles' state in one consistent look (a job's snapshot reads the running chunk, its steps and its payload), and
// waits span them (an idle replica waits for a change or for claiming to resume), so every path locks as it did
// before the split.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace skyreels::server {

struct SchedulerShared {
  std::mutex mu;
  std::condition_variable changed;  // any job changed (store notification, local event), running chunk ended
  std::condition_variable work;     // a chunk may have become ready
  std::condition_variable wake;     // the background loops: stopping, a renewal or retention is due
  uint64_t change_count = 0;  // bumped by every change: waiters sleep only when nothing changed since they looked
  bool draining = false;
  bool hard_stop = false;  // abort_all / destructor: running chunks stop now
  bool stopping = false;
  std::optional<std::string> aborted;  // abort_all's reason
};

}  // namespace skyreels::server
