#include "server/api/client.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"

namespace skyreels::server {

Client::Client(ConnectionOptions options) : options_(std::move(options)) {
  channel_ = make_channel();
  stub_ = v1::VideoService::NewStub(channel_);
}

std::shared_ptr<grpc::Channel> Client::make_channel() const {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // Reconnect quickly to a server that is still starting (gRPC's default backoff grows from 1 s towards 120 s).
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is left alone: it is also the connect timeout (TLS handshakes need it).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (options_.tls) {
    grpc::SslCredentialsOptions ssl;
    if (!options_.tls_ca.empty()) ssl.pem_root_certs = read_binary_file(options_.tls_ca);
    credentials = grpc::SslCredentials(ssl);
    if (!options_.tls_server_name.empty()) args.SetSslTargetNameOverride(options_.tls_server_name);
  }
  return grpc::CreateCustomChannel(options_.server, credentials, args);
}

std::unique_ptr<grpc::ClientContext> Client::context(double timeout_seconds) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!options_.api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.api_key);
  if (timeout_seconds > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
  }
  return ctx;
}

bool Client::wait_ready(double timeout_seconds, std::string* last_error) {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  while (true) {
    // A fresh channel per probe: a channel that failed to connect waits out its reconnect backoff (and DNS
    // re-resolution limits), which would delay noticing a server that just came up by seconds.
    auto health = grpc::health::v1::Health::NewStub(make_channel());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&ctx, request, &response);
    if (status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) return true;
    if (last_error) *last_error = status.ok() ? "NOT_SERVING" : describe(status);
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::string describe(const grpc::Status& status) {
  static const char* names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = static_cast<int>(status.error_code());
  const std::string name = code >= 0 && code <= 16 ? names[code] : std::to_string(code);
  return name + ": " + status.error_message();
}

v1::Tensor random_embeddings(int64_t tokens, int64_t text_dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(tokens * text_dim));
  for (auto& v : values) v = normal(rng);
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FLOAT32);
  t.add_shape(1);
  t.add_shape(tokens);
  t.add_shape(text_dim);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

std::string read_binary_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_binary_file(const std::string& path, const std::string& bytes) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write '" + partial + "'");
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename to '" + path + "'");
}

grpc::Status download_chunks(Client& client, const v1::DownloadResultRequest& request,
                             const std::function<void(int32_t, int32_t, std::string)>& on_chunk) {
  auto ctx = client.context();
  auto reader = client.stub().DownloadResult(ctx.get(), request);
  v1::ResultPart part;
  std::string current;
  int32_t current_chunk = -1;
  while (reader->Read(&part)) {
    if (part.chunk_index() != current_chunk) {
      current.clear();
      current.reserve(part.chunk_bytes());
      current_chunk = part.chunk_index();
    }
    if (part.offset() != current.size()) {
      ctx->TryCancel();
      reader->Finish();
      return grpc::Status(grpc::StatusCode::DATA_LOSS, "result part of chunk " + std::to_string(current_chunk) +
                                                           " at offset " + std::to_string(part.offset()) +
                                                           ", expected " + std::to_string(current.size()));
    }
    current += part.data();
    if (part.last_part()) on_chunk(part.chunk_index(), part.chunk_count(), std::move(current));
  }
  return reader->Finish();
}

const char* state_name(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_QUEUED:
      return "QUEUED";
    case v1::JOB_STATE_RUNNING:
      return "RUNNING";
    case v1::JOB_STATE_SUCCEEDED:
      return "SUCCEEDED";
    case v1::JOB_STATE_FAILED:
      return "FAILED";
    case v1::JOB_STATE_CANCELLED:
      return "CANCELLED";
    case v1::JOB_STATE_DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    default:
      return "UNSPECIFIED";
  }
}

namespace {

std::string bar(double fraction, int width) {
  const int filled = static_cast<int>(fraction * width + 0.5);
  std::string s = "[";
  for (int i = 0; i < width; ++i) s += i < filled ? '#' : '.';
  return s + "]";
}

std::string seconds_text(double s) {
  std::ostringstream os;
  os.precision(s < 10 ? 2 : 1);
  os << std::fixed << s << " s";
  return os.str();
}

}  // namespace

WatchOutcome watch_job(Client& client, const std::string& job_id, bool progress_bar, std::ostream& log,
                       const std::function<void(const v1::ChunkPreview&)>& on_preview) {
  WatchOutcome outcome;
  auto ctx = client.context();
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  request.set_skip_steps(!progress_bar);
  request.set_skip_previews(!on_preview);
  auto reader = client.stub().WatchJob(ctx.get(), request);
  v1::JobEvent event;
  bool bar_shown = false;
  auto end_bar = [&] {
    if (bar_shown) log << "\n";
    bar_shown = false;
  };
  while (reader->Read(&event)) {
    switch (event.event_case()) {
      case v1::JobEvent::kQueued:
        end_bar();
        log << "queued: position " << event.queued().position();
        if (event.queued().estimated_start_seconds() >= 0) {
          log << ", starts in ~" << seconds_text(event.queued().estimated_start_seconds());
        }
        log << "\n";
        break;
      case v1::JobEvent::kChunkStarted: {
        const auto& c = event.chunk_started();
        end_bar();
        log << "chunk " << c.chunk_index() + 1 << "/" << c.chunk_count() << " started on " << c.replica()
            << (c.handoff() ? " (handoff)" : "")
            << (c.attempt() > 0 ? " (retry " + std::to_string(c.attempt()) + ")" : "") << "\n";
        break;
      }
      case v1::JobEvent::kStep: {
        const auto& s = event.step();
        log << "\r" << bar(s.progress(), 30) << " " << static_cast<int>(s.progress() * 100 + 0.5) << "%  chunk "
            << s.chunk_index() + 1 << "  step " << s.step() << "/" << s.steps() << "   " << std::flush;
        bar_shown = true;
        break;
      }
      case v1::JobEvent::kPreview:
        if (on_preview) on_preview(event.preview());
        break;
      case v1::JobEvent::kChunkFinished: {
        const auto& c = event.chunk_finished();
        end_bar();
        log << "chunk " << c.chunk_index() + 1 << " finished on " << c.replica() << " in " << seconds_text(c.seconds())
            << " (latent frames " << c.latent_frame_begin() << ".." << c.latent_frame_end() << ")\n";
        break;
      }
      case v1::JobEvent::kChunkRetry: {
        const auto& r = event.chunk_retry();
        end_bar();
        if (r.takeover()) {
          log << "chunk " << r.chunk_index() + 1 << " lost its process, taken over: " << r.error() << "\n";
        } else {
          log << "chunk " << r.chunk_index() + 1 << " failed on " << r.replica() << ", retrying elsewhere: "
              << r.error() << "\n";
        }
        break;
      }
      case v1::JobEvent::kFinished: {
        end_bar();
        outcome.job = event.finished().job();
        const auto& j = outcome.job;
        log << "finished: " << state_name(j.state()) << " (" << j.chunks_done() << "/" << j.chunks_total()
            << " chunks, " << j.handoffs() << " handoff(s), " << j.retries() << " retr"
            << (j.retries() == 1 ? "y" : "ies") << ", seed " << j.params().seed() << ")";
        if (j.has_error() && !j.error().message().empty()) log << ": " << j.error().message();
        log << "\n";
        if (const auto& w = j.transformer_work(); w.full() > 0) {
          const double saved = static_cast<double>(w.saved_exact() + w.saved_cache()) / static_cast<double>(w.full());
          log << "transformer: " << w.computed() << " of " << w.full() << " token-blocks computed ("
              << static_cast<int>(saved * 100 + 0.5) << " % saved: " << w.saved_exact() << " exact, "
              << w.saved_cache() << " by the step cache)\n";
        }
        break;
      }
      default:
        break;
    }
  }
  end_bar();
  outcome.status = reader->Finish();
  return outcome;
}

}  // namespace skyreels::server
