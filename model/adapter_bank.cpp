#include "model/adapter_bank.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <stdexcept>

#include "model/safetensors.h"
#include "model/sha256.h"
#include "model/utf8_text.h"

namespace skyreels::model {
namespace {

namespace fs = std::filesystem;

constexpr const char* kExtension = ".safetensors";

std::string number_text(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

// The catalogue's entry of one file: its header read, mapped and checked against the model first (a file that is
// not an adapter, however large, is refused after reading a few bytes), then its digest. Its name and reason are
// valid UTF-8 (utf8_escape): they reach proto3 strings, JSON bodies and logs. A name that is not valid UTF-8 is listed
// escaped and unavailable (a request names adapters in UTF-8, so none could choose it); its file is not read.
AdapterInfo catalogue_entry(const fs::path& path, const AdapterCatalogue& catalogue) {
  AdapterInfo info;
  const std::string stem = path.stem().string();
  info.name = utf8_escape(stem);
  info.path = path.string();
  if (info.name != stem) {
    info.reason = "file name '" + utf8_escape(path.filename().string()) +
                  "' is not valid UTF-8 (an adapter is chosen by its name in UTF-8; rename the file)";
    return info;
  }
  try {
    info.bytes = fs::file_size(path);
    const LoraLayout layout = read_lora_layout(info.path, safetensors::read_header(info.path));
    catalogue.check_fits(info.path, layout);
    info.sha256 = sha256_file(info.path);
    info.format = lora_format_name(layout.format);
    info.rank = layout.max_rank;
    info.parameters = static_cast<int64_t>(layout.targets.size());
    info.available = true;
  } catch (const std::exception& e) {
    info.reason = utf8_escape(e.what());
  }
  return info;
}

// What says a file is still the one catalogued without reading it: an in-place rewrite changes the size or the
// modification time, a replacement by rename the inode.
struct FileStamp {
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  int64_t modified_ns = 0;
  bool operator==(const FileStamp& o) const {
    return device == o.device && inode == o.inode && size == o.size && modified_ns == o.modified_ns;
  }
};

// The stamp of a regular file (symbolic links followed, as the listing does); nullopt when there is none.
std::optional<FileStamp> stamp_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return FileStamp{st.st_dev, st.st_ino, st.st_size,
                   static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

struct Entry {
  AdapterInfo info;
  FileStamp stamp;
};

// By name (escaped names sort apart from their files); an available adapter before an unavailable one of the same
// name ("a\xff" written out, next to a file whose name holds the byte 0xff), so lookups answer the available one.
void sort_entries(std::vector<Entry>& entries) {
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.info.name != b.info.name ? a.info.name < b.info.name : a.info.available && !b.info.available;
  });
}

const Entry* entry_named(const std::vector<Entry>& entries, const std::string& name) {
  auto it = std::lower_bound(entries.begin(), entries.end(), name,
                             [](const Entry& e, const std::string& n) { return e.info.name < n; });
  return it != entries.end() && it->info.name == name ? &*it : nullptr;
}

// A name a request may give that can name a file of the directory itself (no path, no NUL).
bool names_a_file_here(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

// Files are read and hashed under `reading` (one look at the directory at a time); `entries` is swapped under `mu`,
// which is never held while a file is read, so lookups of unchanged adapters never wait for a hash.
struct AdapterCatalogue::State {
  std::mutex reading;
  mutable std::mutex mu;
  std::vector<Entry> entries;  // sort_entries order
};

AdapterRequest parse_adapter_request(const std::string& text) {
  AdapterRequest request{text, 1.0};
  const size_t colon = text.rfind(':');
  if (colon != std::string::npos) {
    const std::string tail = text.substr(colon + 1);
    char* end = nullptr;
    const double value = std::strtod(tail.c_str(), &end);
    if (tail.empty() || end != tail.c_str() + tail.size()) {
      throw std::invalid_argument("--adapter '" + text + "': '" + tail + "' is not a scale (expected NAME[:SCALE])");
    }
    request = {text.substr(0, colon), value};
  }
  if (request.name.empty()) throw std::invalid_argument("--adapter '" + text + "': no name (expected NAME[:SCALE])");
  return request;
}

namespace {

// The regular *.safetensors files of `directory`, sorted. Throws std::invalid_argument when it cannot be listed.
std::vector<fs::path> adapter_files(const std::string& directory, const std::string& shown) {
  std::error_code error;
  std::vector<fs::path> files;
  for (fs::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    if (it->path().extension() == kExtension && it->is_regular_file(error)) files.push_back(it->path());
  }
  if (error) throw std::invalid_argument("--lora-dir '" + shown + "': cannot list it: " + error.message());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

AdapterCatalogue::AdapterCatalogue(const std::string& directory, const TransformerConfig& config,
                                   const AdapterCatalogueOptions& options)
    : directory_(directory),
      shown_directory_(utf8_escape(directory)),
      specs_(transformer_parameter_specs(config)),
      linear_modules_(transformer_linear_modules(config)),
      state_(std::make_unique<State>()) {
  std::sort(linear_modules_.begin(), linear_modules_.end());
  std::error_code error;
  if (!fs::is_directory(directory, error)) {
    throw std::invalid_argument("--lora-dir '" + shown_directory_ + "': not a directory");
  }
  rescan();
  const std::vector<AdapterInfo> all = adapters();
  for (const AdapterInfo& info : all) {
    if (!info.available && options.strict) {
      throw std::invalid_argument("--lora-dir '" + shown_directory_ + "': adapter '" + info.name +
                                  "' is unavailable: " + info.reason);
    }
  }
  const auto available = std::count_if(all.begin(), all.end(), [](const auto& a) { return a.available; });
  spdlog::info("--lora-dir '{}': {} adapter(s), {} available", shown_directory_, all.size(), available);
}

AdapterCatalogue::~AdapterCatalogue() = default;

std::vector<AdapterInfo> AdapterCatalogue::adapters() const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<AdapterInfo> out;
  out.reserve(state_->entries.size());
  for (const Entry& e : state_->entries) out.push_back(e.info);
  return out;
}

std::optional<AdapterInfo> AdapterCatalogue::find(const std::string& name) const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  const Entry* entry = entry_named(state_->entries, name);
  return entry ? std::optional<AdapterInfo>(entry->info) : std::nullopt;
}

CatalogueChanges AdapterCatalogue::rescan() const {
  const std::lock_guard<std::mutex> reading(state_->reading);
  std::vector<Entry> before;
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    before = state_->entries;
  }
  std::map<std::string, const Entry*> by_path;
  for (const Entry& e : before) by_path[e.info.path] = &e;
  CatalogueChanges changes;
  std::vector<Entry> now;
  for (const auto& path : adapter_files(directory_, shown_directory_)) {
    const std::optional<FileStamp> stamp = stamp_of(path.string());
    if (!stamp) continue;  // gone since it was listed
    auto it = by_path.find(path.string());
    if (it != by_path.end() && it->second->stamp == *stamp) {
      now.push_back(*it->second);
      by_path.erase(it);
      continue;
    }
    ++(it == by_path.end() ? changes.added : changes.changed);
    if (it != by_path.end()) by_path.erase(it);
    now.push_back({catalogue_entry(path, *this), *stamp});
    const AdapterInfo& info = now.back().info;
    if (!info.available) spdlog::warn("adapter '{}' is unavailable: {}", info.name, info.reason);
  }
  changes.removed = static_cast<int64_t>(by_path.size());
  sort_entries(now);
  const std::lock_guard<std::mutex> lock(state_->mu);
  state_->entries = std::move(now);
  return changes;
}

// The entry of `name` after a look at its file (without listing the directory): catalogued when it is new or
// changed, forgotten when it is gone.
std::optional<AdapterInfo> AdapterCatalogue::refresh(const std::string& name) const {
  if (!names_a_file_here(name)) return find(name);
  const std::string path = (fs::path(directory_) / (name + kExtension)).string();
  auto listed = [&](const std::string& file) {
    const std::lock_guard<std::mutex> lock(state_->mu);
    return std::any_of(state_->entries.begin(), state_->entries.end(),
                       [&](const Entry& e) { return e.info.path == file; });
  };
  auto current = [&](const std::optional<FileStamp>& stamp) -> std::optional<AdapterInfo> {
    const std::lock_guard<std::mutex> lock(state_->mu);
    const Entry* entry = entry_named(state_->entries, name);
    if (entry != nullptr && entry->info.path == path && stamp && entry->stamp == *stamp) return entry->info;
    return std::nullopt;
  };
  const std::optional<FileStamp> seen = stamp_of(path);
  if (auto same = current(seen)) return same;
  if (!seen && !listed(path)) return find(name);  // no such file and nothing to forget: an unknown name costs a stat
  const std::lock_guard<std::mutex> reading(state_->reading);
  const std::optional<FileStamp> stamp = stamp_of(path);
  if (auto same = current(stamp)) return same;  // another call looked at it meanwhile
  std::optional<Entry> fresh;
  if (stamp) fresh = Entry{catalogue_entry(path, *this), *stamp};
  const std::lock_guard<std::mutex> lock(state_->mu);
  auto& entries = state_->entries;
  const auto gone = std::remove_if(entries.begin(), entries.end(), [&](const Entry& e) { return e.info.path == path; });
  const bool forgotten = gone != entries.end();
  entries.erase(gone, entries.end());
  if (!fresh) {
    if (forgotten) spdlog::info("adapter '{}': its file is gone from --lora-dir '{}'", name, shown_directory_);
    const Entry* other = entry_named(entries, name);  // an escaped name's file, if any
    return other ? std::optional<AdapterInfo>(other->info) : std::nullopt;
  }
  spdlog::info("adapter '{}' catalogued: sha256={} available={}", name, fresh->info.sha256, fresh->info.available);
  entries.push_back(*fresh);
  sort_entries(entries);
  return fresh->info;
}

void AdapterCatalogue::check_fits(const std::string& path, const LoraLayout& layout) const {
  check_lora_layout(path, layout, specs_);
  for (const auto& [name, target] : layout.targets) {
    const size_t dot = name.rfind('.');
    const std::string module = name.substr(0, dot);
    const bool linear = std::binary_search(linear_modules_.begin(), linear_modules_.end(), module);
    if (!linear ||
        (name.compare(dot, std::string::npos, ".weight") != 0 && name.compare(dot, std::string::npos, ".bias") != 0)) {
      throw std::invalid_argument("LoRA '" + path + "': key '" + target.key + "': targets '" + name +
                                  "', which is not a linear layer's weight or bias (adapters per call change linear "
                                  "layers only; --lora merges it)");
    }
  }
}

std::vector<ResolvedAdapter> AdapterCatalogue::resolve(const std::vector<AdapterRequest>& request,
                                                       const std::string& list) const {
  if (std::string why = adapter_count_problem(request.size(), list); !why.empty()) throw std::invalid_argument(why);
  std::map<std::string, size_t> seen;
  std::vector<ResolvedAdapter> out;
  for (size_t i = 0; i < request.size(); ++i) {
    const AdapterRequest& r = request[i];
    const std::string field = list + "[" + std::to_string(i) + "]";
    if (std::string why = adapter_name_problem(r.name.size(), field + ".name"); !why.empty()) {
      throw std::invalid_argument(why);
    }
    const std::optional<AdapterInfo> info = refresh(r.name);
    if (!info) {
      throw std::invalid_argument(field + ".name: unknown adapter '" + r.name + "' (no " + r.name + kExtension +
                                  " in --lora-dir '" + shown_directory_ + "')");
    }
    if (!info->available) {
      throw std::invalid_argument(field + ".name: adapter '" + r.name + "' is unavailable: " + info->reason);
    }
    if (!std::isfinite(r.scale) || std::abs(r.scale) > kMaxAdapterScale) {
      throw std::invalid_argument(field + ".scale: adapter '" + r.name + "' has scale " + number_text(r.scale) +
                                  "; it must be a finite number within +-" + number_text(kMaxAdapterScale));
    }
    if (auto [it, fresh] = seen.emplace(r.name, i); !fresh) {
      throw std::invalid_argument(field + ".name: adapter '" + r.name + "' is given twice (also " + list + "[" +
                                  std::to_string(it->second) + "])");
    }
    out.push_back({r.name, r.scale, info->sha256});
  }
  return out;
}

AdapterBank::AdapterBank(std::shared_ptr<const AdapterCatalogue> catalogue, c10::Device device,
                         at::ScalarType compute_dtype, size_t max_resident)
    : catalogue_(std::move(catalogue)), device_(device), dtype_(compute_dtype), max_resident_(max_resident) {
  if (!catalogue_) throw std::invalid_argument("AdapterBank: no catalogue");
  if (max_resident_ == 0) {
    throw std::invalid_argument("max_resident: must be at least 1 (there is no unbounded adapter bank; default " +
                                std::to_string(kDefaultMaxResident) + ")");
  }
}

std::shared_ptr<const LoraAdapter> AdapterBank::load(const std::string& name, const std::string& sha256) const {
  const std::optional<AdapterInfo> info = catalogue_->find(name);
  const std::string path =
      info ? info->path : (fs::path(catalogue_->directory()) / (name + kExtension)).string();
  std::shared_ptr<safetensors::File> file;
  try {
    file = safetensors::File::read(path);  // memory of its own: what is hashed below is what the adapter views
  } catch (const std::exception& e) {
    throw std::runtime_error("adapter '" + name + "': " + utf8_escape(e.what()));
  }
  Sha256 hash;
  hash.update(file->bytes(), file->file_size());
  const std::string now = hash.hex();
  if (now != sha256) {
    throw std::runtime_error("adapter '" + name + "' is not the file this job was accepted with (sha256 " + sha256 +
                             "); the file '" + utf8_escape(path) + "' now has sha256 " + now +
                             " (submit again to use it)");
  }
  LoraAdapter adapter = read_lora({path, 1.0}, *file);
  catalogue_->check_fits(path, read_lora_layout(path, {file->tensors(), file->metadata(), file->file_size()}));
  return std::make_shared<const LoraAdapter>(place_lora(adapter, catalogue_->specs(), device_, dtype_));
}

std::shared_ptr<const LoraAdapter> AdapterBank::acquire(const std::string& name, const std::string& sha256) {
  std::string wanted = sha256;
  if (wanted.empty()) {
    const std::optional<AdapterInfo> info = catalogue_->find(name);
    if (!info) throw std::invalid_argument("adapter '" + name + "': unknown");
    if (!info->available) throw std::invalid_argument("adapter '" + name + "' is unavailable: " + info->reason);
    wanted = info->sha256;
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(lru_.begin(), lru_.end(), [&](const Resident& r) { return r.name == name && r.sha256 == wanted; });
  if (it != lru_.end()) {
    lru_.splice(lru_.begin(), lru_, it);
    return lru_.front().adapter;
  }
  auto adapter = load(name, wanted);
  ++loads_;
  lru_.remove_if([&](const Resident& r) { return r.name == name; });  // an older file's: no new job asks for it
  lru_.push_front({name, wanted, adapter});
  while (lru_.size() > max_resident_) lru_.pop_back();
  return adapter;
}

std::vector<ActiveAdapter> AdapterBank::activate(const std::vector<AdapterRequest>& request) {
  std::vector<ActiveAdapter> out;
  for (const ResolvedAdapter& r : catalogue_->resolve(request)) out.push_back({acquire(r.name, r.sha256), r.scale});
  return out;
}

std::vector<std::string> AdapterBank::resident() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (const Resident& r : lru_) names.push_back(r.name);
  return names;
}

int64_t AdapterBank::loads() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return loads_;
}

}  // namespace skyreels::model
