#include "server/store/job_store_sqlite.h"

#include <spdlog/spdlog.h>
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "server/store/sqlite_db.h"

namespace skyreels::server {

namespace {

// Forward migrations: entry i takes the schema from version i to i + 1. Never edit an entry once released; append.
const std::vector<std::string>& migrations() {
  static const std::vector<std::string> list = {
      // 0 -> 1
      "CREATE TABLE jobs(id TEXT PRIMARY KEY, ord INTEGER NOT NULL, vbase INTEGER NOT NULL, owner TEXT NOT NULL,"
      " client TEXT NOT NULL, priority INTEGER NOT NULL, deadline_ms INTEGER, idempotency_key TEXT NOT NULL,"
      " fingerprint INTEGER NOT NULL, state TEXT NOT NULL, error_kind TEXT NOT NULL, error TEXT NOT NULL,"
      " created_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL,"
      " chunk_count INTEGER NOT NULL, chunks_done INTEGER NOT NULL, retries INTEGER NOT NULL,"
      " handoffs INTEGER NOT NULL, request BLOB NOT NULL);"
      "CREATE TABLE chunks(job_id TEXT NOT NULL, idx INTEGER NOT NULL, replica TEXT NOT NULL,"
      " attempts INTEGER NOT NULL, bytes BLOB NOT NULL, PRIMARY KEY(job_id, idx));"
      "CREATE TABLE events(job_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY(job_id, seq));",
      // 1 -> 2: tombstones of jobs dropped by retention
      "CREATE TABLE dropped(id TEXT PRIMARY KEY, owner TEXT NOT NULL, reason TEXT NOT NULL,"
      " dropped_ms INTEGER NOT NULL);",
      // 2 -> 3: MP4 segments, made on demand and read back instead of decoding again
      "CREATE TABLE segments(job_id TEXT NOT NULL, idx INTEGER NOT NULL, bytes BLOB NOT NULL,"
      " PRIMARY KEY(job_id, idx));",
      // 3 -> 4: SHA-256 idempotency fingerprints ('' for jobs stored before: their 64-bit one decides)
      "ALTER TABLE jobs ADD COLUMN fingerprint_v2 TEXT NOT NULL DEFAULT '';",
      // 4 -> 5: the names of the adapters each job applies (StoredJob::adapters)
      "ALTER TABLE jobs ADD COLUMN adapters TEXT NOT NULL DEFAULT '';",
  };
  return list;
}

constexpr const char* kJobColumns =
    "id, ord, vbase, owner, client, priority, deadline_ms, idempotency_key, fingerprint, state, error_kind, error,"
    " created_ms, started_ms, finished_ms, chunk_count, chunks_done, retries, handoffs, request, fingerprint_v2,"
    " adapters";

}  // namespace

SqliteJobStore::SqliteJobStore(const std::string& path, bool synchronous_full, int64_t max_growth_pages)
    : path_(path) {
  const std::filesystem::path file(path);
  std::error_code ec;
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
  if (ec) throw StoreError("job store " + path + ": cannot create its directory: " + ec.message());
  db_ = std::make_unique<sqlite::Database>(path, true);
  // One server per file: the exclusive lock is taken at the first access below and held while the server runs.
  db_->exec("PRAGMA busy_timeout=0");
  db_->exec("PRAGMA locking_mode=EXCLUSIVE");
  db_->exec("PRAGMA journal_mode=WAL");
  db_->exec(synchronous_full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
  {
    sqlite::Statement mode(*db_, "PRAGMA synchronous");
    synchronous_full_ = mode.step() && mode.int64(0) == 2;  // 1 NORMAL, 2 FULL
  }
  {
    sqlite::Statement check(*db_, "PRAGMA quick_check");
    if (check.step() && check.text(0) != "ok") {
      throw StoreError("job store " + path + ": the file is corrupt (quick_check: " + check.text(0) + ")");
    }
  }
  migrate();
  if (max_growth_pages >= 0) cap_growth_for_tests(max_growth_pages);
  spdlog::info("event=job_store_opened store=sqlite path={} schema_version={} synchronous={}", path, kSchemaVersion,
               synchronous_full_ ? "full" : "normal");
}

std::string SqliteJobStore::describe() const {
  return "sqlite:" + path_ + (synchronous_full_ ? "?synchronous=full" : "");
}

SqliteJobStore::~SqliteJobStore() = default;

// Test hook, like --fault-inject: --job-store-max-growth-pages N lets the file grow by N pages at most, so that tests
// see what a full disk does (SQLITE_FULL on the write that needs more) without filling one.
void SqliteJobStore::cap_growth_for_tests(int64_t max_growth_pages) {
  sqlite::Statement count(*db_, "PRAGMA page_count");
  const int64_t pages = count.step() ? count.int64(0) : 0;
  const int64_t cap = pages + max_growth_pages;
  sqlite::Statement(*db_, "PRAGMA max_page_count = " + std::to_string(cap)).step();
  spdlog::warn("event=job_store_capped_for_tests path={} max_pages={}", path_, cap);
}

void SqliteJobStore::migrate() {
  int64_t tables = 0;
  bool has_version = false;
  {
    sqlite::Statement s(*db_, "SELECT name FROM sqlite_master WHERE type='table'");
    while (s.step()) {
      ++tables;
      if (s.text(0) == "schema_version") has_version = true;
    }
  }
  if (tables > 0 && !has_version) {
    throw StoreError("job store " + path_ + ": not a job store (a SQLite database without a schema_version table)");
  }
  int64_t version = 0;
  if (has_version) {
    sqlite::Statement s(*db_, "SELECT version FROM schema_version");
    if (!s.step()) throw StoreError("job store " + path_ + ": schema_version table is empty");
    version = s.int64(0);
  }
  const auto latest = static_cast<int64_t>(migrations().size());
  if (version > latest) {
    throw StoreError("job store " + path_ + ": schema version " + std::to_string(version) +
                     " is newer than this server's " + std::to_string(latest) + " (upgrade the server)");
  }
  if (version < 0) throw StoreError("job store " + path_ + ": invalid schema version " + std::to_string(version));
  for (int64_t v = version; v < latest; ++v) {
    sqlite::Transaction tx(*db_);
    db_->exec(migrations()[static_cast<size_t>(v)]);
    if (v == 0)
      db_->exec("CREATE TABLE schema_version(version INTEGER NOT NULL); INSERT INTO schema_version VALUES(0)");
    sqlite::Statement(*db_, "UPDATE schema_version SET version = ?").bind(1, v + 1).run();
    tx.commit();
    spdlog::info("event=job_store_migrated path={} from={} to={}", path_, v, v + 1);
  }
}

void SqliteJobStore::insert_job(StoredJob j) {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(
      *db_, std::string("INSERT INTO jobs(") + kJobColumns + ") VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
  s.bind(1, j.id).bind(2, static_cast<int64_t>(j.order)).bind(3, j.vbase).bind(4, j.owner).bind(5, j.client);
  s.bind(6, int64_t{j.priority}).bind(7, j.deadline_ms).bind(8, j.idempotency_key);
  s.bind(9, static_cast<int64_t>(j.fingerprint)).bind(10, j.state).bind(11, j.error_kind).bind(12, j.error);
  s.bind(13, j.created_ms).bind(14, j.started_ms).bind(15, j.finished_ms).bind(16, j.chunk_count);
  s.bind(17, j.chunks_done).bind(18, int64_t{j.retries}).bind(19, int64_t{j.handoffs}).bind_blob(20, j.request);
  s.bind(21, j.fingerprint_v2).bind(22, join_adapter_names(j.adapters));
  s.run();  // one statement: its own transaction
}

void SqliteJobStore::update_job(const StoredJob& j) {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_,
                      "UPDATE jobs SET state=?, error_kind=?, error=?, started_ms=?, finished_ms=?, retries=?,"
                      " handoffs=? WHERE id=?");
  s.bind(1, j.state).bind(2, j.error_kind).bind(3, j.error).bind(4, j.started_ms).bind(5, j.finished_ms);
  s.bind(6, int64_t{j.retries}).bind(7, int64_t{j.handoffs}).bind(8, j.id);
  s.run();
}

void SqliteJobStore::commit_chunk(const std::string& job_id, const StoredChunk& c) {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Transaction tx(*db_);
  sqlite::Statement(*db_, "INSERT OR REPLACE INTO chunks(job_id, idx, replica, attempts, bytes) VALUES(?,?,?,?,?)")
      .bind(1, job_id)
      .bind(2, c.index)
      .bind(3, c.replica)
      .bind(4, int64_t{c.attempts})
      .bind_blob(5, c.bytes)
      .run();
  sqlite::Statement(*db_, "UPDATE jobs SET chunks_done=? WHERE id=?").bind(1, c.index + 1).bind(2, job_id).run();
  tx.commit();
}

void SqliteJobStore::append_event(const std::string& job_id, const StoredEvent& e) {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement(*db_, "INSERT OR REPLACE INTO events(job_id, seq, data) VALUES(?,?,?)")
      .bind(1, job_id)
      .bind(2, static_cast<int64_t>(e.sequence))
      .bind(3, e.data)
      .run();
}

void SqliteJobStore::drop_job(const std::string& job_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Transaction tx(*db_);
  const auto now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  sqlite::Statement(*db_,
                    "INSERT OR REPLACE INTO dropped(id, owner, reason, dropped_ms)"
                    " SELECT id, owner, ?, ? FROM jobs WHERE id=?")
      .bind(1, reason)
      .bind(2, int64_t{now_ms})
      .bind(3, job_id)
      .run();
  sqlite::Statement(*db_,
                    "DELETE FROM dropped WHERE id IN (SELECT id FROM dropped ORDER BY dropped_ms DESC LIMIT -1"
                    " OFFSET ?)")
      .bind(1, kMaxTombstones)
      .run();
  for (const char* table : {"chunks", "segments", "events"}) {
    sqlite::Statement(*db_, std::string("DELETE FROM ") + table + " WHERE job_id=?").bind(1, job_id).run();
  }
  sqlite::Statement(*db_, "DELETE FROM jobs WHERE id=?").bind(1, job_id).run();
  tx.commit();
}

std::optional<std::string> SqliteJobStore::dropped_reason(const std::string& job_id, const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT reason FROM dropped WHERE id=? AND owner=?");
  s.bind(1, job_id).bind(2, owner);
  if (!s.step()) return std::nullopt;
  return s.text(0);
}

std::vector<StoredJob> SqliteJobStore::load_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, std::string("SELECT ") + kJobColumns + " FROM jobs ORDER BY ord");
  std::vector<StoredJob> out;
  while (s.step()) {
    StoredJob j;
    j.id = s.text(0);
    j.order = static_cast<uint64_t>(s.int64(1));
    j.vbase = s.int64(2);
    j.owner = s.text(3);
    j.client = s.text(4);
    j.priority = static_cast<int>(s.int64(5));
    if (!s.is_null(6)) j.deadline_ms = s.int64(6);
    j.idempotency_key = s.text(7);
    j.fingerprint = static_cast<uint64_t>(s.int64(8));
    j.state = s.text(9);
    j.error_kind = s.text(10);
    j.error = s.text(11);
    j.created_ms = s.int64(12);
    j.started_ms = s.int64(13);
    j.finished_ms = s.int64(14);
    j.chunk_count = s.int64(15);
    j.chunks_done = s.int64(16);
    j.retries = static_cast<int>(s.int64(17));
    j.handoffs = static_cast<int>(s.int64(18));
    j.request = s.text(19);
    j.fingerprint_v2 = s.text(20);
    j.adapters = split_adapter_names(s.text(21));
    out.push_back(std::move(j));
  }
  return out;
}

std::vector<StoredChunk> SqliteJobStore::load_chunks(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT idx, replica, attempts, bytes FROM chunks WHERE job_id=? ORDER BY idx");
  s.bind(1, job_id);
  std::vector<StoredChunk> out;
  while (s.step()) out.push_back({s.int64(0), s.text(1), static_cast<int>(s.int64(2)), s.text(3)});
  return out;
}

std::vector<StoredEvent> SqliteJobStore::load_events(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT seq, data FROM events WHERE job_id=? ORDER BY seq");
  s.bind(1, job_id);
  std::vector<StoredEvent> out;
  while (s.step()) out.push_back({static_cast<uint64_t>(s.int64(0)), s.text(1)});
  return out;
}

std::optional<std::string> SqliteJobStore::load_request(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT request FROM jobs WHERE id=?");
  s.bind(1, job_id);
  if (!s.step()) return std::nullopt;
  return s.text(0);
}

std::optional<std::string> SqliteJobStore::load_chunk_bytes(const std::string& job_id, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT bytes FROM chunks WHERE job_id=? AND idx=?");
  s.bind(1, job_id).bind(2, index);
  if (!s.step()) return std::nullopt;
  return s.text(0);
}

void SqliteJobStore::put_segment(const std::string& job_id, int64_t index, const std::string& bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  // Only for a job still stored: a segment finished after its job was dropped would otherwise stay forever.
  sqlite::Statement(*db_, "INSERT OR REPLACE INTO segments(job_id, idx, bytes) SELECT id, ?, ? FROM jobs WHERE id=?")
      .bind(1, index)
      .bind_blob(2, bytes)
      .bind(3, job_id)
      .run();  // one statement: its own transaction
}

std::optional<std::string> SqliteJobStore::load_segment(const std::string& job_id, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, "SELECT bytes FROM segments WHERE job_id=? AND idx=?");
  s.bind(1, job_id).bind(2, index);
  if (!s.step()) return std::nullopt;
  return s.text(0);
}

std::optional<int64_t> SqliteJobStore::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  sqlite::Statement s(*db_, std::string("SELECT length(bytes) FROM ") + (kind == Blob::chunk ? "chunks" : "segments") +
                                " WHERE job_id=? AND idx=?");
  s.bind(1, job_id).bind(2, index);
  if (!s.step()) return std::nullopt;
  return s.int64(0);
}

// Incremental blob I/O (sqlite3_blob_read): only the piece is read from the file, whatever the blob's size.
std::optional<std::string> SqliteJobStore::load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                           int64_t offset, int64_t length) const {
  std::lock_guard<std::mutex> lock(mu_);
  const char* table = kind == Blob::chunk ? "chunks" : "segments";
  sqlite::Statement s(*db_, std::string("SELECT rowid FROM ") + table + " WHERE job_id=? AND idx=?");
  s.bind(1, job_id).bind(2, index);
  if (!s.step()) return std::nullopt;
  const int64_t rowid = s.int64(0);
  sqlite3_blob* blob = nullptr;
  if (const int rc = sqlite3_blob_open(db_->handle(), "main", table, "bytes", rowid, 0, &blob); rc != SQLITE_OK) {
    sqlite3_blob_close(blob);
    db_->fail(std::string("open the blob of ") + table + " " + job_id + "/" + std::to_string(index), rc);
  }
  const int64_t size = sqlite3_blob_bytes(blob);
  std::string out;
  if (offset >= 0 && length > 0 && offset < size) {
    out.resize(static_cast<size_t>(std::min(length, size - offset)));
    const int rc = sqlite3_blob_read(blob, out.data(), static_cast<int>(out.size()), static_cast<int>(offset));
    sqlite3_blob_close(blob);
    if (rc != SQLITE_OK) db_->fail(std::string("read the blob of ") + table + " " + job_id, rc);
  } else {
    sqlite3_blob_close(blob);
  }
  return out;
}

}  // namespace skyreels::server
