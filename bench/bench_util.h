// What the benchmarks measure about their own process: CPU time (robust to other processes on the cores) and
// memory from /proc/self/status.
#pragma once

#include <sys/resource.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace skyreels::bench {

// User + system CPU seconds of this process, all threads: cpu_s / wall_s shows how many cores it really got.
inline double process_cpu_seconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return sec(usage.ru_utime) + sec(usage.ru_stime);
}

// The number of a /proc/<process>/status field ("self" or a pid), e.g. "VmRSS" (kB) or "Threads"; -1 when absent.
inline int64_t proc_status(const std::string& process, const char* field) {
  std::ifstream in("/proc/" + process + "/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size()));
  }
  return -1;
}

// A /proc/self/status field in MiB, e.g. "VmHWM" (peak RSS) or "VmRSS"; 0 when absent.
inline double status_mb(const char* field) {
  const int64_t kb = proc_status("self", field);
  return kb < 0 ? 0.0 : static_cast<double>(kb) / 1024.0;
}

// Runs `command` through the shell and returns what it wrote to stdout, with its exit status (pclose's).
struct CommandOutput {
  std::string text;
  int status = 0;
};
inline CommandOutput command_output(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command);
  CommandOutput out;
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) out.text.append(buffer, n);
  out.status = ::pclose(pipe);
  return out;
}

// Before any row: bench/diffusers_pipeline_time.py --check, which imports nothing it has not checked. A missing
// Python package ends the bench at once (status 1) with the timer's own first line, the apt-get command to run
// (scripts/bench-deps.sh installs them all), instead of a ModuleNotFoundError after our rows have run.
inline void check_diffusers_timer(const std::string& timer) {
  const CommandOutput out = command_output("/usr/bin/python3 " + timer + " --check 2>&1");
  if (out.status == 0) return;
  if (WIFEXITED(out.status) && WEXITSTATUS(out.status) == 127) {
    std::fprintf(stderr,
                 "--diffusers-src needs /usr/bin/python3: apt-get install python3, then scripts/bench-deps.sh\n");
  } else {
    std::fprintf(stderr, "%s", out.text.c_str());
  }
  std::exit(1);
}

// Runs bench/diffusers_pipeline_time.py's command line (its stderr kept in dir/stderr.txt) and returns the JSON object
// it prints last; throws with its stderr when it failed or printed none.
inline std::string diffusers_timer_json(const std::string& command, const std::string& dir) {
  const std::string full = command + " 2>" + dir + "/stderr.txt";
  const CommandOutput out = command_output(full);
  const auto brace = out.text.rfind('{');
  if (out.status != 0 || brace == std::string::npos) {
    std::ifstream err(dir + "/stderr.txt");
    throw std::runtime_error("diffusers' pipeline failed: " + full + "\n" +
                             std::string(std::istreambuf_iterator<char>(err), {}));
  }
  return out.text.substr(brace);
}

}  // namespace skyreels::bench
