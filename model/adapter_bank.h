// Adapters chosen per call (issue 33): a directory of LoRA files (--lora-dir), catalogued from their headers, loaded
// onto a replica's device on first use and kept there in a bounded bank. The model's weights never change: the
// adapters of a call are applied unmerged (TransformerForwardArgs::adapters).
//
// AdapterCatalogue: one per process (replicas may share it). Every *.safetensors file of the directory (not its
// subdirectories) is an adapter named by its file name without ".safetensors". An entry reads only the header, never
// a tensor: it maps the keys (model/lora.h), checks that every update targets a linear layer of the model with the
// implied shape, and then (only for a file that fits) records the file's SHA-256 (streamed, 1 MiB at a time). A
// damaged or unfitting file is listed as unavailable with the reason; with `strict` construction throws naming it
// instead. Names and reasons are valid UTF-8 (model/utf8_text.h): a file name that is not is listed escaped (\xNN) and
// unavailable.
// The directory is the truth and the catalogue follows it while serving: resolve() looks at each file it is asked for
// (a new one is catalogued, one whose size, time or inode changed is read and hashed again, a removed one is
// forgotten), and rescan() does so for the whole directory (SIGHUP). Unchanged files are never read again.
//
// AdapterBank: one per replica device. acquire(name, sha256) reads an adapter's file into memory once (the bytes
// hashed are the bytes used: a file rewritten later changes nothing resident), refuses it when its SHA-256 is not the
// one asked for (the job was accepted with another file), places it on the device in the model's dtypes and keeps at
// most max_resident adapters; the least recently used one leaves first. A call keeps the adapters it was given
// (shared pointers), also when the bank lets them go meanwhile.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/adapter_limits.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

// One adapter asked for by a request, by name (--adapter NAME[:SCALE]).
struct AdapterRequest {
  std::string name;
  double scale = 1.0;
};
// "NAME" or "NAME:SCALE" (the text after the last ':' is the scale when it parses as a number). Throws
// std::invalid_argument on an empty name or a scale that is not a number.
AdapterRequest parse_adapter_request(const std::string& text);

// Adapters a bank keeps on its device by default (a rank-64 adapter of every DF-1.3B linear is ~130 MB in bf16).
inline constexpr size_t kDefaultMaxResident = 4;

// One file of the catalogue.
struct AdapterInfo {
  std::string name;  // file name without .safetensors, valid UTF-8 (bytes of an invalid name escaped as \xNN)
  std::string path;  // as on disk (not necessarily UTF-8): what is opened, never shown as it is
  std::string sha256;  // 64 hex digits; empty when the file could not be read or its header is refused
  uint64_t bytes = 0;
  std::string format;      // "diffusers", "original", "musubi"; empty when unavailable
  int64_t rank = 0;        // the largest rank of its low-rank updates
  int64_t parameters = 0;  // parameters it changes
  bool available = false;
  std::string reason;  // why it is unavailable (names the file, the key and the shapes where they are the problem),
                       // valid UTF-8
};

// An adapter of a request after validation, with the digest of the file it names (for fingerprints and logs).
struct ResolvedAdapter {
  std::string name;
  double scale = 1.0;
  std::string sha256;
};

struct AdapterCatalogueOptions {
  bool strict = false;  // throw on the first unavailable file instead of listing it
};

// What rescan() found.
struct CatalogueChanges {
  int64_t added = 0, changed = 0, removed = 0;
};

class AdapterCatalogue {
 public:
  // Throws std::invalid_argument when `directory` is not a readable directory, and with `strict` naming the first
  // unavailable adapter and why.
  AdapterCatalogue(const std::string& directory, const TransformerConfig& config,
                   const AdapterCatalogueOptions& options = {});
  ~AdapterCatalogue();

  const std::string& directory() const { return directory_; }
  std::vector<AdapterInfo> adapters() const;                    // as last looked at, sorted by name
  std::optional<AdapterInfo> find(const std::string& name) const;  // as last looked at
  const std::vector<checkpoint::ParamSpec>& specs() const { return specs_; }

  // Validates a request's adapters, in order, each file looked at now (see above). Throws std::invalid_argument
  // naming the field as the caller names the list (`field`, `field`[i].name, `field`[i].scale) and the adapter: more
  // than kMaxAdaptersPerRequest, an unknown or unavailable name, a name longer than kMaxAdapterNameBytes (not
  // echoed), a scale that is not finite or beyond +-kMaxAdapterScale, a name given twice.
  std::vector<ResolvedAdapter> resolve(const std::vector<AdapterRequest>& request,
                                       const std::string& field = "adapters") const;

  // Looks at the whole directory again. Throws std::invalid_argument when it cannot be listed (the catalogue stays).
  CatalogueChanges rescan() const;

  // What the file holds now fits the model as an adapter per call (also checked at load: the file may have changed):
  // every update targets a linear layer's weight or bias with the implied shape. Throws std::invalid_argument.
  void check_fits(const std::string& path, const LoraLayout& layout) const;

 private:
  struct State;
  std::optional<AdapterInfo> refresh(const std::string& name) const;

  std::string directory_;
  std::string shown_directory_;  // directory_ made valid UTF-8, for messages and logs
  std::vector<checkpoint::ParamSpec> specs_;
  std::vector<std::string> linear_modules_;  // sorted
  std::unique_ptr<State> state_;             // the entries, behind their own locks
};

class AdapterBank {
 public:
  // Throws std::invalid_argument when max_resident is 0 (a bank that keeps nothing would read every adapter of every
  // call from disk; there is no unbounded bank).
  AdapterBank(std::shared_ptr<const AdapterCatalogue> catalogue, c10::Device device, at::ScalarType compute_dtype,
              size_t max_resident = kDefaultMaxResident);

  // The adapter's tensors on the device (unit scale: ActiveAdapter::scale scales them), from the file whose SHA-256
  // is `sha256` (empty: the one the catalogue lists now). Loads it when it is not resident. Throws
  // std::invalid_argument for an unknown or unavailable name, std::runtime_error naming the adapter when its file is
  // not that one any more or cannot be read.
  std::shared_ptr<const LoraAdapter> acquire(const std::string& name, const std::string& sha256 = "");
  // resolve() then acquire() of each: what TransformerForwardArgs::adapters takes.
  std::vector<ActiveAdapter> activate(const std::vector<AdapterRequest>& request);

  std::vector<std::string> resident() const;  // most recently used first
  int64_t loads() const;                      // adapters read from disk so far
  size_t max_resident() const { return max_resident_; }
  const AdapterCatalogue& catalogue() const { return *catalogue_; }

 private:
  std::shared_ptr<const LoraAdapter> load(const std::string& name, const std::string& sha256) const;
  struct Resident {
    std::string name, sha256;
    std::shared_ptr<const LoraAdapter> adapter;
  };

  std::shared_ptr<const AdapterCatalogue> catalogue_;
  c10::Device device_;
  at::ScalarType dtype_;
  size_t max_resident_;
  mutable std::mutex mutex_;  // guards everything below; held while an adapter loads
  std::list<Resident> lru_;  // front: the most recently used
  int64_t loads_ = 0;
};

}  // namespace skyreels::model
