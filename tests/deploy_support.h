// Helpers for tests/test_deploy.cpp: read what deploy/ ships (YAML, JSON, kustomizations, Dockerfiles), the
// operations contract of docs/ARCHITECTURE.md, PromQL metric references, and talk to a running skyreels-server
// (process, Prometheus text exposition over HTTP, grpc.health.v1 checks).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace skyreels::test::deploy {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The repository root (two levels above tests/data).
fs::path repo_root();
std::string read_text(const fs::path& file);
// Regular files under `dir` whose names end in one of `suffixes`, sorted.
std::vector<fs::path> files_under(const fs::path& dir, const std::vector<std::string>& suffixes);

// --- YAML (libyaml) --------------------------------------------------------------------------------------------
// Every document of a YAML stream as JSON. Keeps YAML to what every parser reads the same way: throws
// std::runtime_error (naming `origin` and the line) on anchors, aliases, explicit tags, duplicate keys, non-string
// keys, and plain scalars that YAML 1.1 and 1.2 resolve differently (yes/no/on/off, leading-zero numbers).
// Plain scalars resolve as in YAML 1.2's core schema: null, true/false, integers, floats, else strings.
std::vector<Json> parse_yaml(const std::string& text, const std::string& origin);
std::vector<Json> load_yaml(const fs::path& file);
Json load_json(const fs::path& file);

// --- kustomize (the subset deploy/k8s uses) --------------------------------------------------------------------
// Renders a kustomization directory with the fields that kubectl 1.20's kustomize (v2.0.3) and current kustomize
// read alike: `bases` (kustomization directories), `resources` (files), `patchesStrategicMerge` (files; strategic
// merge by kind + metadata.name: lists of objects merge by their merge key, volumeMounts by mountPath and others by
// name, `$patch: delete` removes an element, other lists are replaced) and `images` (name -> newName:newTag).
// Throws on any other field, so the manifests stay that simple.
std::vector<Json> render_kustomization(const fs::path& dir);
// GCC 14's -Wdangling-reference assumes a returned reference may point into a temporary argument; this one points
// into `objects`.
#if defined(__has_cpp_attribute) && __has_cpp_attribute(gnu::no_dangling)
#define SKYREELS_RETURNS_INTO_FIRST_ARGUMENT [[gnu::no_dangling]]
#else
#define SKYREELS_RETURNS_INTO_FIRST_ARGUMENT
#endif
// The object of `kind` (and `name`, when not empty); throws when there is not exactly one.
SKYREELS_RETURNS_INTO_FIRST_ARGUMENT
const Json& only_object(const std::vector<Json>& objects, const std::string& kind, const std::string& name = "");
std::string kubectl_path();  // empty when kubectl is not on PATH

// --- Dockerfiles ------------------------------------------------------------------------------------------------
struct DockerInstruction {
  std::string keyword;    // upper case: RUN, COPY, ...
  std::string arguments;  // continuation lines joined
};
struct DockerStage {
  std::string base;  // FROM argument with global ARG defaults substituted
  std::string name;  // AS name, may be empty
  std::vector<DockerInstruction> instructions;
  std::vector<std::string> all(const std::string& keyword) const;
};
std::vector<DockerStage> parse_dockerfile(const fs::path& file);

// --- the operations contract (docs/ARCHITECTURE.md) -------------------------------------------------------------
struct MetricSpec {
  std::string name;
  std::string type;                    // counter, gauge, histogram
  std::string label;                   // the first label in the contract's row; may be empty
  std::set<std::string> labels;        // every label of the row (grpc_server_* have several)
  std::set<std::string> label_values;  // of `label`, when the contract enumerates them
};
struct Contract {
  std::set<std::string> flags;                  // --model, --devices, ...
  std::map<std::string, std::string> defaults;  // flag -> default value where the contract states one
  std::map<std::string, MetricSpec> metrics;    // by name
  std::string text;                             // the section itself
};
Contract load_contract(const fs::path& architecture_md);

// Labels Prometheus attaches to every scraped series (target labels), usable with any metric.
const std::set<std::string>& target_labels();

// --- PromQL -----------------------------------------------------------------------------------------------------
// Series names starting with `skyreels_` in an expression (e.g. skyreels_queue_wait_seconds_bucket).
std::set<std::string> skyreels_series(const std::string& promql);
// The contract metric a series belongs to: strips _bucket/_sum/_count when the base is a histogram.
std::string metric_of_series(const std::string& series, const Contract& contract);
// Problems with how `promql` uses contract metrics (unknown metric, wrong suffix, label not in the contract,
// enumerated label value not in the contract, rate() over a gauge, histogram_quantile without `le`).
std::vector<std::string> promql_problems(const std::string& promql, const Contract& contract);

// --- skyreels-server flags ----------------------------------------------------------------------------------------
std::set<std::string> flags_in_help(const std::string& help_text);
// "--flag value" and "--flag=value" pairs of an argument list; a flag followed by another flag maps to "".
std::map<std::string, std::string> parse_flag_values(const std::vector<std::string>& args);
int port_of(const std::string& host_port);  // "0.0.0.0:50051" -> 50051; throws when there is no port

// --- a running server ---------------------------------------------------------------------------------------------
int free_tcp_port();  // a port the kernel just handed out on 127.0.0.1

class ServerProcess {
 public:
  // Starts `binary args...`, stdout and stderr into `log_file`.
  ServerProcess(const std::string& binary, const std::vector<std::string>& args, const fs::path& log_file);
  ~ServerProcess();  // SIGKILL if still running
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  bool running();  // reaps it when it has exited
  void signal(int signo) const;
  // Waits up to `seconds` for the exit; returns false on timeout. `status` is the waitpid status.
  bool wait_exit(double seconds, int* status);
  std::string log_tail(size_t bytes = 4000) const;

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  fs::path log_file_;
};

// GET http://127.0.0.1:port/path; returns the body, throws on connection errors and non-200 answers.
std::string http_get(int port, const std::string& path);

// Prometheus text format: `# TYPE` declarations and the label sets of every sample.
struct Exposition {
  std::map<std::string, std::string> types;                                        // family -> type
  std::map<std::string, std::vector<std::map<std::string, std::string>>> samples;  // series name -> label sets
};
Exposition parse_exposition(const std::string& text);

// grpc.health.v1.Health/Check on `target` for `service`. Returns the serving status (0 UNKNOWN, 1 SERVING,
// 2 NOT_SERVING, 3 SERVICE_UNKNOWN) or -1 with `error` set to the gRPC status when the call fails.
int grpc_health_check(const std::string& target, const std::string& service, std::string* error);

}  // namespace skyreels::test::deploy
