// The key names of transformer checkpoints: the ordered rename tables between the original SkyReels-V2/Wan names and
// the internal (diffusers) ones, both directions, and the detection of a checkpoint's layout from its keys. Separate
// from the loader because it is pure string mapping: no tensors, no files.
#include <string>
#include <vector>

#include "model/transformer_loader.h"
#include "model/transformer_loader_detail.h"

namespace skyreels::model {

using checkpoint::CheckpointError;
using checkpoint::RenameRule;
using loader_detail::contains;
using loader_detail::kPrefix;
using loader_detail::starts_with;

namespace loader_detail {

// ---- rename tables -----------------------------------------------------------------------------------------------
// Ordered substring rules, as diffusers' scripts/convert_skyreelsv2_to_diffusers.py applies them. Every `from` carries
// its dots so that e.g. "ffn.0." cannot match inside another name. Order matters where noted.

const std::vector<RenameRule>& original_rules() {
  static const std::vector<RenameRule> rules = {
      {kPrefix, ""},
      {"text_embedding.0.", "condition_embedder.text_embedder.linear_1."},
      {"text_embedding.2.", "condition_embedder.text_embedder.linear_2."},
      {"time_embedding.0.", "condition_embedder.time_embedder.linear_1."},
      {"time_embedding.2.", "condition_embedder.time_embedder.linear_2."},
      {"time_projection.1.", "condition_embedder.time_proj."},
      {"fps_projection.0.", "fps_projection.net.0.proj."},
      {"fps_projection.2.", "fps_projection.net.2."},
      {"head.modulation", "scale_shift_table"},  // before the per-block rule: the head table is top-level
      {"head.head.", "proj_out."},
      {".modulation", ".scale_shift_table"},
      {"self_attn.q.", "attn1.to_q."},
      {"self_attn.k.", "attn1.to_k."},
      {"self_attn.v.", "attn1.to_v."},
      {"self_attn.o.", "attn1.to_out.0."},
      {"self_attn.norm_q.", "attn1.norm_q."},
      {"self_attn.norm_k.", "attn1.norm_k."},
      {"cross_attn.q.", "attn2.to_q."},
      {"cross_attn.k.", "attn2.to_k."},
      {"cross_attn.v.", "attn2.to_v."},
      {"cross_attn.o.", "attn2.to_out.0."},
      {"cross_attn.norm_q.", "attn2.norm_q."},
      {"cross_attn.norm_k.", "attn2.norm_k."},
      {"cross_attn.k_img.", "attn2.add_k_proj."},  // I2V: the image tokens' key / value projections and key norm
      {"cross_attn.v_img.", "attn2.add_v_proj."},
      {"cross_attn.norm_k_img.", "attn2.norm_added_k."},
      {".ffn.0.", ".ffn.net.0.proj."},
      {".ffn.2.", ".ffn.net.2."},
      // The cross-attention LayerNorm is norm3 in the original and norm2 in diffusers (only it has parameters).
      {".norm2.", ".norm__placeholder."},
      {".norm3.", ".norm2."},
      {".norm__placeholder.", ".norm3."},
      // After the swap, so that image_embedder.norm2 is not swapped. Wan's MLPProj: LayerNorm, Linear, GELU, Linear,
      // LayerNorm (proj.2 is the GELU), and the first-last-frame position embedding.
      {"img_emb.proj.0.", "condition_embedder.image_embedder.norm1."},
      {"img_emb.proj.1.", "condition_embedder.image_embedder.ff.net.0.proj."},
      {"img_emb.proj.3.", "condition_embedder.image_embedder.ff.net.2."},
      {"img_emb.proj.4.", "condition_embedder.image_embedder.norm2."},
      {"img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"},
  };
  return rules;
}

}  // namespace loader_detail

using loader_detail::original_rules;

namespace {

// internal -> original: original_rules() mirrored (each rule swapped, in reverse order; the prefix rule becomes an
// empty `from`, which apply_rules ignores). Tested to invert the forward table on every parameter.
const std::vector<RenameRule>& original_reverse_rules() {
  static const std::vector<RenameRule> rules = [] {
    std::vector<RenameRule> out;
    const auto& forward = original_rules();
    for (auto it = forward.rbegin(); it != forward.rend(); ++it) out.push_back({it->to, it->from});
    return out;
  }();
  return rules;
}

// diffusers and the PR #11850 layout already use the internal names; the norm_out.linear pair is folded afterwards
// (fold_norm_out_linear), a value transform that no rename can express.
const std::vector<RenameRule>& prefix_only_rules() {
  static const std::vector<RenameRule> rules = {{kPrefix, ""}};
  return rules;
}

// ---- layout detection --------------------------------------------------------------------------------------------

bool is_original_key(const std::string& k) {
  static const char* const starts[] = {"head.",    "text_embedding.",   "time_embedding.",  "time_projection.",
                                       "img_emb.", "fps_projection.0.", "fps_projection.2."};
  for (const char* s : starts) {
    if (starts_with(k, s)) return true;
  }
  return contains(k, ".self_attn.") || contains(k, ".cross_attn.") || contains(k, ".ffn.0.") ||
         contains(k, ".ffn.2.") || (starts_with(k, "blocks.") && contains(k, ".modulation"));
}

bool is_diffusers_key(const std::string& k) {
  static const char* const starts[] = {"condition_embedder.", "proj_out.", "scale_shift_table", "fps_projection.net.",
                                       "norm_out."};
  for (const char* s : starts) {
    if (starts_with(k, s)) return true;
  }
  return contains(k, ".attn1.") || contains(k, ".attn2.") || contains(k, ".ffn.net.") ||
         contains(k, ".scale_shift_table");
}

std::string strip_prefix(const std::string& key) { return starts_with(key, kPrefix) ? key.substr(22) : key; }

}  // namespace

// ---- public ------------------------------------------------------------------------------------------------------

const char* layout_name(TransformerLayout layout) {
  switch (layout) {
    case TransformerLayout::Diffusers:
      return "diffusers";
    case TransformerLayout::Original:
      return "original";
    case TransformerLayout::NormOutLinear:
      return "norm_out_linear";
  }
  return "?";
}

TransformerLayout detect_transformer_layout(const std::vector<std::string>& keys) {
  std::string original_example, diffusers_example;
  bool norm_out_linear = false;
  for (const auto& raw : keys) {
    const std::string k = strip_prefix(raw);
    if (original_example.empty() && is_original_key(k)) original_example = raw;
    if (diffusers_example.empty() && is_diffusers_key(k)) diffusers_example = raw;
    if (starts_with(k, "norm_out.linear.")) norm_out_linear = true;
  }
  if (!original_example.empty() && !diffusers_example.empty()) {
    throw CheckpointError("checkpoint mixes original SkyReels-V2/Wan key names ('" + original_example +
                          "') with diffusers names ('" + diffusers_example + "'); it is neither layout");
  }
  if (!original_example.empty()) return TransformerLayout::Original;
  if (norm_out_linear) return TransformerLayout::NormOutLinear;
  if (!diffusers_example.empty()) return TransformerLayout::Diffusers;
  std::string seen;
  for (size_t i = 0; i < keys.size() && i < 3; ++i) seen += (i ? ", '" : "'") + keys[i] + "'";
  throw CheckpointError("no SkyReels-V2 transformer keys found (" + std::to_string(keys.size()) + " tensors" +
                        (seen.empty() ? "" : ", e.g. " + seen) + "); is this a VAE or text-encoder checkpoint?");
}

const std::vector<RenameRule>& transformer_rename_rules(TransformerLayout layout) {
  return layout == TransformerLayout::Original ? original_rules() : prefix_only_rules();
}

std::string transformer_checkpoint_key(TransformerLayout layout, const std::string& internal) {
  switch (layout) {
    case TransformerLayout::Original:
      return checkpoint::apply_rules(internal, original_reverse_rules());
    case TransformerLayout::NormOutLinear:
      return internal == "scale_shift_table" ? "norm_out.linear.bias" : internal;
    case TransformerLayout::Diffusers:
      break;
  }
  return internal;
}

}  // namespace skyreels::model
