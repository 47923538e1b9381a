// What the HTTP routes share (internal to server/http/): one call into the gRPC service on behalf of an HTTP request,
// the mapping of gRPC statuses to HTTP ones, and OpenAI's error shape.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/http/http_api.h"
#include "skyreels/v1/video_service.grpc.pb.h"

namespace skyreels::server::http {

namespace pb = ::skyreels::v1;

struct ServiceCall {
  pb::VideoService::Stub& stub;
  grpc::GenericStub& raw;  // calls whose messages stay bytes (WatchJob: a preview's image is never copied)
  const HttpApiConfig& config;
  const Request& request;
  // A client context carrying the request's API key and client address, with a deadline `timeout_ms` from now.
  std::unique_ptr<grpc::ClientContext> context(int64_t timeout_ms) const;
  std::unique_ptr<grpc::ClientContext> context() const { return context(config.call_timeout_ms); }
};

Response json_response(int status, const nlohmann::json& body);

// A message in protobuf's JSON mapping as the /skyreels/v1 API writes it (proto field names, every field printed).
std::string to_json(const google::protobuf::Message& message);

// {"error": {"message", "type", "param", "code"}}; `type` from the status unless given.
Response error_response(int status, const std::string& message, const std::string& param = "",
                        const std::string& code = "", const std::string& type = "");

// A failed call's answer: INVALID_ARGUMENT 400 (param = the field the message starts with), UNAUTHENTICATED 401,
// PERMISSION_DENIED 403, NOT_FOUND 404, ALREADY_EXISTS 409 (an idempotency conflict), RESOURCE_EXHAUSTED 429 with
// Retry-After when the service sent a retry hint (413 without: a request over a size limit), FAILED_PRECONDITION
// 400, UNAVAILABLE 503 (+ Retry-After), DEADLINE_EXCEEDED 504, others 500.
Response from_status(const grpc::Status& status, const grpc::ClientContext& context);

// GetJob and CancelJob for the request's caller: the job into *job, or the answer to the failure.
std::optional<Response> get_job(const ServiceCall& call, const std::string& id, pb::Job* job);
std::optional<Response> cancel_job(const ServiceCall& call, const std::string& id, pb::Job* job);

// A job's result (its chunks' blobs in `format`, from chunk `from_chunk` on; one_chunk: that chunk only) sized
// before it is sent: each chunk's bytes and first frame, and the first chunk's part (its layout, the chunk count).
struct ResultSizes {
  std::vector<int64_t> chunk_bytes;
  std::vector<int64_t> chunk_starts;  // pixel_frame_begin
  pb::ResultPart first;
};
std::optional<Response> result_sizes(const ServiceCall& call, const std::string& id, pb::ResultFormat format,
                                     int32_t from_chunk, bool one_chunk, ResultSizes* out);
// The bytes [first, first + bytes) of those chunks joined, as a response body read from the service a part at a time
// as the client reads (the calls carry the request's key and client, like every call).
std::shared_ptr<BodyStream> result_body(const ServiceCall& call, const std::string& id, pb::ResultFormat format,
                                        int32_t from_chunk, const std::vector<int64_t>& chunk_bytes, int64_t first,
                                        int64_t bytes);

// OpenAI's Videos API.
Response create_video(const ServiceCall& call);
Response extend_video(const ServiceCall& call);
Response retrieve_video(const ServiceCall& call, const std::string& id);
Response list_videos(const ServiceCall& call);
Response delete_video(const ServiceCall& call, const std::string& id);
Response video_content(const ServiceCall& call, const std::string& id);

// The service's own API in JSON (/skyreels/v1/...): jobs, their events as Server-Sent Events, results, server info.
Response skyreels_route(const ServiceCall& call, std::string* route);  // *route: the template

}  // namespace skyreels::server::http
