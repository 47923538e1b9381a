#include "server/api/probes.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <memory>
#include <string>

#include "server/api/auth.h"
#include "server/api/guards.h"
#include "server/queue/job_types.h"
#include "skyreels/v1/video_service.grpc.pb.h"

namespace skyreels::server {

namespace pb = ::skyreels::v1;
using grpc::Status;
using grpc::StatusCode;

struct UnaryProbe::Impl {
  std::unique_ptr<pb::VideoService::Stub> stub;
  std::chrono::milliseconds period;
  Clock::time_point next{};
  bool answered = true;
};

UnaryProbe::UnaryProbe(grpc::Server& server, std::chrono::milliseconds period) : impl_(std::make_unique<Impl>()) {
  impl_->stub = pb::VideoService::NewStub(server.InProcessChannel(grpc::ChannelArguments()));
  impl_->period = period;
}

UnaryProbe::~UnaryProbe() = default;

bool UnaryProbe::answered() {
  const auto now = Clock::now();
  if (now < impl_->next) return impl_->answered;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + impl_->period);
  ctx.AddMetadata(kForwardedPeerMetadata, forwarded_peer(kSelfPeer));
  pb::ServerInfo info;
  const Status status = impl_->stub->GetServerInfo(&ctx, pb::GetServerInfoRequest(), &info);
  const bool answered = status.ok() || status.error_code() == StatusCode::UNAUTHENTICATED;
  if (answered != impl_->answered) {
    spdlog::warn("event=unary_probe answered={} status=\"{}\"", answered, log_escape(status.error_message()));
  }
  impl_->answered = answered;
  impl_->next = Clock::now() + impl_->period;
  return answered;
}

}  // namespace skyreels::server
