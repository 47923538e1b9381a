#include "server/job/blob.h"

#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string_view>

#include "model/safetensors_limits.h"

namespace skyreels::server {

std::string safetensors_bytes(const std::string& name, const std::vector<int64_t>& shape, const float* data,
                              const std::map<std::string, std::string>& metadata) {
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
  const uint64_t nbytes = numel * sizeof(float);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {0, nbytes}}};
  std::string json = header.dump();
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');
  std::string out;
  out.reserve(8 + json.size() + nbytes);
  const uint64_t len = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += json;
  out.append(reinterpret_cast<const char*>(data), nbytes);
  return out;
}

namespace {

[[noreturn]] void bad_result(const std::string& what) { throw std::runtime_error("result: " + what); }

// Product of non-negative dimensions times `element_size`, refusing what does not fit in 64 bits.
uint64_t checked_bytes(const std::vector<int64_t>& shape, uint64_t element_size) {
  uint64_t n = element_size;
  for (int64_t d : shape) {
    if (d < 0) bad_result("negative dimension");
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > std::numeric_limits<uint64_t>::max() / ud) bad_result("shape overflows 64 bits");
    n *= ud;
  }
  return n;
}

}  // namespace

F32View parse_f32_tensor(const std::string& bytes, const std::string& name) {
  if (bytes.size() < 8) bad_result(std::to_string(bytes.size()) + " bytes is not safetensors");
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  if (len > bytes.size() - 8) bad_result("safetensors header past the end");
  if (len > safetensors::kMaxBlobHeaderBytes) {
    bad_result("safetensors header of " + std::to_string(len) + " bytes is over the limit of " +
               std::to_string(safetensors::kMaxBlobHeaderBytes));
  }
  const std::string_view text(bytes.data() + 8, len);
  if (!safetensors::json_nesting_within(text, safetensors::kMaxJsonDepth))
    bad_result("safetensors header nests too deep");
  F32View view;
  uint64_t begin = 0, end = 0;
  try {
    const auto header = nlohmann::json::parse(text);
    if (!header.is_object()) bad_result("safetensors header is not an object");
    if (header.contains("__metadata__")) {
      for (auto it = header["__metadata__"].begin(); it != header["__metadata__"].end(); ++it) {
        view.metadata[it.key()] = it.value().get<std::string>();
      }
    }
    if (!header.contains(name)) bad_result("no tensor '" + name + "'");
    const auto& entry = header[name];
    if (entry.at("dtype").get<std::string>() != "F32") bad_result("'" + name + "' is not F32");
    view.shape = entry.at("shape").get<std::vector<int64_t>>();
    begin = entry.at("data_offsets").at(0).get<uint64_t>();
    end = entry.at("data_offsets").at(1).get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    bad_result(std::string("safetensors header is malformed (") + e.what() + ")");
  }
  const uint64_t data_size = bytes.size() - 8 - len;
  if (end < begin || end > data_size || end - begin != checked_bytes(view.shape, sizeof(float))) {
    bad_result("'" + name + "' has inconsistent data offsets");
  }
  view.data = bytes.data() + 8 + len + begin;
  view.bytes = end - begin;
  return view;
}

std::string concat_latent_chunks(const std::vector<std::string>& chunk_blobs,
                                 const std::map<std::string, std::string>& metadata) {
  if (chunk_blobs.empty()) bad_result("no chunks to join");
  std::vector<F32View> views;
  for (const auto& blob : chunk_blobs) views.push_back(parse_f32_tensor(blob, "latents"));
  const auto& first = views.front().shape;
  if (first.size() != 5) bad_result("latents are not 5-D [B, C, F, h, w]");
  int64_t frames = 0;
  uint64_t total_bytes = 0;
  for (const auto& v : views) {
    if (v.shape.size() != 5 || v.shape[0] != first[0] || v.shape[1] != first[1] || v.shape[3] != first[3] ||
        v.shape[4] != first[4]) {
      bad_result("chunk latents have different shapes");
    }
    frames += v.shape[2];
    total_bytes += v.bytes;  // each was checked against its own blob, so the sum is at most the input's size
  }
  const int64_t outer = first[0] * first[1];  // (batch, channel) slabs; frames are contiguous inside each
  const size_t frame_bytes = static_cast<size_t>(first[3] * first[4]) * sizeof(float);
  if (checked_bytes({first[0], first[1], frames, first[3], first[4]}, sizeof(float)) != total_bytes) {
    bad_result("chunk latents do not add up to one video");
  }
  std::vector<float> joined(static_cast<size_t>(total_bytes / sizeof(float)));
  char* out = reinterpret_cast<char*>(joined.data());
  for (int64_t o = 0; o < outer; ++o) {
    for (const auto& v : views) {
      const size_t slab = static_cast<size_t>(v.shape[2]) * frame_bytes;
      std::memcpy(out, v.data + static_cast<size_t>(o) * slab, slab);
      out += slab;
    }
  }
  return safetensors_bytes("latents", {first[0], first[1], frames, first[3], first[4]}, joined.data(), metadata);
}

}  // namespace skyreels::server
