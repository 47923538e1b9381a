// `skyreels cancel`: cancels a job on a skyreels-server (at the next denoising step if it is running).
#include <iostream>

#include "cli/command.h"
#include "server/api/client.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;
namespace pb = skyreels::v1;
namespace server = skyreels::server;

const std::string kUsage =
    std::string(
        "usage: skyreels cancel JOB_ID\n\n"
        "Cancels a job: at once when queued or between chunks, at the next denoising step when running.\n"
        "Prints the job's state (a running job reports CANCELLED once its step ends; see `skyreels watch`).\n") +
    skyreels::server::kConnectionFlagsHelp;

int run_cancel(const std::vector<std::string>& raw) {
  const Args args(raw, {"tls"});
  args.reject_unknown(server::kConnectionFlags);
  if (args.positional().size() != 1) throw UsageError("expected one JOB_ID");
  server::Client client(server::connection_from(args));
  pb::CancelJobRequest request;
  request.set_job_id(args.positional().front());
  pb::Job job;
  auto ctx = client.context(30);
  const grpc::Status status = client.stub().CancelJob(ctx.get(), request, &job);
  if (!status.ok()) {
    std::cerr << "skyreels cancel: " << server::describe(status) << "\n";
    return 1;
  }
  std::cout << job.job_id() << " " << server::state_name(job.state()) << std::endl;
  return 0;
}

}  // namespace

SKYREELS_COMMAND("cancel", "cancel a job on a skyreels-server", kUsage, run_cancel);
