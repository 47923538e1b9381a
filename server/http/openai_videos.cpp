// OpenAI's Videos API (as the official SDKs send and parse it) over the gRPC service: a video is a job; its MP4 is
// the job's per-chunk MP4 segments joined (a fragmented MP4).
#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "model/adapter_limits.h"
#include "server/http/routes.h"
#include "server/job/base64.h"
#include "server/http/stills.h"
#include "server/job/limits.h"
#include "server/job/video_shape.h"

namespace skyreels::server::http {

namespace {

using nlohmann::json;
namespace protobuf = google::protobuf;

// What a create request carries, from multipart/form-data or JSON alike: values (strings from a form) and files.
struct Fields {
  json values = json::object();
  std::map<std::string, const FormPart*> files;
};

std::optional<Response> read_fields(const Request& request, Fields* out) {
  if (request.multipart) {
    for (const FormPart& part : request.parts) {
      if (!part.filename.empty() || part.content_type.rfind("image/", 0) == 0 ||
          part.content_type.rfind("video/", 0) == 0) {
        out->files[part.name] = &part;
        continue;
      }
      // The SDK's nested values: input_reference[image_url]=...
      const size_t open = part.name.find('[');
      if (open != std::string::npos && part.name.back() == ']') {
        out->values[part.name.substr(0, open)][part.name.substr(open + 1, part.name.size() - open - 2)] = part.data;
      } else {
        out->values[part.name] = part.data;
      }
    }
    return std::nullopt;
  }
  if (request.body.empty()) return error_response(400, "the request has no body: send JSON or multipart/form-data");
  json body = json::parse(request.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) return error_response(400, "the request body is not a JSON object");
  out->values = std::move(body);
  return std::nullopt;
}

std::optional<std::string> text_of(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_number()) return value.dump();
  return std::nullopt;
}

// input_reference: an uploaded image, or {"image_url": "data:image/...;base64,..."}.
std::optional<Response> read_reference(const Fields& fields, pb::JobSpec* spec) {
  if (auto file = fields.files.find("input_reference"); file != fields.files.end()) {
    spec->mutable_image()->set_encoded(file->second->data);
    return std::nullopt;
  }
  auto it = fields.values.find("input_reference");
  if (it == fields.values.end()) return std::nullopt;
  const json& reference = *it;
  if (!reference.is_object()) {
    return error_response(400, "input_reference: send an image file or {\"image_url\": \"data:image/png;base64,...\"}",
                          "input_reference");
  }
  if (reference.contains("file_id")) {
    return error_response(400, "input_reference.file_id: this server has no Files API; send the image itself",
                          "input_reference");
  }
  const std::string url = reference.value("image_url", "");
  const std::string marker = ";base64,";
  const size_t comma = url.find(marker);
  if (url.rfind("data:image/", 0) != 0 || comma == std::string::npos) {
    return error_response(400, "input_reference.image_url: only data:image/...;base64 URLs (this server fetches no URLs)",
                          "input_reference");
  }
  const auto bytes = base64_decode(url.substr(comma + marker.size()));
  if (!bytes) return error_response(400, "input_reference.image_url: malformed base64", "input_reference");
  spec->mutable_image()->set_encoded(*bytes);
  return std::nullopt;
}

// Every GenerationParams field given under its own name, typed by the message's descriptor and parsed by protobuf's
// JSON mapping (form values arrive as strings; proto3 JSON takes numbers as strings, booleans are converted here).
std::optional<Response> read_params(const json& values, std::set<std::string>* used, pb::GenerationParams* params) {
  const protobuf::Descriptor* descriptor = pb::GenerationParams::descriptor();
  json given = json::object();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const protobuf::FieldDescriptor* field = descriptor->field(i);
    auto it = values.find(field->name());
    if (it == values.end()) continue;
    used->insert(field->name());
    json value = *it;
    if (field->cpp_type() == protobuf::FieldDescriptor::CPPTYPE_BOOL && value.is_string()) {
      if (value == "true" || value == "false") value = value == "true";
    }
    given[field->name()] = value;
  }
  protobuf::util::JsonParseOptions options;
  const auto status = protobuf::util::JsonStringToMessage(given.dump(), params, options);
  if (!status.ok()) return error_response(400, "generation parameters: " + std::string(status.message()));
  return std::nullopt;
}

// One adapter of `lora`: {"name", "scale"} (vLLM-Omni's "lora_name" / "lora_scale" too) or "NAME[:SCALE]".
std::optional<std::string> add_adapter(const json& given, pb::GenerationParams* params) {
  pb::AdapterRef ref;
  if (given.is_object()) {
    if (given.contains("path") || given.contains("lora_path")) {
      return "this server serves the adapters of its --lora-dir by name; it reads no path from a request";
    }
    const json name = given.contains("name") ? given["name"] : given.value("lora_name", json());
    const json scale = given.contains("scale") ? given["scale"] : given.value("lora_scale", json());
    if (!name.is_string() || name.get<std::string>().empty()) return "each adapter needs a name";
    ref.set_name(name.get<std::string>());
    if (!scale.is_null()) {
      if (!scale.is_number()) return "scale: a number";
      ref.set_scale(scale.get<double>());
    }
  } else if (given.is_string()) {
    const std::string text = given.get<std::string>();
    const auto colon = text.rfind(':');
    char* end = nullptr;
    const double scale = colon == std::string::npos ? 0 : std::strtod(text.c_str() + colon + 1, &end);
    const bool has_scale = colon != std::string::npos && end != nullptr && *end == '\0' && colon + 1 < text.size();
    ref.set_name(has_scale ? text.substr(0, colon) : text);
    if (has_scale) ref.set_scale(scale);
    if (ref.name().empty()) return "each adapter needs a name";
  } else {
    return "an adapter is \"NAME[:SCALE]\" or {\"name\": ..., \"scale\": ...}";
  }
  *params->add_loras() = std::move(ref);
  return std::nullopt;
}

// `lora`, as vLLM-Omni's videos API names it: one adapter, a list of them, or (a form value) "NAME[:SCALE],..." or
// their JSON; after any GenerationParams.loras given.
std::optional<Response> read_lora(const json& values, std::set<std::string>* used, pb::GenerationParams* params) {
  auto it = values.find("lora");
  if (it == values.end()) return std::nullopt;
  used->insert("lora");
  json given = *it;
  if (given.is_string()) {
    const std::string text = given.get<std::string>();
    if (!text.empty() && (text.front() == '[' || text.front() == '{')) {
      given = json::parse(text, nullptr, false);
      if (given.is_discarded()) return error_response(400, "lora: not valid JSON", "lora");
    } else {
      given = json::array();
      std::stringstream items(text);
      for (std::string item; given.size() <= model::kMaxAdaptersPerRequest && std::getline(items, item, ',');) {
        given.push_back(item);
      }
    }
  }
  if (!given.is_array()) given = json::array({given});
  if (given.size() > model::kMaxAdaptersPerRequest) {  // before any is copied
    return error_response(400, "lora: at most " + std::to_string(model::kMaxAdaptersPerRequest) +
                                   " adapters per request", "lora");
  }
  for (const json& adapter : given) {
    if (auto why = add_adapter(adapter, params)) return error_response(400, "lora: " + *why, "lora");
  }
  return std::nullopt;
}

std::string seconds_text(int64_t frames, int64_t fps) {
  if (fps <= 0 || frames < 1) return "0";
  const double seconds = seconds_of_frames(frames, fps);
  char text[32];
  if (std::fabs(seconds - std::round(seconds)) < 1e-9) {
    std::snprintf(text, sizeof text, "%lld", static_cast<long long>(std::llround(seconds)));
  } else {
    std::snprintf(text, sizeof text, "%.2f", seconds);
  }
  return text;
}

// `seconds` and `size` into the parameters they stand for.
std::optional<Response> read_shape(const json& values, std::set<std::string>* used, pb::GenerationParams* params,
                                   int64_t default_fps) {
  if (auto it = values.find("size"); it != values.end()) {
    used->insert("size");
    const std::string size = text_of(*it).value_or("");
    std::smatch m;
    static const std::regex pattern("([0-9]{1,5})x([0-9]{1,5})");
    if (!std::regex_match(size, m, pattern)) {
      return error_response(400, "size: expected WIDTHxHEIGHT in pixels, multiples of 16 (e.g. 960x544), got '" +
                                     size + "'", "size");
    }
    if (params->has_width() || params->has_height()) {
      return error_response(400, "size: give size or width and height, not both", "size");
    }
    params->set_width(std::stoll(m[1]));
    params->set_height(std::stoll(m[2]));
  }
  if (auto it = values.find("seconds"); it != values.end()) {
    used->insert("seconds");
    const std::string text = text_of(*it).value_or("");
    char* end = nullptr;
    const double seconds = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(seconds > 0) || seconds > 86400) {
      return error_response(400, "seconds: expected a positive number of seconds, got '" + text + "'", "seconds");
    }
    if (params->has_num_frames()) {
      return error_response(400, "seconds: give seconds or num_frames, not both", "seconds");
    }
    const int64_t fps = params->has_fps() ? params->fps() : default_fps;
    params->set_num_frames(frames_for_seconds(seconds, fps));
  }
  return std::nullopt;
}

const char* video_status(pb::JobState state) {
  switch (state) {
    case pb::JOB_STATE_QUEUED:
      return "queued";
    case pb::JOB_STATE_RUNNING:
      return "in_progress";
    case pb::JOB_STATE_SUCCEEDED:
      return "completed";
    default:
      return "failed";
  }
}

bool finished(pb::JobState state) {
  return state == pb::JOB_STATE_SUCCEEDED || state == pb::JOB_STATE_FAILED || state == pb::JOB_STATE_CANCELLED ||
         state == pb::JOB_STATE_DEADLINE_EXCEEDED;
}

const char* error_code(pb::JobState state, int32_t grpc_code) {
  if (state == pb::JOB_STATE_CANCELLED) return "cancelled";
  if (state == pb::JOB_STATE_DEADLINE_EXCEEDED) return "deadline_exceeded";
  switch (static_cast<grpc::StatusCode>(grpc_code)) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "invalid_argument";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "resource_exhausted";
    case grpc::StatusCode::UNAVAILABLE:
      return "unavailable";
    default:
      return "internal_error";
  }
}

json video_object(const pb::Job& job, const HttpApiConfig& config) {
  json video = {{"id", job.job_id()},
                {"object", "video"},
                {"status", video_status(job.state())},
                {"progress", static_cast<int>(std::floor(std::clamp(job.progress(), 0.0, 1.0) * 100.0))},
                {"created_at", job.created_at().seconds()},
                {"completed_at", nullptr},
                {"expires_at", nullptr},
                {"error", nullptr},
                {"model", config.model_id},
                {"prompt", job.prompt().empty() ? json(nullptr) : json(job.prompt())},
                {"remixed_from_video_id", nullptr},
                {"seconds", seconds_text(job.params().num_frames(), job.params().fps())},
                {"size", std::to_string(job.params().width()) + "x" + std::to_string(job.params().height())}};
  if (job.state() == pb::JOB_STATE_SUCCEEDED) video["progress"] = 100;
  if (finished(job.state()) && job.has_finished_at()) {
    video["completed_at"] = job.finished_at().seconds();
    video["expires_at"] = job.finished_at().seconds() + config.result_ttl_seconds;
  }
  if (job.state() != pb::JOB_STATE_SUCCEEDED && job.has_error()) {
    video["error"] = {{"code", error_code(job.state(), job.error().code())}, {"message", job.error().message()}};
  }
  std::string own;
  protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (protobuf::util::MessageToJsonString(job, &own, options).ok()) video["skyreels"] = json::parse(own, nullptr, false);
  return video;
}

// The service's complaint about a parameter the request gave under another name (seconds, size).
Response renamed(Response r, const std::set<std::string>& used) {
  json body = json::parse(r.body, nullptr, false);
  if (body.is_discarded() || !body.contains("error")) return r;
  const json& given = body["error"]["param"];
  const std::string param = given.is_string() ? given.get<std::string>() : "";
  if (param == "num_frames" && used.count("seconds") && !used.count("num_frames")) {
    body["error"]["param"] = "seconds";
  } else if ((param == "width" || param == "height") && used.count("size")) {
    body["error"]["param"] = "size";
  } else {
    return r;
  }
  r.body = body.dump();
  return r;
}

}  // namespace

namespace {

// A finished video's MP4 (its chunks' segments joined) into *mp4, the first frame of each chunk into *chunk_starts;
// the job into *job. An error response when it is not finished or cannot be read.
std::optional<Response> download_mp4(const ServiceCall& call, const std::string& id, pb::Job* job, std::string* mp4,
                                     std::vector<int64_t>* chunk_starts) {
  if (auto failed = get_job(call, id, job)) return failed;
  if (job->state() != pb::JOB_STATE_SUCCEEDED) {
    return finished(job->state())
               ? error_response(400, "video '" + id + "' failed; it has no content", "", "video_failed")
               : error_response(409, "video '" + id + "' is " + video_status(job->state()) +
                                         "; its content exists once it is completed", "", "video_not_ready");
  }
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(pb::RESULT_FORMAT_MP4);
  request.set_no_wait(true);
  auto context = call.context(call.config.download_timeout_ms);
  auto reader = call.stub.DownloadResult(context.get(), request);
  pb::ResultPart part;
  while (reader->Read(&part)) {
    if (part.offset() == 0) chunk_starts->push_back(part.pixel_frame_begin());
    *mp4 += part.data();
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return from_status(status, *context);
  return std::nullopt;
}

// What create and extend both take: prompt, negative_prompt, model, priority, the generation parameters under their
// own names, size and seconds (read_shape). Names read go into *used.
std::optional<Response> read_request(const ServiceCall& call, const json& values, std::set<std::string>* used,
                                     pb::SubmitJobRequest* submit, int64_t default_fps = kDefaultFps) {
  pb::JobSpec* spec = submit->mutable_spec();
  const auto prompt = values.contains("prompt") ? text_of(values["prompt"]) : std::nullopt;
  if (!prompt || prompt->empty()) return error_response(400, "prompt: required", "prompt");
  used->insert("prompt");
  spec->mutable_text()->set_prompt(*prompt);
  if (values.contains("negative_prompt")) {
    used->insert("negative_prompt");
    spec->mutable_text()->set_negative_prompt(text_of(values["negative_prompt"]).value_or(""));
  }
  if (values.contains("model")) {
    used->insert("model");
    const std::string model = text_of(values["model"]).value_or("");
    if (model != call.config.model_id) {
      return error_response(400, "model: this server serves '" + call.config.model_id + "', not '" + model + "'",
                            "model", "model_not_found");
    }
  }
  if (values.contains("priority")) {
    used->insert("priority");
    const std::string text = text_of(values["priority"]).value_or("");
    char* end = nullptr;
    const long priority = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || priority < kMinPriority || priority > kMaxPriority) {
      return error_response(400, "priority: an integer in [" + std::to_string(kMinPriority) + ", " +
                                     std::to_string(kMaxPriority) + "]", "priority");
    }
    submit->set_priority(static_cast<int32_t>(priority));
  }
  if (values.contains("webhook_url")) {
    used->insert("webhook_url");
    submit->mutable_webhook()->set_url(text_of(values["webhook_url"]).value_or(""));
  }
  if (values.contains("webhook_events")) {  // "completed,failed" (a form) or ["completed", "failed"] (JSON)
    used->insert("webhook_events");
    const json& given = values["webhook_events"];
    std::vector<std::string> names;
    if (given.is_array()) {
      for (const json& e : given) names.push_back(e.is_string() ? e.get<std::string>() : e.dump());
    } else {
      std::stringstream list(text_of(given).value_or(""));
      for (std::string name; std::getline(list, name, ',');) {
        if (!name.empty()) names.push_back(name);
      }
    }
    for (const std::string& name : names) submit->mutable_webhook()->add_events(name);
    if (!values.contains("webhook_url")) return error_response(400, "webhook_events: needs webhook_url", "webhook_events");
  }
  if (auto refused = read_params(values, used, spec->mutable_params())) return *refused;
  if (auto refused = read_lora(values, used, spec->mutable_params())) return refused;
  if (auto refused = read_shape(values, used, spec->mutable_params(), default_fps)) return refused;
  if (!spec->params().has_fps() && default_fps != kDefaultFps) spec->mutable_params()->set_fps(default_fps);
  return std::nullopt;
}

// Submits what the request asked for, once every name it sent was understood.
Response submit_video(const ServiceCall& call, const Fields& fields, const std::set<std::string>& used,
                      pb::SubmitJobRequest& submit) {
  for (const auto& [name, value] : fields.values.items()) {
    if (!used.count(name)) return error_response(400, "unknown parameter '" + name + "'", name, "unknown_parameter");
  }
  for (const auto& [name, part] : fields.files) {
    if (!used.count(name)) return error_response(400, "unknown file parameter '" + name + "'", name, "unknown_parameter");
  }
  if (auto key = call.request.header("idempotency-key")) submit.set_idempotency_key(*key);
  submit.set_produce_mp4(call.config.vae_available);
  auto context = call.context();
  pb::SubmitJobResponse response;
  const grpc::Status status = call.stub.SubmitJob(context.get(), submit, &response);
  if (!status.ok()) return renamed(from_status(status, *context), used);
  return json_response(200, video_object(response.job(), call.config));
}

constexpr int64_t kDefaultExtensionOverlap = 17;  // SkyReels-V2's own examples continue the last 17 frames

}  // namespace

Response create_video(const ServiceCall& call) {
  Fields fields;
  if (auto refused = read_fields(call.request, &fields)) return *refused;
  std::set<std::string> used;
  pb::SubmitJobRequest submit;
  if (auto refused = read_request(call, fields.values, &used, &submit)) return *refused;
  if (fields.values.contains("input_reference") || fields.files.count("input_reference")) used.insert("input_reference");
  if (auto refused = read_reference(fields, submit.mutable_spec())) return *refused;
  return submit_video(call, fields, used, submit);
}

// The SDK's extend: a finished video (by id) or an uploaded MP4 continued by `seconds` of new frames from its last
// overlap_history frames (video-to-video); num_frames counts those continued frames too, as the pipeline does.
Response extend_video(const ServiceCall& call) {
  Fields fields;
  if (auto refused = read_fields(call.request, &fields)) return *refused;
  // The source first: its size and frame rate are the extension's unless the request says otherwise.
  std::string source;
  int64_t width = 0, height = 0, fps = kDefaultFps;
  if (auto file = fields.files.find("video"); file != fields.files.end()) {
    source = file->second->data;
    try {
      const VideoShape shape = video_shape(source);
      width = shape.width;
      height = shape.height;
      if (shape.fps >= 1) fps = std::llround(shape.fps);
    } catch (const std::exception& e) {
      return error_response(400, std::string("video: not a readable MP4: ") + e.what(), "video");
    }
  } else {
    auto it = fields.values.find("video");
    if (it == fields.values.end() || !it->is_object() || !it->contains("id") || !(*it)["id"].is_string()) {
      return error_response(400, "video: required, an MP4 file or {\"id\": \"VIDEO_ID\"}", "video");
    }
    pb::Job job;
    std::vector<int64_t> chunk_starts;
    if (auto refused = download_mp4(call, (*it)["id"].get<std::string>(), &job, &source, &chunk_starts)) {
      return *refused;
    }
    width = job.params().width();
    height = job.params().height();
    fps = job.params().fps();
  }
  std::set<std::string> used{"video"};
  pb::SubmitJobRequest submit;
  if (auto refused = read_request(call, fields.values, &used, &submit, fps)) return *refused;
  pb::GenerationParams& params = *submit.mutable_spec()->mutable_params();
  if (!params.has_width() && !params.has_height()) {
    params.set_width(width);
    params.set_height(height);
  }
  params.set_fps(params.has_fps() ? params.fps() : fps);
  if (!params.has_overlap_history()) params.set_overlap_history(kDefaultExtensionOverlap);
  if (used.count("seconds")) params.set_num_frames(params.overlap_history() + params.num_frames() - 1);
  submit.mutable_spec()->mutable_video()->set_encoded(std::move(source));
  return submit_video(call, fields, used, submit);
}

Response retrieve_video(const ServiceCall& call, const std::string& id) {
  pb::Job job;
  if (auto failed = get_job(call, id, &job)) return *failed;
  return json_response(200, video_object(job, call.config));
}

Response list_videos(const ServiceCall& call) {
  const std::string order = call.request.query_value("order").value_or("desc");
  if (order != "asc" && order != "desc") return error_response(400, "order: asc or desc", "order");
  int64_t limit = 20;
  if (auto text = call.request.query_value("limit")) {
    char* end = nullptr;
    limit = std::strtoll(text->c_str(), &end, 10);
    if (text->empty() || *end != '\0' || limit < 1 || limit > 100) {
      return error_response(400, "limit: an integer in [1, 100]", "limit");
    }
  }
  std::vector<pb::Job> jobs;  // oldest first, every page
  pb::ListJobsRequest request;
  request.set_page_size(kMaxPageSize);
  do {
    auto context = call.context();
    pb::ListJobsResponse page;
    const grpc::Status status = call.stub.ListJobs(context.get(), request, &page);
    if (!status.ok()) return from_status(status, *context);
    jobs.insert(jobs.end(), page.jobs().begin(), page.jobs().end());
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty());
  if (order == "desc") std::reverse(jobs.begin(), jobs.end());
  size_t first = 0;
  if (auto after = call.request.query_value("after"); after && !after->empty()) {
    auto it = std::find_if(jobs.begin(), jobs.end(), [&](const pb::Job& j) { return j.job_id() == *after; });
    if (it == jobs.end()) return error_response(400, "after: no video '" + *after + "' in this list", "after");
    first = static_cast<size_t>(it - jobs.begin()) + 1;
  }
  json data = json::array();
  const size_t last = std::min(jobs.size(), first + static_cast<size_t>(limit));
  for (size_t i = first; i < last; ++i) data.push_back(video_object(jobs[i], call.config));
  json page = {{"object", "list"},
               {"data", data},
               {"first_id", data.empty() ? json(nullptr) : data.front()["id"]},
               {"last_id", data.empty() ? json(nullptr) : data.back()["id"]},
               {"has_more", last < jobs.size()}};
  return json_response(200, page);
}

// DeleteJob: cancels a video still being made, then deletes it and its content; later calls get 404.
Response delete_video(const ServiceCall& call, const std::string& id) {
  pb::DeleteJobRequest request;
  request.set_job_id(id);
  auto context = call.context();
  pb::Job job;
  const grpc::Status status = call.stub.DeleteJob(context.get(), request, &job);
  if (!status.ok()) return from_status(status, *context);
  return json_response(200, {{"id", id}, {"object", "video.deleted"}, {"deleted", true}});
}


Response video_content(const ServiceCall& call, const std::string& id) {
  const std::string variant = call.request.query_value("variant").value_or("video");
  if (variant != "video" && variant != "thumbnail" && variant != "spritesheet") {
    return error_response(400, "variant: video, thumbnail or spritesheet, not '" + variant + "'", "variant");
  }
  pb::Job job;
  if (variant != "video") {  // stills are made from the whole video (small images of it)
    std::string mp4;
    std::vector<int64_t> chunk_starts;
    if (auto refused = download_mp4(call, id, &job, &mp4, &chunk_starts)) return *refused;
    Response still;
    still.content_type = "image/png";
    try {
      still.body = variant == "thumbnail" ? first_frame_png(mp4) : sprite_sheet_png(mp4, chunk_starts);
    } catch (const std::exception& e) {
      return error_response(500, "the " + variant + " of video '" + id + "' could not be made: " + e.what());
    }
    return still;
  }

  // The video: its segments' sizes first (made now when they were not yet), then the bytes asked for, streamed from
  // the job store as the client reads them.
  if (auto failed = get_job(call, id, &job)) return *failed;
  if (job.state() != pb::JOB_STATE_SUCCEEDED) {
    return finished(job.state())
               ? error_response(400, "video '" + id + "' failed; it has no content", "", "video_failed")
               : error_response(409, "video '" + id + "' is " + video_status(job.state()) +
                                         "; its content exists once it is completed", "", "video_not_ready");
  }
  ResultSizes sizes;
  if (auto refused = result_sizes(call, id, pb::RESULT_FORMAT_MP4, 0, false, &sizes)) return *refused;
  uint64_t size = 0;
  for (int64_t n : sizes.chunk_bytes) size += static_cast<uint64_t>(n);
  Response r;
  r.content_type = "video/mp4";
  r.headers.emplace_back("Accept-Ranges", "bytes");
  uint64_t first = 0, last = size == 0 ? 0 : size - 1;
  if (auto range = call.request.header("range")) {
    const auto span = byte_range(*range, size);
    if (!span) {
      Response refused = error_response(416, "range: not one satisfiable byte range of " + std::to_string(size));
      refused.headers.emplace_back("Content-Range", "bytes */" + std::to_string(size));
      return refused;
    }
    first = span->first;
    last = span->second;
    r.status = 206;
    r.headers.emplace_back("Content-Range", "bytes " + std::to_string(first) + "-" + std::to_string(last) + "/" +
                                                std::to_string(size));
  }
  if (size == 0) return r;
  r.stream_bytes = static_cast<int64_t>(last - first + 1);
  r.stream = result_body(call, id, pb::RESULT_FORMAT_MP4, 0, sizes.chunk_bytes, static_cast<int64_t>(first),
                         r.stream_bytes);
  return r;
}

}  // namespace skyreels::server::http
