#include "model/adapter_bank.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

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

}  // namespace

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

AdapterCatalogue::AdapterCatalogue(const std::string& directory, const TransformerConfig& config,
                                   const AdapterCatalogueOptions& options)
    : directory_(directory),
      shown_directory_(utf8_escape(directory)),
      specs_(transformer_parameter_specs(config)),
      linear_modules_(transformer_linear_modules(config)) {
  std::sort(linear_modules_.begin(), linear_modules_.end());
  std::error_code error;
  if (!fs::is_directory(directory, error)) {
    throw std::invalid_argument("--lora-dir '" + shown_directory_ + "': not a directory");
  }
  std::vector<fs::path> files;
  for (fs::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    if (it->path().extension() == kExtension && it->is_regular_file(error)) files.push_back(it->path());
  }
  if (error) throw std::invalid_argument("--lora-dir '" + shown_directory_ + "': cannot list it: " + error.message());
  std::sort(files.begin(), files.end());
  for (const auto& path : files) {
    AdapterInfo info = catalogue_entry(path, *this);
    if (!info.available && options.strict) {
      throw std::invalid_argument("--lora-dir '" + shown_directory_ + "': adapter '" + info.name +
                                  "' is unavailable: " + info.reason);
    }
    if (!info.available) spdlog::warn("adapter '{}' is unavailable: {}", info.name, info.reason);
    adapters_.push_back(std::move(info));
  }
  // By name (escaped names sort apart from their files); an available adapter before an unavailable one of the same
  // name ("a\xff" written out, next to a file whose name holds the byte 0xff), so find() answers the available one.
  std::stable_sort(adapters_.begin(), adapters_.end(), [](const AdapterInfo& a, const AdapterInfo& b) {
    return a.name != b.name ? a.name < b.name : a.available && !b.available;
  });
  const auto available = std::count_if(adapters_.begin(), adapters_.end(), [](const auto& a) { return a.available; });
  spdlog::info("--lora-dir '{}': {} adapter(s), {} available", shown_directory_, adapters_.size(), available);
}

const AdapterInfo* AdapterCatalogue::find(const std::string& name) const {
  auto it = std::lower_bound(adapters_.begin(), adapters_.end(), name,
                             [](const AdapterInfo& a, const std::string& n) { return a.name < n; });
  return it != adapters_.end() && it->name == name ? &*it : nullptr;
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
    const AdapterInfo* info = find(r.name);
    if (info == nullptr) {
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

std::shared_ptr<const LoraAdapter> AdapterBank::load(const AdapterInfo& info) const {
  std::shared_ptr<safetensors::File> file;
  try {
    file = safetensors::File::open(info.path);
  } catch (const std::exception& e) {
    throw std::runtime_error("adapter '" + info.name + "': " + utf8_escape(e.what()));
  }
  // The bytes read below are the bytes hashed: a file replaced after the catalogue read it is refused.
  Sha256 hash;
  hash.update(file->bytes(), file->file_size());
  const std::string now = hash.hex();
  if (now != info.sha256) {
    throw std::runtime_error("adapter '" + info.name + "': file '" + utf8_escape(info.path) +
                             "' changed since --lora-dir was read (SHA-256 " + info.sha256 + " then, " + now +
                             " now); restart to take the new file");
  }
  LoraAdapter adapter = read_lora({info.path, 1.0}, *file);
  catalogue_->check_fits(info.path,
                         read_lora_layout(info.path, {file->tensors(), file->metadata(), file->file_size()}));
  return std::make_shared<const LoraAdapter>(place_lora(adapter, catalogue_->specs(), device_, dtype_));
}

std::shared_ptr<const LoraAdapter> AdapterBank::acquire(const std::string& name) {
  const std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(lru_.begin(), lru_.end(), [&](const auto& entry) { return entry.first == name; });
  if (it != lru_.end()) {
    lru_.splice(lru_.begin(), lru_, it);
    return lru_.front().second;
  }
  const AdapterInfo* info = catalogue_->find(name);
  if (info == nullptr) throw std::invalid_argument("adapter '" + name + "': unknown");
  if (!info->available) throw std::invalid_argument("adapter '" + name + "' is unavailable: " + info->reason);
  auto adapter = load(*info);
  ++loads_;
  lru_.emplace_front(name, adapter);
  while (lru_.size() > max_resident_) lru_.pop_back();
  return adapter;
}

std::vector<ActiveAdapter> AdapterBank::activate(const std::vector<AdapterRequest>& request) {
  std::vector<ActiveAdapter> out;
  for (const ResolvedAdapter& r : catalogue_->resolve(request)) out.push_back({acquire(r.name), r.scale});
  return out;
}

std::vector<std::string> AdapterBank::resident() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (const auto& entry : lru_) names.push_back(entry.first);
  return names;
}

int64_t AdapterBank::loads() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return loads_;
}

}  // namespace skyreels::model
