#include "server/job/generation_params.h"

#include <cmath>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "model/sampler_table.h"
#include "model/step_caches.h"
#include "model/video_shape.h"

namespace skyreels::server {

namespace {

using model::kPixelMultiple;
using model::kVaeTemporalFactor;

[[noreturn]] void invalid(const std::string& message) { throw ValidationError(message); }

// ---- checks -------------------------------------------------------------------------------------------------------

void check_range(const std::string& name, int64_t value, int64_t lo, int64_t hi, const std::string& why) {
  if (value < lo || value > hi) {
    invalid(name + ": " + std::to_string(value) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
            "]" + (why.empty() ? "" : " (" + why + ")"));
  }
}

void check_range(const std::string& name, double value, const DoubleRange& range) {
  if (!std::isfinite(value) || value < range.lo || value > range.hi) {
    std::ostringstream os;
    os << name << ": " << value << " is outside [" << range.lo << ", " << range.hi << "]";
    invalid(os.str());
  }
}

std::string quoted(const ParamValue& value) {
  const std::string text = format_param_value(value);
  return kind_of(value) == ParamKind::kString ? "\"" + text + "\"" : text;
}

void check_allowed(const std::string& name, const ParamValue& value, const std::vector<ParamValue>& allowed) {
  if (allowed.empty()) return;
  std::string list;
  for (const ParamValue& a : allowed) {
    if (a == value) return;
    list += (list.empty() ? "" : ", ") + quoted(a);
  }
  invalid(name + ": " + quoted(value) + " is not supported (supported: " + list + ")");
}

void four_k_plus_one(const std::string& name, const ParamValue& value, const CheckContext&) {
  const int64_t frames = std::get<int64_t>(value);
  if (!model::is_4k_plus_1(frames)) {
    const int64_t below = model::four_k_plus_one_below(frames);
    invalid(name + ": " + std::to_string(frames) + " is not of the form 4k+1 (the VAE packs " +
            std::to_string(kVaeTemporalFactor) + " frames per latent frame after the first); use " +
            std::to_string(below) + " or " + std::to_string(below + kVaeTemporalFactor));
  }
}

void multiple_of_16(const std::string& name, const ParamValue& value, const CheckContext&) {
  const int64_t pixels = std::get<int64_t>(value);
  if (pixels % kPixelMultiple != 0) {
    invalid(name + ": " + std::to_string(pixels) + " is not a multiple of " + std::to_string(kPixelMultiple));
  }
}

// cache: the first-block kinds read the diffusion-forcing loop's rows; taylorseer / magcache run on t2v / i2v and on
// synchronous diffusion forcing (ar_step 0: one noise level per call, one row per step).
// (check_pipeline_params: each value is valid on its own pipeline.)
void cache_fits_pipeline(const ResolvedParams& params) {
  const std::string name = "cache";
  const std::string& cache = params.cache;
  const std::string& pipeline = params.pipeline;
  if (cache.rfind("first-block", 0) == 0 && pipeline != "df") {
    invalid(name + ": \"" + cache + "\" is a diffusion-forcing cache; pipeline " + pipeline +
            " takes \"taylorseer\" or \"magcache\"");
  }
  if ((cache == "taylorseer" || cache == "magcache") && pipeline == "df" && params.ar_step != 0) {
    invalid(name + ": \"" + cache +
            "\" needs ar_step 0 on diffusion forcing (with ar_step > 0 the frames of one call sit at different noise "
            "levels; use \"first-block-per-block\")");
  }
}

// taylorseer_*_modules: comma-separated regular expressions (ECMAScript, as std::regex reads them), 512 characters
// at most. Which modules they match is checked against the model when the job runs.
void module_patterns(const std::string& name, const ParamValue& value, const CheckContext&) {
  const std::string& text = std::get<std::string>(value);
  if (text.size() > 512) invalid(name + ": " + std::to_string(text.size()) + " characters, at most 512");
  for (const std::string& pattern : model::split_module_patterns(text)) {
    try {
      std::regex compiled(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      invalid(name + ": \"" + pattern + "\" is not a regular expression (" + e.what() + ")");
    }
  }
}

void at_most_one_entry_per_step(const std::string& name, const ParamValue& value, const CheckContext& context) {
  if (static_cast<int64_t>(std::get<std::vector<int64_t>>(value).size()) > context.params.num_inference_steps) {
    invalid(name + ": more entries than num_inference_steps");
  }
}

// A timestep list is for a sampler whose row takes one (model/sampler_table.h). The list is checked before
// scheduler.type, so a name without a row is refused here too.
void check_list_sampler(const std::string& name, const std::string& type) {
  const model::SamplerRow* sampler = model::find_sampler(type);
  if (sampler != nullptr && sampler->takes_timestep_list) return;
  const std::string why = sampler ? "; " + sampler->label + " spaces num_inference_steps itself" : "";
  invalid(name + ": a timestep list needs scheduler.type " + model::timestep_list_samplers(model::samplers(), "\"") +
          " (got \"" + type + "\"" + why + ")");
}

// scheduler.timesteps: strictly decreasing, one entry per step. (Its entries' range is the row's; the shifted
// schedule's checks are the sampler's, run by the plan.)
void timestep_list(const std::string& name, const ParamValue& value, const CheckContext& context) {
  const auto& list = std::get<std::vector<int64_t>>(value);
  if (list.empty()) return;
  check_list_sampler(name, context.params.sampler);
  const auto size = static_cast<int64_t>(list.size());
  if (size > context.limits.max_steps) {
    invalid(name + ": " + std::to_string(size) + " entries, more than " + std::to_string(context.limits.max_steps) +
            " (--max-steps)");
  }
  for (size_t i = 1; i < list.size(); ++i) {
    if (list[i] >= list[i - 1]) {
      invalid(name + ": must be strictly decreasing, but entry " + std::to_string(i) + " (" + std::to_string(list[i]) +
              ") follows " + std::to_string(list[i - 1]));
    }
  }
  if (size != context.params.num_inference_steps) {
    invalid(name + ": " + std::to_string(size) + " entries, but num_inference_steps is " +
            std::to_string(context.params.num_inference_steps) + " (leave it unset, or give the list's length)");
  }
}

void check_param(const GenerationParam& param, const ParamValue& value, const CheckContext& context) {
  if (param.range) {
    const int64_t lo = param.range->lo.of(context);
    const int64_t hi = param.range->hi.of(context);
    if (param.kind == ParamKind::kInt) check_range(param.name, std::get<int64_t>(value), lo, hi, param.range->why);
    if (param.kind == ParamKind::kIntList) {
      for (int64_t v : std::get<std::vector<int64_t>>(value)) check_range(param.name, v, lo, hi, param.range->why);
    }
  }
  if (param.real_range) check_range(param.name, std::get<double>(value), *param.real_range);
  check_allowed(param.name, value, param.allowed);
  for (const auto& rule : param.rules) rule(param.name, value, context);
}

// ---- rows ---------------------------------------------------------------------------------------------------------

// scheduler.type's row: the sampler table's names, the first the default, and the flag's words for each.
std::vector<ParamValue> sampler_names() {
  std::vector<ParamValue> names;
  for (const model::SamplerRow& row : model::samplers()) names.emplace_back(row.name);
  return names;
}

std::string sampler_help() {
  std::string help;
  for (const model::SamplerRow& row : model::samplers()) {
    help += (help.empty() ? "" : "; ") + row.name + ": " + row.help;
  }
  return help;
}

IntBound limit(int64_t ServerLimits::*member) {
  return IntBound([member](const CheckContext& c) { return c.limits.*member; });
}

IntBound value_of(int64_t ResolvedParams::*member, int64_t plus = 0) {
  return IntBound([member, plus](const CheckContext& c) { return c.params.*member + plus; });
}

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};

// One row, built from where the parameter lives; the setters read like the table's columns.
class Row {
 public:
  template <typename T, typename Resolved>
  Row(std::string name, std::optional<T> JobRequest::*request, Resolved ResolvedParams::*resolved) {
    p_.name = std::move(name);
    p_.kind = kind_of(ParamValue(T{}));
    p_.requested = [request](const JobRequest& r) -> std::optional<ParamValue> {
      if (!(r.*request)) return std::nullopt;
      return ParamValue(*(r.*request));
    };
    p_.set_requested = [request](JobRequest& r, const ParamValue& v) { r.*request = std::get<T>(v); };
    p_.resolved = [resolved](const ResolvedParams& r) -> std::optional<ParamValue> {
      if constexpr (IsOptional<Resolved>::value) {
        if (!(r.*resolved)) return std::nullopt;
        return ParamValue(*(r.*resolved));
      } else {
        return ParamValue(r.*resolved);
      }
    };
    p_.set_resolved = [resolved](ResolvedParams& r, const ParamValue& v) { r.*resolved = std::get<T>(v); };
  }

  // A list: never unset, empty by default.
  Row(std::string name, std::vector<int64_t> JobRequest::*request, std::vector<int64_t> ResolvedParams::*resolved) {
    using List = std::vector<int64_t>;
    p_.name = std::move(name);
    p_.kind = ParamKind::kIntList;
    p_.default_value = List{};
    p_.requested = [request](const JobRequest& r) -> std::optional<ParamValue> { return ParamValue(r.*request); };
    p_.set_requested = [request](JobRequest& r, const ParamValue& v) { r.*request = std::get<List>(v); };
    p_.resolved = [resolved](const ResolvedParams& r) -> std::optional<ParamValue> { return ParamValue(r.*resolved); };
    p_.set_resolved = [resolved](ResolvedParams& r, const ParamValue& v) { r.*resolved = std::get<List>(v); };
  }

  Row& defaults(ParamValue value) {
    require_kind(value, "default");
    p_.default_rule = DefaultRule::kValue;
    p_.default_value = std::move(value);
    return *this;
  }
  Row& defaults(DefaultRule rule) {
    p_.default_rule = rule;
    return *this;
  }
  Row& within(IntBound lo, IntBound hi, std::string why = "") {
    p_.range = IntRange{std::move(lo), std::move(hi), std::move(why)};
    return *this;
  }
  Row& finite_within(double lo, double hi) {
    p_.real_range = DoubleRange{lo, hi};
    return *this;
  }
  Row& one_of(std::vector<ParamValue> values) {
    for (const ParamValue& v : values) require_kind(v, "allowed value");
    p_.allowed = std::move(values);
    return *this;
  }
  Row& rule(void (*check)(const std::string&, const ParamValue&, const CheckContext&)) {
    p_.rules.emplace_back(check);
    return *this;
  }
  Row& checked_first() {
    p_.checked_first = true;
    return *this;
  }
  Row& diffusion_forcing_only() {
    p_.diffusion_forcing_only = true;
    return *this;
  }
  Row& not_fingerprinted() {
    p_.fingerprinted = false;
    return *this;
  }
  Row& fingerprint_when_set() {
    p_.fingerprint_absent = false;
    return *this;
  }
  Row& flag(std::string flag, std::string help) {
    p_.flag = std::move(flag);
    p_.help = std::move(help);
    return *this;
  }
  operator GenerationParam() const { return p_; }  // NOLINT(google-explicit-constructor)

 private:
  // A default such as "bh2" (const char*) would silently become a bool: refused at start-up.
  void require_kind(const ParamValue& value, const char* what) const {
    if (kind_of(value) != p_.kind) {
      throw std::logic_error("generation parameter " + p_.name + ": " + what + " is a " + kind_name(kind_of(value)) +
                             ", the parameter a " + kind_name(p_.kind));
    }
  }
  GenerationParam p_;
};

// diffusers' SkyReelsV2DiffusionForcingPipeline arguments and the flow UniPC scheduler_config, with diffusers'
// defaults. The order is the fingerprint's (it predates the table): new rows go at the end.
std::vector<GenerationParam> make_table() {
  using R = ResolvedParams;
  using J = JobRequest;
  const IntBound max_frames = limit(&ServerLimits::max_frames);
  return {
#define SKYREELS_TABLE_ROW(member, name, request_type, resolved_type, initial, ...) \
  Row(name, &J::member, &R::member) __VA_ARGS__,
      SKYREELS_GENERATION_PARAMS(SKYREELS_TABLE_ROW)
#undef SKYREELS_TABLE_ROW
  };
}

std::string placeholder(const GenerationParam& param) {
  switch (param.kind) {
    case ParamKind::kInt:
    case ParamKind::kSeed:
      return "N";
    case ParamKind::kDouble:
      return "X";
    case ParamKind::kString: {
      std::string names;
      for (const ParamValue& a : param.allowed) names += (names.empty() ? "" : "|") + format_param_value(a);
      return names.empty() ? "TEXT" : names;
    }
    case ParamKind::kBool:
      return "true|false";
    case ParamKind::kIntList:
      return "I,J,...";
  }
  return "";
}

std::string default_text(const GenerationParam& param) {
  switch (param.default_rule) {
    case DefaultRule::kValue: {
      const std::string text = format_param_value(param.default_value);
      return text.empty() ? "none" : text;
    }
    case DefaultRule::kUnset:
      return "none";
    case DefaultRule::kModelBlockSize:
      return "the model's num_frame_per_block";
    case DefaultRule::kRandomSeed:
      return "random";
    case DefaultRule::kModelPipeline:
      return "the model's: i2v for an I2V checkpoint, else df";
  }
  return "";
}

template <typename T>
T parse_number(const std::string& text, T (*convert)(const std::string&, size_t*), const char* expects) {
  try {
    size_t used = 0;
    const T value = convert(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return value;
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string("expects ") + expects + ", got '" + text + "'");
  }
}

int64_t to_int64(const std::string& text, size_t* used) { return std::stoll(text, used); }
double to_double(const std::string& text, size_t* used) { return std::stod(text, used); }
uint64_t to_uint64(const std::string& text, size_t* used) {
  if (!text.empty() && text.front() == '-') throw std::invalid_argument(text);  // stoull wraps negatives around
  return std::stoull(text, used);
}

}  // namespace

IntBound::IntBound(int64_t value) : of([value](const CheckContext&) { return value; }) {}
IntBound::IntBound(std::function<int64_t(const CheckContext&)> bound) : of(std::move(bound)) {}

ParamKind kind_of(const ParamValue& value) { return static_cast<ParamKind>(value.index()); }

const char* kind_name(ParamKind kind) {
  switch (kind) {
    case ParamKind::kInt:
      return "integer";
    case ParamKind::kDouble:
      return "number";
    case ParamKind::kString:
      return "string";
    case ParamKind::kBool:
      return "bool";
    case ParamKind::kIntList:
      return "integer list";
    case ParamKind::kSeed:
      return "seed";
  }
  return "?";
}

const std::vector<GenerationParam>& generation_params() {
  static const std::vector<GenerationParam> table = make_table();
  return table;
}

const GenerationParam& generation_param(const std::string& name) {
  for (const GenerationParam& p : generation_params()) {
    if (p.name == name) return p;
  }
  throw std::out_of_range("no generation parameter named " + name);
}

ResolvedParams resolve_generation_params(const JobRequest& request, const ResolveContext& context) {
  ResolvedParams out;
  for (const GenerationParam& p : generation_params()) {
    if (const std::optional<ParamValue> value = p.requested(request)) {
      p.set_resolved(out, *value);
      continue;
    }
    switch (p.default_rule) {
      case DefaultRule::kValue:
        p.set_resolved(out, p.default_value);
        break;
      case DefaultRule::kUnset:
        break;
      case DefaultRule::kModelBlockSize:
        if (context.num_frame_per_block) p.set_resolved(out, ParamValue(*context.num_frame_per_block));
        break;
      case DefaultRule::kRandomSeed:
        p.set_resolved(out, ParamValue(context.random_seed));
        break;
      case DefaultRule::kModelPipeline:
        p.set_resolved(out, ParamValue(context.default_pipeline));
        break;
    }
  }
  // An explicit timestep list defines the steps.
  if (!request.num_inference_steps && !out.timesteps.empty()) {
    out.num_inference_steps = static_cast<int64_t>(out.timesteps.size());
  }
  if (!request.guidance_scale && out.pipeline == "i2v") out.guidance_scale = kImageToVideoGuidanceScale;
  return out;
}

void check_pipeline_params(const JobRequest& request, const ResolvedParams& params) {
  cache_fits_pipeline(params);
  if (params.pipeline == "df") return;
  for (const GenerationParam& p : generation_params()) {
    if (p.diffusion_forcing_only && p.requested(request)) {
      throw ValidationError(p.name + ": a diffusion-forcing parameter; pipeline " + params.pipeline +
                            " does not take it (leave it unset, or use pipeline df)");
    }
  }
}

void validate_generation_params(const ResolvedParams& params, const ServerLimits& limits) {
  const CheckContext context{limits, params};
  for (const bool first : {true, false}) {
    for (const GenerationParam& p : generation_params()) {
      if (p.checked_first != first) continue;
      if (const std::optional<ParamValue> value = p.resolved(params)) check_param(p, *value, context);
    }
  }
}

void fingerprint_generation_params(const JobRequest& request,
                                   const std::function<void(const void* data, size_t size)>& bytes) {
  auto add = [&](const auto& v) { bytes(&v, sizeof v); };
  for (const GenerationParam& p : generation_params()) {
    if (!p.fingerprinted) continue;
    const std::optional<ParamValue> value = p.requested(request);
    if (p.kind == ParamKind::kIntList) {  // a list has no presence: its size, then its entries
      const auto& list = std::get<std::vector<int64_t>>(*value);
      if (list.empty() && !p.fingerprint_absent) continue;  // a newer list, empty: the fingerprint older jobs had
      add(static_cast<uint64_t>(list.size()));
      for (int64_t v : list) add(v);
      continue;
    }
    if (!value && !p.fingerprint_absent) continue;  // a newer parameter, unset: the fingerprint older jobs had
    add(static_cast<uint8_t>(value.has_value()));
    if (!value) continue;
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string>) {
            add(static_cast<uint64_t>(v.size()));
            bytes(v.data(), v.size());
          } else if constexpr (std::is_arithmetic_v<T>) {
            add(v);
          }
        },
        *value);
  }
}

ParamValue parse_param_value(const GenerationParam& param, const std::string& text) {
  switch (param.kind) {
    case ParamKind::kInt:
      return parse_number<int64_t>(text, to_int64, "an integer");
    case ParamKind::kDouble:
      return parse_number<double>(text, to_double, "a number");
    case ParamKind::kString:
      return text;
    case ParamKind::kBool:
      if (text == "true" || text == "false") return text == "true";
      throw std::invalid_argument("expects true or false, got '" + text + "'");
    case ParamKind::kIntList: {
      std::vector<int64_t> list;
      std::stringstream items(text);
      for (std::string item; std::getline(items, item, ',');) {
        list.push_back(parse_number<int64_t>(item, to_int64, "comma-separated integers"));
      }
      return list;
    }
    case ParamKind::kSeed:
      return parse_number<uint64_t>(text, to_uint64, "a non-negative integer");
  }
  throw std::logic_error("unknown parameter kind");
}

std::string format_param_value(const ParamValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          std::string text;
          for (int64_t i : v) text += (text.empty() ? "" : ",") + std::to_string(i);
          return text;
        } else {
          std::ostringstream os;
          os << v;
          // A number flag's default reads as a number: 6.0, not 6.
          if (std::is_same_v<T, double> && os.str().find_first_of(".en") == std::string::npos) os << ".0";
          return os.str();
        }
      },
      value);
}

std::string generation_flags_help() {
  std::string help;
  for (const GenerationParam& p : generation_params()) {
    std::string left = "  --" + p.flag + " " + placeholder(p);
    if (left.size() < 32) left.resize(32, ' ');
    help += left + " " + p.help + " (default " + default_text(p) + ")\n";
  }
  return help;
}

}  // namespace skyreels::server
