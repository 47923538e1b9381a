// Results over HTTP a piece at a time: their sizes first (DownloadResult with sizes_only), then the bytes the response
// needs as one DownloadResult stream read a part (kPartBytes at most) at a time as the client reads. A download holds
// one part whatever the video's size; a slow reader holds no more.
#include <stdexcept>

#include "server/http/routes.h"

namespace skyreels::server::http {

namespace {

// A body stream's deadline: it ends with its client (the listener's idle timeout closes a client that stops reading),
// not after a fixed time; a day bounds a client that reads a byte now and then.
constexpr int64_t kBodyDeadlineMs = 24LL * 3600 * 1000;

class ResultBody final : public BodyStream {
 public:
  ResultBody(std::unique_ptr<grpc::ClientContext> context, pb::VideoService::Stub& stub,
             const pb::DownloadResultRequest& request, int64_t bytes)
      : context_(std::move(context)), reader_(stub.DownloadResult(context_.get(), request)), remaining_(bytes) {}
  ~ResultBody() override {
    if (finished_) return;
    context_->TryCancel();  // a range ends before the result does, or the client went away
    reader_->Finish();
  }
  std::optional<std::string> next() override {
    while (remaining_ > 0) {
      pb::ResultPart part;
      if (!reader_->Read(&part)) {
        const grpc::Status status = reader_->Finish();
        finished_ = true;
        throw std::runtime_error("the result stream ended " + std::to_string(remaining_) +
                                 " bytes early: " + status.error_message());
      }
      std::string data = std::move(*part.mutable_data());
      if (static_cast<int64_t>(data.size()) > remaining_) data.resize(static_cast<size_t>(remaining_));
      remaining_ -= static_cast<int64_t>(data.size());
      if (!data.empty()) return data;
    }
    return std::nullopt;
  }

 private:
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReader<pb::ResultPart>> reader_;
  int64_t remaining_;
  bool finished_ = false;
};

}  // namespace

std::optional<Response> result_sizes(const ServiceCall& call, const std::string& id, pb::ResultFormat format,
                                     int32_t from_chunk, bool one_chunk, ResultSizes* out) {
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(format);
  request.set_from_chunk(from_chunk);
  request.set_no_wait(true);
  request.set_sizes_only(true);
  auto context = call.context(call.config.download_timeout_ms);  // an MP4's segments may be made now
  auto reader = call.stub.DownloadResult(context.get(), request);
  pb::ResultPart part;
  while (reader->Read(&part)) {
    if (out->chunk_bytes.empty()) {
      out->first = part;
    }
    out->chunk_bytes.push_back(static_cast<int64_t>(part.chunk_bytes()));
    out->chunk_starts.push_back(part.pixel_frame_begin());
    if (one_chunk) break;
  }
  if (one_chunk && !out->chunk_bytes.empty()) context->TryCancel();  // the later chunks are not wanted
  const grpc::Status status = reader->Finish();
  if (!status.ok() && !(one_chunk && !out->chunk_bytes.empty())) return from_status(status, *context);
  return std::nullopt;
}

std::shared_ptr<BodyStream> result_body(const ServiceCall& call, const std::string& id, pb::ResultFormat format,
                                        int32_t from_chunk, const std::vector<int64_t>& chunk_bytes, int64_t first,
                                        int64_t bytes) {
  // The chunk that holds byte `first` (counted from from_chunk's start), and where in it.
  int32_t chunk = from_chunk;
  int64_t offset = first;
  for (size_t i = 0; i < chunk_bytes.size() && offset >= chunk_bytes[i] && i + 1 < chunk_bytes.size(); ++i) {
    offset -= chunk_bytes[i];
    ++chunk;
  }
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(format);
  request.set_from_chunk(chunk);
  request.set_from_offset(static_cast<uint64_t>(offset));
  request.set_no_wait(true);
  return std::make_shared<ResultBody>(call.context(kBodyDeadlineMs), call.stub, request, bytes);
}

}  // namespace skyreels::server::http
