#include "server/app/restore_job.h"

#include <spdlog/spdlog.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "server/job/durable_request.h"
#include "server/job/log_escape.h"

namespace skyreels::server {

RestoredJob restore_job(const StoredJob& stored, std::vector<StoredChunk> chunks, const ModelDescription& model,
                        const ServerLimits& limits, const JobParts& parts) {
  RestoredJob r;
  r.stored = stored;
  r.stored.request.clear();
  const std::string& id = stored.id;
  try {
    const v1::SubmitJobRequest request = parse_durable_request(stored.request);
    // Requests are stored with embeddings, never text: no text is encoded again. (Only a request stored by an older
    // server may still hold prompt changes as text; they are encoded with this server's encoder.)
    auto job = ModelJob::create(request_from_proto(request.spec()), model, limits, 0, parts);
    std::vector<std::string> bytes;
    for (auto& chunk : chunks) bytes.push_back(std::move(chunk.bytes));
    job->restore_results(bytes);  // the next chunk's tail; the results stay in the store
    r.chunk_work = job->chunk_work();
    r.chunk_rows = job->chunk_rows();
    if (static_cast<int64_t>(r.chunk_work.size()) != stored.chunk_count) {
      throw std::runtime_error("the request now plans " + std::to_string(r.chunk_work.size()) + " chunks, it had " +
                               std::to_string(stored.chunk_count));
    }
    r.description = job->description();
    r.payload = std::move(job);
  } catch (const std::exception& e) {
    r.error = e.what();
    r.payload.reset();
    r.description.reset();
    spdlog::error("job={} event=restore_failed error=\"{}\"", id, log_escape(e.what()));
  }
  for (auto& chunk : chunks) chunk.bytes.clear();  // read back from the store when asked for
  r.chunks = std::move(chunks);
  return r;
}

}  // namespace skyreels::server
