// safetensors reader and writer of our own: memory-mapped or read into memory, validated.
//
// Format: 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets:[begin,end]},
// "__metadata__": {str: str}}), then the data area. Offsets are relative to the data area.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace skyreels::safetensors {

// Every problem with a file: the message names the file and, where one is involved, the tensor.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// F8_E4M3 / F8_E5M2: fp8 (float8_e4m3fn / float8_e5m2, model/fp8.h). LibTorch 1.13 has no fp8 type: their tensors are
// uint8 tensors of the codes, to be decoded with fp8::decode.
enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

const char* dtype_name(DType dtype);  // "F32", ...
size_t dtype_size(DType dtype);       // bytes per element
at::ScalarType to_scalar_type(DType dtype);  // fp8: at::kByte (the codes)
bool is_fp8(DType dtype);
DType from_scalar_type(at::ScalarType type);  // throws FormatError for types safetensors cannot hold

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets into the data area
  uint64_t end = 0;
  int64_t numel() const;
};

// An open, validated safetensors file, in one of two backings:
// - open(): the file's private mapping, paged in on use. Its pages show the file as it is on disk, also after an
//   in-place rewrite, and a truncated file faults (SIGBUS) on the pages it lost: read what you need and copy what you
//   keep (place_strict copies every tensor that would view a mapping), then drop the File. For checkpoints, read once.
// - read(): the whole file read into memory the File owns (pread, refused when the file changes size meanwhile).
//   Nothing done to the file afterwards changes its bytes, and bytes() are exactly what every tensor() views: hash them
//   to know what is used. For files whose tensors are kept while serving (adapters chosen per call).
// Tensors returned by tensor() view the backing (kept alive by the tensor's deleter); clone() them before writing.
class File {
 public:
  static std::shared_ptr<File> open(const std::string& path);
  static std::shared_ptr<File> read(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  std::vector<std::string> names() const;
  uint64_t file_size() const { return size_; }

  // A CPU tensor viewing the backing's bytes (no copy). Throws FormatError naming file and tensor when absent.
  at::Tensor tensor(const std::string& name) const;
  // Raw bytes of one tensor inside the backing.
  const uint8_t* data(const TensorInfo& info) const;
  // The whole file as read, header included (file_size() bytes): with read(), what every tensor views.
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(map_); }

 private:
  enum class Backing { kMapping, kOwnedCopy };
  static std::shared_ptr<File> open_as(const std::string& path, Backing backing);
  File() = default;
  Backing backing_ = Backing::kMapping;
  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<File> self_;
};

// A file's header without mapping or reading its data area (what File::open checks of it; the tensors' bytes are
// not checked beyond their offsets lying inside the file).
struct Header {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t file_size = 0;
};
Header read_header(const std::string& path);

// Parses and validates a header against a file of `file_size` bytes (exposed for tests of damaged headers).
void parse_header(const std::string& path, const std::string& json, uint64_t header_len, uint64_t file_size,
                  std::vector<TensorInfo>& tensors, std::map<std::string, std::string>& metadata);

// One tensor to write: its header entry is known up front, its bytes are produced only when it is written, so a
// writer holds one tensor in memory at a time (convert and the benchmark write multi-GB files this way).
struct SaveItem {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> produce;  // must return exactly `dtype` and `shape` (any device, any layout)
  // The dtype written to the header when it is not from_scalar_type(dtype): F8_E4M3 / F8_E5M2 for uint8 codes.
  std::optional<DType> stored_as = std::nullopt;
};

// Writes `path` atomically (to path + ".partial", renamed at the end; removed on failure). The data area is aligned
// to 8 bytes so that readers can view it without copying.
void save_streaming(const std::string& path, const std::vector<SaveItem>& items,
                    const std::map<std::string, std::string>& metadata = {});

// Writes tensors (any device, any layout; stored contiguous, little-endian) in the given order.
void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {});

// Whether a CPU tensor's storage lies inside an open File's mapping (open(), not read()): what must be copied before
// it is kept, since the file may change under it.
bool views_mapping(const at::Tensor& tensor);

// Drops the resident pages wholly inside a tensor that views an open File's mapping, once its bytes have been decoded
// or copied (an fp8 load): they stop counting in the RSS and would be read from the file again if touched. Returns
// false, doing nothing, for a tensor that views no mapping.
bool release_mapped_pages(const at::Tensor& view);

// Convenience: load every tensor as an owning CPU tensor (copied out of the mapping).
std::map<std::string, at::Tensor> load_all(const std::string& path);

}  // namespace skyreels::safetensors
