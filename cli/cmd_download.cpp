// `skyreels download`: fetches a job's result from a skyreels-server, chunk by chunk as the chunks are produced.
#include <filesystem>
#include <iostream>

#include "cli/command.h"
#include "server/job/blob.h"
#include "server/api/client.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::UsageError;
namespace pb = skyreels::v1;
namespace server = skyreels::server;
namespace fs = std::filesystem;

const std::string kUsage =
    std::string(
        "usage: skyreels download JOB_ID --out PATH [flags]\n\n"
        "Downloads a job's latents (fp32 [1, 16, F, H/8, W/8], tensor `latents`) into one safetensors file, following\n"
        "a running job chunk by chunk. PATH is a file, or a directory (then PATH/JOB_ID.safetensors).\n"
        "  --per-chunk               also write JOB_ID.chunkK.safetensors next to it, one per chunk\n"
        "  --format latents|mp4      mp4 needs a server with a VAE (default latents)\n"
        "  --no-wait                 only the chunks that exist now\n") +
    skyreels::server::kConnectionFlagsHelp;

int run_download(const std::vector<std::string>& raw) {
  const Args args(raw, {"per-chunk", "no-wait", "tls"});
  std::vector<std::string> known = {"out", "per-chunk", "format", "no-wait"};
  known.insert(known.end(), server::kConnectionFlags.begin(), server::kConnectionFlags.end());
  args.reject_unknown(known);
  if (args.positional().size() != 1) throw UsageError("expected one JOB_ID");
  const std::string id = args.positional().front();
  const std::string format = args.get("format", "latents");
  if (format != "latents" && format != "mp4") throw UsageError("--format must be latents or mp4");

  std::string out = args.require("out");
  if (fs::is_directory(out) || out.back() == '/') {
    fs::create_directories(out);
    out = (fs::path(out) / (id + (format == "mp4" ? ".mp4" : ".safetensors"))).string();
  } else if (fs::path(out).has_parent_path()) {
    fs::create_directories(fs::path(out).parent_path());
  }

  server::Client client(server::connection_from(args));
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(format == "mp4" ? pb::RESULT_FORMAT_MP4 : pb::RESULT_FORMAT_LATENTS);
  request.set_no_wait(args.has("no-wait"));
  std::vector<std::string> chunks;
  const grpc::Status status =
      server::download_chunks(client, request, [&](int32_t index, int32_t count, std::string bytes) {
        std::cerr << "chunk " << index + 1 << "/" << count << ": " << bytes.size() << " bytes\n";
        if (args.has("per-chunk")) {
          const fs::path p = fs::path(out).replace_extension("");
          server::write_binary_file(
              p.string() + ".chunk" + std::to_string(index) + (format == "mp4" ? ".mp4" : ".safetensors"), bytes);
        }
        chunks.push_back(std::move(bytes));
      });
  if (!status.ok()) {
    std::cerr << "skyreels download: " << server::describe(status) << "\n";
    return 1;
  }
  if (chunks.empty()) {
    std::cerr << "skyreels download: no chunk is available yet\n";
    return 1;
  }
  if (format == "mp4") {
    std::string joined;
    for (const auto& c : chunks) joined += c;
    server::write_binary_file(out, joined);
  } else {
    server::write_binary_file(out, server::concat_latent_chunks(chunks, {{"job_id", id}}));
  }
  std::cout << out << std::endl;
  return 0;
}

}  // namespace

SKYREELS_COMMAND("download", "download a job's result from a skyreels-server", kUsage, run_download);
