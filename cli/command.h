// Subcommands of the `skyreels` tool. Each cmd_*.cpp registers one with SKYREELS_COMMAND; main.cpp dispatches.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace skyreels::server {
struct JobRequest;
}
namespace skyreels::model {
struct LoraSpec;
struct ActiveAdapter;
class SkyReelsV2Transformer;
}

namespace skyreels::cli {

struct Command {
  std::string name;
  std::string summary;                                           // one line for `skyreels --help`
  std::string usage;                                             // full text for `skyreels NAME --help`
  std::function<int(const std::vector<std::string>& args)> run;  // args exclude the subcommand name
};

std::map<std::string, Command>& registry();
bool register_command(Command command);

// Minimal flag parsing shared by subcommands: --name value, --name=value, repeated flags, bare switches.
class Args {
 public:
  Args(const std::vector<std::string>& args, const std::vector<std::string>& switches = {});
  bool has(const std::string& name) const;
  std::string get(const std::string& name, const std::string& fallback = "") const;
  std::string require(const std::string& name) const;  // throws UsageError naming the flag
  std::vector<std::string> all(const std::string& name) const;
  int get_int(const std::string& name, int fallback) const;
  double get_double(const std::string& name, double fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }
  // Throws UsageError for any flag not in `known` (catches typos such as --num-frame).
  void reject_unknown(const std::vector<std::string>& known) const;

 private:
  std::multimap<std::string, std::string> flags_;
  std::vector<std::string> positional_;
};

// The flags that `generate` (in process) and `submit` (to a server) both take: the conditioning, one per generation
// parameter (server/generation_params.h) and --scheduler-config, so that the two commands accept the same flags.
extern const std::vector<std::string> kGenerationFlags;
// The switches (flags without a value) among them: --no-FLAG for each boolean parameter that is on by default.
std::vector<std::string> generation_switches();
std::vector<std::string> with_generation_switches(std::vector<std::string> switches);
// `known` followed by kGenerationFlags, for Args::reject_unknown.
std::vector<std::string> with_generation_flags(std::vector<std::string> known);

// The generation parameters the flags set: --scheduler-config's values first, each parameter's flag over them.
// Throws UsageError naming a flag whose value does not parse.
server::JobRequest generation_request_from_flags(const Args& args);

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A --prompt-at / --inputs-at value: FRAME:VALUE, FRAME a pixel frame (>= 0) of the output video. Throws UsageError
// naming `flag`.
std::pair<int64_t, std::string> frame_and_value(const std::string& flag, const std::string& text);

// Every --lora FILE[:SCALE], in order. Throws UsageError on a bad value.
std::vector<model::LoraSpec> lora_specs_from_flags(const Args& args);

// The flags of adapters per call, checked before a model loads: UsageError for --adapter without --lora-dir or a bad
// NAME[:SCALE].
void check_adapter_flags(const Args& args);
// Every --adapter NAME[:SCALE], in order, from the adapters of --lora-dir, on `model`'s device in its dtypes (applied
// unmerged per call). Empty without --adapter. Throws UsageError for a request the catalogue refuses (unknown name,
// bad scale, duplicate, ...).
std::vector<model::ActiveAdapter> adapters_from_flags(const Args& args, const model::SkyReelsV2Transformer& model);

}  // namespace skyreels::cli

#define SKYREELS_CONCAT_INNER(a, b) a##b
#define SKYREELS_CONCAT(a, b) SKYREELS_CONCAT_INNER(a, b)
#define SKYREELS_COMMAND(...)                                                 \
  static const bool SKYREELS_CONCAT(skyreels_command_registered_, __LINE__) = \
      ::skyreels::cli::register_command(::skyreels::cli::Command{__VA_ARGS__})
