#include "server/job/generation_params_proto.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <stdexcept>
#include <type_traits>

#include "model/adapter_limits.h"

namespace skyreels::server {

namespace {

namespace pb = google::protobuf;
using Cpp = pb::FieldDescriptor::CppType;

Cpp cpp_type_of(ParamKind kind) {
  switch (kind) {
    case ParamKind::kInt:
    case ParamKind::kIntList:
      return pb::FieldDescriptor::CPPTYPE_INT64;
    case ParamKind::kDouble:
      return pb::FieldDescriptor::CPPTYPE_DOUBLE;
    case ParamKind::kString:
      return pb::FieldDescriptor::CPPTYPE_STRING;
    case ParamKind::kBool:
      return pb::FieldDescriptor::CPPTYPE_BOOL;
    case ParamKind::kSeed:
      return pb::FieldDescriptor::CPPTYPE_UINT64;
  }
  throw std::logic_error("unknown parameter kind");
}

// "scheduler.solver_type" -> {"scheduler", "solver_type"}.
std::vector<std::string> path_of(const std::string& name) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', begin)) {
    parts.push_back(name.substr(begin, dot - begin));
    begin = dot + 1;
  }
  parts.push_back(name.substr(begin));
  return parts;
}

// The fields from GenerationParams down to the row's field: the messages on the way, then the field itself.
std::vector<const pb::FieldDescriptor*> field_path(const GenerationParam& param) {
  auto fail = [&](const std::string& why) {
    return std::logic_error("generation parameter " + param.name + ": " + why + " in skyreels.v1.GenerationParams");
  };
  std::vector<const pb::FieldDescriptor*> fields;
  const pb::Descriptor* message = v1::GenerationParams::descriptor();
  for (const std::string& part : path_of(param.name)) {
    if (!message) throw fail(fields.back()->name() + " is not a message");
    const pb::FieldDescriptor* field = message->FindFieldByName(part);
    if (!field) throw fail("no field " + part);
    fields.push_back(field);
    message = field->message_type();
  }
  const pb::FieldDescriptor* field = fields.back();
  const bool list = param.kind == ParamKind::kIntList;
  if (field->cpp_type() != cpp_type_of(param.kind) || field->is_repeated() != list ||
      (!list && !field->has_presence())) {
    throw fail(std::string("not an ") + (list ? "repeated " : "optional ") + field->cpp_type_name() +
               " field of kind " + kind_name(param.kind));
  }
  return fields;
}

// Every row's path, looked up once.
const std::vector<std::vector<const pb::FieldDescriptor*>>& field_paths() {
  static const auto paths = [] {
    std::vector<std::vector<const pb::FieldDescriptor*>> out;
    for (const GenerationParam& p : generation_params()) out.push_back(field_path(p));
    return out;
  }();
  return paths;
}

std::optional<ParamValue> read(const pb::Message& root, const std::vector<const pb::FieldDescriptor*>& path) {
  const pb::Message* message = &root;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    if (!message->GetReflection()->HasField(*message, path[i])) return std::nullopt;
    message = &message->GetReflection()->GetMessage(*message, path[i]);
  }
  const pb::FieldDescriptor* field = path.back();
  const pb::Reflection& r = *message->GetReflection();
  if (field->is_repeated()) {
    std::vector<int64_t> list;
    for (int i = 0; i < r.FieldSize(*message, field); ++i) list.push_back(r.GetRepeatedInt64(*message, field, i));
    return list;
  }
  if (!r.HasField(*message, field)) return std::nullopt;
  switch (field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return ParamValue(r.GetInt64(*message, field));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return ParamValue(r.GetDouble(*message, field));
    case pb::FieldDescriptor::CPPTYPE_STRING:
      return ParamValue(r.GetString(*message, field));
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return ParamValue(r.GetBool(*message, field));
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return ParamValue(r.GetUInt64(*message, field));
    default:
      throw std::logic_error("unmapped field type of " + field->full_name());
  }
}

void write(pb::Message& root, const std::vector<const pb::FieldDescriptor*>& path, const ParamValue& value) {
  pb::Message* message = &root;
  for (size_t i = 0; i + 1 < path.size(); ++i) message = message->GetReflection()->MutableMessage(message, path[i]);
  const pb::FieldDescriptor* field = path.back();
  const pb::Reflection& r = *message->GetReflection();
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          r.SetInt64(message, field, v);
        } else if constexpr (std::is_same_v<T, double>) {
          r.SetDouble(message, field, v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          r.SetString(message, field, v);
        } else if constexpr (std::is_same_v<T, bool>) {
          r.SetBool(message, field, v);
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          r.SetUInt64(message, field, v);
        } else {
          r.ClearField(message, field);
          for (int64_t entry : v) r.AddInt64(message, field, entry);
        }
      },
      value);
}

}  // namespace

const pb::FieldDescriptor& proto_field(const GenerationParam& param) { return *field_path(param).back(); }

// GenerationParams.loras: a list of records beside the table's rows. Its bounds are checked here, before anything
// is copied (a 64 MB message could carry millions of entries); the catalogue checks the rest when the job is made.
std::vector<AdapterChoice> adapters_from_proto(const v1::GenerationParams& proto) {
  const auto count = static_cast<size_t>(proto.loras_size());
  if (std::string why = model::adapter_count_problem(count, "loras"); !why.empty()) throw ValidationError(why);
  std::vector<AdapterChoice> adapters;
  for (size_t i = 0; i < count; ++i) {
    const v1::AdapterRef& ref = proto.loras(static_cast<int>(i));
    const std::string field = "loras[" + std::to_string(i) + "].name";
    if (std::string why = model::adapter_name_problem(ref.name().size(), field); !why.empty()) {
      throw ValidationError(why);
    }
    adapters.push_back({ref.name(), ref.has_scale() ? std::optional<double>(ref.scale()) : std::nullopt, ref.sha256()});
  }
  return adapters;
}

void adapters_to_proto(const std::vector<AdapterChoice>& adapters, v1::GenerationParams* proto) {
  proto->clear_loras();
  for (const AdapterChoice& a : adapters) {
    v1::AdapterRef* ref = proto->add_loras();
    ref->set_name(a.name);
    if (a.scale) ref->set_scale(*a.scale);
    ref->set_sha256(a.sha256);
  }
}

void request_params_from_proto(const v1::GenerationParams& proto, JobRequest& request) {
  const auto& params = generation_params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (const std::optional<ParamValue> value = read(proto, field_paths()[i])) params[i].set_requested(request, *value);
  }
  request.loras = adapters_from_proto(proto);
}

void request_params_to_proto(const JobRequest& request, v1::GenerationParams* proto) {
  const auto& params = generation_params();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::optional<ParamValue> value = params[i].requested(request);
    const bool empty_list =
        value && params[i].kind == ParamKind::kIntList && std::get<std::vector<int64_t>>(*value).empty();
    if (value && !empty_list) write(*proto, field_paths()[i], *value);  // no empty scheduler message for nothing
  }
  adapters_to_proto(request.loras, proto);
}

void resolved_params_to_proto(const ResolvedParams& resolved, v1::GenerationParams* proto) {
  const auto& params = generation_params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (const std::optional<ParamValue> value = params[i].resolved(resolved)) write(*proto, field_paths()[i], *value);
  }
  adapters_to_proto(resolved.loras, proto);
}

}  // namespace skyreels::server
