// The service's own API as JSON (/skyreels/v1/...) for curl and scripts: the gRPC messages in protobuf's JSON mapping,
// WatchJob as Server-Sent Events (resumable with Last-Event-ID = the event sequence; watch_events.h), results per
// chunk.
#include <google/protobuf/util/json_util.h>

#include "server/http/routes.h"
#include "server/http/watch_events.h"
#include "server/job/limits.h"

namespace skyreels::server::http {

namespace protobuf = google::protobuf;

std::string to_json(const protobuf::Message& message) {
  protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

namespace {

constexpr int64_t kStreamTimeoutMs = int64_t{7} * 24 * 3600 * 1000;  // a watch lives as long as its job, within a week

Response message_response(const protobuf::Message& message) {
  Response r;
  r.body = to_json(message);
  return r;
}

std::optional<Response> from_json(const std::string& body, protobuf::Message* message) {
  if (body.empty()) return error_response(400, "the request has no body: send a JSON " + message->GetTypeName());
  const auto status = protobuf::util::JsonStringToMessage(body, message, protobuf::util::JsonParseOptions());
  if (!status.ok()) {
    return error_response(400, "the body is not a " + message->GetTypeName() + " in JSON: " +
                                   std::string(status.message()));
  }
  return std::nullopt;
}

std::optional<uint64_t> unsigned_value(const std::optional<std::string>& text) {
  if (!text || text->empty() || text->size() > 19 || text->find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return std::stoull(*text);
}

Response submit_job(const ServiceCall& call) {
  pb::SubmitJobRequest request;
  if (auto refused = from_json(call.request.body, &request)) return *refused;
  if (auto key = call.request.header("idempotency-key")) request.set_idempotency_key(*key);
  auto context = call.context();
  pb::SubmitJobResponse response;
  const grpc::Status status = call.stub.SubmitJob(context.get(), request, &response);
  if (!status.ok()) return from_status(status, *context);
  return message_response(response);
}

Response list_jobs(const ServiceCall& call) {
  pb::ListJobsRequest request;
  if (auto size = call.request.query_value("page_size")) {
    const auto n = unsigned_value(size);
    if (!n || *n > kMaxPageSize) {
      return error_response(400, "page_size: an integer in [0, " + std::to_string(kMaxPageSize) + "]", "page_size");
    }
    request.set_page_size(static_cast<int32_t>(*n));
  }
  request.set_page_token(call.request.query_value("page_token").value_or(""));
  auto context = call.context();
  pb::ListJobsResponse response;
  const grpc::Status status = call.stub.ListJobs(context.get(), request, &response);
  if (!status.ok()) return from_status(status, *context);
  return message_response(response);
}

Response job(const ServiceCall& call, const std::string& id) {
  pb::Job job;
  if (auto failed = get_job(call, id, &job)) return *failed;
  return message_response(job);
}

Response cancelled(const ServiceCall& call, const std::string& id) {
  pb::Job job;
  if (auto failed = cancel_job(call, id, &job)) return *failed;
  return message_response(job);
}

Response job_events(const ServiceCall& call, const std::string& id) {
  pb::WatchJobRequest request;
  request.set_job_id(id);
  auto after = call.request.header("last-event-id");
  if (!after) after = call.request.query_value("after_sequence");
  if (after) {
    const auto n = unsigned_value(after);
    if (!n) return error_response(400, "Last-Event-ID: an event sequence number, got '" + *after + "'", "after_sequence");
    request.set_after_sequence(*n);
  }
  request.set_skip_steps(call.request.query_value("skip_steps").value_or("") == "true");
  request.set_skip_previews(call.request.query_value("skip_previews").value_or("") == "true");
  auto context = call.context(kStreamTimeoutMs);
  const grpc::ClientContext* raw = context.get();
  auto stream = std::make_shared<WatchStream>(call.raw, std::move(context), request);
  if (auto failed = stream->wait_started(std::chrono::milliseconds(call.config.call_timeout_ms))) {
    return from_status(*failed, *raw);
  }
  Response r;
  r.content_type = "text/event-stream";
  r.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
  r.stream = std::move(stream);
  return r;
}

// One chunk's result: ?chunk=N (required) &format=latents (safetensors, default) | mp4.
Response job_result(const ServiceCall& call, const std::string& id) {
  const auto chunk = unsigned_value(call.request.query_value("chunk"));
  if (!chunk || *chunk > 100000) return error_response(400, "chunk: the chunk index, an integer", "chunk");
  const std::string format = call.request.query_value("format").value_or("latents");
  if (format != "latents" && format != "mp4") return error_response(400, "format: latents or mp4", "format");
  const pb::ResultFormat wanted = format == "mp4" ? pb::RESULT_FORMAT_MP4 : pb::RESULT_FORMAT_LATENTS;
  ResultSizes sizes;
  if (auto refused = result_sizes(call, id, wanted, static_cast<int32_t>(*chunk), true, &sizes)) return *refused;
  if (sizes.chunk_bytes.empty() || sizes.first.chunk_index() != static_cast<int32_t>(*chunk)) {
    return error_response(409, "chunk " + std::to_string(*chunk) + " of job '" + id + "' is not finished", "chunk",
                          "chunk_not_ready");
  }
  Response r;
  r.headers = {{"X-Skyreels-Chunk-Count", std::to_string(sizes.first.chunk_count())},
               {"X-Skyreels-Latent-Frames", std::to_string(sizes.first.latent_frame_begin()) + "-" +
                                                std::to_string(sizes.first.latent_frame_end())}};
  r.content_type = format == "mp4" ? "video/mp4" : "application/octet-stream";
  if (sizes.chunk_bytes[0] == 0) return r;
  r.stream_bytes = sizes.chunk_bytes[0];
  r.stream = result_body(call, id, wanted, static_cast<int32_t>(*chunk), sizes.chunk_bytes, 0, r.stream_bytes);
  return r;
}

Response server_info(const ServiceCall& call) {
  auto context = call.context();
  pb::ServerInfo info;
  const grpc::Status status = call.stub.GetServerInfo(context.get(), pb::GetServerInfoRequest(), &info);
  if (!status.ok()) return from_status(status, *context);
  return message_response(info);
}

}  // namespace

Response skyreels_route(const ServiceCall& call, std::string* route) {
  const std::string& path = call.request.path;
  const std::string& method = call.request.method;
  const std::string jobs = "/skyreels/v1/jobs";
  if (path == "/skyreels/v1/server-info" && method == "GET") {
    *route = path;
    return server_info(call);
  }
  if (path == jobs) {
    *route = jobs;
    if (method == "POST") return submit_job(call);
    if (method == "GET") return list_jobs(call);
    return error_response(405, "use GET or POST on " + jobs);
  }
  if (path.rfind(jobs + "/", 0) != 0) return error_response(404, "no route " + method + " " + path);
  const std::string rest = path.substr(jobs.size() + 1);
  const size_t slash = rest.find('/');
  const std::string id = rest.substr(0, slash);
  const std::string action = slash == std::string::npos ? "" : rest.substr(slash + 1);
  const bool known = action.empty() || action == "cancel" || action == "events" || action == "result";
  if (known) *route = jobs + "/{id}" + (action.empty() ? "" : "/" + action);
  if (action.empty() && method == "GET") return job(call, id);
  if (action == "cancel" && method == "POST") return cancelled(call, id);
  if (action == "events" && method == "GET") return job_events(call, id);
  if (action == "result" && method == "GET") return job_result(call, id);
  return error_response(known ? 405 : 404, "no route " + method + " " + path);
}

}  // namespace skyreels::server::http
