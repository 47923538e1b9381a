// WatchJob as Server-Sent Events (GET /skyreels/v1/jobs/{id}/events), pulled: the next event is read from the service
// only when the listener wants bytes for its client, and a preview's image goes out base64-encoded a piece at a time
// from the bytes the service sent, which are the hub's own PNG (issue 46). A watcher whose client reads slowly holds
// a reference to one image and a piece of text, never a copy of an image nor its base64 text. Internal to http/.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/http/http_server.h"
#include "skyreels/v1/video_service.pb.h"

namespace skyreels::server::http {

// An event as WatchJob's bytes carried it: a preview's image stays those bytes (references to the message's slices).
struct WatchedEvent {
  v1::JobEvent event;              // a preview's image is empty here
  std::vector<grpc::Slice> image;  // the preview's image
};

// A JobEvent's bytes read without copying its preview's image; nullopt when they are not a JobEvent.
std::optional<WatchedEvent> read_event(const grpc::ByteBuffer& message);

// One event's Server-Sent Events text, a piece of at most 16 KiB at a time. A preview is not in the job's log: no
// `id:` (a reconnect's Last-Event-ID stays the last event's), and its image goes as a data: URL
// (`preview.image_url`) that a page can show as it is, encoded as it is sent.
class SseText {
 public:
  explicit SseText(WatchedEvent event);
  std::optional<std::string> next_piece();  // nullopt once all of it was given

 private:
  std::string base64_piece();
  std::string head_;
  std::vector<grpc::Slice> image_;  // base64 after head_ (previews)
  size_t slice_ = 0, offset_ = 0;   // how far into image_
  std::string tail_;
  enum class Part { Head, Image, Tail, Done } part_ = Part::Head;
};

// The stream of one watch: a WatchJob call over the in-process channel whose next message is asked for when the
// listener has sent what came before (one read at a time). Keep-alive comments fill quiet spells.
class WatchStream final : public BodyStream, public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  WatchStream(grpc::GenericStub& stub, std::unique_ptr<grpc::ClientContext> context,
              const v1::WatchJobRequest& request);
  ~WatchStream() override;  // cancels the call and waits for its end

  // Waits for the stream's first event, or its end: the status when it ended without one (then no SSE is sent).
  std::optional<grpc::Status> wait_started(std::chrono::milliseconds timeout);
  std::optional<std::string> next() override;

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  std::optional<std::string> next_event(std::unique_lock<std::mutex>& lock);
  void release_hold_if_over(std::unique_lock<std::mutex>& lock);

  std::unique_ptr<grpc::ClientContext> context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer incoming_;    // the read's message, gRPC's until OnReadDone
  std::optional<SseText> text_;  // the event being sent; the listener's thread's own
  std::mutex mu_;
  std::condition_variable cv_;
  bool reading_ = false;        // a read is outstanding
  bool arrived_ = false;        // incoming_ holds a message not yet taken
  bool ended_ = false;          // a read found no more messages
  bool closing_ = false;        // the destructor runs
  bool hold_released_ = false;  // OnDone may come (after the last read, or when closing)
  bool done_ = false;           // OnDone came: status_ is the call's
  bool error_sent_ = false;
  grpc::Status status_;
};

}  // namespace skyreels::server::http
