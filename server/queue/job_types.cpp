#include "server/queue/job_types.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "server/job/fingerprint.h"

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

JobState parse_job_state(const std::string& name) {
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

int64_t wall_ms(WallClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}
int64_t wall_ms(const std::optional<WallClock::time_point>& t) { return t ? wall_ms(*t) : 0; }
WallClock::time_point from_wall_ms(int64_t ms) { return WallClock::time_point(std::chrono::milliseconds(ms)); }

// Chunk-level events as the store keeps them; step events in the same form for other pods (LeaseStore::publish_step).
static JobEvent decode_event_json(const StoredEvent& stored);  // throws nlohmann::json::exception

std::string encode_stored_event(const JobEvent& e) {
  nlohmann::json j = {{"type", static_cast<int>(e.type)}, {"time_ms", wall_ms(e.time)}, {"chunk", e.chunk},
                      {"chunk_count", e.chunk_count},     {"replica", e.replica},     {"attempt", e.attempt},
                      {"handoff", e.handoff},             {"seconds", e.seconds},     {"position", e.position},
                      {"eta_seconds", e.eta_seconds},     {"message", e.message}};
  if (e.type == EventType::ChunkFinished) {
    j["work"] = {e.work.full, e.work.computed, e.work.saved_exact, e.work.saved_cache};
  }
  if (e.type == EventType::ChunkRetry && e.takeover) j["takeover"] = true;
  if (e.type == EventType::Webhook) {
    j["target"] = e.target;
    j["status"] = e.status;
  }
  if (e.type == EventType::Step) {  // published to other pods, never stored
    j["step"] = e.step;
    j["steps"] = e.steps;
    j["progress"] = e.progress;
  }
  return j.dump();
}

JobEvent decode_stored_event(const StoredEvent& stored) {
  try {
    return decode_event_json(stored);
  } catch (const nlohmann::json::exception& e) {
    // A damaged row (or one a newer server wrote) is the store's fault: every caller handles StoreError.
    throw StoreError("stored event " + std::to_string(stored.sequence) + " is unreadable: " + e.what());
  }
}

static JobEvent decode_event_json(const StoredEvent& stored) {
  const auto j = nlohmann::json::parse(stored.data);
  JobEvent e;
  e.sequence = stored.sequence;
  e.type = static_cast<EventType>(j.at("type").get<int>());
  e.time = from_wall_ms(j.at("time_ms").get<int64_t>());
  e.chunk = j.at("chunk").get<int64_t>();
  e.chunk_count = j.at("chunk_count").get<int64_t>();
  e.replica = j.at("replica").get<std::string>();
  e.attempt = j.at("attempt").get<int>();
  e.handoff = j.at("handoff").get<bool>();
  e.seconds = j.at("seconds").get<double>();
  e.position = j.at("position").get<int64_t>();
  e.eta_seconds = j.at("eta_seconds").get<double>();
  e.message = j.at("message").get<std::string>();
  e.step = j.value("step", int64_t{0});
  e.steps = j.value("steps", int64_t{0});
  e.progress = j.value("progress", 0.0);
  // Servers before the flag recorded a takeover by this message alone.
  e.takeover = j.value("takeover", e.type == EventType::ChunkRetry &&
                                       e.message == "the lease of the replica running the chunk expired");
  e.target = j.value("target", uint64_t{0});
  e.status = j.value("status", 0);
  if (j.contains("work")) {  // ChunkFinished events stored before it have none
    const auto& w = j.at("work");
    e.work = {w.at(0).get<int64_t>(), w.at(1).get<int64_t>(), w.at(2).get<int64_t>(), w.at(3).get<int64_t>()};
  }
  return e;
}


void random_bytes(void* out, size_t size) {
  auto* p = static_cast<unsigned char*>(out);
  while (size > 0) {
    const ssize_t n = ::getrandom(p, size, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom: ") + std::strerror(errno));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

std::string new_job_id() {
  unsigned char bytes[kJobIdBits / 8];
  random_bytes(bytes, sizeof bytes);
  return "j-" + hex_digits(bytes, sizeof bytes);
}

}  // namespace skyreels::server
