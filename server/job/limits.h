// Work limits that admission derives from the model and the device (issue 12, item 4): tokens per chunk (memory
// and the quadratic attention of one forward), total work per job, chunks per job. Torch-free header.
#pragma once

#include <cstdint>
#include <string>

namespace skyreels::server {

// Attention is quadratic in a chunk's tokens: past this, one transformer block takes minutes even on a GPU and a
// forward cannot be interrupted in time. 131072 covers diffusers' largest standard chunk (720P, 121 frames:
// 111,600 tokens).
constexpr int64_t kAttentionTokenCeiling = 131072;
// The default --max-job-work admits this many chunks of --max-chunk-tokens at --max-steps with guidance (the
// 1457-frame maximum in diffusers' 97-frame chunks with 17 frames of overlap is 19 chunks).
constexpr int64_t kReferenceChunksPerJob = 24;
// Chunks per job (--max-chunks): each chunk re-runs the overlap frames and costs a handoff; more only adds cost.
constexpr int64_t kDefaultMaxChunks = 64;

// A job's priority, higher first: SubmitJob, the HTTP door and API keys' max_priority all keep to [min, max].
constexpr int kMinPriority = -10;
constexpr int kMaxPriority = 10;
// ListJobs' pages: at most kMaxPageSize jobs; kDefaultPageSize when the request leaves page_size 0.
constexpr int kMaxPageSize = 1000;
constexpr int kDefaultPageSize = 100;

// What the memory estimate needs to know about the model (docs/OPERATIONS.md §3).
struct ModelFootprint {
  int64_t dim = 0;               // inner dim D
  int64_t ffn_dim = 0;           // FFN hidden size
  int64_t parameter_count = 0;   // transformer weights
  int64_t weight_bytes = 4;      // per parameter (2 for bfloat16)
  int64_t activation_bytes = 4;  // per activation element in the compute dtype
};

// Bytes of activations per token of one forward: the FFN hidden state twice (before and after GELU) in the compute
// dtype, plus about four fp32 copies of the residual stream (norms, modulation, attention output).
int64_t activation_bytes_per_token(const ModelFootprint& model);

// Device memory to plan with: "cpu" = physical memory, or the cgroup's limit when lower; "cuda:N" = 0 (unknown:
// CPU builds have no CUDA API; set --max-chunk-tokens from docs/OPERATIONS.md §3 instead).
uint64_t device_memory_bytes(const std::string& device);

// The default --kv-cache-bytes (exact savings keep the keys/values of final frames, issue 21): a fifth of what
// 80 % of the device memory leaves after the weights and 1 GB; the model's default (4 GiB) when the memory is
// unknown. It is set aside before --max-chunk-tokens is derived.
int64_t default_kv_cache_bytes(const ModelFootprint& model, uint64_t device_memory);

// The default --max-chunk-tokens: what fits in 80 % of the device memory after the weights, 1 GB for the
// attention score blocks and the latents, and the kept keys/values (kv_cache_bytes), never above
// kAttentionTokenCeiling; at least 1024.
int64_t default_max_chunk_tokens(const ModelFootprint& model, uint64_t device_memory, int64_t kv_cache_bytes = 0);

// The default --max-job-work, in token-forwards (tokens x denoising rows x model passes, summed over chunks).
constexpr int64_t default_max_job_work(int64_t max_chunk_tokens, int64_t max_steps) {
  return kReferenceChunksPerJob * max_chunk_tokens * max_steps * 2;
}

}  // namespace skyreels::server
