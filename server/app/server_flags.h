// skyreels-server's flags, declared once: one row per flag (name, the ServerOptions member it sets, bounds, default,
// help) generates the usage text, the parser, the environment variable SKYREELS_<NAME> each flag also reads (as TGI's
// launcher offers one per flag: a PostgreSQL URL with its password stays out of the process list) and
// `--print-flags`. Adding a flag is its member here and its row in server_flags.cpp (and its line in the operations
// contract, docs/ARCHITECTURE.md, which tests/test_deploy.cpp checks). gRPC-free.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/lora.h"
#include "server/api/service.h"
#include "server/job/limits.h"
#include "server/queue/job_queue.h"

namespace skyreels::server {

// The scheduler's options as the server starts it: SchedulerOptions' defaults, but for a cap of 16 unfinished jobs per
// client (a queue built by a test or a benchmark does without one).
SchedulerOptions server_scheduling();

// What the flags set. Defaults here are the documented ones (the scheduler's: SchedulerOptions').
struct ServerOptions {
  // model
  std::string model, vae, vae_device, text_encoder, tokenizer, image_encoder, image_processor;
  bool demo = false;
  std::string devices = "auto";
  std::string parallel = "cfg=1,ulysses=1";  // --parallel: each replica's layout (model/parallel_layout.h)
  int64_t collective_timeout_seconds = 120;  // how long a rank waits for its peers in one exchange
  bool shard_weights = false;                // --shard-weights
  std::string dtype = "auto";
  std::vector<model::LoraSpec> loras;  // --lora, in order
  std::string lora_dir;                // adapters chosen per request
  std::string magcache_ratios;         // MagCache's ratios of the model (skyreels calibrate-magcache)
  int64_t max_resident_adapters = 4;   // per replica (model::kDefaultMaxResident)
  bool strict_adapters = false;
  // network
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen = "0.0.0.0:9090";
  std::string http_listen;  // empty: no HTTP listener
  int64_t http_idle_timeout_seconds = 30;
  std::string webhook_secret_file, webhook_allow_hosts;  // both, or no webhooks
  int64_t webhook_takeover_seconds = 30;
  std::string tls_cert, tls_key, api_keys;
  // limits
  int64_t max_frames = 1457, max_height = 1280, max_width = 1280, max_steps = 100;
  int64_t max_chunk_tokens = 0, max_job_work = 0;  // 0: derived (server/limits.h)
  int64_t kv_cache_bytes = -1;                       // < 0: derived (server/limits.h)
  int64_t max_chunks = kDefaultMaxChunks;
  int64_t drain_timeout_seconds = 600;
  TransportLimits transport;
  SchedulerOptions scheduling = server_scheduling();  // --max-queue, --chunk-retries, --result-ttl-seconds, ...
  // jobs that survive a restart
  std::string data_dir = "./skyreels-data";
  std::string job_store;  // empty: sqlite:<data_dir>/jobs.sqlite
  std::string pod_name;   // empty: $HOSTNAME, else the host name
  double lease_seconds = 30;
  // test hooks: refused at start unless enable_test_hooks (--enable-test-hooks, command line only)
  bool enable_test_hooks = false;
  std::string fault_inject;
  int64_t step_delay_ms = 0, block_delay_ms = 0;
  int64_t job_store_max_growth_pages = -1;  // < 0: no cap (a SQLite store only)
  // other
  std::string log_level = "info";
};

// A bad flag or flag value (exit status 2, with the usage).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ServerFlag {
  std::string name;         // without the dashes: "max-queue"
  std::string group;        // the usage's heading
  std::string value;        // the placeholder ("N", "DIR"); empty for a switch
  std::string help;         // one paragraph; the usage wraps it
  std::string default_text; // what the usage and --print-flags say the default is ("" : none)
  std::string bounds;       // "[1, 1000000]" for numbers ("" : none)
  bool repeatable = false;  // --lora: each occurrence adds one (the environment variable: comma-separated)
  bool secret = false;      // --print-flags shows only whether it is set
  bool command_line_only = false;  // no environment variable (--enable-test-hooks: a stray variable must not count)
  std::function<void(ServerOptions&, const std::string& value)> apply;  // throws UsageError without the flag's name
  std::function<std::string(const ServerOptions&)> current;            // the value in effect, as text

  std::string env() const;  // SKYREELS_MAX_QUEUE
};

// Every flag, in the usage's order.
const std::vector<ServerFlag>& server_flags();

// The usage text: synopsis, every group's flags with their help and defaults, and the shutdown behaviour.
std::string server_usage();

// Flags from `argv` over the environment (`getenv`; each flag's SKYREELS_<NAME>), then the checks between flags
// (--model or --demo, TLS and webhook pairs, lease floor; a test hook given without --enable-test-hooks, or
// --enable-test-hooks with --api-keys) unless `check` is false. Throws UsageError naming the flag (or the environment
// variable) and what it expects. --help, --version and --print-flags are the caller's.
ServerOptions parse_server_flags(int argc, char** argv,
                                 const std::function<const char*(const char*)>& getenv = nullptr, bool check = true);

// The test hooks in effect, as "--name=value" (those whose value is not the default), in the table's order.
std::vector<std::string> active_test_hooks(const ServerOptions& options);

// `--print-flags`: a line per flag: --name, SKYREELS_NAME ("(none)" for a command-line-only flag), the value in effect
// (secrets: "(set)"), the default, the bounds and the group, tab-separated after a header line.
std::string print_server_flags(const ServerOptions& options);

}  // namespace skyreels::server
