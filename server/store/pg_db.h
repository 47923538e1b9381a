// A thin RAII wrapper over libpq: connections that reconnect, parameterised statements (text, int8, bool and binary
// bytea parameters; results always in binary), transactions that roll back unless committed, a small connection
// pool and a LISTEN connection. Every error is a StoreError naming the store (its URL, password redacted) and the
// cause.
//
// Deadlines: every statement is sent and read without blocking, and fails (dropping its connection) once the
// thread's store_call_deadline() (job_store.h: the RPC's deadline, at most kStoreCallTimeout) passes; waiting for a
// pooled connection ends then too. Connection loss: the call that meets it fails; the next call reconnects. While reconnecting fails, calls throw
// StoreError without trying until a back-off (doubling from 50 ms to 2 s) has passed, so an outage costs nothing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/store/job_store.h"

struct pg_conn;
struct pg_result;

namespace skyreels::server::pg {

// The URL with its password replaced by "***" (user:PASSWORD@ and password= parameters).
std::string redact_url(const std::string& url);

// One statement parameter. Text and integers are sent typed (text, int8, bool); bytes() sends bytea in binary and
// refers to the caller's string, which must outlive the statement (blobs are megabytes: never copied).
class Param {
 public:
  Param(const std::string& text) : owned_(text), type_(kText) {}  // NOLINT(google-explicit-constructor)
  Param(const char* text) : owned_(text), type_(kText) {}         // NOLINT(google-explicit-constructor)
  Param(int64_t value);                                           // NOLINT(google-explicit-constructor)
  Param(int value) : Param(int64_t{value}) {}                     // NOLINT(google-explicit-constructor)
  Param(const std::optional<int64_t>& value);                     // NOLINT(google-explicit-constructor)
  static Param boolean(bool value);
  static Param bytes(const std::string& bytes);

  const char* data() const { return null_ ? nullptr : ref_ != nullptr ? ref_->data() : owned_.data(); }
  int size() const { return static_cast<int>(ref_ != nullptr ? ref_->size() : owned_.size()); }
  unsigned type() const { return type_; }
  bool binary() const { return type_ != kText; }

 private:
  static constexpr unsigned kText = 25, kInt8 = 20, kBool = 16, kBytea = 17;
  Param() = default;
  std::string owned_;
  const std::string* ref_ = nullptr;
  unsigned type_ = kText;
  bool null_ = false;
};

// A statement's rows (binary format). Column accessors check the column's type and throw StoreError on a mismatch.
class Result {
 public:
  Result(pg_result* result, std::string store);
  int rows() const;
  bool is_null(int row, int column) const;
  int64_t int64(int row, int column) const;  // int2, int4 or int8
  bool boolean(int row, int column) const;
  std::string text(int row, int column) const;  // text, varchar or bytea: the raw bytes
  int64_t affected() const;                      // rows an INSERT/UPDATE/DELETE touched

 private:
  const char* value(int row, int column, unsigned* type, int* length) const;
  std::shared_ptr<pg_result> result_;
  std::string store_;
};

class Connection {
 public:
  explicit Connection(std::string url);  // connects at the first call
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  Result exec(const std::string& sql, const std::vector<Param>& params = {});
  // Several statements without parameters (a migration), in the simple protocol.
  void exec_script(const std::string& sql);
  // Connects now if needed (respecting the back-off); throws StoreError when that fails.
  void ensure_connected();
  bool connected() const;
  // After a failure mid-transaction: back to an idle session (ROLLBACK), or drop a connection that is broken.
  void reset_session();
  pg_conn* handle() { return conn_; }
  const std::string& store() const { return store_; }  // "postgresql://user:***@host/db", for messages
  [[noreturn]] void fail(const std::string& what) const;

 private:
  void connect();
  void drop();
  bool wait_socket(bool write, std::chrono::steady_clock::time_point until);
  pg_result* await_result(const std::string& sql);
  std::string url_, store_;
  pg_conn* conn_ = nullptr;
  std::chrono::steady_clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_{0};
};

// BEGIN ... COMMIT; rolled back when destroyed uncommitted (an exception on the way).
class Transaction {
 public:
  explicit Transaction(Connection& connection);
  ~Transaction();
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit();

 private:
  Connection& connection_;
  bool done_ = false;
};

// A fixed number of connections to one store, lent one at a time per calling thread.
class Pool {
 public:
  Pool(const std::string& url, int size);
  ~Pool();

  class Lease {
   public:
    Lease(Pool& pool, Connection& connection) : pool_(pool), connection_(&connection) {}
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Connection* operator->() { return connection_; }
    Connection& operator*() { return *connection_; }

   private:
    Pool& pool_;
    Connection* connection_;
  };
  Lease acquire();
  const std::string& url() const { return url_; }

 private:
  std::string url_;
  std::vector<std::unique_ptr<Connection>> connections_;
  std::vector<Connection*> free_;
  std::mutex mu_;
  std::condition_variable returned_;
};

// LISTEN on one channel over a connection of its own; re-LISTENs after a reconnect (and says so: `missed`).
class Listener {
 public:
  Listener(const std::string& url, std::string channel);
  struct Batch {
    std::vector<std::string> payloads;
    bool missed = false;
  };
  Batch wait(std::chrono::milliseconds timeout);

 private:
  bool drain(Batch& batch);  // false: the connection broke
  Connection connection_;
  std::string channel_;
  bool listening_ = false;
};

}  // namespace skyreels::server::pg
