// deploy/ against the operations contract (docs/ARCHITECTURE.md) and the real skyreels-server: every manifest parses,
// the Kubernetes objects agree with each other and with the server's flags, the dashboard and alerts use metrics the
// server really exports, and the images are built by the README's own setup script.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <thread>

#include "server/store/job_lease.h"
#include "server/store/job_store_memory.h"
#include "server/store/job_store_timed.h"
#include "server/metrics/metric_families.h"
#include "server/metrics/metrics.h"
#include "tests/stored_jobs.h"
#include "tests/deploy_support.h"
#include "tests/test_util.h"

namespace skyreels::test::deploy {
namespace {

const fs::path& root() {
  static const fs::path r = repo_root();
  return r;
}
fs::path deploy_dir() { return root() / "deploy"; }

const Contract& contract() {
  static const Contract c = load_contract(root() / "docs" / "ARCHITECTURE.md");
  return c;
}

// Every overlay and the image it runs; postgresql is the GPU overlay on a shared PostgreSQL job store.
const std::map<std::string, std::string>& overlay_images() {
  static const std::map<std::string, std::string> images = {
      {"cpu", "skyreels-server-cpu"}, {"gpu", "skyreels-server-cuda"}, {"postgresql", "skyreels-server-cuda"}};
  return images;
}

const std::vector<std::string>& overlay_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [name, image] : overlay_images()) out.push_back(name);
    return out;
  }();
  return names;
}

// The overlays whose pods keep their jobs in an embedded SQLite file on a volume of their own.
const std::vector<std::string>& sqlite_overlay_names() {
  static const std::vector<std::string> names = {"cpu", "gpu"};
  return names;
}

// The embedded store's location in the container (the image's home of the server user, the contract's --data-dir).
constexpr const char* kContainerDataDir = "/var/lib/skyreels";

std::vector<Json> overlay(const std::string& name) {
  return render_kustomization(deploy_dir() / "k8s" / "overlays" / name);
}

const Json& pod_spec(const std::vector<Json>& objects) {
  return only_object(objects, "Deployment", "skyreels").at("spec").at("template").at("spec");
}

const Json& server_container(const std::vector<Json>& objects) {
  for (const Json& c : pod_spec(objects).at("containers")) {
    if (c.value("name", "") == "server") return c;
  }
  throw std::runtime_error("the Deployment has no container named server");
}

std::vector<std::string> strings_of(const Json& list, const std::string& what) {
  std::vector<std::string> out;
  for (const Json& e : list) {
    if (!e.is_string()) throw std::runtime_error(what + ": '" + e.dump() + "' is not a string (quote it)");
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::map<std::string, std::string> server_flags(const std::vector<Json>& objects) {
  return parse_flag_values(strings_of(server_container(objects).at("args"), "container args"));
}

// The value a flag has in an argument list, else the contract's default.
std::string flag_or_default(const std::map<std::string, std::string>& flags, const std::string& flag) {
  const auto it = flags.find(flag);
  if (it != flags.end()) return it->second;
  const auto d = contract().defaults.find(flag);
  if (d == contract().defaults.end()) throw std::runtime_error(flag + " is neither set nor defaulted by the contract");
  return d->second;
}

const std::string& server_help() {
  static const std::string help = [] {
    std::string output;
    const int rc = run_command(bin_path("skyreels-server") + " --help", &output);
    if (rc != 0) throw std::runtime_error("skyreels-server --help exited with " + std::to_string(rc) + ":\n" + output);
    return output;
  }();
  return help;
}

// A named container port's number ("grpc" -> 50051); numbers pass through.
int container_port(const Json& container, const Json& port) {
  if (port.is_number()) return port.get<int>();
  for (const Json& p : container.at("ports")) {
    if (p.value("name", "") == port.get<std::string>()) return p.at("containerPort").get<int>();
  }
  throw std::runtime_error("no container port named " + port.dump());
}

bool labels_match(const Json& selector, const Json& labels) {
  for (auto it = selector.begin(); it != selector.end(); ++it) {
    if (!labels.contains(it.key()) || labels[it.key()] != it.value()) return false;
  }
  return !selector.empty();
}

void collect_strings(const Json& j, const std::set<std::string>& keys, std::vector<std::string>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (keys.count(it.key()) > 0 && it.value().is_string()) out.push_back(it.value().get<std::string>());
      collect_strings(it.value(), keys, out);
    }
  } else if (j.is_array()) {
    for (const Json& e : j) collect_strings(e, keys, out);
  }
}

// Loaded once; references stay valid for the whole test program.
const Json& dashboard() {
  static const Json d = load_json(deploy_dir() / "grafana" / "skyreels-dashboard.json");
  return d;
}
const Json& alert_rule_object() {
  static const Json rules = load_yaml(deploy_dir() / "prometheus" / "alerts.yaml").at(0);
  return rules;
}
const Json& adapter_values() {
  static const Json values = load_yaml(deploy_dir() / "prometheus" / "prometheus-adapter-values.yaml").at(0);
  return values;
}

std::vector<std::string> dashboard_queries() {
  std::vector<std::string> queries;
  collect_strings(dashboard(), {"expr", "query", "definition"}, queries);
  return queries;
}

std::vector<std::string> alert_expressions() {
  std::vector<std::string> exprs;
  for (const Json& group : alert_rule_object().at("spec").at("groups")) {
    for (const Json& rule : group.at("rules")) exprs.push_back(rule.at("expr").get<std::string>());
  }
  return exprs;
}

// The series queries of the prometheus-adapter rules (custom: per pod; external: per namespace).
std::vector<std::string> adapter_queries() {
  std::vector<std::string> queries;
  for (const char* kind : {"custom", "external"}) {
    for (const Json& rule : adapter_values().at("rules").value(kind, Json::array()))
      queries.push_back(rule.at("seriesQuery"));
  }
  return queries;
}

// Every query of the dashboard, the alerts and the adapter rules.
std::vector<std::string> all_queries() {
  std::vector<std::string> queries = dashboard_queries();
  for (const auto& more : {alert_expressions(), adapter_queries()})
    queries.insert(queries.end(), more.begin(), more.end());
  return queries;
}

// Every contract metric the dashboard, the alerts and the adapter rules query.
std::set<std::string> metrics_used() {
  const std::vector<std::string> queries = all_queries();
  std::set<std::string> metrics;
  for (const auto& q : queries) {
    for (const auto& series : skyreels_series(q)) metrics.insert(metric_of_series(series, contract()));
  }
  return metrics;
}

std::string join(const std::vector<std::string>& items, const std::string& separator = "\n  ") {
  std::string out;
  for (const auto& i : items) out += separator + i;
  return out;
}

// --- every file parses ---------------------------------------------------------------------------------------------

TEST(DeployFiles, EveryYamlAndJsonFileUnderDeployParses) {
  const auto yaml_files = files_under(deploy_dir(), {".yaml", ".yml"});
  const auto json_files = files_under(deploy_dir(), {".json"});
  EXPECT_GE(yaml_files.size(), 12u);
  EXPECT_GE(json_files.size(), 1u);
  for (const auto& file : yaml_files) {
    try {
      const auto documents = load_yaml(file);
      EXPECT_FALSE(documents.empty()) << file << " holds no document";
      for (const Json& d : documents) EXPECT_TRUE(d.is_object()) << file << ": a document is not a mapping";
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
  for (const auto& file : json_files) {
    try {
      EXPECT_TRUE(load_json(file).is_object()) << file;
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

TEST(DeployFiles, YamlCheckerRejectsWhatParsersReadDifferently) {
  const std::vector<std::string> rejected = {
      "a: &x 1\nb: 2\n",      // anchor
      "a: [1]\nb: *x\n",      // alias (also undefined)
      "a: !!str 1\n",         // explicit tag
      "a: 1\na: 2\n",         // duplicate key
      "enabled: yes\n",       // YAML 1.1 boolean
      "mode: 0644\n",         // octal in 1.1, decimal in 1.2
      "t: 1:30\n",            // sexagesimal 90 in 1.1
      "x: 1e-9\n",            // float in 1.2, string in 1.1
      "a: [1, 2\n",           // syntax
      "e: >-\n  x\n    y\n",  // folded scalar keeping a line break (kustomize reads it differently)
  };
  for (const auto& text : rejected) {
    EXPECT_THROW(parse_yaml(text, "snippet"), std::runtime_error) << text;
  }
  const auto documents = parse_yaml("a: \"yes\"\nb: 1.5\nc: ~\nd: [64, two, \"64\"]\n---\ne: true\n", "snippet");
  ASSERT_EQ(documents.size(), 2u);
  EXPECT_EQ(documents[0], Json::parse(R"({"a":"yes","b":1.5,"c":null,"d":[64,"two","64"]})"));
  EXPECT_EQ(documents[1], Json::parse(R"({"e":true})"));
}

// --- Kubernetes ------------------------------------------------------------------------------------------------------

TEST(Kustomize, EachOverlayRendersTheWholeDeploymentFromFilesItReferences) {
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    for (const char* kind : {"Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                             "ServiceMonitor", "PrometheusRule"}) {
      EXPECT_NO_THROW(only_object(objects, kind)) << kind;
    }
    EXPECT_NO_THROW(only_object(objects, "Service", "skyreels"));
    EXPECT_NO_THROW(only_object(objects, "Service", "skyreels-headless"));
    const std::string image = server_container(objects).at("image");
    EXPECT_EQ(image.rfind(overlay_images().at(name) + ":", 0), 0u) << image;
  }
}

// Every kustomization an operator applies: the overlays and the PostgreSQL example.
std::vector<fs::path> applied_kustomizations() {
  std::vector<fs::path> dirs;
  for (const auto& name : overlay_names()) dirs.push_back(deploy_dir() / "k8s" / "overlays" / name);
  dirs.push_back(deploy_dir() / "k8s" / "examples" / "postgresql");
  return dirs;
}

// Whatever kubectl is installed (Debian 12's 1.20 with kustomize v2.0.3, or a current one) renders what we render.
TEST(Kustomize, OurRenderingEqualsKubectlKustomize) {
  const std::string kubectl = kubectl_path();
  ASSERT_FALSE(kubectl.empty()) << "kubectl is not on PATH: scripts/setup.sh installs Debian's kubernetes-client";
  const fs::path errors = fs::path(temp_dir("kubectl")) / "stderr";
  for (const auto& dir : applied_kustomizations()) {
    SCOPED_TRACE(dir.string());
    std::string output;
    ASSERT_EQ(run_command(kubectl + " kustomize " + dir.string() + " 2>" + errors.string(), &output), 0)
        << read_text(errors);
    const auto theirs = parse_yaml(output, "kubectl kustomize " + dir.string());
    const auto ours = render_kustomization(dir);
    ASSERT_EQ(theirs.size(), ours.size());
    for (const Json& object : ours) {
      const Json& same = only_object(theirs, object.at("kind"), object.at("metadata").at("name"));
      EXPECT_EQ(same, object) << object.at("kind") << "/" << object.at("metadata").at("name");
    }
  }
}

TEST(Kustomize, RendererAppliesStrategicMergeDeletesByMergeKey) {
  const fs::path dir = temp_dir("kustomization");
  std::ofstream(dir / "deployment.yaml") << R"(apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec: {template: {spec: {containers: [{name: c, args: [a, b], volumeMounts: [{name: v, mountPath: /x},
  {name: v, mountPath: /y}]}], volumes: [{name: v}, {name: w}]}}}
)";
  std::ofstream(dir / "patch.yaml") << R"(apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec: {template: {spec: {containers: [{name: c, args: [z], env: [{name: E, value: "1"}],
  volumeMounts: [{mountPath: /x, $patch: delete}]}], volumes: [{name: w, $patch: delete}]}}}
)";
  std::ofstream(dir / "kustomization.yaml") << "resources: [deployment.yaml]\npatchesStrategicMerge: [patch.yaml]\n";
  const auto rendered = render_kustomization(dir);
  const Json& spec = rendered.at(0).at("spec").at("template").at("spec");
  EXPECT_EQ(spec.at("containers"), Json::parse(R"([{"name":"c","args":["z"],"env":[{"name":"E","value":"1"}],
                                                   "volumeMounts":[{"name":"v","mountPath":"/y"}]}])"));
  EXPECT_EQ(spec.at("volumes"), Json::parse(R"([{"name":"v"}])"));

  std::ofstream(dir / "kustomization.yaml") << "resources: [deployment.yaml]\npatches: [{path: patch.yaml}]\n";
  EXPECT_THROW(render_kustomization(dir), std::runtime_error) << "kubectl 1.20 reads no `patches`";
}

TEST(Kustomize, GpuOverlayRequestsOneGpuAndUsesEveryVisibleDevice) {
  const auto gpu = overlay("gpu");
  const Json& resources = server_container(gpu).at("resources");
  EXPECT_EQ(resources.at("limits").value("nvidia.com/gpu", Json()).dump(), "\"1\"");
  EXPECT_EQ(resources.at("requests").value("nvidia.com/gpu", Json()).dump(), "\"1\"");
  EXPECT_EQ(server_flags(gpu).at("--devices"), "auto");
  bool tolerates_gpu_taint = false;
  for (const Json& t : pod_spec(gpu).value("tolerations", Json::array())) {
    tolerates_gpu_taint |= t.value("key", "") == "nvidia.com/gpu";
  }
  EXPECT_TRUE(tolerates_gpu_taint);

  const auto cpu = overlay("cpu");
  EXPECT_FALSE(server_container(cpu).at("resources").at("limits").contains("nvidia.com/gpu"));
  EXPECT_EQ(server_flags(cpu).at("--devices"), "cpu");
}

TEST(Kustomize, ContainerArgumentsAreFlagsOfTheServerAndTheContract) {
  const auto help_flags = flags_in_help(server_help());
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto flags = server_flags(overlay(name));
    EXPECT_EQ(flags.count(""), 0u) << "positional argument " << flags.at("");
    for (const auto& [flag, value] : flags) {
      if (flag.empty()) continue;
      EXPECT_TRUE(help_flags.count(flag)) << flag << " is not in skyreels-server --help:\n" << server_help();
      EXPECT_TRUE(contract().flags.count(flag)) << flag << " is not in the operations contract";
    }
  }
}

// `skyreels-server --print-flags` rows (flag, environment variable, value in effect, default, bounds, group) under
// `environment` (NAME=VALUE words before the command).
std::vector<std::vector<std::string>> print_flags(const std::string& environment = "", const std::string& args = "",
                                                  int* status = nullptr) {
  std::string output;
  const int rc = run_command(environment + " " + bin_path("skyreels-server") + " --print-flags " + args + " 2>&1",
                             &output);
  if (status != nullptr) *status = rc;
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> cells;
    std::istringstream fields(line);
    for (std::string cell; std::getline(fields, cell, '\t');) cells.push_back(cell);
    if (line.back() == '\t') cells.emplace_back();
    if (cells.size() == 6 && cells[0] != "flag") rows.push_back(cells);
  }
  if (status == nullptr && rc != 0) throw std::runtime_error("--print-flags exited with " + std::to_string(rc) + output);
  return rows;
}

std::string value_of(const std::vector<std::vector<std::string>>& rows, const std::string& flag) {
  for (const auto& row : rows) {
    if (row[0] == flag) return row[2];
  }
  return "(no such flag)";
}

// The documented contract names every operational flag the server takes (the test hooks apart): a flag added to the
// server's table and not to docs/ARCHITECTURE.md fails here. The usage text shows every flag of the table.
TEST(Contract, EveryServerFlagIsInTheOperationsContract) {
  const auto rows = print_flags();
  ASSERT_GT(rows.size(), 40u) << "the flag table lost its flags";
  const auto help_flags = flags_in_help(server_help());
  for (const auto& row : rows) {
    EXPECT_TRUE(help_flags.count(row[0])) << row[0] << " is in the flag table but not in --help";
    if (row[5] == "test hooks") continue;
    EXPECT_TRUE(contract().flags.count(row[0])) << row[0] << " is a server flag but not in the contract";
  }
}

// Every flag also reads SKYREELS_<NAME> (TGI's launcher does the same), but --enable-test-hooks; the command line wins
// over it, a bad value is refused naming the variable, and --print-flags keeps a PostgreSQL URL's password to itself.
TEST(Contract, EveryFlagReadsItsEnvironmentVariableAndTheCommandLineWins) {
  const auto defaults = print_flags();
  EXPECT_EQ(value_of(defaults, "--max-queue"), "64");
  for (const auto& row : defaults) {
    if (row[0] == "--enable-test-hooks") {
      EXPECT_EQ(row[1], "(none)") << "a variable in a pod spec must not turn the test hooks on";
      continue;
    }
    std::string expected = "SKYREELS_";
    for (char c : row[0].substr(2)) expected += c == '-' ? '_' : static_cast<char>(std::toupper(c));
    EXPECT_EQ(row[1], expected) << row[0];
  }
  const auto from_env = print_flags("SKYREELS_MAX_QUEUE=7 SKYREELS_LEASE_SECONDS=2.5 SKYREELS_DEMO=1 "
                                    "SKYREELS_LORA=a.safetensors:0.5,b.safetensors "
                                    "SKYREELS_JOB_STORE=postgresql://u:hunter2@db/jobs");
  EXPECT_EQ(value_of(from_env, "--max-queue"), "7");
  EXPECT_EQ(value_of(from_env, "--lease-seconds"), "2.5");
  EXPECT_EQ(value_of(from_env, "--demo"), "true");
  EXPECT_EQ(value_of(from_env, "--lora"), "a.safetensors:0.5,b.safetensors:1");
  EXPECT_EQ(value_of(from_env, "--job-store"), "(set)");
  EXPECT_EQ(value_of(print_flags("SKYREELS_MAX_QUEUE=7", "--max-queue 9"), "--max-queue"), "9");
  EXPECT_EQ(value_of(print_flags("SKYREELS_MAX_QUEUE=7", "--max-queue=9"), "--max-queue"), "9");
  EXPECT_EQ(value_of(print_flags("SKYREELS_ENABLE_TEST_HOOKS=1"), "--enable-test-hooks"), "false");
  int status = 0;
  std::string output;
  status = run_command("SKYREELS_MAX_QUEUE=many " + bin_path("skyreels-server") + " --demo 2>&1", &output);
  EXPECT_EQ(status, 2) << output;
  EXPECT_NE(output.find("SKYREELS_MAX_QUEUE: 'many' is not an integer in [1, 1000000]"), std::string::npos) << output;
  status = run_command(bin_path("skyreels-server") + " --demo --lease-seconds 0.1 2>&1", &output);
  EXPECT_EQ(status, 2) << output;
  EXPECT_NE(output.find("--lease-seconds: '0.1' is not a number in [0.2, 604800]"), std::string::npos) << output;
}

TEST(Kustomize, ProbesAskTheContractHealthServicesOnTheListenPort) {
  EXPECT_NE(contract().text.find("service `\"\"`"), std::string::npos) << "contract: readiness service";
  EXPECT_NE(contract().text.find("service `\"liveness\"`"), std::string::npos) << "contract: liveness service";
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const Json& c = server_container(objects);
    const auto flags = server_flags(objects);
    const int grpc_port = port_of(flag_or_default(flags, "--listen"));
    const int metrics_port = port_of(flag_or_default(flags, "--metrics-listen"));
    EXPECT_EQ(container_port(c, "grpc"), grpc_port);
    EXPECT_EQ(container_port(c, "metrics"), metrics_port);
    for (const char* probe : {"startupProbe", "readinessProbe", "livenessProbe"}) {
      ASSERT_TRUE(c.contains(probe) && c[probe].contains("grpc")) << probe << " must be a native gRPC probe";
      EXPECT_EQ(c[probe].at("grpc").at("port"), grpc_port) << probe;
    }
    EXPECT_EQ(c.at("readinessProbe").at("grpc").value("service", ""), "");
    EXPECT_EQ(c.at("startupProbe").at("grpc").value("service", ""), "");
    EXPECT_EQ(c.at("livenessProbe").at("grpc").value("service", ""), "liveness");
    const Json& startup = c.at("startupProbe");
    EXPECT_GE(startup.at("failureThreshold").get<int>() * startup.at("periodSeconds").get<int>(), 15 * 60)
        << "the startup probe must wait for weight loading";
    const Json& liveness = c.at("livenessProbe");
    EXPECT_GE(liveness.at("failureThreshold").get<int>() * liveness.at("periodSeconds").get<int>(), 60);
  }
}

TEST(Kustomize, ServicesAndMonitorReachTheServerPorts) {
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const Json& c = server_container(objects);
    const Json& pod_labels =
        only_object(objects, "Deployment", "skyreels").at("spec").at("template").at("metadata").at("labels");
    const int metrics_port = port_of(flag_or_default(server_flags(objects), "--metrics-listen"));

    const Json& service = only_object(objects, "Service", "skyreels");
    EXPECT_TRUE(labels_match(service.at("spec").at("selector"), pod_labels));
    const Json& headless = only_object(objects, "Service", "skyreels-headless");
    EXPECT_EQ(headless.at("spec").value("clusterIP", ""), "None");
    EXPECT_TRUE(labels_match(headless.at("spec").at("selector"), pod_labels));
    for (const Json& p : headless.at("spec").at("ports")) {  // clients dial pod IPs: no port translation
      EXPECT_EQ(p.at("port").get<int>(), container_port(c, p.at("targetPort"))) << p.dump();
    }
    for (const Json& p : service.at("spec").at("ports"))
      EXPECT_NO_THROW(container_port(c, p.at("targetPort"))) << p.dump();

    const Json& monitor = only_object(objects, "ServiceMonitor");
    const Json& endpoint = monitor.at("spec").at("endpoints").at(0);
    EXPECT_EQ(endpoint.value("path", "/metrics"), "/metrics");
    int scraped = 0;
    for (const Json& o : objects) {
      if (o.at("kind") != "Service" ||
          !labels_match(monitor.at("spec").at("selector").at("matchLabels"), o.at("metadata").at("labels"))) {
        continue;
      }
      for (const Json& p : o.at("spec").at("ports")) {
        if (p.value("name", "") != endpoint.at("port")) continue;
        ++scraped;
        EXPECT_EQ(container_port(c, p.at("targetPort")), metrics_port);
      }
    }
    EXPECT_EQ(scraped, 1) << "each pod must be scraped through exactly one Service port";
    const Json& pdb = only_object(objects, "PodDisruptionBudget");
    EXPECT_TRUE(labels_match(pdb.at("spec").at("selector").at("matchLabels"), pod_labels));
  }
}

TEST(Kustomize, GracePeriodCoversPreStopAndTheDrainTimeout) {
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const int drain = std::stoi(flag_or_default(server_flags(objects), "--drain-timeout-seconds"));
    int pre_stop = 0;
    const Json& c = server_container(objects);
    if (c.contains("lifecycle")) {
      const auto command = strings_of(c.at("lifecycle").at("preStop").at("exec").at("command"), "preStop");
      ASSERT_EQ(command.size(), 2u);
      EXPECT_EQ(command[0], "sleep");
      pre_stop = std::stoi(command[1]);
    }
    const int grace = pod_spec(objects).at("terminationGracePeriodSeconds").get<int>();
    EXPECT_GE(grace, pre_stop + drain + 30) << "preStop " << pre_stop << " s + drain " << drain << " s + 30 s margin";
  }
}

TEST(Kustomize, WeightsAreMountedReadOnlyFromAReadOnlyManyClaim) {
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const Json& c = server_container(objects);
    std::string volume;
    for (const Json& m : c.at("volumeMounts")) {
      if (m.at("mountPath") != "/models") continue;
      volume = m.at("name");
      EXPECT_TRUE(m.value("readOnly", false));
    }
    ASSERT_FALSE(volume.empty()) << "nothing is mounted at /models";
    std::string claim;
    for (const Json& v : pod_spec(objects).at("volumes")) {
      if (v.at("name") != volume) continue;
      ASSERT_TRUE(v.contains("persistentVolumeClaim"));
      EXPECT_TRUE(v.at("persistentVolumeClaim").value("readOnly", false));
      claim = v.at("persistentVolumeClaim").at("claimName");
    }
    const Json& pvc = only_object(objects, "PersistentVolumeClaim", claim);
    EXPECT_EQ(pvc.at("spec").at("accessModes"), Json::array({"ReadOnlyMany"}));
    const auto flags = server_flags(objects);
    for (const char* flag : {"--model", "--vae", "--text-encoder", "--tokenizer"}) {
      EXPECT_EQ(flags.at(flag).rfind("/models/", 0), 0u) << flag << " " << flags.at(flag);
    }
  }
}

TEST(Kustomize, ServerRunsAsNonRootWithRequestsAndLimits) {
  for (const auto& name : overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    EXPECT_TRUE(pod_spec(objects).at("securityContext").value("runAsNonRoot", false));
    const Json& c = server_container(objects);
    EXPECT_FALSE(c.at("securityContext").value("allowPrivilegeEscalation", true));
    EXPECT_TRUE(c.at("securityContext").value("readOnlyRootFilesystem", false));
    for (const char* kind : {"requests", "limits"}) {
      for (const char* resource : {"cpu", "memory"}) {
        EXPECT_TRUE(c.at("resources").at(kind).contains(resource)) << kind << "." << resource;
      }
    }
  }
}

// The volume mounted at `path` in the server container; empty when none is.
std::string volume_mounted_at(const std::vector<Json>& objects, const std::string& path) {
  for (const Json& m : server_container(objects).value("volumeMounts", Json::array())) {
    if (m.at("mountPath") == path) return m.at("name");
  }
  return "";
}

bool has_volume(const std::vector<Json>& objects, const std::string& name) {
  const Json& volumes = pod_spec(objects).value("volumes", Json::array());
  return std::any_of(volumes.begin(), volumes.end(), [&](const Json& v) { return v.at("name") == name; });
}

TEST(Kustomize, SqliteOverlaysKeepTheJobStoreOnAVolumeAtTheDataDir) {
  EXPECT_NE(contract().text.find(std::string("`") + kContainerDataDir + "`"), std::string::npos)
      << "the contract names the container's data dir";
  for (const auto& name : sqlite_overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const auto flags = server_flags(objects);
    ASSERT_EQ(flags.count("--data-dir"), 1u) << "the default ./skyreels-data is on the read-only root filesystem";
    EXPECT_EQ(flags.at("--data-dir"), kContainerDataDir);
    EXPECT_EQ(flags.count("--job-store"), 0u) << "the default store: sqlite:<--data-dir>/jobs.sqlite";
    const std::string volume = volume_mounted_at(objects, kContainerDataDir);
    ASSERT_FALSE(volume.empty()) << "nothing is mounted at " << kContainerDataDir;
    EXPECT_TRUE(has_volume(objects, volume)) << volume;
  }
}

// postgresql://USER:PASSWORD@HOST:PORT/DATABASE[?options]
struct PostgresUrl {
  std::string user, password, host, port, database;
};

PostgresUrl parse_postgres_url(const std::string& url) {
  static const std::regex url_re("postgresql://([^:@/]+):([^@/]+)@([^:/]+):([0-9]+)/([^?]+)(\\?.*)?");
  std::smatch m;
  if (!std::regex_match(url, m, url_re))
    throw std::runtime_error("not postgresql://USER:PASSWORD@HOST:PORT/DB: " + url);
  return {m[1], m[2], m[3], m[4], m[5]};
}

const Json& env_var(const Json& container, const std::string& name) {
  if (container.contains("env")) {
    for (const Json& e : container.at("env")) {
      if (e.at("name") == name) return e;
    }
  }
  throw std::runtime_error("the server container has no environment variable " + name);
}

// The job store URL as the overlay's Secret holds it.
std::string overlay_store_url(const std::vector<Json>& objects) {
  const Json ref = env_var(server_container(objects), "SKYREELS_JOB_STORE").at("valueFrom").at("secretKeyRef");
  const Json& secret = only_object(objects, "Secret", ref.at("name"));
  return secret.at("stringData").at(ref.at("key").get<std::string>());
}

TEST(Kustomize, PostgresqlOverlayReadsTheStoreUrlFromASecretNeverFromArguments) {
  const auto objects = overlay("postgresql");
  const PostgresUrl url = parse_postgres_url(overlay_store_url(objects));
  const auto flags = server_flags(objects);
  EXPECT_EQ(flags.count("--job-store"), 0u) << "a URL in the arguments shows its password in process lists";
  for (const auto& arg : strings_of(server_container(objects).at("args"), "args")) {
    EXPECT_EQ(arg.find("://"), std::string::npos) << arg;
    EXPECT_EQ(arg.find(url.password), std::string::npos) << arg;
  }
  ASSERT_EQ(flags.count("--lease-seconds"), 1u);
  EXPECT_GT(std::stoi(flags.at("--lease-seconds")), 0);
  EXPECT_EQ(flags.count("--data-dir"), 0u) << "no SQLite file in PostgreSQL mode";
  EXPECT_EQ(volume_mounted_at(objects, kContainerDataDir), "") << "no per-pod job store volume";
  EXPECT_FALSE(has_volume(objects, "work"));
}

TEST(Kustomize, PostgresqlOverlayReplacesPodsWithoutDroppingCapacity) {
  const auto objects = overlay("postgresql");
  const Json& spec = only_object(objects, "Deployment", "skyreels").at("spec");
  EXPECT_EQ(spec.at("strategy").at("type"), "RollingUpdate");
  EXPECT_EQ(spec.at("strategy").at("rollingUpdate").at("maxUnavailable"), 0);
  EXPECT_GE(spec.at("strategy").at("rollingUpdate").at("maxSurge").get<int>(), 1);
}

// The try-it-out database answers the overlay's placeholder URL: same host, port, user, password and database.
TEST(Kustomize, PostgresqlExampleServesTheOverlayPlaceholderUrl) {
  const PostgresUrl url = parse_postgres_url(overlay_store_url(overlay("postgresql")));
  const auto example = render_kustomization(deploy_dir() / "k8s" / "examples" / "postgresql");
  const Json& service = only_object(example, "Service", url.host);
  const Json& ports = service.at("spec").at("ports");
  EXPECT_TRUE(std::any_of(ports.begin(), ports.end(), [&](const Json& p) {
    return std::to_string(p.at("port").get<int>()) == url.port;
  })) << service.dump();
  const Json& database = only_object(example, "StatefulSet");
  EXPECT_EQ(database.at("spec").at("replicas"), 1);
  EXPECT_TRUE(
      labels_match(service.at("spec").at("selector"), database.at("spec").at("template").at("metadata").at("labels")));
  const Json& secret = only_object(example, "Secret").at("stringData");
  EXPECT_EQ(secret.at("user"), url.user);
  EXPECT_EQ(secret.at("password"), url.password);
  EXPECT_EQ(secret.at("database"), url.database);
}

// The adapter rule publishing `metric` under `rules.<kind>` (custom or external), nullptr when none does.
const Json* adapter_rule(const std::string& kind, const std::string& metric) {
  const Json& rules = adapter_values().at("rules");
  if (!rules.contains(kind)) return nullptr;
  for (const Json& rule : rules.at(kind)) {
    if (rule.at("name").value("as", "") == metric) return &rule;
  }
  return nullptr;
}

const Json& only_hpa_metric(const std::vector<Json>& objects) {
  const Json& hpa = only_object(objects, "HorizontalPodAutoscaler");
  EXPECT_EQ(hpa.at("spec").at("scaleTargetRef").at("kind"), "Deployment");
  EXPECT_EQ(hpa.at("spec").at("scaleTargetRef").at("name"),
            only_object(objects, "Deployment").at("metadata").at("name"));
  EXPECT_GE(hpa.at("spec").at("behavior").at("scaleDown").at("stabilizationWindowSeconds").get<int>(), 600);
  if (hpa.at("spec").at("metrics").size() != 1) throw std::runtime_error("the HPA must scale on exactly one metric");
  return hpa.at("spec").at("metrics")[0];
}

// SQLite mode: each pod has its own queue, so the HPA averages the per-pod depth (a Pods metric).
TEST(Kustomize, SqliteOverlaysScaleOnPerPodQueueDepthServedByTheAdapterRule) {
  for (const auto& name : sqlite_overlay_names()) {
    SCOPED_TRACE("overlay " + name);
    const auto objects = overlay(name);
    const Json& metric = only_hpa_metric(objects);
    EXPECT_EQ(metric.at("type"), "Pods");
    const std::string served = metric.at("pods").at("metric").at("name");
    EXPECT_EQ(served, "skyreels_queue_depth");
    EXPECT_EQ(contract().metrics.at(served).type, "gauge");
    const Json* rule = adapter_rule("custom", served);
    ASSERT_NE(rule, nullptr) << "no prometheus-adapter custom rule publishes " << served;
    EXPECT_EQ(skyreels_series(rule->at("seriesQuery")), std::set<std::string>{served});
    EXPECT_EQ(rule->at("resources").at("overrides").at("pod").at("resource"), "pod");
    EXPECT_EQ(rule->at("resources").at("overrides").at("namespace").at("resource"), "namespace");
    const std::string query = rule->at("metricsQuery");
    for (const char* placeholder : {"<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"}) {
      EXPECT_NE(query.find(placeholder), std::string::npos) << placeholder;
    }
  }
}

// PostgreSQL mode: every pod exports the same store-wide depth, so the HPA reads it once, as an External metric.
TEST(Kustomize, PostgresqlOverlayScalesOnTheStoreQueueAsOneExternalMetric) {
  const auto objects = overlay("postgresql");
  const Json& metric = only_hpa_metric(objects);
  ASSERT_EQ(metric.at("type"), "External") << "an averaged per-pod metric would divide the store's queue by the pods";
  const std::string served = metric.at("external").at("metric").at("name");
  EXPECT_EQ(served, "skyreels_global_queue_depth");
  EXPECT_EQ(contract().metrics.at(served).type, "gauge");
  // AverageValue over an External metric: desired replicas = ceil(store queue / averageValue).
  EXPECT_EQ(metric.at("external").at("target").at("type"), "AverageValue");
  EXPECT_GT(std::stod(metric.at("external").at("target").at("averageValue").get<std::string>()), 0);

  const Json* rule = adapter_rule("external", served);
  ASSERT_NE(rule, nullptr) << "no prometheus-adapter external rule publishes " << served;
  EXPECT_EQ(skyreels_series(rule->at("seriesQuery")), std::set<std::string>{served});
  EXPECT_EQ(rule->at("resources").at("overrides").at("namespace").at("resource"), "namespace");
  EXPECT_FALSE(rule->at("resources").at("overrides").contains("pod")) << "one value for the namespace, not per pod";
  const std::string query = rule->at("metricsQuery");
  EXPECT_EQ(query.rfind("max(", 0), 0u) << "the pods' identical values collapse with max, never sum: " << query;
  for (const char* placeholder : {"<<.Series>>", "<<.LabelMatchers>>"}) {
    EXPECT_NE(query.find(placeholder), std::string::npos) << placeholder;
  }
}

// --- dashboards and alerts -----------------------------------------------------------------------------------------

TEST(Monitoring, DashboardAndAlertsUseContractMetricsWithTheirTypesAndLabels) {
  std::vector<std::string> problems;
  for (const auto& q : all_queries()) {
    for (const auto& p : promql_problems(q, contract())) problems.push_back(p);
  }
  EXPECT_TRUE(problems.empty()) << join(problems);

  // The dashboard shows throughput, queue, latency histograms, replica state, retries, handoffs and failures.
  std::set<std::string> on_dashboard;
  for (const auto& q : dashboard_queries()) {
    for (const auto& s : skyreels_series(q)) on_dashboard.insert(metric_of_series(s, contract()));
  }
  for (const char* needed :
       {"skyreels_frames_generated_total", "skyreels_queue_depth", "skyreels_queue_wait_seconds",
        "skyreels_chunk_duration_seconds", "skyreels_step_duration_seconds", "skyreels_replica_busy",
        "skyreels_replica_healthy", "skyreels_chunk_retries_total", "skyreels_chunk_handoffs_total",
        "skyreels_jobs_finished_total", "skyreels_job_store_seconds", "skyreels_lease_takeovers_total",
        "skyreels_global_queue_depth"}) {
    EXPECT_TRUE(on_dashboard.count(needed)) << needed << " is missing from the dashboard";
  }
}

TEST(Monitoring, PromqlCheckerCatchesMisusedMetrics) {
  const std::vector<std::string> wrong = {
      "rate(skyreels_jobs_total[5m])",                                             // unknown metric
      "sum by (device) (skyreels_replica_busy)",                                   // label of no metric
      "skyreels_jobs_finished_total{outcome=\"failure\"}",                         // value not in the contract
      "skyreels_replica_busy{gpu=\"0\"}",                                          // label not in the contract
      "rate(skyreels_queue_depth[5m])",                                            // rate over a gauge
      "histogram_quantile(0.9, rate(skyreels_step_duration_seconds_bucket[5m]))",  // no `by (le)`
      "skyreels_chunk_duration_seconds",                                           // histogram without a suffix
  };
  for (const auto& q : wrong) EXPECT_FALSE(promql_problems(q, contract()).empty()) << q;
  const std::string right =
      "histogram_quantile(0.95, sum by (le, pod, replica) (rate(skyreels_chunk_duration_seconds_bucket"
      "{namespace=\"$namespace\"}[5m]))) / on (pod) group_left () sum by (pod) (skyreels_replicas_ready)";
  EXPECT_TRUE(promql_problems(right, contract()).empty()) << join(promql_problems(right, contract()));
}

::testing::AssertionResult promtool_installed() {
  if (run_command("command -v promtool") == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "promtool is not on PATH: scripts/setup.sh installs Debian's prometheus";
}

// Prometheus' own parser: the alert groups as they are, and every dashboard query as a recording rule with the
// Grafana variables filled in.
TEST(Monitoring, AlertsAndDashboardQueriesPassPromtoolCheckRules) {
  ASSERT_TRUE(promtool_installed());
  const fs::path dir = temp_dir("promtool");
  std::ofstream(dir / "alerts.yml") << alert_rule_object().at("spec").dump();  // JSON is YAML
  Json recording = Json::array();
  int index = 0;
  for (auto q : dashboard_queries()) {
    if (skyreels_series(q).empty() || q.find("label_values") != std::string::npos) continue;
    q = std::regex_replace(q, std::regex("\\$(namespace|pod)"), "x");
    recording.push_back({{"record", "dashboard:query" + std::to_string(index++)}, {"expr", q}});
  }
  const Json groups = {{"groups", Json::array({{{"name", "dashboard"}, {"rules", recording}}})}};
  std::ofstream(dir / "dashboard.yml") << groups.dump();
  std::string output;
  EXPECT_EQ(
      run_command("promtool check rules " + (dir / "alerts.yml").string() + " " + (dir / "dashboard.yml").string(),
                  &output),
      0)
      << output;
}

const Json& alert_rule(const std::string& name) {
  for (const Json& group : alert_rule_object().at("spec").at("groups")) {
    for (const Json& rule : group.at("rules")) {
      if (rule.at("alert") == name) return rule;
    }
  }
  throw std::runtime_error("alerts.yaml has no alert " + name);
}

const Json& alert_tests() {
  static const Json tests = load_yaml(deploy_dir() / "prometheus" / "alerts.test.yaml").at(0);
  return tests;
}

// An annotation with {{ $labels.NAME }} filled from `labels`, as Prometheus renders it; throws on any other template.
std::string fill_template(const std::string& text, const Json& labels) {
  static const std::regex label_re("\\{\\{\\s*\\$labels\\.([a-zA-Z_][a-zA-Z0-9_]*)\\s*\\}\\}");
  std::string out;
  auto last = text.cbegin();
  for (std::sregex_iterator it(text.begin(), text.end(), label_re), end; it != end; ++it) {
    const std::string label = (*it)[1];
    if (!labels.contains(label))
      throw std::runtime_error("'" + text + "' uses $labels." + label + ", not among " + labels.dump());
    out.append(last, (*it)[0].first).append(labels.at(label).get<std::string>());
    last = (*it)[0].second;
  }
  out.append(last, text.cend());
  if (out.find("{{") != std::string::npos) throw std::runtime_error("a template other than $labels: " + text);
  return out;
}

// alerts.test.yaml with each expected alert completed by its rule's labels and annotations, so that those are
// declared once, in alerts.yaml.
Json completed_alert_tests() {
  Json tests = alert_tests();
  for (Json& group : tests.at("tests")) {
    for (Json& check : group.at("alert_rule_test")) {
      const Json rule = alert_rule(check.at("alertname"));
      for (Json& expected : check.at("exp_alerts")) {
        Json& labels = expected["exp_labels"];
        for (auto it = rule.at("labels").begin(); it != rule.at("labels").end(); ++it) labels[it.key()] = it.value();
        for (auto it = rule.at("annotations").begin(); it != rule.at("annotations").end(); ++it) {
          expected["exp_annotations"][it.key()] = fill_template(it.value(), labels);
        }
      }
    }
  }
  return tests;
}

TEST(Monitoring, EveryAlertFiresOnAFaultAndStaysQuietOnHealthySeriesInItsUnitTests) {
  std::map<std::string, std::pair<int, int>> checks;  // alert -> (firing checks, quiet checks)
  for (const Json& group : alert_rule_object().at("spec").at("groups")) {
    for (const Json& rule : group.at("rules")) checks[rule.at("alert")] = {0, 0};
  }
  for (const Json& group : alert_tests().at("tests")) {
    for (const Json& check : group.at("alert_rule_test")) {
      const std::string alert = check.at("alertname");
      ASSERT_TRUE(checks.count(alert)) << "alerts.test.yaml tests an alert alerts.yaml lacks: " << alert;
      auto& [firing, quiet] = checks[alert];
      (check.at("exp_alerts").empty() ? quiet : firing)++;
    }
  }
  for (const auto& [alert, counts] : checks) {
    EXPECT_GE(counts.first, 1) << alert << " has no unit test in which it fires";
    EXPECT_GE(counts.second, 1) << alert << " has no unit test in which it stays quiet";
  }
}

TEST(Monitoring, EveryAlertPassesItsPromtoolUnitTests) {
  ASSERT_TRUE(promtool_installed());
  const fs::path dir = temp_dir("promtool-test");
  const Json tests = completed_alert_tests();
  ASSERT_EQ(tests.at("rule_files").size(), 1u);
  std::ofstream(dir / tests.at("rule_files")[0].get<std::string>()) << alert_rule_object().at("spec").dump();
  std::ofstream(dir / "alerts.test.yml") << tests.dump();
  std::string output;
  EXPECT_EQ(run_command("cd " + dir.string() + " && promtool test rules alerts.test.yml", &output), 0) << output;
}

TEST(Monitoring, AlertAnnotationTemplatesAreFilledFromTheExpectedLabels) {
  const Json labels = {{"pod", "a"}, {"namespace", "ns"}};
  EXPECT_EQ(fill_template("{{ $labels.pod }} in {{$labels.namespace}}.", labels), "a in ns.");
  EXPECT_THROW(fill_template("{{ $labels.replica }}", labels), std::runtime_error) << "a label the alert lacks";
  EXPECT_THROW(fill_template("{{ $value }}", labels), std::runtime_error) << "a value the test cannot know";
}

TEST(Monitoring, AlertRulesHaveUniqueNamesSeverityAndSummary) {
  std::set<std::string> names;
  static const std::regex duration_re("[0-9]+[smhd]");
  for (const Json& group : alert_rule_object().at("spec").at("groups")) {
    for (const Json& rule : group.at("rules")) {
      const std::string alert = rule.value("alert", "");
      SCOPED_TRACE(alert);
      EXPECT_FALSE(alert.empty());
      EXPECT_TRUE(names.insert(alert).second) << "duplicate alert";
      EXPECT_FALSE(rule.value("expr", "").empty());
      const std::string severity = rule.at("labels").value("severity", "");
      EXPECT_TRUE(severity == "warning" || severity == "critical") << severity;
      EXPECT_FALSE(rule.at("annotations").value("summary", "").empty());
      if (rule.contains("for")) {
        EXPECT_TRUE(std::regex_match(rule.at("for").get<std::string>(), duration_re));
      }
    }
  }
  EXPECT_GE(names.size(), 8u);
}

TEST(Monitoring, DashboardPanelsHaveQueriesPositionsAndUniqueIds) {
  const Json d = dashboard();
  EXPECT_FALSE(d.value("uid", "").empty());
  std::set<int> ids;
  for (const Json& panel : d.at("panels")) {
    const std::string title = panel.value("title", "");
    SCOPED_TRACE(title);
    EXPECT_TRUE(ids.insert(panel.at("id").get<int>()).second) << "duplicate panel id";
    EXPECT_TRUE(panel.contains("gridPos"));
    if (panel.at("type") == "row") continue;
    EXPECT_EQ(panel.at("datasource").at("uid"), "${datasource}");
    ASSERT_FALSE(panel.value("targets", Json::array()).empty());
    for (const Json& t : panel.at("targets")) EXPECT_FALSE(t.value("expr", "").empty());
  }
}

// --- container images ----------------------------------------------------------------------------------------------

bool contains(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream stream(text);
  for (std::string line; std::getline(stream, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

TEST(DockerImages, CpuImageBuildsWithTheReadmeSetupScriptAndNoRecipeOfItsOwn) {
  EXPECT_TRUE(contains(read_text(root() / "README.md"), "scripts/setup.sh"));
  EXPECT_TRUE(contains(read_text(root() / "scripts" / "test.sh"), "scripts/setup.sh"));
  const auto stages = parse_dockerfile(deploy_dir() / "docker" / "Dockerfile.cpu");
  ASSERT_GE(stages.size(), 2u);
  const DockerStage& build = stages.front();
  EXPECT_TRUE(std::regex_match(build.base, std::regex("debian:(bookworm|12)(-slim)?"))) << build.base;
  bool runs_setup = false;
  for (const auto& run : build.all("RUN")) {
    runs_setup |= std::regex_search(run, std::regex("(^|[ ;&])(\\./)?scripts/setup\\.sh\\b"));
    EXPECT_FALSE(contains(run, "apt-get install")) << "packages come from scripts/setup.sh: " << run;
    EXPECT_FALSE(contains(run, "cmake ")) << "the build comes from scripts/setup.sh: " << run;
  }
  EXPECT_TRUE(runs_setup) << "the build stage must run scripts/setup.sh";
  bool installs_the_closure = false;
  for (const auto& run : stages.back().all("RUN")) {
    if (contains(run, "apt-get install")) installs_the_closure |= contains(run, "runtime-packages.txt");
  }
  EXPECT_TRUE(installs_the_closure) << "the runtime stage installs the computed runtime-packages.txt";
}

TEST(DockerImages, CudaImageIsDebianTrixiePackagesInstalledByTheScriptItsChrootCheckRuns) {
  const auto stages = parse_dockerfile(deploy_dir() / "docker" / "Dockerfile.cuda");
  ASSERT_GE(stages.size(), 2u);
  EXPECT_TRUE(std::regex_match(stages.back().base, std::regex("debian:(trixie|13)(-slim)?"))) << stages.back().base;
  bool installs_with_setup_cuda = false, build_with_setup = false, trixie_build = false;
  for (const auto& stage : stages) {
    EXPECT_TRUE(std::regex_match(stage.base, std::regex("debian:[a-z0-9]+(-slim)?"))) << "Debian only: " << stage.base;
    for (const auto& run : stage.all("RUN")) {
      const bool setup_cuda = contains(run, "scripts/setup-cuda.sh --cudnn=nvidia");
      installs_with_setup_cuda |= setup_cuda;
      trixie_build |= setup_cuda && std::regex_match(stage.base, std::regex("debian:(trixie|13)(-slim)?"));
      build_with_setup |= contains(run, "SKYREELS_SKIP_DEPS=1 scripts/setup.sh");
      EXPECT_FALSE(contains(run, "cmake ")) << run;
      EXPECT_FALSE(contains(run, "--cudnn=stub")) << "the stub cuDNN is for the chroot check only: " << run;
      // No downloads outside Debian's archive (cuDNN comes through Debian's own nvidia-cudnn installer package).
      for (const char* fetch : {"curl ", "wget ", "http://", "https://", "ADD "}) EXPECT_FALSE(contains(run, fetch)) << run;
    }
    EXPECT_TRUE(stage.all("ADD").empty()) << "no ADD of remote files";
  }
  EXPECT_TRUE(installs_with_setup_cuda) << "the packages come from scripts/setup-cuda.sh";
  EXPECT_TRUE(trixie_build) << "scripts/setup-cuda.sh runs on debian:trixie";
  EXPECT_TRUE(build_with_setup);
  // The chroot check installs with the same script (with the stub cuDNN it is allowed, never the image).
  const std::string check = read_text(root() / "scripts" / "check-cuda-build.sh");
  EXPECT_TRUE(contains(check, "scripts/setup-cuda.sh --cudnn=stub"));
  // setup-cuda.sh reads setup.sh's PACKAGES and swaps the CPU libtorch-dev for the CUDA one.
  const std::string setup_cuda = read_text(root() / "scripts" / "setup-cuda.sh");
  for (const char* what : {"scripts/setup.sh", "PACKAGES", "-e libtorch-dev", "libtorch-cuda-dev", "nvidia-cuda-toolkit",
                           "libcuda1", "nvidia-cudnn"}) {
    EXPECT_TRUE(contains(setup_cuda, what)) << what;
  }
}

TEST(DockerImages, ImagesAreMultiStageNonRootWithWeightsMountedAndServerFlags) {
  const auto help_flags = flags_in_help(server_help());
  for (const char* file : {"Dockerfile.cpu", "Dockerfile.cuda"}) {
    SCOPED_TRACE(file);
    const auto stages = parse_dockerfile(deploy_dir() / "docker" / file);
    ASSERT_GE(stages.size(), 2u);
    const DockerStage& runtime = stages.back();
    const auto users = runtime.all("USER");
    ASSERT_FALSE(users.empty());
    EXPECT_FALSE(std::regex_match(users.back(), std::regex("(root|0)(:.*)?"))) << users.back();
    for (const char* copy : {"COPY", "ADD"}) {
      for (const auto& c : runtime.all(copy)) EXPECT_FALSE(contains(c, " /models")) << "weights are never baked in";
    }
    const Json entrypoint = Json::parse(runtime.all("ENTRYPOINT").at(0));
    EXPECT_EQ(entrypoint.back(), "skyreels-server");
    const auto args = strings_of(Json::parse(runtime.all("CMD").at(0)), "CMD");
    const auto flags = parse_flag_values(args);
    for (const auto& [flag, value] : flags) {
      EXPECT_TRUE(help_flags.count(flag)) << flag << " is not in skyreels-server --help";
      EXPECT_TRUE(contract().flags.count(flag)) << flag << " is not in the contract";
    }
    EXPECT_EQ(flags.at("--model").rfind("/models/", 0), 0u);
    std::string exposed;
    for (const auto& e : runtime.all("EXPOSE")) exposed += " " + e + " ";
    for (const char* listen : {"--listen", "--metrics-listen"}) {
      const int port = port_of(flag_or_default(flags, listen));
      EXPECT_TRUE(contains(exposed, " " + std::to_string(port) + " ")) << listen << " port not exposed";
    }
  }
}

TEST(DockerImages, RuntimeClosureListsOnlyRuntimePackagesOfTheBuiltBinaries) {
  if (run_command("command -v dpkg-query") != 0) GTEST_SKIP() << "not a Debian system";
  const std::string out = temp_dir("closure");
  const fs::path build_dir = fs::path(bin_path("x")).parent_path().parent_path();
  std::string output;
  ASSERT_EQ(
      run_command((deploy_dir() / "docker" / "runtime-closure.sh").string() + " " + build_dir.string() + " " + out,
                  &output),
      0)
      << output;
  EXPECT_TRUE(fs::exists(fs::path(out) / "bin" / "skyreels-server"));
  const auto packages = split_lines(read_text(fs::path(out) / "runtime-packages.txt"));
  EXPECT_GE(packages.size(), 10u);
  for (const auto& p : packages) EXPECT_FALSE(p.size() > 4 && p.compare(p.size() - 4, 4, "-dev") == 0) << p;
  EXPECT_NE(std::find(packages.begin(), packages.end(), "libc6"), packages.end());
}

// --- the job store's metrics (server/job_store_timed.*, server/metrics.*) -----------------------------------------

// A store whose every call fails, as a database that went away does.
class FailingStore final : public server::JobStore {
 public:
  std::string describe() const override { return "failing"; }
  bool durable() const override { return true; }
  void insert_job(server::StoredJob) override { fail(); }
  void update_job(const server::StoredJob&) override { fail(); }
  void commit_chunk(const std::string&, const server::StoredChunk&) override { fail(); }
  void append_event(const std::string&, const server::StoredEvent&) override { fail(); }
  void drop_job(const std::string&, const std::string&) override { fail(); }
  std::optional<std::string> dropped_reason(const std::string&, const std::string&) const override { fail(); }
  std::vector<server::StoredJob> load_jobs() const override { fail(); }
  std::vector<server::StoredChunk> load_chunks(const std::string&) const override { fail(); }
  std::optional<std::string> load_chunk_bytes(const std::string&, int64_t) const override { fail(); }
  void put_segment(const std::string&, int64_t, const std::string&) override { fail(); }
  std::optional<std::string> load_segment(const std::string&, int64_t) const override { fail(); }
  std::vector<server::StoredEvent> load_events(const std::string&) const override { fail(); }

 private:
  [[noreturn]] static void fail() { throw server::StoreError("connection lost"); }
};

// Calls every JobStore method once, in the order of kJobStoreOps; StoreErrors are swallowed.
void call_every_store_method(server::JobStore& store) {
  const auto attempt = [](auto&& call) {
    try {
      call();
    } catch (const server::StoreError&) {
    }
  };
  server::StoredJob job;
  job.id = "j1";
  attempt([&] { store.insert_job(job); });
  attempt([&] { store.update_job(job); });
  attempt([&] { store.commit_chunk("j1", {0, "cpu:0", 1, "bytes"}); });
  attempt([&] { store.append_event("j1", {1, "event"}); });
  attempt([&] { store.drop_job("j1", "expired"); });
  attempt([&] { store.dropped_reason("j1", "owner"); });
  attempt([&] { store.load_jobs(); });
  attempt([&] { store.load_chunks("j1"); });
  attempt([&] { store.load_events("j1"); });
  attempt([&] { store.load_request("j1"); });
  attempt([&] { store.load_chunk_bytes("j1", 0); });
  attempt([&] { store.put_segment("j1", 0, "mp4"); });
  attempt([&] { store.load_segment("j1", 0); });
  attempt([&] { store.blob_size("j1", server::JobStore::Blob::segment, 0); });
  attempt([&] { store.load_blob_range("j1", server::JobStore::Blob::segment, 0, 0, 1); });
}

std::vector<std::string> reported_ops(std::unique_ptr<server::JobStore> inner) {
  std::vector<std::string> ops;
  server::TimedJobStore timed(*inner, [&](const char* op, double seconds) {
    EXPECT_GE(seconds, 0.0);
    ops.push_back(op);
  });
  call_every_store_method(timed);
  return ops;
}

TEST(StoreMetrics, TimedStoreReportsEveryCallWithItsOperationAlsoWhenTheCallFails) {
  const std::vector<std::string> all(std::begin(server::kJobStoreOps), std::end(server::kJobStoreOps));
  EXPECT_EQ(reported_ops(std::make_unique<server::MemoryJobStore>()), all);
  EXPECT_EQ(reported_ops(std::make_unique<FailingStore>()), all);
}

// The leases are timed like the records: every LeaseStore call that reaches the store, by its name, and records()
// hands out the records timed.
TEST(StoreMetrics, TimedLeaseStoreReportsEveryLeaseCallAndTimesTheRecordsItHolds) {
  auto leases = server::lease_store_over(std::make_unique<server::MemoryJobStore>(), "finished");
  std::vector<std::string> ops;
  server::TimedLeaseStore timed(*leases, [&](const char* op, double seconds) {
    EXPECT_GE(seconds, 0.0);
    ops.push_back(op);
  });
  const server::StoredJob job = make_job("j1", 0, 0, 0, 1);
  const auto ttl = std::chrono::milliseconds(10000);
  timed.candidates(10);
  const auto lease = timed.try_lease("j1", "cpu:0", ttl, 1);
  timed.report_replica("cpu:0", {}, true);
  timed.replica_reports(ttl);
  timed.insert_job_once(job, {});
  const auto leased = timed.try_lease("j1", "cpu:0", ttl, 1);
  ASSERT_TRUE(leased.has_value()) << "a leased chunk to renew, commit and release";
  timed.renew(*leased, ttl);
  timed.release(*leased);
  const auto again = timed.try_lease("j1", "cpu:0", ttl, 1);
  ASSERT_TRUE(again.has_value());
  timed.commit(*again, {0, "cpu:0", 1, "bytes"}, {});
  timed.expire_deadlines();
  timed.finished_to_retire(0, 10);
  timed.request_cancel("j1", "alice");
  timed.admission_counts("alice");
  timed.queue_depth();
  timed.jobs_of("alice");
  timed.load_job("j1", false);
  timed.append_events("j1", {"event"});
  timed.reserve_sequences("j1", 1);
  timed.publish_step("j1", {1, "step"});
  const std::set<std::string> reported(ops.begin(), ops.end());
  EXPECT_EQ(reported, std::set<std::string>(std::begin(server::kLeaseStoreOps), std::end(server::kLeaseStoreOps)));
  EXPECT_FALSE(lease.has_value()) << "nothing was stored yet";
  ops.clear();
  timed.records().load_jobs();
  EXPECT_EQ(ops, std::vector<std::string>{"load_jobs"}) << "the records it holds are timed too";
}

TEST(StoreMetrics, ContractListsEveryStoreOperationAsTheOpLabel) {
  const MetricSpec& spec = contract().metrics.at("skyreels_job_store_seconds");
  EXPECT_EQ(spec.type, "histogram");
  EXPECT_EQ(spec.label, "op");
  std::set<std::string> ops(std::begin(server::kJobStoreOps), std::end(server::kJobStoreOps));
  ops.insert(std::begin(server::kLeaseStoreOps), std::end(server::kLeaseStoreOps));
  EXPECT_EQ(spec.label_values, ops);
}

// --- the metric family table (server/metrics/metric_families.*) against the contract --------------------------------

// A contract row's enumerated values without their notes ("failed (retried later)" is "failed").
std::set<std::string> contract_values(const MetricSpec& spec) {
  std::set<std::string> values;
  for (const std::string& v : spec.label_values) values.insert(v.substr(0, v.find(" (")));
  return values;
}

TEST(MetricTable, EveryFamilyIsAContractRowWithItsTypeLabelsAndValues) {
  std::set<std::string> in_table;
  for (const server::MetricFamily& family : server::metric_families()) {
    in_table.insert(family.name);
    const auto row = contract().metrics.find(family.name);
    ASSERT_NE(row, contract().metrics.end()) << family.name << " is exported but not in docs/ARCHITECTURE.md";
    const MetricSpec& spec = row->second;
    EXPECT_EQ(spec.type, server::metric_type_name(family.type)) << family.name;
    EXPECT_EQ(spec.labels, std::set<std::string>(family.labels.begin(), family.labels.end())) << family.name;
    if (!family.labels.empty()) {
      EXPECT_EQ(spec.label, family.labels.front()) << family.name;
    }
    if (family.series == server::Series::Values) {
      EXPECT_EQ(contract_values(spec), std::set<std::string>(family.values.begin(), family.values.end()))
          << family.name << ": the values created at start are the contract's";
    }
    EXPECT_EQ(family.type == server::MetricType::Histogram, !family.buckets.empty()) << family.name;
  }
  for (const auto& [name, spec] : contract().metrics) {
    EXPECT_EQ(in_table.count(name), 1u) << name << " is in the contract but not in the metric table";
  }
}

// prometheus-cpp leaves out a family without series: those made on demand (RPCs, routes, adapters) appear once
// reported.
TEST(MetricTable, AFreshExpositionDeclaresEveryFamilyMadeAtStartWithItsType) {
  const Exposition fresh = parse_exposition(server::Metrics({"cpu:0"}, "test").render());
  for (const server::MetricFamily& family : server::metric_families()) {
    if (family.series == server::Series::OnDemand && family.id != server::MetricId::BuildInfo) continue;
    const auto type = fresh.types.find(family.name);
    ASSERT_NE(type, fresh.types.end()) << family.name;
    EXPECT_EQ(type->second, server::metric_type_name(family.type)) << family.name;
  }
}

// The value of the sample whose line starts with `series` (name and labels as exported), NaN when none does.
double sample_value(const std::string& exposition, const std::string& series) {
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

server::SchedulerEvent queue_changed(int64_t queued, int64_t running) {
  server::SchedulerEvent event(server::SchedulerEventKind::QueueChanged);
  event.queued = queued;
  event.running = running;
  return event;
}

TEST(StoreMetrics, GlobalQueueDepthFollowsThePodQueueUntilTheStoreReportsIt) {
  server::Metrics metrics({"cpu:0"}, "test");
  metrics.consume(queue_changed(3, 1));
  EXPECT_EQ(sample_value(metrics.render(), "skyreels_global_queue_depth"), 3) << "single pod: its own queue";
  metrics.set_global_queue_depth(7);
  metrics.consume(queue_changed(2, 1));
  EXPECT_EQ(sample_value(metrics.render(), "skyreels_global_queue_depth"), 7) << "shared store: the store's count";
  EXPECT_EQ(sample_value(metrics.render(), "skyreels_queue_depth"), 2);
}

TEST(StoreMetrics, TakeoversAndStoreCallsAreCounted) {
  server::Metrics metrics({"cpu:0"}, "test");
  server::SchedulerEvent takeover(server::SchedulerEventKind::LeaseTakeover);
  takeover.replica = "pod-1/cpu:0";
  metrics.consume(takeover);
  metrics.consume(takeover);
  const auto report = metrics.store_call_report();
  report("commit_chunk", 0.2);
  report("no_such_op", 1.0);  // ignored rather than a series the contract does not list
  const std::string text = metrics.render();
  EXPECT_EQ(sample_value(text, "skyreels_lease_takeovers_total"), 2);
  EXPECT_EQ(sample_value(text, "skyreels_job_store_seconds_count{op=\"commit_chunk\"}"), 1);
  EXPECT_EQ(sample_value(text, "skyreels_job_store_seconds_bucket{op=\"commit_chunk\",le=\"0.25\"}"), 1);
  EXPECT_EQ(sample_value(text, "skyreels_job_store_seconds_bucket{op=\"commit_chunk\",le=\"0.1\"}"), 0);
  EXPECT_EQ(text.find("no_such_op"), std::string::npos);
}

// --- a real server
// ----------------------------------------------------------------------------------------------------

// The CPU overlay's own arguments, with --demo instead of weight folders and loopback ports.
std::vector<std::string> demo_args(int grpc_port, int metrics_port, const std::string& drain_seconds = "") {
  const auto manifest = strings_of(server_container(overlay("cpu")).at("args"), "args");
  static const std::set<std::string> weight_flags = {"--model", "--vae", "--text-encoder", "--tokenizer"};
  std::vector<std::string> args;
  for (size_t i = 0; i < manifest.size(); ++i) {
    const std::string& flag = manifest[i];
    const bool has_value = i + 1 < manifest.size() && manifest[i + 1].rfind("--", 0) != 0;
    std::string value = has_value ? manifest[i + 1] : "";
    if (has_value) ++i;
    if (weight_flags.count(flag)) continue;
    if (flag == "--listen") value = "127.0.0.1:" + std::to_string(grpc_port);
    if (flag == "--metrics-listen") value = "127.0.0.1:" + std::to_string(metrics_port);
    if (flag == "--drain-timeout-seconds" && !drain_seconds.empty()) value = drain_seconds;
    if (flag == "--data-dir") continue;  // the container's volume; each test server gets a temp dir below
    args.push_back(flag);
    if (has_value) args.push_back(value);
  }
  args.insert(args.end(), {"--data-dir", temp_dir("server-data")});
  args.push_back("--demo");
  return args;
}

struct DemoServer {
  int grpc_port = free_tcp_port();
  int metrics_port = free_tcp_port();
  std::unique_ptr<ServerProcess> process;

  explicit DemoServer(const std::string& drain_seconds = "") {
    const fs::path log = fs::path(temp_dir("server")) / "server.log";
    process = std::make_unique<ServerProcess>(bin_path("skyreels-server"),
                                              demo_args(grpc_port, metrics_port, drain_seconds), log);
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(grpc_port); }

  // Polls the health service until SERVING; fails with the server's log when it exits or times out.
  ::testing::AssertionResult wait_serving(const std::string& service, double seconds = 120) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    std::string last = "no answer yet";
    while (std::chrono::steady_clock::now() < deadline) {
      if (!process->running()) return ::testing::AssertionFailure() << "server exited:\n" << process->log_tail();
      std::string error;
      const int status = grpc_health_check(target(), service, &error);
      if (status == 1) return ::testing::AssertionSuccess();
      last = status < 0 ? error : "status " + std::to_string(status);
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    return ::testing::AssertionFailure() << "service \"" << service << "\" not SERVING after " << seconds
                                         << " s (last: " << last << "):\n"
                                         << process->log_tail();
  }
};

TEST(RunningServer, ExportsEveryMetricTheDashboardAlertsAndAutoscalerUse) {
  DemoServer server;
  ASSERT_TRUE(server.wait_serving(""));
  const std::string path =
      only_object(overlay("cpu"), "ServiceMonitor").at("spec").at("endpoints")[0].value("path", "");
  const Exposition scraped = parse_exposition(http_get(server.metrics_port, path));
  std::vector<std::string> problems;
  for (const auto& metric : metrics_used()) {
    if (contract().metrics.count(metric) == 0) {
      problems.push_back(metric + ": not in the contract");
      continue;
    }
    const MetricSpec& spec = contract().metrics.at(metric);
    const auto type = scraped.types.find(metric);
    if (type == scraped.types.end()) {
      problems.push_back(metric + ": not exported by a freshly started server (create every label value at start)");
      continue;
    }
    if (type->second != spec.type)
      problems.push_back(metric + ": exported as " + type->second + ", contract says " + spec.type);
    const auto samples = scraped.samples.find(spec.type == "histogram" ? metric + "_bucket" : metric);
    if (samples == scraped.samples.end()) {
      problems.push_back(metric + ": declared but has no sample");
      continue;
    }
    const bool labelled =
        spec.label.empty() || std::any_of(samples->second.begin(), samples->second.end(),
                                          [&](const auto& labels) { return labels.count(spec.label) > 0; });
    if (!labelled) problems.push_back(metric + ": no sample carries the label '" + spec.label + "'");
  }
  EXPECT_TRUE(problems.empty()) << join(problems) << "\n" << server.process->log_tail(1500);
}

TEST(RunningServer, AnswersTheManifestProbeServicesOnTheListenPort) {
  const auto objects = overlay("cpu");
  const Json& c = server_container(objects);
  DemoServer server;
  ASSERT_TRUE(server.wait_serving(c.at("readinessProbe").at("grpc").value("service", "")));
  EXPECT_TRUE(server.wait_serving(c.at("livenessProbe").at("grpc").value("service", ""), 10));
  EXPECT_TRUE(server.wait_serving(c.at("startupProbe").at("grpc").value("service", ""), 10));
  std::string error;
  EXPECT_NE(grpc_health_check(server.target(), "no-such-service", &error), 1) << "an unknown service is not SERVING";
}

TEST(RunningServer, DrainsAndExitsCleanlyOnSigtermWithinTheDrainTimeout) {
  DemoServer server("5");
  ASSERT_TRUE(server.wait_serving(""));
  server.process->signal(SIGTERM);
  int status = 0;
  ASSERT_TRUE(server.process->wait_exit(5 + 25, &status)) << "still running 30 s after SIGTERM:\n"
                                                          << server.process->log_tail();
  EXPECT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << " instead of draining:\n"
                                 << server.process->log_tail();
  if (WIFEXITED(status)) {
    EXPECT_EQ(WEXITSTATUS(status), 0) << server.process->log_tail();
  }
}

}  // namespace
}  // namespace skyreels::test::deploy
