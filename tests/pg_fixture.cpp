#include "tests/pg_fixture.h"

#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#ifndef SKYREELS_PG_BINDIR
#define SKYREELS_PG_BINDIR "/usr/lib/postgresql/15/bin"
#endif

namespace skyreels::test {

namespace {

std::string pg_bindir() {
  const char* env = std::getenv("SKYREELS_PG_BINDIR");
  return env != nullptr && *env != '\0' ? env : SKYREELS_PG_BINDIR;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

PgServer::PgServer(bool durable) : bindir_(pg_bindir()) {
  if (!std::filesystem::exists(bindir_ + "/initdb")) {
    throw std::runtime_error("PostgreSQL server binaries not found in " + bindir_ +
                             " (apt-get install postgresql, or set SKYREELS_PG_BINDIR)");
  }
  char pattern[] = "/tmp/skyreels-pg-XXXXXX";  // short: a unix socket path has at most 107 bytes
  if (mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
  dir_ = pattern;
  data_ = dir_ + "/data";
  log_ = dir_ + "/server.log";  // written by the server (as postgres)
  commands_log_ = dir_ + "/commands.log";
  try {
    make_cluster(durable);
    start();
  } catch (...) {  // no destructor runs for a constructor that throws
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    throw;
  }
}

void PgServer::make_cluster(bool durable) {
  if (geteuid() == 0) {
    const passwd* pw = getpwnam("postgres");
    if (pw == nullptr) throw std::runtime_error("running as root but there is no `postgres` user to run PostgreSQL");
    if (chown(dir_.c_str(), pw->pw_uid, pw->pw_gid) != 0) throw std::runtime_error("cannot chown " + dir_);
  }
  if (run("cp", {"-a", template_data(), data_}, true) != 0) throw std::runtime_error("copy failed: " + log_tail());
  std::ofstream conf(data_ + "/postgresql.conf", std::ios::app);
  conf << "listen_addresses = ''\nunix_socket_directories = '" << dir_ << "'\nmax_connections = 100\n";
  if (!durable) conf << "fsync = off\nfull_page_writes = off\n";
}

PgServer::~PgServer() {
  thaw();
  if (running_) run(bindir_ + "/pg_ctl", {"-D", data_, "-m", "immediate", "-w", "stop"}, true);
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

// initdb costs seconds; a copy of a cluster made once (per user of /tmp and bindir) costs a fraction. The template
// is only ever read after an atomic rename, so parallel test processes never see half of one.
std::string PgServer::template_data() const {
  const std::string tmpl = "/tmp/skyreels-pg-template-v1-" + std::to_string(std::hash<std::string>{}(bindir_));
  if (std::filesystem::exists(tmpl + "/data/PG_VERSION")) return tmpl + "/data";
  const std::string building = dir_ + "/template";
  if (run(bindir_ + "/initdb", {"-D", building + "/data", "-U", "postgres", "-A", "trust", "-E", "UTF8",
                                "--locale=C", "--no-sync"},
          true) != 0) {
    throw std::runtime_error("initdb failed: " + log_tail());
  }
  if (rename(building.c_str(), tmpl.c_str()) != 0 && !std::filesystem::exists(tmpl + "/data/PG_VERSION")) {
    throw std::runtime_error("cannot publish the template cluster " + tmpl);
  }
  std::error_code ec;
  std::filesystem::remove_all(building, ec);  // another process published one first
  return tmpl + "/data";
}

std::string PgServer::url(const std::string& database) const {
  return "postgresql:///" + database + "?host=" + dir_ + "&user=postgres";
}

int PgServer::run(const std::string& program, const std::vector<std::string>& args, bool as_postgres,
                  std::string* output) const {
  std::vector<std::string> argv;
  if (as_postgres && geteuid() == 0) argv = {"runuser", "-u", "postgres", "--"};
  argv.push_back(program);
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string out_path = output != nullptr ? dir_ + "/psql.out" : commands_log_;
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | (output != nullptr ? O_TRUNC : O_APPEND), 0666);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    std::vector<char*> c_argv;
    for (std::string& a : argv) c_argv.push_back(a.data());
    c_argv.push_back(nullptr);
    execvp(c_argv[0], c_argv.data());
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  if (output != nullptr) *output = read_all(out_path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string PgServer::log_tail() const {
  const std::string log = read_all(commands_log_) + read_all(log_);
  return log.size() > 2000 ? log.substr(log.size() - 2000) : log;
}

void PgServer::pg_ctl(const std::vector<std::string>& args) const {
  std::vector<std::string> all = {"-D", data_, "-l", log_, "-w", "-t", "120"};
  all.insert(all.end(), args.begin(), args.end());
  if (run(bindir_ + "/pg_ctl", all, true) != 0) throw std::runtime_error("pg_ctl " + args.back() + ": " + log_tail());
}

void PgServer::start() {
  pg_ctl({"start"});
  running_ = true;
}

void PgServer::stop() {
  pg_ctl({"-m", "fast", "stop"});
  running_ = false;
}

void PgServer::restart() {
  pg_ctl({"-m", "fast", "restart"});
  running_ = true;
}

// The postmaster (first line of postmaster.pid) first, so that it forks no new backend, then its children (ppid from
// /proc/PID/stat), scanned again until a scan finds none left running: a backend forked just before is caught too.
void PgServer::freeze() {
  std::ifstream pid_file(data_ + "/postmaster.pid");
  int postmaster = 0;
  if (!(pid_file >> postmaster) || postmaster <= 0) throw std::runtime_error("freeze: no postmaster.pid in " + data_);
  if (::kill(postmaster, SIGSTOP) != 0) throw std::runtime_error("freeze: cannot stop the postmaster");
  frozen_.push_back(postmaster);
  for (bool found = true; found && frozen_.size() < 10000;) {  // bounded: a stop takes effect at once
    found = false;
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const std::string name = entry.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(entry.path() / "stat");
      std::string line;
      if (!std::getline(stat, line)) continue;
      const size_t close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 1));
      std::string state;
      int ppid = 0;
      if (!(rest >> state >> ppid) || ppid != postmaster) continue;
      if (state == "T" || state == "t" || state == "Z" || state == "X") continue;  // stopped already, or gone
      const int pid = std::stoi(name);
      if (::kill(pid, SIGSTOP) == 0) {
        frozen_.push_back(pid);
        found = true;
      }
    }
  }
}

void PgServer::thaw() {
  for (int pid : frozen_) ::kill(pid, SIGCONT);
  frozen_.clear();
}

void PgServer::create_database(const std::string& name) const { sql("CREATE DATABASE \"" + name + "\""); }

std::string PgServer::sql(const std::string& statement, const std::string& database) const {
  std::string output;
  const int rc = run(bindir_ + "/psql", {"-h", dir_, "-U", "postgres", "-d", database, "-v", "ON_ERROR_STOP=1",
                                         "-X", "-At", "-c", statement},
                     false, &output);
  if (rc != 0) throw std::runtime_error("psql -c '" + statement + "' failed: " + output);
  while (!output.empty() && output.back() == '\n') output.pop_back();
  return output;
}

}  // namespace skyreels::test
