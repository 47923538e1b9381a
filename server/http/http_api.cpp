#include "server/http/http_api.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "server/job/forwarded_peer.h"
#include "server/http/page.h"
#include "server/http/routes.h"

namespace skyreels::server::http {

namespace {

const char* error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 409:
      return "conflict_error";
    case 413:
    case 429:
      return "rate_limit_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

// The field an INVALID_ARGUMENT message starts with ("num_frames: must be 4k+1"), as OpenAI's `param`.
std::string param_of(const std::string& message) {
  const size_t colon = message.find(':');
  if (colon == std::string::npos || colon == 0 || colon > 40) return "";
  const std::string field = message.substr(0, colon);
  const bool name = std::all_of(field.begin(), field.end(), [](unsigned char c) { return std::islower(c) || c == '_' || c == '.' || std::isdigit(c); });
  return name ? field : "";
}

std::string status_code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "invalid_argument";
    case grpc::StatusCode::NOT_FOUND:
      return "not_found";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "idempotency_conflict";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "resource_exhausted";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "failed_precondition";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "invalid_api_key";
    case grpc::StatusCode::UNAVAILABLE:
      return "unavailable";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "deadline_exceeded";
    default:
      return "internal_error";
  }
}

Response probe(bool up, const char* what) {
  Response r;
  r.status = up ? 200 : 503;
  r.content_type = "text/plain; charset=utf-8";
  r.body = std::string(what) + (up ? " ok\n" : " not ok\n");
  return r;
}

}  // namespace

std::unique_ptr<grpc::ClientContext> ServiceCall::context(int64_t timeout_ms) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  if (auto authorization = request.header("authorization")) context->AddMetadata("authorization", *authorization);
  if (auto key = request.header("x-api-key")) context->AddMetadata("x-api-key", *key);
  context->AddMetadata(kForwardedPeerMetadata, forwarded_peer(request.peer));
  return context;
}

Response json_response(int status, const nlohmann::json& body) {
  Response r;
  r.status = status;
  r.body = body.dump();
  return r;
}

Response error_response(int status, const std::string& message, const std::string& param, const std::string& code,
                        const std::string& type) {
  nlohmann::json error = {{"message", message},
                          {"type", type.empty() ? error_type(status) : type},
                          {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                          {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  return json_response(status, {{"error", error}});
}

Response from_status(const grpc::Status& status, const grpc::ClientContext& context) {
  const std::string& message = status.error_message();
  std::string retry_after;
  const auto& trailers = context.GetServerTrailingMetadata();
  if (auto it = trailers.find("retry-after-ms"); it != trailers.end()) {
    const double ms = std::atof(std::string(it->second.data(), it->second.size()).c_str());
    retry_after = std::to_string(std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ms / 1000.0))));
  }
  int http = 500;
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      http = 400;
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      http = 401;
      break;
    case grpc::StatusCode::PERMISSION_DENIED:
      http = 403;
      break;
    case grpc::StatusCode::NOT_FOUND:
      http = 404;
      break;
    case grpc::StatusCode::ALREADY_EXISTS:
      http = 409;
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      http = retry_after.empty() ? 413 : 429;
      break;
    case grpc::StatusCode::UNAVAILABLE:
      http = 503;
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      http = 504;
      break;
    default:
      http = 500;
  }
  Response r = error_response(http, message, http == 400 ? param_of(message) : "", status_code_name(status.error_code()));
  if (!retry_after.empty()) r.headers.emplace_back("Retry-After", retry_after);
  return r;
}

std::optional<Response> get_job(const ServiceCall& call, const std::string& id, pb::Job* job) {
  pb::GetJobRequest request;
  request.set_job_id(id);
  auto context = call.context();
  const grpc::Status status = call.stub.GetJob(context.get(), request, job);
  if (!status.ok()) return from_status(status, *context);
  return std::nullopt;
}

std::optional<Response> cancel_job(const ServiceCall& call, const std::string& id, pb::Job* job) {
  pb::CancelJobRequest request;
  request.set_job_id(id);
  auto context = call.context();
  const grpc::Status status = call.stub.CancelJob(context.get(), request, job);
  if (!status.ok()) return from_status(status, *context);
  return std::nullopt;
}

struct HttpApi::Impl {
  std::unique_ptr<pb::VideoService::Stub> stub;
  std::unique_ptr<grpc::GenericStub> raw;
  HttpApiConfig config;
};

HttpApi::HttpApi(std::shared_ptr<grpc::Channel> channel, HttpApiConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->stub = pb::VideoService::NewStub(channel);
  impl_->raw = std::make_unique<grpc::GenericStub>(std::move(channel));
  impl_->config = std::move(config);
}

HttpApi::~HttpApi() = default;

Response HttpApi::refuse(int status, const std::string& message) { return error_response(status, message); }

Response HttpApi::handle(const Request& request) const {
  const auto t0 = std::chrono::steady_clock::now();
  std::string template_of = "other";
  Response r = route(request, &template_of);
  if (impl_->config.observe) {
    impl_->config.observe(template_of, r.status,
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return r;
}

// The answer, and the route's template into *route (bounded label values for the metrics).
Response HttpApi::route(const Request& request, std::string* route) const {
  const std::string& path = request.path;
  const std::string& method = request.method;
  const HttpApiConfig& config = impl_->config;
  if (path == "/" && method == "GET") {
    *route = "/";
    Response r;
    r.content_type = "text/html; charset=utf-8";
    r.body = kPageHtml;
    r.headers = {{"Cache-Control", "no-cache"}, {"X-Content-Type-Options", "nosniff"}};
    return r;
  }
  if (path == "/healthz" || path == "/livez" || path == "/readyz" || path == "/metrics") *route = path;
  if (path == "/healthz" || path == "/livez") return probe(config.live(), "live");
  if (path == "/readyz") return probe(config.ready(), "ready");
  if (path == "/metrics") {
    Response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = config.metrics();
    return r;
  }
  const ServiceCall call{*impl_->stub, *impl_->raw, config, request};
  if (path.rfind("/skyreels/v1/", 0) == 0) return skyreels_route(call, route);
  const std::string videos = "/v1/videos";
  if (path == videos || path == videos + "/") {
    *route = videos;
    if (method == "POST") return create_video(call);
    if (method == "GET") return list_videos(call);
    return error_response(405, "use GET or POST on " + videos);
  }
  if (path.rfind(videos + "/", 0) == 0) {
    std::string rest = path.substr(videos.size() + 1);
    const std::string content = "/content";
    if (rest == "extensions") {
      *route = videos + "/extensions";
      if (method == "POST") return extend_video(call);
      return error_response(405, "use POST on " + path);
    }
    if (rest.size() > content.size() && rest.compare(rest.size() - content.size(), content.size(), content) == 0) {
      *route = videos + "/{id}/content";
      if (method != "GET") return error_response(405, "use GET on " + path);
      return video_content(call, rest.substr(0, rest.size() - content.size()));
    }
    if (rest.find('/') != std::string::npos) return error_response(404, "no route " + method + " " + path);
    *route = videos + "/{id}";
    if (method == "GET") return retrieve_video(call, rest);
    if (method == "DELETE") return delete_video(call, rest);
    return error_response(405, "use GET or DELETE on " + path);
  }
  return error_response(404, "no route " + method + " " + path);
}

}  // namespace skyreels::server::http
