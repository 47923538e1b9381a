#include "server/api/probes.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <future>
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
  std::unique_ptr<grpc::GenericStub> stub;
  std::chrono::milliseconds period;
  Clock::time_point next{};
  bool answered = true;
};

UnaryProbe::UnaryProbe(grpc::Server& server, std::chrono::milliseconds period) : impl_(std::make_unique<Impl>()) {
  impl_->stub = std::make_unique<grpc::GenericStub>(server.InProcessChannel(grpc::ChannelArguments()));
  impl_->period = period;
}

UnaryProbe::~UnaryProbe() = default;

// GetServerInfo as bytes: the answer is never parsed, so readiness proves a thread took the call and does not depend
// on what the answer says (text from --lora-dir once made it unparsable and the pod NOT_SERVING for good, issue 46).
bool UnaryProbe::answered() {
  const auto now = Clock::now();
  if (now < impl_->next) return impl_->answered;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + impl_->period);
  ctx.AddMetadata(kForwardedPeerMetadata, forwarded_peer(kSelfPeer));
  std::string request_bytes;
  pb::GetServerInfoRequest().SerializeToString(&request_bytes);
  grpc::Slice slice(request_bytes);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<Status> done;
  std::future<Status> result = done.get_future();
  impl_->stub->UnaryCall(&ctx, "/skyreels.v1.VideoService/GetServerInfo", grpc::StubOptions(), &request, &response,
                         [&done](Status s) { done.set_value(std::move(s)); });
  const Status status = result.get();  // the deadline bounds it
  const bool answered = status.ok() || status.error_code() == StatusCode::UNAUTHENTICATED;
  if (answered != impl_->answered) {
    spdlog::warn("event=unary_probe answered={} status=\"{}\"", answered, log_escape(status.error_message()));
  }
  impl_->answered = answered;
  impl_->next = Clock::now() + impl_->period;
  return answered;
}

}  // namespace skyreels::server
