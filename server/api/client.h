// Client side of skyreels.v1.VideoService for the `skyreels` tool: channel with TLS and API key, random prompt
// embeddings, readiness wait, result download. No LibTorch.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "skyreels/v1/video_service.grpc.pb.h"

namespace skyreels::server {

struct ConnectionOptions {
  std::string server = "127.0.0.1:50051";  // --server, $SKYREELS_SERVER
  std::string api_key;                     // --api-key, $SKYREELS_API_KEY
  std::string tls_ca;                      // --tls-ca FILE: TLS with this root certificate
  bool tls = false;                        // --tls: TLS with the system roots
  std::string tls_server_name;             // --tls-server-name: override the name checked in the certificate
};

// The flags every client subcommand takes, for its usage text.
inline constexpr const char* kConnectionFlagsHelp =
    "connection:\n"
    "  --server HOST:PORT        (default $SKYREELS_SERVER or 127.0.0.1:50051)\n"
    "  --api-key KEY             sent as 'authorization: Bearer KEY' (default $SKYREELS_API_KEY)\n"
    "  --tls                     TLS with the system roots; --tls-ca FILE: with this root certificate\n"
    "  --tls-server-name NAME    name to verify in the server certificate\n";
inline const std::vector<std::string> kConnectionFlags = {"server", "api-key", "tls", "tls-ca", "tls-server-name"};

// Fills ConnectionOptions from a cli::Args-like object (has(), get(); names without dashes; "tls" is a switch).
template <typename ArgsT>
ConnectionOptions connection_from(const ArgsT& args) {
  ConnectionOptions o;
  if (const char* env = std::getenv("SKYREELS_SERVER")) o.server = env;
  if (const char* env = std::getenv("SKYREELS_API_KEY")) o.api_key = env;
  o.server = args.get("server", o.server);
  o.api_key = args.get("api-key", o.api_key);
  o.tls_ca = args.get("tls-ca", "");
  o.tls = args.has("tls") || !o.tls_ca.empty();
  o.tls_server_name = args.get("tls-server-name", "");
  return o;
}

class Client {
 public:
  explicit Client(ConnectionOptions options);
  // A context carrying the API key (and an optional deadline in seconds; 0 = none).
  std::unique_ptr<grpc::ClientContext> context(double timeout_seconds = 0) const;
  v1::VideoService::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Polls grpc.health.v1 (service "") until SERVING; false after `timeout_seconds`.
  bool wait_ready(double timeout_seconds, std::string* last_error = nullptr);

 private:
  std::shared_ptr<grpc::Channel> make_channel() const;
  ConnectionOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::VideoService::Stub> stub_;
};

// "CODE: message" for errors printed by the tool.
std::string describe(const grpc::Status& status);

// Standard-normal float32 [1, tokens, text_dim] from `seed` (for demos and load tests, no text encoder needed).
v1::Tensor random_embeddings(int64_t tokens, int64_t text_dim, uint64_t seed);

std::string read_binary_file(const std::string& path);
void write_binary_file(const std::string& path, const std::string& bytes);

// Streams DownloadResult and reassembles each chunk's blob; on_chunk(index, count, bytes) per completed chunk.
grpc::Status download_chunks(Client& client, const v1::DownloadResultRequest& request,
                             const std::function<void(int32_t, int32_t, std::string)>& on_chunk);

// Follows a job with WatchJob until it ends, printing events to `log` (a progress bar when `progress_bar`), and
// handing each preview to `on_preview` when set (previews are not asked for otherwise).
// Returns the final job (state UNSPECIFIED when the stream failed; `status` tells why).
struct WatchOutcome {
  v1::Job job;
  grpc::Status status;
};
WatchOutcome watch_job(Client& client, const std::string& job_id, bool progress_bar, std::ostream& log,
                       const std::function<void(const v1::ChunkPreview&)>& on_preview = {});

const char* state_name(v1::JobState state);  // "SUCCEEDED", ...

}  // namespace skyreels::server
