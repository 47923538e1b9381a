#include "server/app/server_flags.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace skyreels::server {

namespace {

using O = ServerOptions;

const char* const kModel = "model";
const char* const kNetwork = "network";
const char* const kLimits = "limits";
const char* const kDurable = "jobs that survive a restart";
const char* const kHooks = "test hooks";
const char* const kEnableTestHooks = "enable-test-hooks";  // the one flag that unlocks the rest of kHooks
const char* const kOther = "other";

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

ServerFlag row(std::string name, std::string group, std::string value, std::string help) {
  ServerFlag f;
  f.name = std::move(name);
  f.group = std::move(group);
  f.value = std::move(value);
  f.help = std::move(help);
  return f;
}

// ---- row builders: each binds a flag to its member and says how a value is parsed and bounded ----------------------

ServerFlag text(std::string name, std::string O::*member, std::string group, std::string value, std::string help) {
  ServerFlag f = row(std::move(name), std::move(group), std::move(value), std::move(help));
  f.default_text = O{}.*member;
  f.apply = [member](O& o, const std::string& v) { o.*member = v; };
  f.current = [member](const O& o) { return o.*member; };
  return f;
}

int64_t parse_integer(const std::string& v, int64_t lo, int64_t hi) {
  try {
    size_t used = 0;
    const int64_t n = std::stoll(v, &used);
    if (used == v.size() && n >= lo && n <= hi) return n;
  } catch (const std::exception&) {
  }
  throw UsageError("'" + v + "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

std::string integer_bounds(int64_t lo, int64_t hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"; }

ServerFlag integer(std::string name, int64_t O::*member, int64_t lo, int64_t hi, std::string group,
                   std::string value, std::string help) {
  ServerFlag f = row(std::move(name), std::move(group), std::move(value), std::move(help));
  f.default_text = std::to_string(O{}.*member);
  f.bounds = integer_bounds(lo, hi);
  f.apply = [member, lo, hi](O& o, const std::string& v) { o.*member = parse_integer(v, lo, hi); };
  f.current = [member](const O& o) { return std::to_string(o.*member); };
  return f;
}

// A member of TransportLimits (the transport's caps), as an integer flag.
ServerFlag transport(std::string name, int64_t TransportLimits::*member, int64_t lo, int64_t hi, std::string group,
                     std::string help) {
  ServerFlag f = row(std::move(name), std::move(group), "N", std::move(help));
  f.default_text = std::to_string(TransportLimits{}.*member);
  f.bounds = integer_bounds(lo, hi);
  f.apply = [member, lo, hi](O& o, const std::string& v) { o.transport.*member = parse_integer(v, lo, hi); };
  f.current = [member](const O& o) { return std::to_string(o.transport.*member); };
  return f;
}

double parse_real(const std::string& v, double lo, double hi) {
  try {
    size_t used = 0;
    const double d = std::stod(v, &used);
    if (used == v.size() && std::isfinite(d) && d >= lo && d <= hi) return d;
  } catch (const std::exception&) {
  }
  throw UsageError("'" + v + "' is not a number in [" + format_number(lo) + ", " + format_number(hi) + "]");
}

std::string real_bounds(double lo, double hi) { return "[" + format_number(lo) + ", " + format_number(hi) + "]"; }

ServerFlag real(std::string name, double O::*member, double lo, double hi, std::string group, std::string value,
                std::string help) {
  ServerFlag f = row(std::move(name), std::move(group), std::move(value), std::move(help));
  f.default_text = format_number(O{}.*member);
  f.bounds = real_bounds(lo, hi);
  f.apply = [member, lo, hi](O& o, const std::string& v) { o.*member = parse_real(v, lo, hi); };
  f.current = [member](const O& o) { return format_number(o.*member); };
  return f;
}

// ---- the scheduler's flags: each writes a member of SchedulerOptions, whose default it shows ------------------------

using S = SchedulerOptions;

// `read` turns the flag's text into the member's value, `show` the value back into text.
template <typename T>
ServerFlag scheduling(std::string name, T S::*member, std::string value, std::string help,
                      std::function<T(const std::string&)> read, std::function<std::string(const T&)> show) {
  ServerFlag f = row(std::move(name), kLimits, std::move(value), std::move(help));
  f.default_text = show(O{}.scheduling.*member);
  f.apply = [member, read](O& o, const std::string& v) { o.scheduling.*member = read(v); };
  f.current = [member, show](const O& o) { return show(o.scheduling.*member); };
  return f;
}

template <typename Int>
ServerFlag count(std::string name, Int S::*member, int64_t lo, int64_t hi, std::string help) {
  ServerFlag f = scheduling<Int>(
      std::move(name), member, "N", std::move(help),
      [lo, hi](const std::string& v) { return static_cast<Int>(parse_integer(v, lo, hi)); },
      [](const Int& n) { return std::to_string(n); });
  f.bounds = integer_bounds(lo, hi);
  return f;
}

// A time given in whole seconds.
template <typename Duration>
ServerFlag whole_seconds(std::string name, Duration S::*member, int64_t lo, int64_t hi, std::string help) {
  ServerFlag f = scheduling<Duration>(
      std::move(name), member, "N", std::move(help),
      [lo, hi](const std::string& v) { return Duration(std::chrono::seconds(parse_integer(v, lo, hi))); },
      [](const Duration& d) { return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count()); });
  f.bounds = integer_bounds(lo, hi);
  return f;
}

// A time given in seconds, kept to the millisecond.
ServerFlag seconds(std::string name, std::chrono::milliseconds S::*member, double lo, double hi, std::string help) {
  ServerFlag f = scheduling<std::chrono::milliseconds>(
      std::move(name), member, "S", std::move(help),
      [lo, hi](const std::string& v) {
        return std::chrono::milliseconds(static_cast<int64_t>(parse_real(v, lo, hi) * 1000.0));
      },
      [](const std::chrono::milliseconds& ms) { return format_number(static_cast<double>(ms.count()) / 1000.0); });
  f.bounds = real_bounds(lo, hi);
  return f;
}

ServerFlag real(std::string name, double S::*member, double lo, double hi, std::string help) {
  ServerFlag f = scheduling<double>(
      std::move(name), member, "S", std::move(help), [lo, hi](const std::string& v) { return parse_real(v, lo, hi); },
      [](const double& d) { return format_number(d); });
  f.bounds = real_bounds(lo, hi);
  return f;
}

ServerFlag toggle(std::string name, bool O::*member, std::string group, std::string help) {
  ServerFlag f = row(std::move(name), std::move(group), "", std::move(help));
  f.apply = [member](O& o, const std::string& v) {
    if (v == "1" || v == "true") {
      o.*member = true;
    } else if (v == "0" || v == "false") {
      o.*member = false;
    } else {
      throw UsageError("'" + v + "' is not true, false, 1 or 0");
    }
  };
  f.current = [member](const O& o) { return std::string(o.*member ? "true" : "false"); };
  return f;
}

ServerFlag with_default(ServerFlag f, std::string text) {
  f.default_text = std::move(text);
  return f;
}

ServerFlag secret(ServerFlag f) {
  f.secret = true;
  return f;
}

// The `lora` row: repeatable, each value read by model::parse_lora_spec; its current value lists them all.
ServerFlag lora_flag() {
  ServerFlag lora = row("lora", kModel, "FILE[:SCALE]",
                  "a LoRA adapter (diffusers/PEFT, original/kohya or musubi keys, as diffusers reads them) merged "
                  "into the weights at load: W + SCALE * (alpha / r) * B @ A in float32, then cast (default SCALE "
                  "1); repeatable, applied in order. GetServerInfo lists them");
  lora.repeatable = true;
  lora.apply = [](O& o, const std::string& v) {
    try {
      o.loras.push_back(model::parse_lora_spec(v));
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  };
  lora.current = [](const O& o) {
    std::string all;
    for (const auto& l : o.loras) all += (all.empty() ? "" : ",") + l.path + ":" + format_number(l.scale);
    return all;
  };
  return lora;
}

// ---- the flag table: one function per group, in the table's order (usage, --print-flags); each appends its rows ----

// model
void add_model_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      text("model", &O::model, kModel, "DIR", "transformer checkpoint (diffusers or original layout, single or sharded)"),
      toggle("demo", &O::demo, kModel,
             "a tiny random-weight model written to a temp dir and loaded as usual (tests, demos)"),
      text("vae", &O::vae, kModel, "DIR",
           "Wan VAE (diffusers layout): results also as MP4, decoded chunk by chunk on demand (a job that asks for MP4 "
           "at submit, or its first MP4 download); \"demo\": a tiny random VAE. Without it, results are latents only"),
      with_default(text("vae-device", &O::vae_device, kModel, "DEV", "where the VAE decodes"),
                   "the first replica's device, next to its transformer"),
      text("text-encoder", &O::text_encoder, kModel, "DIR",
           "UMT5 encoder for text prompts; without it, text prompts answer FAILED_PRECONDITION"),
      with_default(text("tokenizer", &O::tokenizer, kModel, "DIR", "its spiece.model"),
                   "found next to the text encoder"),
      text("image-encoder", &O::image_encoder, kModel, "DIR",
           "CLIP image encoder of an image-to-video (I2V) checkpoint's i2v pipeline (required with one): a "
           "transformers folder, a pipeline folder holding image_encoder/, or the original open-clip weights; it runs "
           "next to the VAE (--vae-device)"),
      with_default(text("image-processor", &O::image_processor, kModel, "DIR", "its preprocessor_config.json"),
                   "found beside the encoder, as diffusers lays out a pipeline"),
      text("devices", &O::devices, kModel, "LIST",
           "auto (every CUDA device, else one CPU replica), cpu, cuda:0,cuda:1; repeats such as cpu,cpu make several "
           "replicas; CPU replicas split the cores evenly"),
      text("parallel", &O::parallel, kModel, "cfg=C,ulysses=U",
           "one video on several devices: --devices are grouped in order into replicas of C x U ranks (threads joined "
           "by torch's c10d over Gloo); cfg=2 runs a guided row's two passes at once, ulysses=U splits the tokens "
           "(U divides the model's attention heads); the scheduler sees each group as one replica"),
      integer("collective-timeout-seconds", &O::collective_timeout_seconds, 1, 3600, kModel, "S",
              "how long a rank of a --parallel replica waits for its peers in one exchange before its chunk fails "
              "(and is retried)"),
      toggle("shard-weights", &O::shard_weights, kModel,
             "with --parallel: each rank keeps 1/(C x U) of every transformer block's weights and gathers a block's "
             "whole weights from its peers just before running it (the same numbers, a fraction of the memory)"),
      text("dtype", &O::dtype, kModel, "auto|float32|bfloat16",
           "auto: bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32"),
      lora_flag(),
      text("lora-dir", &O::lora_dir, kModel, "DIR",
           "LoRA adapters chosen per request (GenerationParams.loras, `lora` on /v1/videos): every *.safetensors file "
           "in DIR by its name without .safetensors, read from its header and hashed (SHA-256) at start, applied "
           "unmerged (the weights never change; no reload), loaded onto a replica on first use. A damaged or unfitting "
           "file is listed unavailable in GetServerInfo"),
      text("magcache-ratios", &O::magcache_ratios, kModel, "FILE",
           "MagCache's magnitude ratios of --model (`skyreels calibrate-magcache`), for jobs with cache \"magcache\" "
           "(refused without it); checked against the model at start"),
      integer("max-resident-adapters", &O::max_resident_adapters, 1, 1024, kModel, "N",
              "adapters each replica keeps on its device, least recently used out first"),
      toggle("strict-adapters", &O::strict_adapters, kModel,
             "refuse to start when a file in --lora-dir is damaged or does not fit the model"),
  });
}

// network
void add_network_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      text("listen", &O::listen, kNetwork, "HOST:PORT", "gRPC"),
      text("metrics-listen", &O::metrics_listen, kNetwork, "HOST:PORT", "Prometheus /metrics"),
      with_default(
          text("http-listen", &O::http_listen, kNetwork, "HOST:PORT",
               "HTTP/1.1 next to gRPC: OpenAI's Videos API at /v1/videos, /skyreels/v1, /healthz, /readyz and "
               "/metrics; the same API keys (Authorization: Bearer KEY), caps and admission as gRPC, and the same "
               "--tls-cert/--tls-key; connections at most --max-streams (--max-streams-per-client per address), bodies "
               "at most the request limit"),
          "off"),
      integer("http-idle-timeout-seconds", &O::http_idle_timeout_seconds, 1, 3600, kNetwork, "N",
              "an HTTP connection that sends nothing for N s is closed"),
      text("webhook-secret-file", &O::webhook_secret_file, kNetwork, "FILE",
           "jobs may carry a webhook (SubmitJobRequest.webhook, webhook_url over HTTP): their events are POSTed signed "
           "as Standard Webhooks with this key (\"whsec_\" + base64, or raw), from a durable outbox in the job store, "
           "retried with back-off"),
      text("webhook-allow-hosts", &O::webhook_allow_hosts, kNetwork, "LIST",
           "the hosts a webhook may call, comma-separated: exact names or *.example.com (so that a client cannot make "
           "the server call internal addresses)"),
      integer("webhook-takeover-seconds", &O::webhook_takeover_seconds, 1, 86400, kNetwork, "N",
              "pods sharing a store: a pod delivers another pod's job's webhook event once it is N s overdue (the "
              "accepting pod is gone or stuck)"),
      text("tls-cert", &O::tls_cert, kNetwork, "FILE", "serve TLS with this certificate (with --tls-key)"),
      text("tls-key", &O::tls_key, kNetwork, "FILE", "and this key (both or neither)"),
      text("api-keys", &O::api_keys, kNetwork, "FILE",
           "require a key per call: lines 'KEY [CLIENT_NAME] [max_priority=N] [max_jobs=N] [max_streams=N]' (keys >= "
           "32 characters); each client sees only its own jobs; SIGHUP reloads the file (TLS certificate and key: "
           "re-read every 10 s)"),
  });
}

// limits
void add_limit_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      count("max-queue", &S::max_jobs, 1, 1000000,
            "jobs admitted and not finished; more: RESOURCE_EXHAUSTED + retry-after-ms"),
      count("max-jobs-per-client", &S::max_jobs_per_client, 1, 1000000,
            "of those, per client (API key, else peer address); more: the same"),
      transport("max-streams", &TransportLimits::max_streams, 1, 100000, kLimits,
                "open WatchJob/DownloadResult/Generate streams in total; more: RESOURCE_EXHAUSTED for the new stream"),
      transport("max-streams-per-client", &TransportLimits::max_streams_per_client, 1, 100000, kLimits,
                "the same per client"),
      transport("max-concurrent-encodes", &TransportLimits::max_concurrent_encodes, 1, 1024, kLimits,
                "text prompts encoded at once, and image / video inputs decoded at once (each); more: "
                "RESOURCE_EXHAUSTED + retry-after-ms"),
      integer("max-frames", &O::max_frames, 1, 100000, kLimits, "N", "pixel frames of one video"),
      integer("max-steps", &O::max_steps, 1, 10000, kLimits, "N", "denoising steps of one video"),
      integer("max-height", &O::max_height, 16, 16384, kLimits, "N", "pixels"),
      integer("max-width", &O::max_width, 16, 16384, kLimits, "N", "pixels"),
      with_default(integer("max-chunk-tokens", &O::max_chunk_tokens, 1, int64_t{1} << 40, kLimits, "N",
                           "transformer tokens of one chunk; more: INVALID_ARGUMENT naming the flag"),
                   "derived from the model and the device memory, at most 131072"),
      with_default(integer("max-job-work", &O::max_job_work, 1, int64_t{1} << 60, kLimits, "N",
                           "token-forwards of one job, tokens x rows x guidance passes summed over its chunks"),
                   "24 chunks of --max-chunk-tokens at --max-steps with guidance"),
      with_default(integer("kv-cache-bytes", &O::kv_cache_bytes, 0, int64_t{1} << 50, kLimits, "N",
                           "memory for the kept keys/values of final frames per chunk loop (exact savings)"),
                   "a fifth of the memory left after the weights, 4 GiB when unknown"),
      integer("max-chunks", &O::max_chunks, 1, 100000, kLimits, "N", "chunks of one job"),
      count("chunk-retries", &S::chunk_retries, 0, 100,
            "attempts after a failed chunk, on another replica when possible"),
      count("chunk-takeover-limit", &S::chunk_takeover_limit, 0, 1000,
            "takeovers of a chunk whose process died or went silent before its job fails (counted apart from "
            "--chunk-retries: a crash is not the chunk's error)"),
      count("replica-failure-limit", &S::replica_failure_limit, 1, 1000000,
            "consecutive failed chunks before a replica is taken out"),
      seconds("replica-retest-seconds", &S::retest_backoff, 0, 604800,
              "a replica taken out is re-tested (one warm-up forward) after S seconds, then after twice as long each "
              "time it fails again"),
      seconds("replica-retest-max-seconds", &S::retest_backoff_max, 0, 604800, "cap of that back-off"),
      whole_seconds("liveness-grace-seconds", &S::liveness_grace, 1, 86400 * 7,
                    "liveness turns NOT_SERVING (the pod is restarted) once no replica has been healthy for N seconds"),
      real("handoff-cost-seconds", &S::handoff_cost_seconds, 0, 604800,
           "what moving a job to another replica is assumed to cost"),
      integer("drain-timeout-seconds", &O::drain_timeout_seconds, 0, 86400 * 7, kLimits, "N",
              "on SIGTERM, how long accepted jobs may still run"),
      whole_seconds("result-ttl-seconds", &S::retention, 1, 86400 * 30,
                    "how long finished jobs and their results are kept"),
      count("max-retained-jobs", &S::max_retained_jobs, 0, 1000000, "finished jobs kept at most, oldest dropped first"),
  });
}

// jobs that survive a restart
void add_durable_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      text("data-dir", &O::data_dir, kDurable, "DIR",
           "where the server keeps its state (the container uses /var/lib/skyreels)"),
      secret(with_default(
          text("job-store", &O::job_store, kDurable,
               "memory|sqlite:PATH[?synchronous=full]|postgresql://USER[:PASSWORD]@HOST[:PORT]/DB",
               "where jobs, their chunk results, MP4 segments and chunk events are kept (SKYREELS_JOB_STORE keeps a "
               "password out of the process list): on start, unfinished jobs resume at their last finished chunk; "
               "memory keeps nothing across a restart. sqlite:PATH?synchronous=full: every commit also survives a "
               "power loss (an fsync each). A corrupt, newer-schema or locked (another server's) store file, or an "
               "unreachable or newer-schema PostgreSQL store, is a startup error. PostgreSQL: several servers (pods) "
               "share the store as peers: any of them accepts, answers and streams any job, and their replicas claim "
               "chunks under leases"),
          "sqlite:<--data-dir>/jobs.sqlite")),
      with_default(text("pod-name", &O::pod_name, kDurable, "NAME", "this server among peers, in chunk leases and events"),
                   "$HOSTNAME"),
      real("lease-seconds", &O::lease_seconds, 0.2, 604800, kDurable, "S",
           "a chunk lease's time to live, renewed every S/3 while the chunk runs; a pod that stops renewing loses the "
           "chunk to another pod after S seconds"),
  });
}

ServerFlag command_line_only(ServerFlag f) {
  f.command_line_only = true;
  return f;
}

// --job-store-max-growth-pages: unset (-1) shows as no value, as an unset text flag does.
ServerFlag growth_pages_flag() {
  ServerFlag f = with_default(
      integer("job-store-max-growth-pages", &O::job_store_max_growth_pages, 0, int64_t{1} << 40, kHooks, "N",
              "a sqlite: job store's file may grow by N pages (of 4 KiB) at most; past them SQLite answers "
              "SQLITE_FULL, as on a full disk"),
      "no cap");
  f.current = [](const O& o) {
    return o.job_store_max_growth_pages < 0 ? std::string() : std::to_string(o.job_store_max_growth_pages);
  };
  return f;
}

// test hooks
void add_test_hook_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      command_line_only(toggle(
          kEnableTestHooks, &O::enable_test_hooks, kHooks,
          "allow the flags below (command line only: it has no environment variable, and without it any of them, "
          "or its SKYREELS_ variable, stops the start with exit status 2); a warning at start, GetServerInfo "
          "(test_hooks_enabled, test_hooks) and skyreels_test_hooks_enabled 1 say so; refused with --api-keys. "
          "Tests only: the hooks fail or slow jobs on purpose")),
      text("fault-inject", &O::fault_inject, kHooks, "SPEC",
           "REPLICA@N[+][:KIND],...: the N-th chunk run on REPLICA (e.g. cpu:1@2) fails after its first step ('+': "
           "and every later run); KIND error (default), oom (an out-of-memory error: the job fails "
           "RESOURCE_EXHAUSTED), dead (re-tests fail too) or kill (the process dies by SIGKILL); REPLICA \"vae\": the "
           "N-th chunk's MP4 encode throws"),
      integer("step-delay-ms", &O::step_delay_ms, 0, 600000, kHooks, "N",
              "sleep N ms after every denoising step (slows the tiny model down for tests)"),
      integer("block-delay-ms", &O::block_delay_ms, 0, 600000, kHooks, "N",
              "sleep N ms at every stop check, i.e. after every transformer block and before every step (a long "
              "forward, for tests)"),
      growth_pages_flag(),
  });
}

// other
void add_other_flags(std::vector<ServerFlag>& flags) {
  flags.insert(flags.end(), {
      text("log-level", &O::log_level, kOther, "LEVEL", "trace, debug, info, warn, error"),
  });
}

std::vector<ServerFlag> make_flags() {
  std::vector<ServerFlag> flags;
  add_model_flags(flags);
  add_network_flags(flags);
  add_limit_flags(flags);
  add_durable_flags(flags);
  add_test_hook_flags(flags);
  add_other_flags(flags);
  return flags;
}

// `text` wrapped to `width` columns for a line whose text starts at column `indent`; later lines are indented so.
std::string wrap(const std::string& text, size_t indent, size_t width) {
  std::string out;
  size_t column = indent;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!out.empty() && column + 1 + word.size() > width) {
      out += "\n" + std::string(indent, ' ');
      column = indent;
    } else if (!out.empty()) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
  }
  return out;
}

constexpr size_t kHelpColumn = 30;
constexpr size_t kWidth = 118;

const char* const kSynopsis = R"(usage: skyreels-server --model DIR [flags]
       skyreels-server --demo [flags]

Serves SkyReels-V2 video generation (diffusion forcing; text-to-video and image-to-video checkpoints) over gRPC
(skyreels.v1.VideoService), one model replica per device, with grpc.health.v1 (service "" = readiness, "liveness"),
server reflection and Prometheus metrics. Every flag but --enable-test-hooks also reads the environment variable
SKYREELS_<NAME> (--max-queue: SKYREELS_MAX_QUEUE; --lora: comma-separated); the command line wins. --print-flags lists
them with their values.
)";

const char* const kShutdown = R"(
SIGTERM/SIGINT drain: readiness turns NOT_SERVING and new jobs get UNAVAILABLE at once; accepted jobs (queued ones
too) keep running until done or --drain-timeout-seconds, then the rest stop after their current transformer block
(FAILED, UNAVAILABLE); results stay downloadable for a short grace, then the process exits 0. Chunks that have not
stopped 5 s later are abandoned: the process logs event=exit forced=true and exits 0. A second signal stops at once.
)";

std::string usage_line(const ServerFlag& f) {
  std::string left = "  --" + f.name + (f.value.empty() ? "" : " " + f.value);
  std::string help = f.help;
  if (!f.default_text.empty()) help += " (default " + f.default_text + ")";
  // A long flag (--job-store's forms) gets its own line; the help starts on the next.
  if (left.size() + 1 >= kHelpColumn) return left + "\n" + std::string(kHelpColumn, ' ') + wrap(help, kHelpColumn, kWidth) + "\n";
  left.resize(kHelpColumn, ' ');
  return left + wrap(help, kHelpColumn, kWidth) + "\n";
}

// Whether `flag` ("--max-queue" or "--max-queue=7") names row `f`; its inline value into *value.
bool names(const ServerFlag& f, const std::string& arg, std::string* value, bool* inline_value) {
  const std::string dashed = "--" + f.name;
  if (arg == dashed) return true;
  if (arg.size() > dashed.size() && arg.compare(0, dashed.size(), dashed) == 0 && arg[dashed.size()] == '=') {
    *value = arg.substr(dashed.size() + 1);
    *inline_value = true;
    return true;
  }
  return false;
}

void apply(const ServerFlag& f, ServerOptions& o, const std::string& value, const std::string& where) {
  try {
    f.apply(o, value);
  } catch (const UsageError& e) {
    throw UsageError(where + ": " + e.what());
  }
}

// In Kubernetes $HOSTNAME is the pod's name.
std::string default_pod_name(const std::function<const char*(const char*)>& getenv) {
  if (const char* env = getenv("HOSTNAME"); env != nullptr && *env != '\0') return env;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0 && host[0] != '\0') return host;
  return "pod";
}

// Per row of the table, where its value came from: "--name", "SKYREELS_NAME", or "" (the default).
using Sources = std::vector<std::string>;

Sources flags_on_command_line(int argc, char** argv) {
  Sources given(server_flags().size());
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    for (size_t k = 0; k < server_flags().size(); ++k) {
      std::string unused;
      bool inline_value = false;
      if (names(server_flags()[k], arg, &unused, &inline_value)) given[k] = "--" + server_flags()[k].name;
    }
  }
  return given;
}

// Each flag's variable, unless the command line names the flag (`given`) or it has none; records those it applies.
void apply_environment(ServerOptions& o, const std::function<const char*(const char*)>& getenv, Sources& given) {
  for (size_t k = 0; k < server_flags().size(); ++k) {
    const ServerFlag& f = server_flags()[k];
    if (!given[k].empty() || f.command_line_only) continue;
    const char* env = getenv(f.env().c_str());
    if (env == nullptr || *env == '\0') continue;
    given[k] = f.env();
    if (!f.repeatable) {
      apply(f, o, env, f.env());
      continue;
    }
    std::stringstream list(env);
    for (std::string item; std::getline(list, item, ',');) {
      if (!item.empty()) apply(f, o, item, f.env());
    }
  }
}

void apply_command_line(ServerOptions& o, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const ServerFlag* flag = nullptr;
    std::string value;
    bool inline_value = false;
    for (const ServerFlag& f : server_flags()) {
      if (names(f, arg, &value, &inline_value)) {
        flag = &f;
        break;
      }
    }
    if (flag == nullptr) throw UsageError("unknown flag '" + arg + "'");
    if (flag->value.empty() && !inline_value) {
      value = "true";  // a switch
    } else if (!inline_value) {
      if (i + 1 >= argc) throw UsageError("--" + flag->name + ": needs a value");
      value = argv[++i];
    }
    apply(*flag, o, value, "--" + flag->name);
  }
}

const std::string& source_of(const Sources& given, const std::string& name) {
  for (size_t k = 0; k < server_flags().size(); ++k) {
    if (server_flags()[k].name == name) return given[k];
  }
  throw std::logic_error("no flag --" + name);
}

// A test hook fails or slows jobs on purpose: one stray flag or variable in a production pod spec must stop the start,
// not go unnoticed. Only --enable-test-hooks on the command line unlocks them, and a server that requires API keys is
// a production one.
void check_test_hooks(const ServerOptions& o, const Sources& given) {
  std::vector<std::string> hooks;
  for (size_t k = 0; k < server_flags().size(); ++k) {
    const ServerFlag& f = server_flags()[k];
    if (f.group == kHooks && f.name != kEnableTestHooks && !given[k].empty()) hooks.push_back(given[k]);
  }
  if (!o.enable_test_hooks && !hooks.empty()) {
    std::string names;
    for (const std::string& h : hooks) names += (names.empty() ? "" : ", ") + h;
    throw UsageError(names + (hooks.size() == 1 ? " is a test hook" : " are test hooks") +
                     ", refused without --enable-test-hooks on the command line (test hooks fail or slow jobs on "
                     "purpose)");
  }
  if (o.enable_test_hooks && !o.api_keys.empty()) {
    throw UsageError("--enable-test-hooks and " + source_of(given, "api-keys") +
                     " exclude each other: a server that requires API keys is a production server, and test hooks "
                     "are for tests only");
  }
}

void check_between_flags(ServerOptions& o, const std::function<const char*(const char*)>& getenv) {
  if (o.model.empty() == !o.demo)
    throw UsageError(o.demo ? "--demo and --model exclude each other" : "--model DIR is required (or --demo)");
  if (o.tls_cert.empty() != o.tls_key.empty()) throw UsageError("--tls-cert and --tls-key go together");
  if (o.webhook_secret_file.empty() != o.webhook_allow_hosts.empty()) {
    throw UsageError("--webhook-secret-file and --webhook-allow-hosts go together");
  }
  if (o.pod_name.empty()) o.pod_name = default_pod_name(getenv);
}

}  // namespace

SchedulerOptions server_scheduling() {
  SchedulerOptions scheduling;
  scheduling.max_jobs_per_client = 16;
  return scheduling;
}

std::string ServerFlag::env() const {
  std::string env = "SKYREELS_";
  for (char c : name) env += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

const std::vector<ServerFlag>& server_flags() {
  static const std::vector<ServerFlag> flags = make_flags();
  return flags;
}

std::string server_usage() {
  std::string usage = kSynopsis;
  std::string group;
  for (const ServerFlag& f : server_flags()) {
    if (f.group != group) {
      group = f.group;
      usage += "\n" + group + ":\n";
    }
    usage += usage_line(f);
  }
  usage += "  --print-flags               every flag: its environment variable, value in effect, default and bounds\n";
  usage += "  --help, --version\n";
  return usage + kShutdown;
}

ServerOptions parse_server_flags(int argc, char** argv, const std::function<const char*(const char*)>& getenv_fn,
                                 bool check) {
  const std::function<const char*(const char*)> getenv =
      getenv_fn ? getenv_fn : [](const char* name) { return static_cast<const char*>(std::getenv(name)); };
  ServerOptions o;
  // The environment first (a repeatable flag's variable is a comma-separated list), the command line over it.
  Sources given = flags_on_command_line(argc, argv);
  apply_environment(o, getenv, given);
  apply_command_line(o, argc, argv);
  if (check) {
    check_test_hooks(o, given);
    check_between_flags(o, getenv);
  }
  return o;
}

std::vector<std::string> active_test_hooks(const ServerOptions& options) {
  const ServerOptions defaults;
  std::vector<std::string> hooks;
  for (const ServerFlag& f : server_flags()) {
    if (f.group != kHooks || f.name == kEnableTestHooks) continue;
    const std::string value = f.current(options);
    if (value != f.current(defaults)) hooks.push_back("--" + f.name + "=" + value);
  }
  return hooks;
}

std::string print_server_flags(const ServerOptions& options) {
  std::string out = "flag\tenvironment\tvalue\tdefault\tbounds\tgroup\n";
  for (const ServerFlag& f : server_flags()) {
    std::string value = f.current(options);
    if (f.secret && !value.empty()) value = "(set)";
    const std::string env = f.command_line_only ? "(none)" : f.env();
    out += "--" + f.name + "\t" + env + "\t" + value + "\t" + f.default_text + "\t" + f.bounds + "\t" + f.group + "\n";
  }
  return out;
}

}  // namespace skyreels::server
