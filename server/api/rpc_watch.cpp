#include <algorithm>

#include "server/api/video_service.h"

namespace skyreels::server::api {

// Runs on one of gRPC's callback threads, which also answer the health checks: nothing here may wait for the
// scheduler or the store (a frozen store would take the probes down with it). The job is looked up by the pump.
grpc::ServerWriteReactor<grpc::ByteBuffer>* VideoServiceImpl::WatchJob(grpc::CallbackServerContext* ctx,
                                                                     const grpc::ByteBuffer* raw) {
  using Refused = FinishedWriter<grpc::ByteBuffer>;
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return new Refused(s);
  pb::WatchJobRequest request;
  grpc::ByteBuffer bytes(*raw);  // Deserialize consumes its buffer: a copy of the references
  if (!grpc::SerializationTraits<pb::WatchJobRequest>::Deserialize(&bytes, &request).ok()) {
    return new Refused(Status(StatusCode::INVALID_ARGUMENT, "the request is not a WatchJobRequest"));
  }
  if (Status s = check_job_id(request.job_id()); !s.ok()) return new Refused(s);
  std::unique_ptr<StreamLimiter::Slot> slot;
  if (Status s = open_stream(caller, &slot); !s.ok()) return new Refused(s);
  return WatchReactor::start(*this, request, caller.owner, std::move(slot));
}

// Reactions (gRPC's threads) only set flags and finish; whatever reads the scheduler or the store runs in pump(), on
// the service's pump thread, one pump at a time.
struct WatchReactor::Core : std::enable_shared_from_this<WatchReactor::Core> {
  VideoServiceImpl& service;
  WatchReactor* reactor = nullptr;  // valid until `finished`
  std::string id, owner;
  bool skip_steps = false;
  bool skip_previews = false;
  std::unique_ptr<StreamLimiter::Slot> slot;
  uint64_t token = 0;
  std::atomic<bool> queued{false};  // a pump task is pending: notifications in between need no other

  // The pump thread's own: where the log was read up to, and whether the job was looked up.
  uint64_t after = 0;
  bool looked_up = false;
  // Previews are not in the log: the latest one's serial written, and the job's preview count then.
  uint64_t preview_after = 0, previews_counted = 0;
  int64_t finished_through = -1;  // the last chunk whose ChunkFinished was read: its previews are stale

  std::mutex mu;  // guards what follows; never held while calling the scheduler or gRPC (a reaction may run inline)
  std::deque<pb::JobEvent> pending;
  grpc::ByteBuffer writing;  // the message of the write in flight (empty between writes: no image outlives its write)
  bool in_flight = false, cancelled = false, job_done = false, finished = false;

  Core(VideoServiceImpl& s, const pb::WatchJobRequest& request, std::string job_owner)
      : service(s),
        id(request.job_id()),
        owner(std::move(job_owner)),
        skip_steps(request.skip_steps()),
        skip_previews(request.skip_previews()),
        after(request.after_sequence()) {}

  // From the scheduler (its lock held) and from reactions: only schedules a pump.
  void notify() {
    if (queued.exchange(true)) return;
    service.pump_.post([self = shared_from_this()] {
      self->queued = false;
      self->pump();
    });
  }

  // On the pump thread: reads new events when nothing is queued, then starts the next write or the finish.
  void pump() {
    bool read_more = false;  // nothing queued, the job's end not read, the client still there
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished || in_flight) return;
      read_more = !cancelled && pending.empty() && !job_done;
    }
    std::optional<Status> finish;
    std::deque<pb::JobEvent> read;
    bool done = false;
    if (read_more) read_events(&read, &done, &finish);
    // Events first; a preview only when none is waiting (a slow watcher skips to the latest preview).
    std::optional<LatestPreview> preview;
    if (read_more && read.empty() && !done && !finish && looked_up && !skip_previews) {
      preview = service.reads_.latest_preview(id, preview_after);
      if (preview && preview->image->chunk <= finished_through) {  // its frames are out: never sent after them
        preview_after = preview->serial;
        preview.reset();
      }
    }
    bool write = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished) return;  // a reaction finished the stream meanwhile
      for (auto& e : read) pending.push_back(std::move(e));
      job_done = job_done || done;
      if (cancelled) {
        finish = Status(StatusCode::CANCELLED, "client cancelled the watch");
      } else if (!finish && !pending.empty()) {
        writing = event_message(pending.front());
        pending.pop_front();
        in_flight = write = true;
      } else if (!finish && job_done) {
        finish = Status::OK;
      } else if (!finish && preview) {
        write_preview(*preview);
        in_flight = write = true;
      }
      if (finish) finished = true;
    }
    if (write) reactor->StartWrite(&writing);
    if (finish) reactor->Finish(*finish);
  }

  // Into `writing` (mu held): the preview as a sequence-0 event referring to the hub's image; the ones skipped since
  // the last are counted.
  void write_preview(const LatestPreview& preview) {
    if (previews_counted > 0 && preview.count > previews_counted + 1 && service.config_.metrics) {
      service.config_.metrics->previews_dropped(static_cast<int64_t>(preview.count - previews_counted - 1));
    }
    preview_after = preview.serial;
    previews_counted = preview.count;
    const ChunkPreviewImage& image = *preview.image;
    pb::JobEvent event;
    event.set_job_id(id);
    auto* p = event.mutable_preview();
    p->set_chunk_index(static_cast<int32_t>(image.chunk));
    p->set_step(static_cast<int32_t>(image.step));
    p->set_steps(static_cast<int32_t>(image.steps));
    p->set_latent_frame_begin(static_cast<int32_t>(image.frame_begin));
    p->set_latent_frame_end(static_cast<int32_t>(image.frame_end));
    p->set_frame_width(static_cast<int32_t>(image.frame_width));
    p->set_frame_height(static_cast<int32_t>(image.frame_height));
    p->set_mime_type("image/png");
    writing = preview_message(event, preview.image);
  }

  void read_events(std::deque<pb::JobEvent>* out, bool* done, std::optional<Status>* finish) {
    if (!looked_up) {
      // The replay starts with the job's lookup: NOT_FOUND, or UNAVAILABLE while the store cannot say.
      const Status found = service.store_guard(id, [&] {
        return service.reads_.get(id, owner) ? Status::OK : service.job_not_found(id, owner);
      });
      if (!found.ok()) {
        *finish = found;
        return;
      }
      looked_up = true;
    }
    const EventBatch batch = service.reads_.wait_events(id, owner, after, Clock::now());
    if (!batch.found) {
      *finish = service.job_not_found(id, owner);
      return;
    }
    for (const auto& event : batch.events) {
      after = event.sequence;
      if (event.type == EventType::ChunkFinished) finished_through = std::max(finished_through, event.chunk);
      if (skip_steps && event.type == EventType::Step) continue;
      out->emplace_back();
      service.event_to_proto(id, owner, event, &out->back());
    }
    *done = batch.finished;
  }

  // From a reaction: the client is gone. Finishes at once unless a write is in flight (its OnWriteDone finishes);
  // `write_done` says this reaction is that OnWriteDone.
  void cancel(bool write_done) {
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      cancelled = true;
      if (write_done) {
        in_flight = false;
        writing.Clear();
      }
      if (!finished && !in_flight) finished = finish = true;
    }
    if (finish) reactor->Finish(Status(StatusCode::CANCELLED, "client cancelled the watch"));
  }
};

WatchReactor* WatchReactor::start(VideoServiceImpl& service, const pb::WatchJobRequest& request,
                                  const std::string& owner, std::unique_ptr<StreamLimiter::Slot> slot) {
  auto core = std::make_shared<Core>(service, request, owner);
  core->slot = std::move(slot);
  auto* reactor = new WatchReactor(core);
  core->reactor = reactor;
  core->token = service.reads_.subscribe(core->id, [weak = std::weak_ptr<Core>(core)] {
    if (auto c = weak.lock()) c->notify();
  });
  core->notify();  // the lookup and the replay
  return reactor;
}

void WatchReactor::OnWriteDone(bool ok) {
  if (!ok) return core_->cancel(true);  // the client went away
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->in_flight = false;
    core_->writing.Clear();  // its image's reference goes with it
  }
  core_->notify();
}

void WatchReactor::OnCancel() { core_->cancel(false); }

void WatchReactor::OnDone() {
  core_->service.reads_.unsubscribe(core_->id, core_->token);
  core_->slot.reset();  // the stream's place is free again
  delete this;
}

}  // namespace skyreels::server::api
