// `skyreels watch`: follows a job on a skyreels-server until it ends, with a progress bar.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <stdexcept>

#include "cli/command.h"
#include "server/api/client.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;
namespace pb = skyreels::v1;
namespace server = skyreels::server;

const std::string kUsage =
    std::string(
        "usage: skyreels watch JOB_ID [--no-progress]\n\n"
        "Follows a job until it ends: queue position, chunks starting and finishing on replicas, step progress.\n"
        "Exit status 0 when the job succeeded, 1 otherwise.\n"
        "  --no-progress             no progress bar (events only); the default when stderr is not a terminal\n"
        "  --previews DIR            the job's previews (submitted with --preview-every N) as PNG files\n"
        "                            DIR/chunkK_rowR.png: the chunk's new frames side by side at latent resolution\n") +
    skyreels::server::kConnectionFlagsHelp;

// Each preview as DIR/chunkK_rowR.png (zero-padded: the files sort in order), as `skyreels generate --previews`.
std::function<void(const pb::ChunkPreview&)> preview_writer(const std::string& dir) {
  std::filesystem::create_directories(dir);
  return [dir](const pb::ChunkPreview& p) {
    char name[64];
    std::snprintf(name, sizeof(name), "/chunk%03d_row%04d.png", p.chunk_index(), p.step() - 1);
    std::ofstream out(dir + name, std::ios::binary);
    out << p.image();
    if (!out) throw std::runtime_error("--previews: cannot write " + dir + name);
  };
}

int run_watch(const std::vector<std::string>& raw) {
  const Args args(raw, {"no-progress", "tls"});
  std::vector<std::string> known = {"no-progress", "previews"};
  known.insert(known.end(), server::kConnectionFlags.begin(), server::kConnectionFlags.end());
  args.reject_unknown(known);
  if (args.positional().size() != 1) throw UsageError("expected one JOB_ID");
  server::Client client(server::connection_from(args));
  const bool progress = !args.has("no-progress") && ::isatty(2) != 0;
  std::function<void(const pb::ChunkPreview&)> on_preview;
  if (args.has("previews")) on_preview = preview_writer(args.get("previews"));
  const auto outcome = server::watch_job(client, args.positional().front(), progress, std::cerr, on_preview);
  if (!outcome.status.ok()) {
    std::cerr << "skyreels watch: " << server::describe(outcome.status) << "\n";
    return 1;
  }
  std::cout << server::state_name(outcome.job.state()) << std::endl;
  return outcome.job.state() == pb::JOB_STATE_SUCCEEDED ? 0 : 1;
}

}  // namespace

SKYREELS_COMMAND("watch", "follow a job on a skyreels-server (progress bar)", kUsage, run_watch);
