#include "server/queue/event_stream.h"

#include <utility>

namespace skyreels::server {

bool about_every_job(SchedulerEventKind kind) {
  return kind == SchedulerEventKind::ChangesMissed || kind == SchedulerEventKind::LookAgain;
}

SchedulerEvent SchedulerEvent::about(SchedulerEventKind kind, JobSnapshot job) {
  SchedulerEvent event(kind);
  event.job_id = job.id;
  event.job = std::move(job);
  return event;
}

SchedulerEvent SchedulerEvent::about(SchedulerEventKind kind, const std::string& job_id) {
  SchedulerEvent event(kind);
  event.job_id = job_id;
  return event;
}

uint64_t EventStream::subscribe(Consumer consumer, const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t token = next_token_++;
  if (job_id.empty()) {
    all_[token] = std::move(consumer);
  } else {
    by_job_[job_id][token] = std::move(consumer);
    job_of_[token] = job_id;
  }
  return token;
}

void EventStream::unsubscribe(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  all_.erase(token);
  const auto job = job_of_.find(token);
  if (job == job_of_.end()) return;
  auto it = by_job_.find(job->second);
  if (it != by_job_.end()) {
    it->second.erase(token);
    if (it->second.empty()) by_job_.erase(it);
  }
  job_of_.erase(job);
}

void EventStream::publish(const SchedulerEvent& event) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (about_every_job(event.kind)) {
    for (const auto& [job, consumers] : by_job_) {
      for (const auto& [token, consumer] : consumers) consumer(event);
    }
  } else if (!event.job_id.empty()) {
    if (auto it = by_job_.find(event.job_id); it != by_job_.end()) {
      for (const auto& [token, consumer] : it->second) consumer(event);
    }
  }
  for (const auto& [token, consumer] : all_) consumer(event);
}

Subscription& Subscription::operator=(Subscription&& other) noexcept {
  if (this != &other) {
    reset();
    stream_ = other.stream_;
    token_ = other.token_;
    other.stream_ = nullptr;
  }
  return *this;
}

void Subscription::reset() {
  if (stream_ != nullptr) stream_->unsubscribe(token_);
  stream_ = nullptr;
}

}  // namespace skyreels::server
