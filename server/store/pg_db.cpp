#include "server/store/pg_db.h"

#include <endian.h>
#include <libpq-fe.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace skyreels::server::pg {

namespace {

constexpr unsigned kOidBool = 16, kOidBytea = 17, kOidInt8 = 20, kOidInt2 = 21, kOidInt4 = 23, kOidText = 25,
                   kOidVarchar = 1043, kOidName = 19;
constexpr std::chrono::milliseconds kFirstBackoff{50}, kMaxBackoff{2000};
constexpr std::chrono::milliseconds kRollbackTimeout{2000};  // a session that cannot roll back soon is dropped

// "UPDATE jobs SET a=$1 ..." -> "UPDATE jobs SET a=$1": enough to tell statements apart in a message.
std::string statement_head(const std::string& sql) { return sql.substr(0, std::min<size_t>(sql.find('('), 48)); }

std::string trimmed(const char* message) {
  std::string s = message != nullptr ? message : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

void ignore_notice(void*, const char*) {}  // "relation already exists, skipping" and the like

}  // namespace

std::string redact_url(const std::string& url) {
  std::string out = url;
  const size_t scheme = out.find("://");
  if (scheme != std::string::npos) {
    // user:password@ ends at the last '@' before the parameters (a password may hold a raw '/').
    const size_t start = scheme + 3;
    const size_t query = out.find('?', start);
    const size_t at = out.rfind('@', query == std::string::npos ? std::string::npos : query - 1);
    if (at != std::string::npos && at >= start) {
      const size_t colon = out.find(':', start);
      if (colon != std::string::npos && colon < at) out.replace(colon + 1, at - colon - 1, "***");
    }
  }
  for (size_t pos = out.find("password="); pos != std::string::npos; pos = out.find("password=", pos + 1)) {
    const size_t value = pos + 9;
    const size_t end = out.find_first_of("& ", value);
    out.replace(value, (end == std::string::npos ? out.size() : end) - value, "***");
  }
  return out;
}

Param::Param(int64_t value) : type_(kInt8) {
  const uint64_t be = htobe64(static_cast<uint64_t>(value));
  owned_.assign(reinterpret_cast<const char*>(&be), sizeof be);
}

Param::Param(const std::optional<int64_t>& value) : Param(value.value_or(0)) { null_ = !value.has_value(); }

Param Param::boolean(bool value) {
  Param p;
  p.owned_.assign(1, value ? '\1' : '\0');
  p.type_ = kBool;
  return p;
}

Param Param::bytes(const std::string& bytes) {
  Param p;
  p.ref_ = &bytes;
  p.type_ = kBytea;
  return p;
}

Result::Result(pg_result* result, std::string store) : result_(result, PQclear), store_(std::move(store)) {}

int Result::rows() const { return PQntuples(result_.get()); }

bool Result::is_null(int row, int column) const { return PQgetisnull(result_.get(), row, column) != 0; }

int64_t Result::affected() const {
  const char* n = PQcmdTuples(result_.get());
  return n != nullptr && *n != '\0' ? std::atoll(n) : 0;
}

const char* Result::value(int row, int column, unsigned* type, int* length) const {
  if (row >= rows() || column >= PQnfields(result_.get())) {
    throw StoreError("job store " + store_ + ": no row " + std::to_string(row) + " column " + std::to_string(column));
  }
  *type = PQftype(result_.get(), column);
  *length = PQgetlength(result_.get(), row, column);
  return PQgetvalue(result_.get(), row, column);
}

int64_t Result::int64(int row, int column) const {
  unsigned type = 0;
  int length = 0;
  const char* v = value(row, column, &type, &length);
  if (is_null(row, column)) return 0;
  if (type == kOidInt8 && length == 8) {
    uint64_t be = 0;
    std::memcpy(&be, v, 8);
    return static_cast<int64_t>(be64toh(be));
  }
  if (type == kOidInt4 && length == 4) {
    uint32_t be = 0;
    std::memcpy(&be, v, 4);
    return static_cast<int32_t>(be32toh(be));
  }
  if (type == kOidInt2 && length == 2) {
    uint16_t be = 0;
    std::memcpy(&be, v, 2);
    return static_cast<int16_t>(be16toh(be));
  }
  throw StoreError("job store " + store_ + ": column " + PQfname(result_.get(), column) + " is not an integer (type " +
                   std::to_string(type) + ")");
}

bool Result::boolean(int row, int column) const {
  unsigned type = 0;
  int length = 0;
  const char* v = value(row, column, &type, &length);
  if (type != kOidBool || length != 1) {
    throw StoreError("job store " + store_ + ": column " + PQfname(result_.get(), column) + " is not a boolean");
  }
  return *v != 0;
}

std::string Result::text(int row, int column) const {
  unsigned type = 0;
  int length = 0;
  const char* v = value(row, column, &type, &length);
  if (type != kOidText && type != kOidVarchar && type != kOidBytea && type != kOidName) {
    throw StoreError("job store " + store_ + ": column " + PQfname(result_.get(), column) + " is not text");
  }
  return std::string(v, static_cast<size_t>(length));
}

Connection::Connection(std::string url) : url_(std::move(url)), store_(redact_url(url_)) {}

Connection::~Connection() {
  if (conn_ != nullptr) PQfinish(conn_);
}

bool Connection::connected() const { return conn_ != nullptr && PQstatus(conn_) == CONNECTION_OK; }

void Connection::fail(const std::string& what) const {
  std::string cause = conn_ != nullptr ? trimmed(PQerrorMessage(conn_)) : "not connected";
  throw StoreError("job store " + store_ + ": " + what + ": " + cause);
}

void Connection::connect() {
  // Callers may hold locks (the scheduler's), so a dead network must fail a call within seconds, not after TCP's
  // minutes: short connect timeout, keepalives, and tcp_user_timeout for a send that is never acknowledged. Defaults
  // only: the URL is expanded after them and overrides any.
  const char* keys[] = {"connect_timeout", "keepalives_idle", "keepalives_interval", "keepalives_count",
                        "tcp_user_timeout", "application_name", "dbname", nullptr};
  const char* values[] = {"2", "10", "5", "3", "10000", "skyreels-server", url_.c_str(), nullptr};
  conn_ = PQconnectdbParams(keys, values, 1);
  if (conn_ != nullptr && PQstatus(conn_) == CONNECTION_OK && PQsetnonblocking(conn_, 1) == 0) {
    PQsetNoticeProcessor(conn_, ignore_notice, nullptr);
    if (backoff_.count() > 0) spdlog::info("event=job_store_reconnected store={}", store_);
    backoff_ = std::chrono::milliseconds(0);
    return;
  }
  const std::string cause = conn_ != nullptr ? trimmed(PQerrorMessage(conn_)) : "out of memory";
  if (conn_ != nullptr) PQfinish(conn_);
  conn_ = nullptr;
  backoff_ = backoff_.count() == 0 ? kFirstBackoff : std::min(backoff_ * 2, kMaxBackoff);
  next_attempt_ = std::chrono::steady_clock::now() + backoff_;
  spdlog::warn("event=job_store_unreachable store={} retry_in_ms={} error=\"{}\"", store_, backoff_.count(), cause);
  throw StoreError("job store " + store_ + ": cannot connect: " + cause);
}

void Connection::ensure_connected() {
  if (connected()) return;
  if (conn_ != nullptr) {  // lost: the first reconnect is tried at once
    PQfinish(conn_);
    conn_ = nullptr;
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < next_attempt_) {
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_attempt_ - now);
    throw StoreError("job store " + store_ + ": unreachable (next connection attempt in " +
                     std::to_string(wait.count()) + " ms)");
  }
  connect();
}

void Connection::reset_session() {
  if (conn_ == nullptr) return;
  if (PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) == PQTRANS_IDLE) return;
  if (PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) != PQTRANS_ACTIVE) {
    try {
      StoreCallDeadline soon(std::chrono::steady_clock::now() + kRollbackTimeout);
      exec("ROLLBACK");
      if (PQtransactionStatus(conn_) == PQTRANS_IDLE) return;
    } catch (const StoreError&) {
    }
  }
  drop();  // broken, stuck or busy: the next call reconnects
}

void Connection::drop() {
  if (conn_ != nullptr) PQfinish(conn_);
  conn_ = nullptr;
}

// Waits for the socket to be readable (and writable when `write`) until `until`; false when the time is up.
bool Connection::wait_socket(bool write, std::chrono::steady_clock::time_point until) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
  if (left.count() <= 0) return false;
  pollfd fd{PQsocket(conn_), static_cast<short>(POLLIN | (write ? POLLOUT : 0)), 0};
  const int n = poll(&fd, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 60000)));
  return n != 0 || std::chrono::steady_clock::now() < until;  // poll's own timeout never outlasts `until`
}

// The result of the statement(s) just sent, read without blocking past the call's deadline (store_call_deadline):
// a server that stopped answering fails the call, and the connection, which is then dropped mid-statement.
PGresult* Connection::await_result(const std::string& sql) {
  const auto until = store_call_deadline();
  const auto timed_out = [&] {
    drop();
    throw StoreError("job store " + store_ + ": " + statement_head(sql) +
                     ": no answer within the call's deadline (the connection is dropped; the next call reconnects)");
  };
  for (int f; (f = PQflush(conn_)) != 0;) {
    if (f < 0) return nullptr;
    if (!wait_socket(true, until)) timed_out();
    if (PQconsumeInput(conn_) == 0) return nullptr;
  }
  PGresult* kept = nullptr;  // the first failure, else the last result
  while (true) {
    while (PQisBusy(conn_) != 0) {
      if (!wait_socket(false, until)) {
        PQclear(kept);
        timed_out();
      }
      if (PQconsumeInput(conn_) == 0) break;  // the connection broke: PQgetResult reports it
    }
    PGresult* r = PQgetResult(conn_);
    if (r == nullptr) break;
    const auto failed = [](PGresult* x) {
      return PQresultStatus(x) != PGRES_COMMAND_OK && PQresultStatus(x) != PGRES_TUPLES_OK;
    };
    if (kept != nullptr && failed(kept)) {
      PQclear(r);  // a script stops at its first failure: that one says why
      continue;
    }
    PQclear(kept);
    kept = r;
    if (PQstatus(conn_) != CONNECTION_OK) break;
  }
  return kept;
}

Result Connection::exec(const std::string& sql, const std::vector<Param>& params) {
  ensure_connected();
  const size_t n = params.size();
  std::vector<unsigned> types(n);
  std::vector<const char*> values(n);
  std::vector<int> lengths(n), formats(n);
  for (size_t i = 0; i < n; ++i) {
    types[i] = params[i].type();
    values[i] = params[i].data();
    lengths[i] = params[i].size();
    formats[i] = params[i].binary() ? 1 : 0;
  }
  PGresult* r = nullptr;
  if (PQsendQueryParams(conn_, sql.c_str(), static_cast<int>(n), types.data(), values.data(), lengths.data(),
                        formats.data(), 1) != 0) {
    r = await_result(sql);
  }
  const ExecStatusType status = r != nullptr ? PQresultStatus(r) : PGRES_FATAL_ERROR;
  if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return Result(r, store_);
  std::string cause = r != nullptr ? trimmed(PQresultErrorMessage(r)) : "";
  if (cause.empty()) cause = trimmed(PQerrorMessage(conn_));
  PQclear(r);
  if (PQstatus(conn_) != CONNECTION_OK) cause += " (connection lost; the next call reconnects)";
  throw StoreError("job store " + store_ + ": " + statement_head(sql) + ": " + cause);
}

void Connection::exec_script(const std::string& sql) {
  ensure_connected();
  PGresult* r = PQsendQuery(conn_, sql.c_str()) != 0 ? await_result(sql) : nullptr;
  const bool ok = r != nullptr && PQresultStatus(r) == PGRES_COMMAND_OK;
  std::string cause = r != nullptr ? trimmed(PQresultErrorMessage(r)) : trimmed(PQerrorMessage(conn_));
  PQclear(r);
  if (!ok) throw StoreError("job store " + store_ + ": " + statement_head(sql) + ": " + cause);
}

Transaction::Transaction(Connection& connection) : connection_(connection) { connection_.exec("BEGIN"); }

Transaction::~Transaction() {
  if (!done_) connection_.reset_session();
}

void Transaction::commit() {
  connection_.exec("COMMIT");
  done_ = true;
}

Pool::Pool(const std::string& url, int size) : url_(url) {
  for (int i = 0; i < std::max(1, size); ++i) {
    connections_.push_back(std::make_unique<Connection>(url));
    free_.push_back(connections_.back().get());
  }
}

Pool::~Pool() = default;

Pool::Lease Pool::acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!returned_.wait_until(lock, store_call_deadline(), [&] { return !free_.empty(); })) {
    throw StoreError("job store " + redact_url(url_) + ": no free connection within the call's deadline (every one "
                     "waits for the store)");
  }
  Connection* c = free_.back();
  free_.pop_back();
  return Lease(*this, *c);
}

Pool::Lease::~Lease() {
  connection_->reset_session();  // a session left inside a transaction never goes back to the pool
  std::lock_guard<std::mutex> lock(pool_.mu_);
  pool_.free_.push_back(connection_);
  pool_.returned_.notify_one();
}

Listener::Listener(const std::string& url, std::string channel) : connection_(url), channel_(std::move(channel)) {}

bool Listener::drain(Batch& batch) {
  if (PQconsumeInput(connection_.handle()) == 0) return false;
  while (PGnotify* n = PQnotifies(connection_.handle())) {
    batch.payloads.emplace_back(n->extra);
    PQfreemem(n);
  }
  return true;
}

Listener::Batch Listener::wait(std::chrono::milliseconds timeout) {
  Batch batch;
  if (!listening_ || !connection_.connected()) {
    batch.missed = listening_;  // a LISTEN that was lost: changes in between were not seen
    listening_ = false;
    try {
      connection_.exec("LISTEN \"" + channel_ + "\"");
      listening_ = true;
    } catch (const StoreError&) {
      std::this_thread::sleep_for(std::min(timeout, kFirstBackoff * 4));  // outage: wait instead of spinning
      batch.missed = true;
      return batch;
    }
  }
  if (!drain(batch)) {
    listening_ = false;
    batch.missed = true;
    return batch;
  }
  if (!batch.payloads.empty()) return batch;
  pollfd fd{PQsocket(connection_.handle()), POLLIN, 0};
  if (poll(&fd, 1, static_cast<int>(timeout.count())) > 0 && !drain(batch)) {
    listening_ = false;
    batch.missed = true;
  }
  return batch;
}

}  // namespace skyreels::server::pg
