#include "server/http/watch_events.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "server/http/routes.h"
#include "server/job/base64.h"
#include "server/job/proto_wire.h"

namespace skyreels::server::http {

namespace {

// An SSE comment this often keeps proxies from closing idle streams.
constexpr auto kKeepAlive = std::chrono::seconds(15);
constexpr size_t kImagePiece = 12 << 10;  // image bytes per piece: a multiple of 3, so the pieces' base64 joins up
const std::string kWatchJob = std::string("/") + pb::VideoService::service_full_name() + "/WatchJob";

// A message's bytes across its slices, read in order; what is asked for by reference comes as sub-slices.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) { skip_empty(); }
  bool done() const { return slice_ == slices_.size(); }
  size_t position() const { return position_; }

  bool varint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64 && !done(); shift += 7) {
      const uint8_t byte = slices_[slice_].begin()[offset_];
      advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  bool copy(uint64_t bytes, std::string* out) {
    return take(bytes, [&](const grpc::Slice& s, size_t at, size_t n) {
      out->append(reinterpret_cast<const char*>(s.begin()) + at, n);
    });
  }

  bool refer(uint64_t bytes, std::vector<grpc::Slice>* out) {
    return take(bytes, [&](const grpc::Slice& s, size_t at, size_t n) { out->push_back(s.sub(at, at + n)); });
  }

 private:
  template <typename Use>
  bool take(uint64_t bytes, const Use& use) {
    while (bytes > 0) {
      if (done()) return false;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, slices_[slice_].size() - offset_));
      use(slices_[slice_], offset_, n);
      advance(n);
      bytes -= n;
    }
    return true;
  }
  void advance(size_t n) {
    offset_ += n;
    position_ += n;
    skip_empty();
  }
  void skip_empty() {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0, offset_ = 0, position_ = 0;
};

// One field (its key already read) copied as it is to *out.
bool copy_field(SliceReader& in, uint64_t key, std::string* out) {
  wire::append_varint(key, out);
  uint64_t value = 0;
  switch (key & 7) {
    case wire::kVarint:
      if (!in.varint(&value)) return false;
      wire::append_varint(value, out);
      return true;
    case wire::kFixed64:
      return in.copy(8, out);
    case wire::kLengthDelimited:
      if (!in.varint(&value)) return false;
      wire::append_varint(value, out);
      return in.copy(value, out);
    case wire::kFixed32:
      return in.copy(4, out);
    default:  // groups: JobEvent has none
      return false;
  }
}

// The fields of a ChunkPreview (`length` bytes) but its image into *fields; the image's bytes by reference.
bool split_preview(SliceReader& in, uint64_t length, std::string* fields, std::vector<grpc::Slice>* image) {
  const uint64_t end = in.position() + length;
  const uint64_t image_key = wire::field_key(pb::ChunkPreview::kImageFieldNumber, wire::kLengthDelimited);
  while (in.position() < end) {
    uint64_t key = 0, size = 0;
    if (!in.varint(&key)) return false;
    if (key != image_key) {
      if (!copy_field(in, key, fields)) return false;
      continue;
    }
    image->clear();  // a repeated scalar field: the last one counts
    if (!in.varint(&size) || !in.refer(size, image)) return false;
  }
  return in.position() == end;
}

std::string event_type(const pb::JobEvent& event) {
  const auto* field = event.GetDescriptor()->FindFieldByNumber(static_cast<int>(event.event_case()));
  return field ? field->name() : "event";
}

}  // namespace

std::optional<WatchedEvent> read_event(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return std::nullopt;
  SliceReader in(std::move(slices));
  const uint64_t preview_key = wire::field_key(pb::JobEvent::kPreviewFieldNumber, wire::kLengthDelimited);
  std::string fields, preview_fields;
  bool preview = false;
  WatchedEvent out;
  while (!in.done()) {
    uint64_t key = 0, length = 0;
    if (!in.varint(&key)) return std::nullopt;
    if (key != preview_key) {
      if (!copy_field(in, key, &fields)) return std::nullopt;
      continue;
    }
    preview = true;  // a message field seen twice is merged: its fields are gathered
    if (!in.varint(&length) || !split_preview(in, length, &preview_fields, &out.image)) return std::nullopt;
  }
  if (!out.event.ParseFromString(fields)) return std::nullopt;
  if (preview && !out.event.mutable_preview()->ParseFromString(preview_fields)) return std::nullopt;
  return out;
}

// ---- the text ---------------------------------------------------------------------------------------------------

SseText::SseText(WatchedEvent watched) {
  const pb::JobEvent& event = watched.event;
  if (!event.has_preview()) {
    head_ = "id: " + std::to_string(event.sequence()) + "\nevent: " + event_type(event) + "\ndata: " +
            to_json(event) + "\n\n";
    return;
  }
  const std::string data = to_json(event);  // its image is empty: "image":"" stands where the data: URL goes
  const std::string empty_image = "\"image\":\"\"";
  const size_t at = data.find(empty_image);
  if (at == std::string::npos) {
    head_ = "event: preview\ndata: " + data + "\n\n";
    return;
  }
  head_ = "event: preview\ndata: " + data.substr(0, at) + "\"image_url\":\"data:" + event.preview().mime_type() +
          ";base64,";
  image_ = std::move(watched.image);
  tail_ = "\"" + data.substr(at + empty_image.size()) + "\n\n";
}

std::optional<std::string> SseText::next_piece() {
  switch (part_) {
    case Part::Head:
      part_ = Part::Image;
      return std::move(head_);
    case Part::Image:
      if (slice_ < image_.size()) return base64_piece();
      image_.clear();  // the image's reference goes as soon as it is sent
      part_ = Part::Tail;
      [[fallthrough]];
    case Part::Tail:
      part_ = Part::Done;
      if (!tail_.empty()) return std::move(tail_);
      [[fallthrough]];
    case Part::Done:
      return std::nullopt;
  }
  return std::nullopt;
}

// The next kImagePiece bytes of the image (fewer at its end) in base64.
std::string SseText::base64_piece() {
  std::string bytes;
  bytes.reserve(kImagePiece);
  while (bytes.size() < kImagePiece && slice_ < image_.size()) {
    const grpc::Slice& s = image_[slice_];
    const size_t n = std::min(kImagePiece - bytes.size(), s.size() - offset_);
    bytes.append(reinterpret_cast<const char*>(s.begin()) + offset_, n);
    offset_ += n;
    if (offset_ == s.size()) {
      ++slice_;
      offset_ = 0;
    }
  }
  return base64_encode(bytes);
}

// ---- the stream -------------------------------------------------------------------------------------------------

// The call's end is held back (AddHold) until a read finds no more messages or the stream closes, so that no read is
// started after OnDone.
WatchStream::WatchStream(grpc::GenericStub& stub, std::unique_ptr<grpc::ClientContext> context,
                         const pb::WatchJobRequest& request)
    : context_(std::move(context)) {
  bool own = false;
  (void)grpc::SerializationTraits<pb::WatchJobRequest>::Serialize(request, &request_, &own);
  stub.PrepareBidiStreamingCall(context_.get(), kWatchJob, grpc::StubOptions(), this);
  AddHold();
  StartWriteLast(&request_, grpc::WriteOptions());
  reading_ = true;  // the first event, which wait_started waits for
  StartRead(&incoming_);
  StartCall();
}

WatchStream::~WatchStream() {
  context_->TryCancel();  // outside mu_: it may complete the outstanding read on this thread
  std::unique_lock<std::mutex> lock(mu_);
  closing_ = true;
  release_hold_if_over(lock);
  lock.lock();
  cv_.wait(lock, [&] { return done_; });
}

// The hold goes once no read is outstanding and none will be started (mu_ held on entry, released on return).
void WatchStream::release_hold_if_over(std::unique_lock<std::mutex>& lock) {
  const bool release = (ended_ || closing_) && !reading_ && !hold_released_;
  if (release) hold_released_ = true;
  lock.unlock();
  if (release) RemoveHold();
}

void WatchStream::OnReadDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  reading_ = false;
  (ok ? arrived_ : ended_) = true;
  cv_.notify_all();
  release_hold_if_over(lock);
}

void WatchStream::OnDone(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = status;
  done_ = true;
  cv_.notify_all();  // with mu_ held: the destructor may run as soon as it is released
}

std::optional<grpc::Status> WatchStream::wait_started(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return arrived_ || ended_; });
  if (arrived_ || !ended_) return std::nullopt;
  cv_.wait(lock, [&] { return done_; });
  if (!status_.ok()) return status_;
  return std::nullopt;
}

std::optional<std::string> WatchStream::next() {
  if (text_) {
    if (auto piece = text_->next_piece()) return piece;
    text_.reset();
  }
  std::unique_lock<std::mutex> lock(mu_);
  return next_event(lock);
}

// Reads the next message (unless one is in already) and starts its text; a keep-alive when none comes in time.
std::optional<std::string> WatchStream::next_event(std::unique_lock<std::mutex>& lock) {
  if (!arrived_ && !reading_ && !ended_) {
    reading_ = true;
    lock.unlock();
    StartRead(&incoming_);
    lock.lock();
  }
  if (!cv_.wait_for(lock, kKeepAlive, [&] { return arrived_ || ended_; })) return std::string(": keep-alive\n\n");
  if (arrived_) {
    arrived_ = false;
    grpc::ByteBuffer message;
    message.Swap(&incoming_);
    lock.unlock();
    std::optional<WatchedEvent> event = read_event(message);
    if (!event) throw std::runtime_error("WatchJob sent a message that is not a JobEvent");
    text_.emplace(std::move(*event));
    return text_->next_piece();
  }
  cv_.wait(lock, [&] { return done_; });
  if (status_.ok() || error_sent_) return std::nullopt;
  error_sent_ = true;
  return "event: error\ndata: " + from_status(status_, *context_).body + "\n\n";
}

}  // namespace skyreels::server::http
