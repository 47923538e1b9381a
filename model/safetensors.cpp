#include "model/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include "model/safetensors_limits.h"

namespace skyreels::safetensors {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw FormatError("safetensors file '" + path + "': " + what);
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, const std::string& what) {
  throw FormatError("safetensors file '" + path + "', tensor '" + name + "': " + what);
}

// The mappings of open Files (begin -> end), so that release_mapped_pages never touches other memory.
std::mutex g_mappings_mutex;
std::map<uintptr_t, uintptr_t> g_mappings;

bool parse_dtype(const std::string& s, DType& out) {
  static const std::pair<const char*, DType> table[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"I64", DType::I64},
      {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},   {"U8", DType::U8},     {"BOOL", DType::BOOL},
      {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2}};
  for (const auto& [name, dtype] : table) {
    if (s == name) {
      out = dtype;
      return true;
    }
  }
  return false;
}

// The header length the first 8 bytes give (little-endian), checked against the file's size and the limit.
uint64_t checked_header_length(const std::string& path, const uint8_t* first8, uint64_t file_size) {
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | first8[i];
  if (header_len > file_size - 8) {
    fail(path, "header length " + std::to_string(header_len) + " is past the end of the file (" +
                   std::to_string(file_size) + " bytes)");
  }
  if (header_len > kMaxFileHeaderBytes) {
    fail(path, "header length " + std::to_string(header_len) + " is over the limit of " +
                   std::to_string(kMaxFileHeaderBytes) + " bytes");
  }
  return header_len;
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return "F64";
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::I16:
      return "I16";
    case DType::I8:
      return "I8";
    case DType::U8:
      return "U8";
    case DType::BOOL:
      return "BOOL";
    case DType::F8_E4M3:
      return "F8_E4M3";
    case DType::F8_E5M2:
      return "F8_E5M2";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
      return 1;
  }
  return 0;
}

at::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return at::kDouble;
    case DType::F32:
      return at::kFloat;
    case DType::F16:
      return at::kHalf;
    case DType::BF16:
      return at::kBFloat16;
    case DType::I64:
      return at::kLong;
    case DType::I32:
      return at::kInt;
    case DType::I16:
      return at::kShort;
    case DType::I8:
      return at::kChar;
    case DType::U8:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
      return at::kByte;
    case DType::BOOL:
      return at::kBool;
  }
  return at::kFloat;
}

bool is_fp8(DType dtype) { return dtype == DType::F8_E4M3 || dtype == DType::F8_E5M2; }

DType from_scalar_type(at::ScalarType type) {
  switch (type) {
    case at::kDouble:
      return DType::F64;
    case at::kFloat:
      return DType::F32;
    case at::kHalf:
      return DType::F16;
    case at::kBFloat16:
      return DType::BF16;
    case at::kLong:
      return DType::I64;
    case at::kInt:
      return DType::I32;
    case at::kShort:
      return DType::I16;
    case at::kChar:
      return DType::I8;
    case at::kByte:
      return DType::U8;
    case at::kBool:
      return DType::BOOL;
    default:
      break;
  }
  throw FormatError(std::string("safetensors cannot store dtype ") + c10::toString(type));
}

// numel x element size, or false when that does not fit in 64 bits (a hostile header must not wrap around).
static bool checked_nbytes(const std::vector<int64_t>& shape, size_t element_size, uint64_t& out) {
  uint64_t n = element_size;
  for (int64_t d : shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > std::numeric_limits<uint64_t>::max() / ud) return false;
    n *= ud;
  }
  out = n;
  return true;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void parse_header(const std::string& path, const std::string& text, uint64_t header_len, uint64_t file_size,
                  std::vector<TensorInfo>& tensors, std::map<std::string, std::string>& metadata) {
  if (file_size < 8 || header_len > file_size - 8) {
    fail(path, "header length " + std::to_string(header_len) + " is past the end of the file (" +
                   std::to_string(file_size) + " bytes)");
  }
  const uint64_t data_size = file_size - 8 - header_len;
  if (!json_nesting_within(text, kMaxJsonDepth)) {
    fail(path, "header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels (not a safetensors header)");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail(path, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");

  tensors.clear();
  metadata.clear();
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path, "__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) fail(path, "__metadata__ value '" + m.key() + "' is not a string");
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) fail_tensor(path, name, "entry is not an object");
    TensorInfo info;
    info.name = name;
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail_tensor(path, name, "missing dtype");
    const std::string dtype = entry["dtype"].get<std::string>();
    if (!parse_dtype(dtype, info.dtype)) fail_tensor(path, name, "unknown dtype '" + dtype + "'");
    if (!entry.contains("shape") || !entry["shape"].is_array()) fail_tensor(path, name, "missing shape");
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail_tensor(path, name, "shape has a bad dimension");
      info.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      fail_tensor(path, name, "data_offsets must be [begin, end]");
    }
    info.begin = offsets[0].get<uint64_t>();
    info.end = offsets[1].get<uint64_t>();
    if (info.begin > info.end) fail_tensor(path, name, "data_offsets begin > end");
    if (info.end > data_size) {
      fail_tensor(path, name,
                  "data_offsets end " + std::to_string(info.end) + " is past the data area (" +
                      std::to_string(data_size) + " bytes; file truncated?)");
    }
    uint64_t expected = 0;
    if (!checked_nbytes(info.shape, dtype_size(info.dtype), expected)) fail_tensor(path, name, "shape is too large");
    if (info.end - info.begin != expected) {
      fail_tensor(path, name,
                  "byte length " + std::to_string(info.end - info.begin) + " does not match shape x " + dtype + " = " +
                      std::to_string(expected));
    }
    tensors.push_back(std::move(info));
  }

  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    if (a->begin != b->begin) return a->begin < b->begin;
    return a->end != b->end ? a->end < b->end : a->name < b->name;  // deterministic messages
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo* prev = by_offset[i - 1];
    const TensorInfo* cur = by_offset[i];
    if (cur->begin < prev->end) {
      fail(path, "tensors '" + prev->name + "' and '" + cur->name + "' have overlapping data_offsets");
    }
  }
}

namespace {

// Opens `path` for reading and returns its descriptor and size (at least 8 bytes).
int open_for_reading(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(error));
  }
  *size = static_cast<uint64_t>(st.st_size);
  if (*size < 8) {
    ::close(fd);
    fail(path, "file is " + std::to_string(*size) + " bytes, too short for a header (truncated?)");
  }
  return fd;
}

// Reads all `size` bytes of `fd` into `to`; a file that ends early or grows meanwhile was rewritten while it was
// read, and is refused (what was read would be neither the old file nor the new one).
void read_exactly(const std::string& path, int fd, uint8_t* to, uint64_t size) {
  uint64_t done = 0;
  while (done < size) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(size - done, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, to + done, want, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path, std::string("cannot read: ") + std::strerror(errno));
    if (got == 0) {
      fail(path, "ended after " + std::to_string(done) + " of " + std::to_string(size) +
                     " bytes: it was truncated or rewritten while it was read");
    }
    done += static_cast<uint64_t>(got);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != size) {
    fail(path, "changed size while it was read (rewritten in place?)");
  }
}

}  // namespace

std::shared_ptr<File> File::open(const std::string& path) { return open_as(path, Backing::kMapping); }

std::shared_ptr<File> File::read(const std::string& path) { return open_as(path, Backing::kOwnedCopy); }

std::shared_ptr<File> File::open_as(const std::string& path, Backing backing) {
  std::shared_ptr<File> file(new File());
  file->path_ = path;
  file->self_ = file;
  file->backing_ = backing;

  const int fd = open_for_reading(path, &file->size_);
  // Private and writable either way: an accidental in-place op on a view changes memory, never the file.
  void* map = backing == Backing::kMapping
                  ? ::mmap(nullptr, file->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
                  : ::mmap(nullptr, file->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    fail(path, std::string("cannot mmap: ") + std::strerror(error));
  }
  file->map_ = map;  // unmapped by ~File from here on, also when reading or parsing throws
  if (backing == Backing::kOwnedCopy) {
    try {
      read_exactly(path, fd, static_cast<uint8_t*>(map), file->size_);
    } catch (...) {
      ::close(fd);
      throw;
    }
  } else {
    const std::lock_guard<std::mutex> lock(g_mappings_mutex);
    g_mappings[reinterpret_cast<uintptr_t>(map)] = reinterpret_cast<uintptr_t>(map) + file->size_;
  }
  ::close(fd);

  const auto* bytes = static_cast<const uint8_t*>(map);
  const uint64_t header_len = checked_header_length(path, bytes, file->size_);
  const std::string text(reinterpret_cast<const char*>(bytes + 8), header_len);
  parse_header(path, text, header_len, file->size_, file->tensors_, file->metadata_);
  file->data_start_ = 8 + header_len;
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

Header read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  Header header;
  in.seekg(0, std::ios::end);
  header.file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (header.file_size < 8) {
    fail(path, "file is " + std::to_string(header.file_size) + " bytes, too short for a header (truncated?)");
  }
  uint8_t first8[8];
  in.read(reinterpret_cast<char*>(first8), 8);
  const uint64_t header_len = checked_header_length(path, first8, header.file_size);
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (static_cast<uint64_t>(in.gcount()) != header_len) fail(path, "cannot read the header");
  parse_header(path, text, header_len, header.file_size, header.tensors, header.metadata);
  return header;
}

File::~File() {
  if (map_ == nullptr) return;
  if (backing_ == Backing::kMapping) {
    const std::lock_guard<std::mutex> lock(g_mappings_mutex);
    g_mappings.erase(reinterpret_cast<uintptr_t>(map_));
  }
  ::munmap(map_, size_);
}

bool views_mapping(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.device().is_cpu() || tensor.storage().nbytes() == 0) return false;
  const auto begin = reinterpret_cast<uintptr_t>(tensor.storage().data_ptr().get());
  const std::lock_guard<std::mutex> lock(g_mappings_mutex);
  auto it = g_mappings.upper_bound(begin);
  if (it == g_mappings.begin()) return false;
  --it;
  return begin >= it->first && begin < it->second;
}

bool release_mapped_pages(const at::Tensor& view) {
  if (!view.defined() || !view.device().is_cpu() || !view.is_contiguous() || view.nbytes() == 0) return false;
  const auto begin = reinterpret_cast<uintptr_t>(view.data_ptr());
  const uintptr_t end = begin + view.nbytes();
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = end / page * page;
  const std::lock_guard<std::mutex> lock(g_mappings_mutex);
  auto it = g_mappings.upper_bound(begin);
  if (it == g_mappings.begin()) return false;
  --it;
  if (begin < it->first || end > it->second) return false;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  return true;
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::vector<std::string> File::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const uint8_t* File::data(const TensorInfo& info) const {
  return static_cast<const uint8_t*>(map_) + data_start_ + info.begin;
}

at::Tensor File::tensor(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) fail_tensor(path_, name, "not in file");
  const auto options = at::TensorOptions().dtype(to_scalar_type(info->dtype)).device(at::kCPU);
  if (info->numel() == 0) return at::empty(info->shape, options);
  auto* ptr = const_cast<uint8_t*>(data(*info));
  if (reinterpret_cast<uintptr_t>(ptr) % dtype_size(info->dtype) != 0) {
    // Misaligned element data (a writer that did not pad its header): copy into an aligned tensor.
    at::Tensor out = at::empty(info->shape, options);
    std::memcpy(out.data_ptr(), ptr, info->end - info->begin);
    return out;
  }
  std::shared_ptr<const File> keep = self_.lock();
  return at::from_blob(
      ptr, info->shape, [keep](void*) {}, options);
}

void save_streaming(const std::string& path, const std::vector<SaveItem>& items,
                    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& item : items) {
    if (item.name == "__metadata__") throw FormatError("cannot write a tensor named __metadata__ to '" + path + "'");
    if (header.contains(item.name)) throw FormatError("tensor '" + item.name + "' given twice for '" + path + "'");
    const DType dtype = item.stored_as ? *item.stored_as : from_scalar_type(item.dtype);
    if (to_scalar_type(dtype) != item.dtype) {
      throw FormatError("tensor '" + item.name + "' for '" + path + "': " + dtype_name(dtype) + " is written from " +
                        c10::toString(to_scalar_type(dtype)) + " tensors, not " + c10::toString(item.dtype));
    }
    uint64_t nbytes = 0;
    if (!checked_nbytes(item.shape, dtype_size(dtype), nbytes)) {
      throw FormatError("tensor '" + item.name + "' for '" + path + "' is too large");
    }
    header[item.name] = {
        {"dtype", dtype_name(dtype)}, {"shape", item.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // align the data area for zero-copy readers

  const std::string partial = path + ".partial";
  try {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) throw FormatError("cannot write safetensors file '" + partial + "'");
    const uint64_t len = text.size();
    char len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    out.write(len_bytes, 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& item : items) {
      at::Tensor t = item.produce().to(at::kCPU).contiguous();
      if (t.scalar_type() != item.dtype || t.sizes().vec() != item.shape) {
        throw FormatError("tensor '" + item.name + "' for '" + path + "' was produced as " +
                          c10::toString(t.scalar_type()) + " " + std::to_string(t.dim()) +
                          "-d, not as declared in the header");
      }
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
    out.close();
    if (!out) throw FormatError("short write to safetensors file '" + partial + "' (disk full?)");
    if (std::rename(partial.c_str(), path.c_str()) != 0) {
      throw FormatError("cannot rename '" + partial + "' to '" + path + "': " + std::strerror(errno));
    }
  } catch (...) {
    std::remove(partial.c_str());
    throw;
  }
}

void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata) {
  std::vector<SaveItem> items;
  items.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor;
    items.push_back({name, t.scalar_type(), t.sizes().vec(), [t] { return t; }});
  }
  save_streaming(path, items, metadata);
}

std::map<std::string, at::Tensor> load_all(const std::string& path) {
  auto file = File::open(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& info : file->tensors()) out[info.name] = file->tensor(info.name).clone();
  return out;
}

}  // namespace skyreels::safetensors
