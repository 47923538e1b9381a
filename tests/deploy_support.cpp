#include "tests/deploy_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tests/test_util.h"

extern char** environ;

namespace skyreels::test::deploy {

namespace {

std::runtime_error error_at(const std::string& where, const std::string& what) {
  return std::runtime_error(where + ": " + what);
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t\r\n");
  return s.substr(begin, end - begin + 1);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(s);
  std::string part;
  while (std::getline(stream, part, separator)) parts.push_back(part);
  return parts;
}

}  // namespace

fs::path repo_root() {
  // tests/data/<x> -> tests/data -> tests -> root
  return fs::weakly_canonical(fs::path(data_path("x")).parent_path().parent_path().parent_path());
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + file.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<fs::path> files_under(const fs::path& dir, const std::vector<std::string>& suffixes) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    for (const auto& suffix : suffixes) {
      if (ends_with(name, suffix)) {
        files.push_back(entry.path());
        break;
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// --- YAML -----------------------------------------------------------------------------------------------------------

namespace {

struct YamlParser {
  yaml_parser_t parser{};
  YamlParser() {
    if (yaml_parser_initialize(&parser) == 0) throw std::runtime_error("libyaml: cannot initialise a parser");
  }
  ~YamlParser() { yaml_parser_delete(&parser); }
};

struct YamlEvent {
  yaml_event_t event{};
  ~YamlEvent() { yaml_event_delete(&event); }
};

// YAML 1.2 core schema for plain scalars, rejecting what YAML 1.1 parsers (PyYAML, go-yaml v2 in kubectl) read
// differently.
Json resolve_plain(const std::string& s, const std::string& where) {
  static const std::regex null_re("~|null|Null|NULL");
  static const std::regex bool_re("true|True|TRUE|false|False|FALSE");
  static const std::regex yaml11_bool_re("y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF");
  static const std::regex int_re("[-+]?(0|[1-9][0-9]*)");
  static const std::regex leading_zero_re("[-+]?0[0-9_]+");
  static const std::regex yaml11_number_re(
      "[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+|[-+]?[0-9]+_[0-9_]*|0x[0-9a-fA-F]+|0o[0-7]+");
  static const std::regex float_re("[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?");
  if (s.empty() || std::regex_match(s, null_re)) return nullptr;
  if (std::regex_match(s, bool_re)) return s[0] == 't' || s[0] == 'T';
  if (std::regex_match(s, yaml11_bool_re)) {
    throw error_at(where, "plain scalar '" + s + "' is a boolean in YAML 1.1 and a string in 1.2; quote it");
  }
  if (std::regex_match(s, leading_zero_re) || std::regex_match(s, yaml11_number_re)) {
    throw error_at(where, "plain scalar '" + s + "' is read differently by YAML 1.1 and 1.2 parsers; quote it");
  }
  if (std::regex_match(s, int_re)) return std::stoll(s);
  if (std::regex_match(s, float_re)) {
    if (s.find('.') == std::string::npos) {
      throw error_at(where, "plain scalar '" + s + "' is a float in YAML 1.2 but a string in 1.1; write it with a dot");
    }
    return std::stod(s);
  }
  return s;
}

struct Frame {
  Json value;
  bool is_map = false;
  bool has_key = false;
  std::string key;
};

class YamlBuilder {
 public:
  explicit YamlBuilder(std::string origin) : origin_(std::move(origin)) {}

  std::string where(const yaml_mark_t& mark) const { return origin_ + ":" + std::to_string(mark.line + 1); }
  bool expecting_key() const { return !stack_.empty() && stack_.back().is_map && !stack_.back().has_key; }

  void check_node(const yaml_char_t* anchor, const yaml_char_t* tag, const yaml_mark_t& mark) const {
    if (anchor != nullptr) throw error_at(where(mark), "anchors are not allowed (keep YAML readable by any parser)");
    if (tag != nullptr) throw error_at(where(mark), "explicit tags are not allowed");
  }

  void scalar(const yaml_event_t& event) {
    const auto& s = event.data.scalar;
    check_node(s.anchor, s.tag, event.start_mark);
    const std::string text(reinterpret_cast<const char*>(s.value), s.length);
    if (expecting_key()) {
      Frame& top = stack_.back();
      if (top.value.contains(text)) throw error_at(where(event.start_mark), "duplicate key '" + text + "'");
      top.key = text;
      top.has_key = true;
      return;
    }
    if (s.style == YAML_FOLDED_SCALAR_STYLE && text.find('\n') != std::string::npos) {
      // Line breaks kept by folding (more-indented or blank lines) differ between parsers (kustomize adds lines).
      throw error_at(where(event.start_mark), "folded block scalar keeps line breaks; use a literal block (|)");
    }
    add(s.style == YAML_PLAIN_SCALAR_STYLE ? resolve_plain(text, where(event.start_mark)) : Json(text));
  }

  void open(bool is_map, const yaml_char_t* anchor, const yaml_char_t* tag, const yaml_mark_t& mark) {
    check_node(anchor, tag, mark);
    if (expecting_key()) throw error_at(where(mark), "mapping keys must be scalars");
    Frame frame;
    frame.is_map = is_map;
    frame.value = is_map ? Json::object() : Json::array();
    stack_.push_back(std::move(frame));
  }

  void close() {
    Json value = std::move(stack_.back().value);
    stack_.pop_back();
    add(std::move(value));
  }

  std::vector<Json> take_documents() { return std::move(documents_); }

 private:
  void add(Json value) {
    if (stack_.empty()) {
      if (!value.is_null()) documents_.push_back(std::move(value));  // empty documents carry nothing
      return;
    }
    Frame& top = stack_.back();
    if (!top.is_map) {
      top.value.push_back(std::move(value));
      return;
    }
    top.value[top.key] = std::move(value);
    top.has_key = false;
  }

  std::string origin_;
  std::vector<Frame> stack_;
  std::vector<Json> documents_;
};

}  // namespace

std::vector<Json> parse_yaml(const std::string& text, const std::string& origin) {
  YamlParser parser;
  yaml_parser_set_input_string(&parser.parser, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  YamlBuilder builder(origin);
  for (;;) {
    YamlEvent e;
    if (yaml_parser_parse(&parser.parser, &e.event) == 0) {
      const auto& p = parser.parser;
      throw error_at(origin + ":" + std::to_string(p.problem_mark.line + 1),
                     std::string("YAML syntax: ") + (p.problem != nullptr ? p.problem : "unknown error") +
                         (p.context != nullptr ? std::string(" ") + p.context : ""));
    }
    const yaml_event_t& ev = e.event;
    switch (ev.type) {
      case YAML_STREAM_END_EVENT:
        return builder.take_documents();
      case YAML_ALIAS_EVENT:
        throw error_at(builder.where(ev.start_mark), "aliases are not allowed");
      case YAML_SCALAR_EVENT:
        builder.scalar(ev);
        break;
      case YAML_SEQUENCE_START_EVENT:
        builder.open(false, ev.data.sequence_start.anchor, ev.data.sequence_start.tag, ev.start_mark);
        break;
      case YAML_MAPPING_START_EVENT:
        builder.open(true, ev.data.mapping_start.anchor, ev.data.mapping_start.tag, ev.start_mark);
        break;
      case YAML_SEQUENCE_END_EVENT:
      case YAML_MAPPING_END_EVENT:
        builder.close();
        break;
      default:  // stream/document start and end
        break;
    }
  }
}

std::vector<Json> load_yaml(const fs::path& file) { return parse_yaml(read_text(file), file.string()); }

Json load_json(const fs::path& file) {
  try {
    return Json::parse(read_text(file));
  } catch (const Json::parse_error& e) {
    throw std::runtime_error(file.string() + ": " + e.what());
  }
}

// --- kustomize ------------------------------------------------------------------------------------------------------

namespace {

void merge_patch(Json& target, const Json& patch);

// The strategic-merge key of a list field (Kubernetes' patchMergeKey): volume mounts by path, the rest by name.
std::string merge_key(const std::string& field) { return field == "volumeMounts" ? "mountPath" : "name"; }

bool keyed_objects(const Json& list, const std::string& key) {
  return std::all_of(list.begin(), list.end(), [&](const Json& e) { return e.is_object() && e.contains(key); });
}

// Strategic-merge lists: objects with the merge key merge by it (containers, env, volumes, volume mounts), an element
// {key: ..., $patch: delete} removes its match; anything else is replaced.
void merge_list(Json& target, const Json& patch, const std::string& key) {
  if (!keyed_objects(target, key) || !keyed_objects(patch, key) || patch.empty()) {
    target = patch;
    return;
  }
  for (const auto& element : patch) {
    auto match = std::find_if(target.begin(), target.end(), [&](const Json& t) { return t[key] == element[key]; });
    if (element.value("$patch", "") == "delete") {
      if (match != target.end()) target.erase(match);
    } else if (match == target.end()) {
      target.push_back(element);
    } else {
      merge_patch(*match, element);
    }
  }
}

void merge_patch(Json& target, const Json& patch) {
  for (auto it = patch.begin(); it != patch.end(); ++it) {
    if (it.value().is_null()) {
      target.erase(it.key());
    } else if (target.contains(it.key()) && target[it.key()].is_object() && it.value().is_object()) {
      merge_patch(target[it.key()], it.value());
    } else if (target.contains(it.key()) && target[it.key()].is_array() && it.value().is_array()) {
      merge_list(target[it.key()], it.value(), merge_key(it.key()));
    } else {
      target[it.key()] = it.value();
    }
  }
}

std::string object_id(const Json& object) {
  return object.value("kind", "?") + "/" + object.value("/metadata/name"_json_pointer, "?");
}

void apply_patch_file(std::vector<Json>& objects, const fs::path& file) {
  for (const Json& patch : load_yaml(file)) {
    auto target = std::find_if(objects.begin(), objects.end(), [&](const Json& o) {
      return o.value("kind", "") == patch.value("kind", "") &&
             o.value("/metadata/name"_json_pointer, "") == patch.value("/metadata/name"_json_pointer, "");
    });
    if (target == objects.end())
      throw std::runtime_error(file.string() + ": patch target " + object_id(patch) + " is not among the resources");
    merge_patch(*target, patch);
  }
}

void set_images(Json& pod_spec, const Json& rule) {
  const std::string name = rule.at("name").get<std::string>();
  for (const char* field : {"containers", "initContainers"}) {
    if (!pod_spec.contains(field)) continue;
    for (Json& container : pod_spec[field]) {
      const std::string image = container.value("image", "");
      const bool same = image == name || image.rfind(name + ":", 0) == 0 || image.rfind(name + "@", 0) == 0;
      if (!same) continue;
      std::string tag = image.size() > name.size() ? image.substr(name.size()) : "";
      if (rule.contains("newTag")) tag = ":" + rule["newTag"].get<std::string>();
      container["image"] = rule.value("newName", name) + tag;
    }
  }
}

void apply_images(std::vector<Json>& objects, const Json& rules) {
  for (Json& object : objects) {
    Json* pod_spec = nullptr;
    if (object.contains("spec") && object["spec"].contains("template")) {
      pod_spec = &object["spec"]["template"]["spec"];
    } else if (object.value("kind", "") == "Pod") {
      pod_spec = &object["spec"];
    }
    if (pod_spec == nullptr) continue;
    for (const Json& rule : rules) set_images(*pod_spec, rule);
  }
}

}  // namespace

namespace {

const Json& kustomization_at(const fs::path& file, const std::vector<Json>& documents) {
  if (documents.size() != 1 || !documents[0].is_object()) throw std::runtime_error(file.string() + ": one mapping");
  static const std::set<std::string> supported = {"apiVersion", "kind",   "bases",
                                                  "resources",  "images", "patchesStrategicMerge"};
  for (auto it = documents[0].begin(); it != documents[0].end(); ++it) {
    if (supported.count(it.key()) == 0) {
      throw std::runtime_error(file.string() + ": field '" + it.key() + "' is outside the subset deploy/ uses");
    }
  }
  return documents[0];
}

// kustomize v2.0.3 reads only directories under `bases` and only files under `resources`.
fs::path listed_path(const fs::path& file, const Json& entry, bool directory) {
  const fs::path path = file.parent_path() / entry.get<std::string>();
  if (!fs::exists(path)) throw std::runtime_error(file.string() + ": " + path.string() + " is missing");
  if (fs::is_directory(path) != directory) {
    throw std::runtime_error(file.string() + ": " + path.string() +
                             (directory ? " is not a directory (bases)" : " is a directory (list it under bases)"));
  }
  return path;
}

}  // namespace

std::vector<Json> render_kustomization(const fs::path& dir) {
  const fs::path file = dir / "kustomization.yaml";
  const auto documents = load_yaml(file);
  const Json& k = kustomization_at(file, documents);
  std::vector<Json> objects;
  for (const Json& base : k.value("bases", Json::array())) {
    const auto rendered = render_kustomization(listed_path(file, base, true));
    objects.insert(objects.end(), rendered.begin(), rendered.end());
  }
  for (const Json& resource : k.value("resources", Json::array())) {
    const auto loaded = load_yaml(listed_path(file, resource, false));
    objects.insert(objects.end(), loaded.begin(), loaded.end());
  }
  for (const Json& patch : k.value("patchesStrategicMerge", Json::array())) {
    apply_patch_file(objects, listed_path(file, patch, false));
  }
  if (k.contains("images")) apply_images(objects, k["images"]);
  return objects;
}

const Json& only_object(const std::vector<Json>& objects, const std::string& kind, const std::string& name) {
  const Json* found = nullptr;
  for (const Json& o : objects) {
    if (o.value("kind", "") != kind || (!name.empty() && o.value("/metadata/name"_json_pointer, "") != name)) {
      continue;
    }
    if (found != nullptr) throw std::runtime_error("more than one " + kind + " " + name);
    found = &o;
  }
  if (found == nullptr) throw std::runtime_error("no " + kind + " " + name);
  return *found;
}

std::string kubectl_path() {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (const auto& dir : split(path, ':')) {
    const fs::path candidate = fs::path(dir) / "kubectl";
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

// --- Dockerfiles ----------------------------------------------------------------------------------------------------

std::vector<std::string> DockerStage::all(const std::string& keyword) const {
  std::vector<std::string> found;
  for (const auto& i : instructions) {
    if (i.keyword == keyword) found.push_back(i.arguments);
  }
  return found;
}

namespace {

// Docker joins lines ending in a backslash and drops comment lines, also inside a continued instruction.
std::vector<std::string> dockerfile_logical_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::string current;
  for (const std::string& raw : split(text, '\n')) {
    const std::string line = trim(raw);
    if (line.empty() || line[0] == '#') continue;
    if (line.back() == '\\') {
      current += line.substr(0, line.size() - 1) + " ";
      continue;
    }
    lines.push_back(current + line);
    current.clear();
  }
  if (!trim(current).empty()) lines.push_back(current);
  return lines;
}

std::string substitute_args(std::string text, const std::map<std::string, std::string>& args) {
  for (const auto& [name, value] : args) {
    for (const std::string& pattern : {"${" + name + "}", "$" + name}) {
      for (size_t at = text.find(pattern); at != std::string::npos; at = text.find(pattern, at + value.size())) {
        text.replace(at, pattern.size(), value);
      }
    }
  }
  return text;
}

}  // namespace

std::vector<DockerStage> parse_dockerfile(const fs::path& file) {
  std::vector<DockerStage> stages;
  std::map<std::string, std::string> global_args;
  for (const std::string& line : dockerfile_logical_lines(read_text(file))) {
    const auto space = line.find_first_of(" \t");
    std::string keyword = line.substr(0, space);
    std::transform(keyword.begin(), keyword.end(), keyword.begin(), ::toupper);
    const std::string arguments = space == std::string::npos ? "" : trim(line.substr(space));
    if (keyword == "FROM") {
      std::vector<std::string> words;
      for (const auto& w : split(substitute_args(arguments, global_args), ' ')) {
        if (!w.empty() && w.rfind("--", 0) != 0) words.push_back(w);
      }
      DockerStage stage;
      stage.base = words.empty() ? "" : words[0];
      if (words.size() == 3) stage.name = words[2];
      stages.push_back(stage);
      continue;
    }
    if (stages.empty()) {
      if (keyword != "ARG") throw std::runtime_error(file.string() + ": " + keyword + " before the first FROM");
      const auto eq = arguments.find('=');
      global_args[arguments.substr(0, eq)] = eq == std::string::npos ? "" : arguments.substr(eq + 1);
      continue;
    }
    stages.back().instructions.push_back({keyword, arguments});
  }
  return stages;
}

// --- contract -------------------------------------------------------------------------------------------------------

Contract load_contract(const fs::path& architecture_md) {
  const std::string text = read_text(architecture_md);
  const auto begin = text.find("## Operations contract");
  if (begin == std::string::npos) throw std::runtime_error(architecture_md.string() + ": no Operations contract");
  const auto end = text.find("\n## ", begin + 1);
  Contract contract;
  contract.text = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);

  const auto flags_end = contract.text.find("Probes");
  const std::string flags_text = contract.text.substr(0, flags_end);
  static const std::regex flag_re("`(--[a-z][a-z0-9-]*)");
  for (std::sregex_iterator it(flags_text.begin(), flags_text.end(), flag_re), last; it != last; ++it) {
    contract.flags.insert((*it)[1]);
  }
  static const std::regex default_re("`(--[a-z][a-z0-9-]*)[^`]*`\\s*\\(default\\s+`?([^`),]+)`?");
  for (std::sregex_iterator it(flags_text.begin(), flags_text.end(), default_re), last; it != last; ++it) {
    contract.defaults[(*it)[1]] = trim((*it)[2]);
  }

  static const std::regex row_re("\\|\\s*`((?:skyreels|grpc_server)_[a-z0-9_]+)`\\s*\\|\\s*([a-z]+)[^|]*\\|([^|\\n]*)\\|");
  static const std::regex label_re("`([a-z_]+)`");
  for (std::sregex_iterator it(contract.text.begin(), contract.text.end(), row_re), last; it != last; ++it) {
    MetricSpec spec;
    spec.name = (*it)[1];
    spec.type = (*it)[2];
    const std::string labels = (*it)[3];
    for (std::sregex_iterator l(labels.begin(), labels.end(), label_re), none; l != none; ++l) {
      spec.labels.insert((*l)[1]);
    }
    std::smatch label;
    if (std::regex_search(labels, label, label_re)) {
      spec.label = label[1];
      const auto eq = labels.find('=');
      if (eq != std::string::npos) {
        for (const auto& value : split(labels.substr(eq + 1), ',')) spec.label_values.insert(trim(value));
      }
    }
    contract.metrics[spec.name] = spec;
  }
  return contract;
}

const std::set<std::string>& target_labels() {
  static const std::set<std::string> labels = {"namespace", "pod",       "instance", "job",
                                               "service",   "container", "endpoint"};
  return labels;
}

// --- PromQL ---------------------------------------------------------------------------------------------------------

std::set<std::string> skyreels_series(const std::string& promql) {
  static const std::regex series_re("\\b(?:skyreels|grpc_server)_[a-zA-Z0-9_]+");
  std::set<std::string> names;
  for (std::sregex_iterator it(promql.begin(), promql.end(), series_re), last; it != last; ++it) {
    names.insert(it->str());
  }
  return names;
}

std::string metric_of_series(const std::string& series, const Contract& contract) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    if (!ends_with(series, suffix)) continue;
    const std::string base = series.substr(0, series.size() - std::strlen(suffix));
    const auto it = contract.metrics.find(base);
    if (it != contract.metrics.end() && it->second.type == "histogram") return base;
  }
  return series;
}

namespace {

using RegexIt = std::sregex_iterator;

std::set<std::string> labels_allowed_in(const std::string& promql, const Contract& contract) {
  std::set<std::string> allowed = target_labels();
  allowed.insert("le");
  for (const auto& series : skyreels_series(promql)) {
    const auto spec = contract.metrics.find(metric_of_series(series, contract));
    if (spec != contract.metrics.end()) allowed.insert(spec->second.labels.begin(), spec->second.labels.end());
  }
  return allowed;
}

void check_series(const std::string& promql, const Contract& contract, std::vector<std::string>& problems) {
  for (const auto& series : skyreels_series(promql)) {
    const std::string metric = metric_of_series(series, contract);
    const auto spec = contract.metrics.find(metric);
    if (spec == contract.metrics.end()) {
      problems.push_back(series + ": not a metric of the contract");
    } else if (spec->second.type == "histogram" && metric == series) {
      problems.push_back(series + ": a histogram is queried through _bucket, _sum or _count");
    }
  }
}

void check_matchers(const std::string& promql, const Contract& contract, std::vector<std::string>& problems) {
  static const std::regex selector_re("((?:skyreels|grpc_server)_[a-zA-Z0-9_]+)\\s*\\{([^}]*)\\}");
  static const std::regex matcher_re("([a-zA-Z_][a-zA-Z0-9_]*)\\s*(=~|!~|!=|=)\\s*\"([^\"]*)\"");
  for (RegexIt it(promql.begin(), promql.end(), selector_re), last; it != last; ++it) {
    const std::string series = (*it)[1];
    const auto spec = contract.metrics.find(metric_of_series(series, contract));
    if (spec == contract.metrics.end()) continue;  // reported by check_series
    const std::string matchers = (*it)[2];
    for (RegexIt m(matchers.begin(), matchers.end(), matcher_re); m != last; ++m) {
      const std::string label = (*m)[1], op = (*m)[2], value = (*m)[3];
      const bool known = spec->second.labels.count(label) > 0 || target_labels().count(label) > 0 ||
                         (label == "le" && ends_with(series, "_bucket"));
      if (!known) problems.push_back(series + ": label '" + label + "' is not in the contract");
      const bool literal = (op == "=" || op == "!=") && value.find('$') == std::string::npos;
      if (label == spec->second.label && literal && !spec->second.label_values.empty() &&
          spec->second.label_values.count(value) == 0) {
        problems.push_back(series + ": " + label + "=\"" + value + "\" is not a value the contract lists");
      }
    }
  }
}

// by (...), without (...), on (...), ignoring (...), group_left (...), label_values(metric, label).
void check_grouping(const std::string& promql, const Contract& contract, std::vector<std::string>& problems) {
  static const std::regex grouping_re("\\b(?:by|without|on|ignoring|group_left|group_right)\\s*\\(([^)]*)\\)");
  static const std::regex label_values_re("label_values\\(\\s*(?:skyreels|grpc_server)_[a-zA-Z0-9_]+(\\{[^}]*\\})?\\s*,\\s*(\\w+)");
  const auto allowed = labels_allowed_in(promql, contract);
  auto check = [&](const std::string& label) {
    if (!label.empty() && allowed.count(label) == 0) {
      problems.push_back("label '" + label + "' belongs to none of the expression's metrics: " + promql);
    }
  };
  for (RegexIt it(promql.begin(), promql.end(), grouping_re), last; it != last; ++it) {
    for (const auto& label : split((*it)[1], ',')) check(trim(label));
  }
  for (RegexIt it(promql.begin(), promql.end(), label_values_re), last; it != last; ++it) check((*it)[2]);
}

// rate()/increase() need counters (or histogram series); histogram_quantile needs _bucket grouped by le.
void check_functions(const std::string& promql, const Contract& contract, std::vector<std::string>& problems) {
  static const std::regex rate_re("\\b(?:rate|irate|increase)\\s*\\(\\s*((?:skyreels|grpc_server)_[a-zA-Z0-9_]+)");
  for (RegexIt it(promql.begin(), promql.end(), rate_re), last; it != last; ++it) {
    const std::string series = (*it)[1];
    const std::string metric = metric_of_series(series, contract);
    const auto spec = contract.metrics.find(metric);
    const bool counter_like = spec != contract.metrics.end() && (spec->second.type == "counter" || metric != series);
    if (!counter_like) problems.push_back(series + ": rate()/increase() over something that is not a counter");
  }
  static const std::regex quantile_re("histogram_quantile");
  static const std::regex by_le_re("\\bby\\s*\\([^)]*\\ble\\b[^)]*\\)");
  const auto quantiles = std::distance(RegexIt(promql.begin(), promql.end(), quantile_re), RegexIt());
  const auto by_le = std::distance(RegexIt(promql.begin(), promql.end(), by_le_re), RegexIt());
  if (quantiles > 0 && (by_le < quantiles || promql.find("_bucket") == std::string::npos)) {
    problems.push_back("histogram_quantile needs rate(..._bucket) summed by (le, ...): " + promql);
  }
}

}  // namespace

std::vector<std::string> promql_problems(const std::string& promql, const Contract& contract) {
  std::vector<std::string> problems;
  check_series(promql, contract, problems);
  check_matchers(promql, contract, problems);
  check_grouping(promql, contract, problems);
  check_functions(promql, contract, problems);
  return problems;
}

// --- flags ----------------------------------------------------------------------------------------------------------

std::set<std::string> flags_in_help(const std::string& help_text) {
  static const std::regex flag_re("(^|[^a-zA-Z0-9-])(--[a-z][a-z0-9-]*)");
  std::set<std::string> flags;
  for (RegexIt it(help_text.begin(), help_text.end(), flag_re), last; it != last; ++it) flags.insert((*it)[2]);
  return flags;
}

std::map<std::string, std::string> parse_flag_values(const std::vector<std::string>& args) {
  std::map<std::string, std::string> values;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0) {
      values[""] = arg;  // a positional argument; the server takes none
      continue;
    }
    const auto eq = arg.find('=');
    if (eq != std::string::npos) {
      values[arg.substr(0, eq)] = arg.substr(eq + 1);
    } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
      values[arg] = args[++i];
    } else {
      values[arg] = "";
    }
  }
  return values;
}

int port_of(const std::string& host_port) {
  const auto colon = host_port.rfind(':');
  if (colon == std::string::npos) throw std::runtime_error("'" + host_port + "' has no :PORT");
  return std::stoi(host_port.substr(colon + 1));
}

// --- a running server -----------------------------------------------------------------------------------------------

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket: " + std::string(std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot get a free port: " + std::string(std::strerror(errno)));
  return ntohs(address.sin_port);
}

ServerProcess::ServerProcess(const std::string& binary, const std::vector<std::string>& args, const fs::path& log_file)
    : log_file_(log_file) {
  std::vector<std::string> argv_storage = {binary};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  const int rc = ::posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + binary + ": " + std::strerror(rc));
}

ServerProcess::~ServerProcess() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

bool ServerProcess::running() {
  if (exited_) return false;
  if (::waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
  return !exited_;
}

void ServerProcess::signal(int signo) const { ::kill(pid_, signo); }

bool ServerProcess::wait_exit(double seconds, int* status) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (running()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (status != nullptr) *status = status_;
  return true;
}

std::string ServerProcess::log_tail(size_t bytes) const {
  std::string text;
  try {
    text = read_text(log_file_);
  } catch (const std::exception&) {
    return "(no log)";
  }
  return text.size() > bytes ? "..." + text.substr(text.size() - bytes) : text;
}

namespace {

std::string decode_chunked(const std::string& body) {
  std::string out;
  size_t at = 0;
  for (;;) {
    const auto line_end = body.find("\r\n", at);
    if (line_end == std::string::npos) throw std::runtime_error("truncated chunked body");
    const size_t size = std::stoul(body.substr(at, line_end - at), nullptr, 16);
    if (size == 0) return out;
    out += body.substr(line_end + 2, size);
    at = line_end + 2 + size + 2;
  }
}

}  // namespace

std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket: " + std::string(std::strerror(errno)));
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("connect 127.0.0.1:" + std::to_string(port) + ": " + why);
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[8192];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  const auto header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) throw std::runtime_error("GET " + path + ": no HTTP response");
  const std::string headers = response.substr(0, header_end);
  if (headers.find(" 200") == std::string::npos || headers.find(" 200") > headers.find("\r\n")) {
    throw std::runtime_error("GET " + path + ": " + headers.substr(0, headers.find("\r\n")));
  }
  std::string lower = headers;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  const std::string body = response.substr(header_end + 4);
  return lower.find("transfer-encoding: chunked") != std::string::npos ? decode_chunked(body) : body;
}

Exposition parse_exposition(const std::string& text) {
  Exposition exposition;
  static const std::regex type_re("# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) ([a-z]+)");
  static const std::regex label_re("([a-zA-Z_][a-zA-Z0-9_]*)=\"((?:[^\"\\\\]|\\\\.)*)\"");
  for (const std::string& line : split(text, '\n')) {
    std::smatch m;
    if (std::regex_match(line, m, type_re)) {
      exposition.types[m[1]] = m[2];
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    const auto name_end = line.find_first_of("{ ");
    const std::string name = line.substr(0, name_end);
    std::map<std::string, std::string> labels;
    if (name_end != std::string::npos && line[name_end] == '{') {
      const std::string inside = line.substr(name_end + 1, line.find('}', name_end) - name_end - 1);
      for (RegexIt it(inside.begin(), inside.end(), label_re), last; it != last; ++it) labels[(*it)[1]] = (*it)[2];
    }
    exposition.samples[name].push_back(labels);
  }
  return exposition;
}

int grpc_health_check(const std::string& target, const std::string& service, std::string* error) {
  // HealthCheckRequest { string service = 1; } encoded by hand: no generated stubs needed.
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    for (size_t n = service.size();; n >>= 7) {
      const bool more = n >= 0x80;
      request.push_back(static_cast<char>((n & 0x7f) | (more ? 0x80 : 0)));
      if (!more) break;
    }
    request += service;
  }
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue queue;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request_buffer, &queue);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    if (error != nullptr) *error = "code " + std::to_string(status.error_code()) + ": " + status.error_message();
    return -1;
  }
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse { ServingStatus status = 1; }: absent means UNKNOWN (0).
  return bytes.size() >= 2 && bytes[0] == '\x08' ? static_cast<unsigned char>(bytes[1]) : 0;
}

}  // namespace skyreels::test::deploy
