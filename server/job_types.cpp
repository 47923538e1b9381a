#include "server/job_types.h"

#include <cstdio>
#include <mutex>
#include <random>

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

std::string new_job_id() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "j-%016llx", static_cast<unsigned long long>(rng()));
  return buffer;
}

}  // namespace skyreels::server
