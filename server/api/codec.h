// The gRPC transport's message mapping: job types -> proto (jobs, events), the checks a request's fields get before
// anything runs, and the small helpers every RPC family uses (deadlines, page tokens, seeds). The request codec and
// the durable form of a submission are job/'s (job/durable_request.h). Internal to api/.
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "server/job/durable_request.h"
#include "server/job/generation_params_proto.h"
#include "server/job/fingerprint.h"
#include "server/api/guards.h"
#include "server/store/job_store.h"
#include "skyreels/v1/video_service.grpc.pb.h"
#include "server/api/service.h"

namespace skyreels::server::api {

namespace pb = ::skyreels::v1;
using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

// Result messages stay small whatever the chunk size; each is read from the store when it is sent, so an open download
// holds about two of them (one in gRPC's send, one on its way), not the result (issue 36).
constexpr size_t kPartBytes = 256 << 10;
constexpr auto kPoll = std::chrono::milliseconds(500);  // how often long streams look for a gone client
constexpr size_t kMaxJobIdBytes = 64;                   // ours are 34 ("j-" + 32 hex digits)
constexpr size_t kMaxIdempotencyKeyBytes = 128;
// Deadlines and timeouts further out than this are refused: no job should wait in a queue for a month.
constexpr std::chrono::hours kMaxJobTimeout{24 * 30};
// google.protobuf.Timestamp's valid range: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z.
constexpr int64_t kMinTimestampSeconds = -62135596800;
constexpr int64_t kMaxTimestampSeconds = 253402300799;

google::protobuf::Timestamp to_timestamp(WallClock::time_point t);

pb::JobState to_proto(JobState s);

StatusCode to_code(ErrorKind kind);

// What `job` resolved of its request, for its durable request (job/durable_request.h). Holds `job` by reference.
ResolvedInputs resolved_inputs(const ModelJob& job);

// Ids are checked against kMaxJobIdBytes before any lookup, and echoed escaped.
Status not_found(const std::string& id);

Status check_job_id(const std::string& id);

Status check_format(pb::ResultFormat format, bool vae_available);

// A client's deadline or timeout as a point on our monotonic clock, range-checked before any arithmetic (chrono
// overflows on values protobuf itself calls invalid, e.g. a timeout of 1e10 s or negative nanos).
Status job_deadline(const pb::SubmitJobRequest& request, std::optional<Clock::time_point>* out);

// What the submission adds to its request's idempotency fingerprint (server/job/fingerprint.h): priority, deadline or
// timeout.
SubmissionTerms submission_terms(const pb::SubmitJobRequest& request);

std::function<void(double)> vae_encode_metric(ApiMetrics* metrics);

void work_to_proto(const TransformerWork& w, pb::TransformerWork* out);

// The RPC's deadline on the steady clock (store calls made for it end then: StoreCallDeadline); max() when none.
std::chrono::steady_clock::time_point rpc_deadline(const grpc::ServerContextBase& ctx);

// A page token is the decimal offset ListJobs returned, nothing else (no sign, no spaces, no overflow).
bool parse_page_token(const std::string& token, size_t* offset);

uint64_t random_seed();

// WatchJob's messages as bytes (its method is raw). A preview event (`event` with its preview's fields, no image)
// whose image is `image`'s PNG itself: the message ends with a slice that refers to the PNG and keeps it alive, so the
// job's watchers all send the one PNG the hub keeps. The bytes are those protobuf writes for the whole event.
grpc::ByteBuffer event_message(const pb::JobEvent& event);
grpc::ByteBuffer preview_message(const pb::JobEvent& event, std::shared_ptr<const ChunkPreviewImage> image);

}  // namespace skyreels::server::api
