#include "server/api/video_service.h"

namespace skyreels::server::api {

grpc::ServerWriteReactor<pb::JobEvent>* VideoServiceImpl::WatchJob(grpc::CallbackServerContext* ctx,
                                                 const pb::WatchJobRequest* request) {
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
  if (Status s = check_job_id(request->job_id()); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
  std::unique_ptr<StreamLimiter::Slot> slot;
  if (Status s = open_stream(caller, &slot); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
  const Status found = store_guard(request->job_id(), [&] {
    return scheduler_.get(request->job_id(), caller.owner) ? Status::OK
                                                           : job_not_found(request->job_id(), caller.owner);
  });
  if (!found.ok()) return new FinishedWriter<pb::JobEvent>(found);
  return WatchReactor::start(*this, *request, caller.owner, std::move(slot));
}

struct WatchReactor::Core : std::enable_shared_from_this<WatchReactor::Core> {
  VideoServiceImpl& service;
  WatchReactor* reactor = nullptr;  // valid until `finished`
  std::string id, owner;
  bool skip_steps = false;
  std::unique_ptr<StreamLimiter::Slot> slot;
  uint64_t token = 0;
  std::atomic<bool> queued{false};  // a pump task is pending: notifications in between need no other

  std::mutex mu;  // guards what follows
  uint64_t after = 0;
  std::deque<pb::JobEvent> pending;
  pb::JobEvent writing;  // the message of the write in flight
  bool in_flight = false, cancelled = false, job_done = false, finished = false;

  Core(VideoServiceImpl& s, const pb::WatchJobRequest& request, std::string job_owner)
      : service(s),
        id(request.job_id()),
        owner(std::move(job_owner)),
        skip_steps(request.skip_steps()),
        after(request.after_sequence()) {}

  // From the scheduler, its lock held: only schedules a pump.
  void notify() {
    if (queued.exchange(true)) return;
    service.pump_.post([self = shared_from_this()] {
      self->queued = false;
      self->pump();
    });
  }

  // Reads new events when nothing is queued, then starts the next write or the finish. Never holds `mu` while
  // calling into gRPC (a reaction may run inline).
  void pump() {
    std::optional<Status> finish;
    bool write = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished || in_flight) return;
      if (cancelled) {
        finish = Status(StatusCode::CANCELLED, "client cancelled the watch");
      } else {
        if (pending.empty() && !job_done) read_events_locked(&finish);
        if (!finish && !pending.empty()) {
          writing = std::move(pending.front());
          pending.pop_front();
          in_flight = write = true;
        } else if (!finish && job_done) {
          finish = Status::OK;
        }
      }
      if (finish) finished = true;
    }
    if (write) reactor->StartWrite(&writing);
    if (finish) reactor->Finish(*finish);
  }

  void read_events_locked(std::optional<Status>* finish) {
    const EventBatch batch = service.scheduler_.wait_events(id, owner, after, Clock::now());
    if (!batch.found) {
      *finish = service.job_not_found(id, owner);
      return;
    }
    for (const auto& event : batch.events) {
      after = event.sequence;
      if (skip_steps && event.type == EventType::Step) continue;
      pending.emplace_back();
      service.event_to_proto(id, owner, event, &pending.back());
    }
    job_done = batch.finished;
  }
};

WatchReactor* WatchReactor::start(VideoServiceImpl& service, const pb::WatchJobRequest& request,
                                  const std::string& owner, std::unique_ptr<StreamLimiter::Slot> slot) {
  auto core = std::make_shared<Core>(service, request, owner);
  core->slot = std::move(slot);
  auto* reactor = new WatchReactor(core);
  core->reactor = reactor;
  core->token = service.scheduler_.subscribe(core->id, owner, [weak = std::weak_ptr<Core>(core)] {
    if (auto c = weak.lock()) c->notify();
  });
  core->pump();  // the replay (or NOT_FOUND when the job went away meanwhile)
  return reactor;
}

void WatchReactor::OnWriteDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->in_flight = false;
    if (!ok) core_->cancelled = true;  // the client went away
  }
  core_->pump();
}

void WatchReactor::OnCancel() {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->cancelled = true;
  }
  core_->pump();
}

void WatchReactor::OnDone() {
  core_->service.scheduler_.unsubscribe(core_->id, core_->token);
  core_->slot.reset();  // the stream's place is free again
  delete this;
}

}  // namespace skyreels::server::api
