#include "server/api/video_service.h"

#include <algorithm>

#include "model/adapter_bank.h"
#include "model/runtime.h"
#include "model/utf8_text.h"

namespace skyreels::server::api {

namespace {
bool serves(const ServiceConfig& config, const std::string& pipeline) {
  const auto& p = config.model.pipelines;
  return std::find(p.begin(), p.end(), pipeline) != p.end();
}

// What a job may be conditioned on here, from the pipelines the model runs and the encoders this server has.
std::vector<std::string> conditionings(const ServiceConfig& config) {
  std::vector<std::string> kinds{"embeddings"};
  if (config.text_encoder) kinds.emplace_back("text");
  if (serves(config, "df")) {
    kinds.emplace_back("prompt_changes");
    if (config.vae) kinds.insert(kinds.end(), {"image", "last_image", "video"});
  }
  if (serves(config, "i2v") && config.vae && config.image_encoder) {
    kinds.emplace_back("image");
    if (config.model.first_last_frame) kinds.emplace_back("last_image");
  }
  return kinds;
}
}  // namespace

VideoServiceImpl::VideoServiceImpl(JobCommands& commands, JobReads& reads, const QueueLifecycle& lifecycle,
                                   ServiceConfig config)
    : commands_(commands),
      reads_(reads),
      lifecycle_(lifecycle),
      config_(std::move(config)),
      idle_trimmer_(runtime::release_free_heap),
      streams_(config_.transport.max_streams, config_.transport.max_streams_per_client),
      encodes_(config_.transport.max_concurrent_encodes),
      decodes_(config_.transport.max_concurrent_encodes) {
  streams_.on_change([this](int64_t open) {
    if (config_.metrics) config_.metrics->set_streams_open(open);
    if (open == 0) idle_trimmer_.request();  // the last stream closed: what the streams freed goes back
  });
}

Status VideoServiceImpl::GetServerInfo(ServerContext* ctx, const pb::GetServerInfoRequest*, pb::ServerInfo* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
  response->set_version(config_.version);
  const ModelSummary& m = config_.summary;
  const model::TransformerConfig& transformer = config_.model.config;
  auto* model = response->mutable_model();
  model->set_source(model::utf8_escape(m.source));
  model->set_dtype(m.dtype);
  model->set_parameter_count(m.parameter_count);
  model->set_num_layers(transformer.num_layers);
  model->set_num_attention_heads(transformer.num_attention_heads);
  model->set_attention_head_dim(transformer.attention_head_dim);
  model->set_text_dim(transformer.text_dim);
  model->set_ffn_dim(transformer.ffn_dim);
  model->set_in_channels(transformer.in_channels);
  model->set_out_channels(transformer.out_channels);
  for (int64_t p : transformer.patch_size) model->add_patch_size(p);
  model->set_inject_sample_info(transformer.inject_sample_info);
  model->set_num_frame_per_block(transformer.num_frame_per_block);
  for (const std::string& pipeline : config_.model.pipelines) model->add_pipelines(pipeline);
  model->set_default_pipeline(config_.model.default_pipeline);
  model->set_image_dim(transformer.image_dim.value_or(0));
  model->set_first_last_frame(config_.model.first_last_frame);
  if (config_.adapters) {
    for (const auto& a : config_.adapters->adapters()) {  // as the catalogue last looked at --lora-dir
      auto* info = model->add_adapters();
      // Text from files and their names: valid UTF-8 (the catalogue escapes it already; a proto3 string that is not
      // fails every client's GetServerInfo).
      info->set_name(model::utf8_escape(a.name));
      info->set_sha256(a.sha256);
      info->set_format(a.format);
      info->set_rank(a.rank);
      info->set_parameters(a.parameters);
      info->set_available(a.available);
      info->set_reason(model::utf8_escape(a.reason));
    }
    model->set_max_resident_adapters(static_cast<int32_t>(config_.max_resident_adapters));
  }
  for (const auto& lora : m.loras) {
    auto* l = model->add_loras();
    l->set_path(model::utf8_escape(lora.path));
    l->set_scale(lora.scale);
    l->set_format(lora.format);
    l->set_parameters(lora.parameters);
    l->set_max_rank(static_cast<int32_t>(lora.max_rank));
  }
  const auto statuses = lifecycle_.replicas();
  for (size_t i = 0; i < statuses.size(); ++i) {
    auto* r = response->add_replicas();
    r->set_name(statuses[i].name);
    r->set_loaded(statuses[i].loaded);
    r->set_healthy(statuses[i].healthy);
    r->set_busy(statuses[i].busy);
    r->set_chunks_run(statuses[i].chunks_run);
    r->set_failures(statuses[i].failures);
    r->set_error(model::utf8_escape(statuses[i].error));
    for (const auto& name : statuses[i].adapters.resident) r->add_resident_adapters(name);
    r->set_adapter_loads(statuses[i].adapters.loads);
    if (i < config_.replicas.size()) {
      r->set_device(config_.replicas[i].device);
      r->set_threads(config_.replicas[i].threads);
      const auto& devices = config_.replicas[i].devices;
      if (devices.empty()) r->add_devices(config_.replicas[i].device);
      for (const auto& d : devices) r->add_devices(d);
      r->set_parallel(config_.replicas[i].parallel);
    }
  }
  auto* limits = response->mutable_limits();
  limits->set_max_queue(static_cast<int32_t>(lifecycle_.options().max_jobs));
  limits->set_max_frames(config_.limits.max_frames);
  limits->set_max_height(config_.limits.max_height);
  limits->set_max_width(config_.limits.max_width);
  limits->set_max_steps(config_.limits.max_steps);
  limits->set_max_text_tokens(config_.limits.max_text_tokens);
  limits->set_chunk_retries(lifecycle_.options().chunk_retries);
  limits->set_max_request_bytes(config_.max_request_bytes);
  limits->set_max_chunk_tokens(config_.limits.max_chunk_tokens);
  limits->set_max_job_work(config_.limits.max_job_work);
  limits->set_max_chunks(config_.limits.max_chunks);
  response->set_vae_available(config_.vae_available);
  response->set_text_encoder_available(static_cast<bool>(config_.text_encoder));
  response->set_ready(lifecycle_.ready());
  response->set_draining(lifecycle_.draining());
  response->set_queued_jobs(static_cast<int32_t>(lifecycle_.queued_jobs()));
  response->set_running_jobs(static_cast<int32_t>(lifecycle_.running_jobs()));
  response->set_api_keys_required(config_.api_keys != nullptr && config_.api_keys->enabled());
  response->set_image_encoder_available(config_.image_encoder != nullptr);
  for (const std::string& kind : conditionings(config_)) response->add_conditionings(kind);
  response->set_test_hooks_enabled(config_.test_hooks_enabled);
  for (const std::string& hook : config_.test_hooks) response->add_test_hooks(model::utf8_escape(hook));
  return Status::OK;
}

Status VideoServiceImpl::authenticate(grpc::ServerContextBase* ctx, Caller* caller, bool submission) {
  *caller = Caller{};
  const auto& metadata = ctx->client_metadata();
  auto value = [&](const char* name) -> std::optional<std::string> {
    auto it = metadata.find(name);
    if (it == metadata.end()) return std::nullopt;
    return std::string(it->second.data(), it->second.size());
  };
  // Calls this process makes on a client's behalf (HTTP) name that client; the readiness probe names itself.
  const auto forwarded = value(kForwardedPeerMetadata);
  const std::optional<std::string> http_peer = forwarded ? forwarded_address(*forwarded) : std::nullopt;
  const bool own_probe = http_peer && *http_peer == kSelfPeer;
  const std::string peer = http_peer ? "http:" + *http_peer : ctx->peer();
  if (config_.api_keys == nullptr || !config_.api_keys->enabled()) {
    caller->client = http_peer ? *http_peer : peer_host(ctx->peer());
    return Status::OK;
  }
  const std::string key = presented_key(value("authorization"), value("x-api-key"));
  std::optional<ClientIdentity> identity;
  if (!key.empty()) identity = config_.api_keys->identify(key);
  if (!identity) {
    if (submission && config_.metrics) config_.metrics->rejected(kRejectUnauthenticated);
    if (!own_probe) {
      spdlog::warn("event=unauthenticated peer={} key_present={}", log_escape(peer), !key.empty());
    }
    return Status(StatusCode::UNAUTHENTICATED,
                  key.empty() ? "missing API key: send metadata 'authorization: Bearer KEY' or 'x-api-key: KEY'"
                              : "invalid API key");
  }
  caller->owner = identity->name;
  caller->client = identity->name;
  caller->limits = identity->limits;
  return Status::OK;
}

Status VideoServiceImpl::open_stream(const Caller& caller, std::unique_ptr<StreamLimiter::Slot>* slot) {
  StreamLimiter::Refusal why = StreamLimiter::Refusal::None;
  *slot = streams_.acquire(caller.client, caller.limits.max_streams, &why);
  if (*slot) return Status::OK;
  const bool total = why == StreamLimiter::Refusal::Total;
  if (config_.metrics) config_.metrics->stream_rejected(total ? kStreamRejectTotal : kStreamRejectPerClient);
  const std::string message =
      total ? "too many open streams on this server (--max-streams " + std::to_string(streams_.max_total()) + ")"
            : "too many open streams for this client (cap " +
                  std::to_string(caller.limits.max_streams.value_or(streams_.max_per_client())) +
                  "): close a WatchJob, DownloadResult or Generate stream first";
  spdlog::info("event=stream_rejected client={} reason={}", log_escape(caller.client),
               total ? kStreamRejectTotal : kStreamRejectPerClient);
  return Status(StatusCode::RESOURCE_EXHAUSTED, message);
}

Status VideoServiceImpl::reject(const char* reason, StatusCode code, const std::string& message) {
  if (config_.metrics && reason != nullptr) config_.metrics->rejected(reason);
  spdlog::info("event=rejected reason={} code={} message=\"{}\"", reason ? reason : "-", static_cast<int>(code),
               log_escape(message));
  return Status(code, message);
}

Status VideoServiceImpl::reject_with_retry_hint(ServerContext* ctx, const char* reason, const std::string& what, double seconds) {
  const auto ms = static_cast<int64_t>(seconds * 1000.0);
  ctx->AddTrailingMetadata("retry-after-ms", std::to_string(ms));
  return reject(reason, StatusCode::RESOURCE_EXHAUSTED, what + "; retry after " + std::to_string(ms) + " ms");
}

Status VideoServiceImpl::admission_refused(ServerContext* ctx, const AdmissionError& e) {
  switch (e.reason()) {
    case AdmissionError::Reason::QueueFull:
      return reject_with_retry_hint(ctx, kRejectQueueFull, e.what(), e.retry_after_seconds());
    case AdmissionError::Reason::ClientQueueFull:
      return reject_with_retry_hint(ctx, kRejectClientLimit, e.what(), e.retry_after_seconds());
    case AdmissionError::Reason::Draining:
      return reject(kRejectDraining, StatusCode::UNAVAILABLE, e.what());
    case AdmissionError::Reason::Unavailable:
      return reject(nullptr, StatusCode::UNAVAILABLE, e.what());
    case AdmissionError::Reason::IdempotencyConflict:
      return reject(nullptr, StatusCode::ALREADY_EXISTS, e.what());
  }
  return Status(StatusCode::INTERNAL, e.what());
}

}  // namespace skyreels::server::api

namespace skyreels::server {

using namespace api;

JobParts job_parts(const ServiceConfig& config, TextEncoderFn text_encoder) {
  JobParts parts;
  parts.text_encoder = std::move(text_encoder);
  parts.vae = config.vae;
  parts.on_vae_encode = vae_encode_metric(config.metrics);
  parts.image_encoder = config.image_encoder;
  parts.adapters = config.adapters;
  return parts;
}

std::unique_ptr<grpc::Service> make_video_service(JobQueue& jobs, ServiceConfig config) {
  return std::make_unique<VideoServiceImpl>(jobs, jobs, jobs, std::move(config));
}

}  // namespace skyreels::server
