// The gRPC transport: skyreels.v1.VideoService on top of the Scheduler. Converts messages, authenticates, maps
// errors to status codes; no policy and no model code here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/auth.h"
#include "server/metrics.h"
#include "server/model_job.h"
#include "server/scheduler.h"

namespace grpc {
class Service;
}

namespace skyreels::server {

struct ReplicaDescription {
  std::string name;
  std::string device;
  int threads = 0;
};

struct ModelSummary {
  std::string source;  // path or "demo"
  std::string dtype;
  int64_t parameter_count = 0;
  int64_t num_layers = 0, num_attention_heads = 0, attention_head_dim = 0, text_dim = 0, ffn_dim = 0;
  int64_t in_channels = 16, out_channels = 16;
  std::vector<int64_t> patch_size{1, 2, 2};
  bool inject_sample_info = false;
  int64_t num_frame_per_block = 1;
};

struct ServiceConfig {
  std::string version;
  ServerLimits limits;
  ModelDescription model;
  ModelSummary summary;
  std::vector<ReplicaDescription> replicas;
  int64_t max_request_bytes = 64 << 20;
  bool vae_available = false;
  // Starts (or keeps) the MP4 decode of a job's chunks: called when a job asks for MP4 at submit or on its first MP4
  // download. Unset without a VAE.
  std::function<void(const JobSnapshot&)> want_video;
  TextEncoderFn text_encoder;  // unset: text prompts answer FAILED_PRECONDITION
  std::shared_ptr<const model::WanVae>
      vae;  // encodes image / video conditioning; null: they answer FAILED_PRECONDITION
  const ApiKeys* api_keys = nullptr;
  Metrics* metrics = nullptr;
};

// The skyreels.v1.VideoService implementation, to register with a grpc::ServerBuilder. `scheduler` must outlive it.
std::unique_ptr<grpc::Service> make_video_service(Scheduler& scheduler, ServiceConfig config);

}  // namespace skyreels::server
