// A thin RAII wrapper over libsqlite3: a connection, prepared statements with typed binds, and transactions that
// roll back unless committed. Errors are StoreError naming the database file and SQLite's message.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "server/store/job_store.h"

struct sqlite3;
struct sqlite3_stmt;

namespace skyreels::server::sqlite {

class Database;

class Statement {
 public:
  Statement(Database& db, const std::string& sql);
  ~Statement();
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int index, int64_t value);
  Statement& bind(int index, const std::string& text);
  Statement& bind_blob(int index, const std::string& bytes);
  Statement& bind_null(int index);
  Statement& bind(int index, const std::optional<int64_t>& value);
  bool step();  // true: a row is ready; false: done
  void run();   // step() for a statement that returns no rows
  int64_t int64(int column) const;
  std::string text(int column) const;  // also blobs
  bool is_null(int column) const;

 private:
  Database& db_;
  sqlite3_stmt* stmt_ = nullptr;
};

class Database {
 public:
  // Opens (creating when `create`) the file; throws StoreError naming it.
  Database(const std::string& path, bool create);
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  void exec(const std::string& sql);
  const std::string& path() const { return path_; }
  sqlite3* handle() { return db_; }
  [[noreturn]] void fail(const std::string& what, int code) const;

 private:
  std::string path_;
  sqlite3* db_ = nullptr;
};

// BEGIN IMMEDIATE ... COMMIT; rolled back when destroyed uncommitted (an exception on the way).
class Transaction {
 public:
  explicit Transaction(Database& db);
  ~Transaction();
  void commit();

 private:
  Database& db_;
  bool done_ = false;
};

}  // namespace skyreels::server::sqlite
