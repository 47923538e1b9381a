#include "server/job/durable_request.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <stdexcept>
#include <utility>

#include "server/job/generation_params_proto.h"

namespace skyreels::server {

namespace pb = ::skyreels::v1;

namespace {

std::optional<RawTensor> raw_tensor(const pb::Tensor& t, bool present) {
  if (!present) return std::nullopt;
  RawTensor raw;
  switch (t.dtype()) {
    case pb::DTYPE_FLOAT32:
      raw.dtype = "F32";
      break;
    case pb::DTYPE_BFLOAT16:
      raw.dtype = "BF16";
      break;
    case pb::DTYPE_FLOAT16:
      raw.dtype = "F16";
      break;
    default:
      raw.dtype = "";
      break;
  }
  raw.shape.assign(t.shape().begin(), t.shape().end());
  raw.data = t.data();
  return raw;
}

std::optional<PixelRequest> pixel_request(const pb::PixelInput& input, bool present) {
  if (!present) return std::nullopt;
  PixelRequest r;
  if (input.source_case() == pb::PixelInput::kEncoded) r.encoded = input.encoded();
  if (input.source_case() == pb::PixelInput::kTensor) r.tensor = raw_tensor(input.tensor(), true);
  return r;
}

// Image / video conditioning and prompt changes (image-to-video, video extension, a prompt per chunk).
void conditioning_from_proto(const pb::JobSpec& spec, JobRequest& r) {
  r.image = pixel_request(spec.image(), spec.has_image());
  r.last_image = pixel_request(spec.last_image(), spec.has_last_image());
  r.video = pixel_request(spec.video(), spec.has_video());
  for (const pb::PromptChange& c : spec.prompt_changes()) {
    PromptChangeRequest change;
    change.from_frame = c.from_frame();
    if (c.prompt_case() == pb::PromptChange::kText) change.text = c.text();
    if (c.prompt_case() == pb::PromptChange::kEmbeddings) {
      change.prompt_embeds = raw_tensor(c.embeddings().prompt_embeds(), c.embeddings().has_prompt_embeds());
      change.negative_prompt_embeds =
          raw_tensor(c.embeddings().negative_prompt_embeds(), c.embeddings().has_negative_prompt_embeds());
    }
    r.prompt_changes.push_back(std::move(change));
  }
}

void f32_to_proto(const RawTensor& raw, pb::Tensor* out) {
  out->set_dtype(pb::DTYPE_FLOAT32);
  for (int64_t d : raw.shape) out->add_shape(d);
  out->set_data(raw.data);
}

// Text in a stored request is replaced by the embeddings it was encoded to at submit (setting the embeddings clears
// the text: they are one oneof), so that a resume never encodes text, nor needs a text encoder.
void text_to_embeddings(const ResolvedInputs& resolved, pb::JobSpec& spec) {
  if (spec.conditioning_case() == pb::JobSpec::kText) {
    spec.set_prompt_text(spec.text().prompt());
    pb::PromptEmbeddings embeddings;
    f32_to_proto(resolved.prompt_embeddings(false), embeddings.mutable_prompt_embeds());
    const RawTensor negative = resolved.prompt_embeddings(true);
    if (!negative.shape.empty()) f32_to_proto(negative, embeddings.mutable_negative_prompt_embeds());
    *spec.mutable_embeddings() = std::move(embeddings);
  }
  for (int i = 0; i < spec.prompt_changes_size(); ++i) {
    pb::PromptChange& change = *spec.mutable_prompt_changes(i);
    if (change.prompt_case() != pb::PromptChange::kText) continue;
    // No negative embeddings: a change given as text takes the job's negative prompt, which is stored above.
    f32_to_proto(resolved.prompt_change_embeddings(static_cast<size_t>(i)),
                 change.mutable_embeddings()->mutable_prompt_embeds());
  }
}

}  // namespace

JobRequest request_from_proto(const pb::JobSpec& spec) {
  JobRequest r;
  switch (spec.conditioning_case()) {
    case pb::JobSpec::kEmbeddings:
      r.prompt_embeds = raw_tensor(spec.embeddings().prompt_embeds(), spec.embeddings().has_prompt_embeds());
      r.negative_prompt_embeds =
          raw_tensor(spec.embeddings().negative_prompt_embeds(), spec.embeddings().has_negative_prompt_embeds());
      if (!r.prompt_embeds) throw ValidationError("embeddings.prompt_embeds: required");
      break;
    case pb::JobSpec::kEmbeddingsSafetensors:
      r.embeddings_safetensors = spec.embeddings_safetensors();
      break;
    case pb::JobSpec::kText:
      r.prompt = spec.text().prompt();
      r.negative_prompt = spec.text().negative_prompt();
      break;
    case pb::JobSpec::CONDITIONING_NOT_SET:
      break;
  }
  r.described_prompt = spec.prompt_text();
  request_params_from_proto(spec.params(), r);
  conditioning_from_proto(spec, r);
  return r;
}

std::string durable_request(const pb::SubmitJobRequest& request, const ResolvedInputs& resolved) {
  pb::SubmitJobRequest kept;
  *kept.mutable_spec() = request.spec();
  kept.set_priority(request.priority());
  kept.set_produce_mp4(request.produce_mp4());
  *kept.mutable_webhook() = request.webhook();
  pb::JobSpec& spec = *kept.mutable_spec();
  spec.mutable_params()->set_seed(resolved.params.seed);
  // The adapters' files as accepted: a resume whose file changed fails naming it (never another video).
  const auto& adapters = resolved.params.loras;
  for (int i = 0; i < spec.params().loras_size() && i < static_cast<int>(adapters.size()); ++i) {
    spec.mutable_params()->mutable_loras(i)->set_sha256(adapters[static_cast<size_t>(i)].sha256);
  }
  text_to_embeddings(resolved, spec);
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    kept.SerializeToCodedStream(&coded);
  }
  return bytes;
}

pb::SubmitJobRequest parse_durable_request(const std::string& bytes) {
  pb::SubmitJobRequest request;
  if (!request.ParseFromString(bytes)) throw std::runtime_error("the stored request is unreadable");
  return request;
}

}  // namespace skyreels::server
