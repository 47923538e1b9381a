// `skyreels submit`: sends a video job to a skyreels-server and prints its id (optionally follows it and downloads
// the result).
#include <ATen/ATen.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>

#include "cli/command.h"
#include "model/adapter_bank.h"
#include "model/safetensors.h"
#include "server/job/blob.h"
#include "server/api/client.h"
#include "server/job/generation_params_proto.h"

namespace {

using skyreels::cli::Args;
using skyreels::cli::frame_and_value;
using skyreels::cli::generation_request_from_flags;
using skyreels::cli::UsageError;
using skyreels::cli::with_generation_flags;
namespace pb = skyreels::v1;
namespace server = skyreels::server;
namespace model = skyreels::model;

const std::string kUsage =
    std::string(
        "usage: skyreels submit (--inputs IN.safetensors | --random-embeddings | --prompt TEXT) [flags]\n\n"
        "Submits a video job (diffusion forcing, or --pipeline t2v / i2v) and prints its id on stdout.\n"
        "conditioning (exactly one):\n"
        "  --inputs FILE             safetensors with prompt_embeds [1, T, text_dim] and negative_prompt_embeds\n"
        "                            (as `skyreels generate --inputs`)\n"
        "  --random-embeddings       random prompt embeddings sized for the server's model (demos, load tests);\n"
        "                            --tokens N (default 16), --embeddings-seed N (default 0)\n"
        "  --prompt TEXT             text (needs a server with a text encoder); --negative-prompt TEXT\n"
        "image-to-video / video extension (a server with --vae) and a prompt per chunk, as for `generate`:\n"
        "  --image PATH  --last-image PATH  --video PATH   PNG/JPEG/MP4 (sent as bytes) or safetensors with\n"
        "                            `image` / `last_image` / `video` float in [0, 1] (sent as tensors)\n"
        "  --prompt-at FRAME:TEXT    --inputs-at FRAME:FILE   the prompt from pixel frame FRAME on (repeatable)\n"
        "adapters (a server with --lora-dir):\n"
        "  --adapter NAME[:SCALE]    a LoRA adapter of the server's --lora-dir for this job, applied unmerged\n"
        "                            (repeatable, in order; default SCALE 1)\n"
        "job:\n"
        "  --priority P              ") +
    std::to_string(server::kMinPriority) + " .. " + std::to_string(server::kMaxPriority) +
    std::string(", higher first (default 0)\n"
        "  --timeout-seconds S       deadline relative to acceptance\n"
        "  --idempotency-key KEY     resubmitting the same request with the same key returns the same job\n"
        "  --mp4                     decode the MP4 as the chunks finish (needs a server with --vae); without it\n"
        "                            the first MP4 download of the job starts the decode\n"
        "  --wait-ready SECONDS      first wait until the server reports ready (grpc.health.v1)\n"
        "  --watch                   follow the job (progress on stderr); exit status 0 only if it succeeds\n"
        "  --out DIR                 with --watch: download the latents into DIR/<job>.safetensors\n"
        "generation parameters, diffusers' names (unset: the server applies the defaults shown):\n"
        "  --scheduler-config FILE        a diffusers scheduler_config.json of --sampler's class:\n"
        "                                 UniPCMultistepScheduler (unipc) or FlowMatchEulerDiscreteScheduler\n"
        "                                 (euler: its shift and num_train_timesteps); the defaults of\n"
        "                                 --flow-shift and of the sampler's flags below\n") +
    skyreels::server::generation_flags_help() + skyreels::server::kConnectionFlagsHelp;

bool is_safetensors(const std::string& path) {
  return path.size() >= 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0;
}

// A float32 tensor of a safetensors file as the wire's Tensor.
pb::Tensor wire_tensor(const std::string& path, const std::string& name) {
  auto file = skyreels::safetensors::File::open(path);
  if (!file->contains(name)) throw std::invalid_argument("'" + path + "' holds no tensor `" + name + "`");
  const at::Tensor t = file->tensor(name).to(at::kFloat).contiguous();
  pb::Tensor out;
  out.set_dtype(pb::DTYPE_FLOAT32);
  for (int64_t d : t.sizes()) out.add_shape(d);
  out.set_data(t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  return out;
}

void fill_pixels(const Args& args, const std::string& flag, const std::string& tensor_name, pb::PixelInput* input) {
  const std::string path = args.get(flag);
  if (is_safetensors(path)) {
    *input->mutable_tensor() = wire_tensor(path, tensor_name);
  } else {
    input->set_encoded(server::read_binary_file(path));
  }
}

// --image / --last-image / --video and --prompt-at / --inputs-at (changes sent in frame order).
void fill_conditioning(const Args& args, pb::JobSpec* spec) {
  if (args.has("image") && args.has("video")) throw UsageError("--image and --video are exclusive");
  if (args.has("last-image") && !args.has("image")) throw UsageError("--last-image needs --image");
  if (args.has("image")) fill_pixels(args, "image", "image", spec->mutable_image());
  if (args.has("last-image")) fill_pixels(args, "last-image", "last_image", spec->mutable_last_image());
  if (args.has("video")) fill_pixels(args, "video", "video", spec->mutable_video());
  std::map<int64_t, pb::PromptChange> changes;
  auto slot = [&](const std::string& flag, int64_t frame) -> pb::PromptChange& {
    if (changes.count(frame))
      throw UsageError("--" + flag + ": two prompts take over at frame " + std::to_string(frame));
    changes[frame].set_from_frame(frame);
    return changes[frame];
  };
  for (const auto& text : args.all("prompt-at")) {
    const auto [frame, prompt] = frame_and_value("prompt-at", text);
    slot("prompt-at", frame).set_text(prompt);
  }
  for (const auto& text : args.all("inputs-at")) {
    const auto [frame, path] = frame_and_value("inputs-at", text);
    pb::PromptEmbeddings* e = slot("inputs-at", frame).mutable_embeddings();
    *e->mutable_prompt_embeds() = wire_tensor(path, "prompt_embeds");
    if (skyreels::safetensors::File::open(path)->contains("negative_prompt_embeds")) {
      *e->mutable_negative_prompt_embeds() = wire_tensor(path, "negative_prompt_embeds");
    }
  }
  for (auto& [frame, change] : changes) *spec->add_prompt_changes() = std::move(change);
}

// The file's bytes as they are, unless it also holds pixels (--inputs and --image may name one file, as for
// `generate`): then its two prompt tensors alone.
void set_embeddings(const std::string& path, pb::JobSpec* spec) {
  auto file = skyreels::safetensors::File::open(path);
  if (!file->contains("image") && !file->contains("last_image") && !file->contains("video")) {
    spec->set_embeddings_safetensors(server::read_binary_file(path));
    return;
  }
  *spec->mutable_embeddings()->mutable_prompt_embeds() = wire_tensor(path, "prompt_embeds");
  if (file->contains("negative_prompt_embeds")) {
    *spec->mutable_embeddings()->mutable_negative_prompt_embeds() = wire_tensor(path, "negative_prompt_embeds");
  }
}

int64_t server_text_dim(server::Client& client) {
  auto ctx = client.context(30);
  pb::ServerInfo info;
  const grpc::Status status = client.stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info);
  if (!status.ok()) throw std::runtime_error("GetServerInfo: " + server::describe(status));
  return info.model().text_dim();
}

int run_submit(const std::vector<std::string>& raw) {
  const Args args(raw, skyreels::cli::with_generation_switches({"random-embeddings", "watch", "tls", "mp4"}));
  std::vector<std::string> known =
      with_generation_flags({"inputs", "random-embeddings", "tokens", "embeddings-seed", "priority", "timeout-seconds",
                             "idempotency-key", "wait-ready", "watch", "out", "mp4", "adapter"});
  known.insert(known.end(), server::kConnectionFlags.begin(), server::kConnectionFlags.end());
  args.reject_unknown(known);
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");
  const int sources = args.has("inputs") + args.has("random-embeddings") + args.has("prompt");
  if (sources != 1) throw UsageError("give exactly one of --inputs, --random-embeddings or --prompt");
  if (args.has("out") && !args.has("watch")) throw UsageError("--out needs --watch");

  server::Client client(server::connection_from(args));
  if (args.has("wait-ready")) {
    std::string why;
    if (!client.wait_ready(args.get_double("wait-ready", 30), &why)) {
      throw std::runtime_error("server " + args.get("server", "") + " not ready: " + why);
    }
  }

  pb::SubmitJobRequest request;
  pb::JobSpec* spec = request.mutable_spec();
  if (args.has("inputs")) {
    set_embeddings(args.get("inputs"), spec);
  } else if (args.has("random-embeddings")) {
    const int64_t text_dim = server_text_dim(client);
    const int64_t tokens = args.get_int("tokens", 16);
    const auto seed = static_cast<uint64_t>(args.get_int("embeddings-seed", 0));
    *spec->mutable_embeddings()->mutable_prompt_embeds() = server::random_embeddings(tokens, text_dim, seed);
    *spec->mutable_embeddings()->mutable_negative_prompt_embeds() =
        server::random_embeddings(tokens, text_dim, seed + 1);
  } else {
    spec->mutable_text()->set_prompt(args.get("prompt"));
    spec->mutable_text()->set_negative_prompt(args.get("negative-prompt", ""));
  }
  server::request_params_to_proto(generation_request_from_flags(args), spec->mutable_params());
  for (const std::string& text : args.all("adapter")) {
    model::AdapterRequest adapter;
    try {
      adapter = model::parse_adapter_request(text);
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--adapter: ") + e.what());
    }
    pb::AdapterRef* ref = spec->mutable_params()->add_loras();
    ref->set_name(adapter.name);
    ref->set_scale(adapter.scale);
  }
  fill_conditioning(args, spec);
  request.set_priority(args.get_int("priority", 0));
  request.set_idempotency_key(args.get("idempotency-key", ""));
  request.set_produce_mp4(args.has("mp4"));
  if (args.has("timeout-seconds")) {
    const double t = args.get_double("timeout-seconds", 0);
    request.mutable_timeout()->set_seconds(static_cast<int64_t>(t));
    request.mutable_timeout()->set_nanos(static_cast<int32_t>((t - static_cast<int64_t>(t)) * 1e9));
  }

  pb::SubmitJobResponse response;
  auto ctx = client.context(120);
  const grpc::Status status = client.stub().SubmitJob(ctx.get(), request, &response);
  if (!status.ok()) {
    std::cerr << "skyreels submit: " << server::describe(status) << "\n";
    for (const auto& [key, value] : ctx->GetServerTrailingMetadata()) {
      if (key == "retry-after-ms") std::cerr << "retry after " << std::string(value.data(), value.size()) << " ms\n";
    }
    return 1;
  }
  const pb::Job& job = response.job();
  std::cout << job.job_id() << std::endl;
  std::cerr << "job " << job.job_id() << (response.deduplicated() ? " (existing, same idempotency key)" : "") << ": "
            << server::state_name(job.state()) << ", " << job.chunks_total() << " chunk(s), " << job.num_frames()
            << " frames " << job.params().width() << "x" << job.params().height() << ", seed " << job.params().seed()
            << "\n";
  if (!args.has("watch")) return 0;

  const auto outcome = server::watch_job(client, job.job_id(), ::isatty(2) != 0, std::cerr);
  if (!outcome.status.ok()) {
    std::cerr << "skyreels submit: watch: " << server::describe(outcome.status) << "\n";
    return 1;
  }
  if (outcome.job.state() != pb::JOB_STATE_SUCCEEDED) return 1;
  if (args.has("out")) {
    const std::string dir = args.get("out");
    std::filesystem::create_directories(dir);
    std::vector<std::string> chunks;
    pb::DownloadResultRequest download;
    download.set_job_id(job.job_id());
    const grpc::Status s = server::download_chunks(
        client, download, [&](int32_t, int32_t, std::string bytes) { chunks.push_back(std::move(bytes)); });
    if (!s.ok()) {
      std::cerr << "skyreels submit: download: " << server::describe(s) << "\n";
      return 1;
    }
    const std::string path = dir + "/" + job.job_id() + ".safetensors";
    server::write_binary_file(
        path, server::concat_latent_chunks(chunks,
                                           {{"job_id", job.job_id()}, {"seed", std::to_string(job.params().seed())}}));
    std::cerr << "wrote " << path << "\n";
  }
  return 0;
}

}  // namespace

SKYREELS_COMMAND("submit", "submit a video job to a skyreels-server", kUsage, run_submit);
