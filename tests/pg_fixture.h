// A real PostgreSQL (15, Debian's server binaries) for one test: a fresh cluster in a fresh temp dir (a copy of one
// initdb made once: /tmp/skyreels-pg-template-*, which no server ever runs on), listening only on a unix socket in
// that dir (no TCP), started with pg_ctl; stopped and removed in the destructor, also when the test failed. As root (tests here and in CI run as root) every server binary runs as the `postgres` user (runuser), with
// the dir chowned to it. The binaries come from $SKYREELS_PG_BINDIR, else `pg_config --bindir` at configure time.
#pragma once

#include <string>
#include <vector>

namespace skyreels::test {

class PgServer {
 public:
  // Throws std::runtime_error with the log's tail when the cluster cannot be made or started. Not `durable`: fsync
  // off (tests never lose power); durable: PostgreSQL's defaults, for benchmarks.
  explicit PgServer(bool durable = false);
  ~PgServer();
  PgServer(const PgServer&) = delete;
  PgServer& operator=(const PgServer&) = delete;

  // postgresql:///DATABASE?host=DIR&user=postgres (trust authentication: a password in the URL is accepted).
  std::string url(const std::string& database = "postgres") const;
  void create_database(const std::string& name) const;
  // psql -At -c SQL on `database`; returns its output (rows as a|b lines). Throws when psql fails.
  std::string sql(const std::string& statement, const std::string& database = "postgres") const;

  void stop();     // pg_ctl stop -m fast
  void start();    // pg_ctl start, waits until it accepts connections
  void restart();  // pg_ctl restart -m fast: every connection is cut
  // SIGSTOP / SIGCONT to the server and every one of its processes: a database that stops answering while the
  // kernel still accepts and ACKs (no TCP error ever reaches the clients). The destructor thaws a frozen server.
  void freeze();
  void thaw();
  const std::string& dir() const { return dir_; }

 private:
  int run(const std::string& program, const std::vector<std::string>& args, bool as_postgres,
          std::string* output = nullptr) const;
  void pg_ctl(const std::vector<std::string>& args) const;
  std::string log_tail() const;
  std::string template_data() const;
  void make_cluster(bool durable);
  std::string bindir_, dir_, data_, log_, commands_log_;
  bool running_ = false;
  std::vector<int> frozen_;  // pids stopped by freeze()
};

}  // namespace skyreels::test
