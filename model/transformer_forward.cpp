// The SkyReels-V2 transformer's forward: input checks, the layers of a block (self-attention with kept keys /
// values, block-sparse attention, cross-attention with the image tokens, the feed-forward, the modulated block), the
// head, the exact savings' and FirstBlockCache's checks and decisions, and forward() itself. Separate from the
// construction (transformer_skyreels_v2.cpp) and from the cache per causal block (transformer_block_cache.cpp): this
// is what every call runs.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/rank_group.h"
#include "model/transformer_impl.h"

namespace skyreels::model {

// ---- Ulysses: the exchanges around self-attention -----------------------------------------------------------

namespace {

// This rank's tokens of every head [B, local, D] -> every token of this rank's heads [B, heads / ranks, tokens, Dh]
// (contiguous): slice j of the heads goes to rank j, and the ranks' token shares come back in order.
Tensor all_tokens_of_my_heads(const Tensor& x, const Geometry& g, int64_t heads) {
  RankGroup& ranks = *g.ranks;
  const int64_t u = ranks.size(), b = x.size(0), local = x.size(1), per_rank = x.size(2) / u;
  const Tensor got = ranks.all_to_all(x.view({b, local, u, per_rank}).permute({2, 0, 1, 3}));
  return got.permute({1, 0, 2, 3})
      .reshape({b, u * local, heads / u, per_rank / (heads / u)})
      .narrow(1, 0, g.tokens)
      .transpose(1, 2)
      .contiguous();
}

// The inverse: attention's output for every token of this rank's heads [B, tokens, heads / ranks, Dh] -> this rank's
// tokens of every head [B, local, D].
Tensor my_tokens_of_all_heads(const Tensor& o, const Geometry& g) {
  RankGroup& ranks = *g.ranks;
  const int64_t u = ranks.size(), b = o.size(0), local = g.local_tokens, per_rank = o.size(2) * o.size(3);
  Tensor padded = o.reshape({b, g.tokens, per_rank});  // a view of attention's contiguous output
  if (g.tokens != u * local) {  // the padding rows go back to the ranks that hold them
    padded = at::zeros({b, u * local, per_rank}, o.options());
    padded.narrow(1, 0, g.tokens).copy_(o.reshape({b, g.tokens, per_rank}));
  }
  const Tensor got = ranks.all_to_all(padded.view({b, u, local, per_rank}).permute({1, 0, 2, 3}));
  return got.permute({1, 2, 0, 3}).reshape({b, local, u * per_rank});
}

}  // namespace

// ---- forward --------------------------------------------------------------------------------------------------

Geometry SkyReelsV2Transformer::Impl::check_inputs(const TransformerForwardArgs& a) const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  const auto& c = config;
  const Tensor& x = a.hidden_states;
  require(x.defined() && x.dim() == 5, "hidden_states: expected [B, in_channels, F, H, W]" +
                                           (x.defined() ? ", got " + checkpoint::shape_str(x.sizes().vec()) : ""));
  require(at::isFloatingType(x.scalar_type()), "hidden_states: expected a floating-point tensor");
  require(x.size(1) == c.in_channels, "hidden_states: expected in_channels=" + std::to_string(c.in_channels) +
                                          " channels, got " + std::to_string(x.size(1)));
  Geometry g;
  g.batch = x.size(0);
  g.frames = x.size(2);
  g.height = x.size(3);
  g.width = x.size(4);
  const char* axis[] = {"frames", "height", "width"};
  const int64_t extent[] = {g.frames, g.height, g.width};
  for (int i = 0; i < 3; ++i) {
    require(extent[i] > 0 && extent[i] % c.patch_size[i] == 0,
            std::string("hidden_states: ") + axis[i] + " " + std::to_string(extent[i]) +
                " must be a positive multiple of patch_size[" + std::to_string(i) +
                "]=" + std::to_string(c.patch_size[i]));
    require(extent[i] / c.patch_size[i] <= c.rope_max_seq_len,
            std::string("hidden_states: ") + axis[i] + " " + std::to_string(extent[i]) +
                " exceeds the RoPE table (rope_max_seq_len=" + std::to_string(c.rope_max_seq_len) + " patches)");
  }
  require(g.batch > 0, "hidden_states: batch must be >= 1");
  g.ppf = g.frames / c.patch_size[0];
  g.pph = g.height / c.patch_size[1];
  g.ppw = g.width / c.patch_size[2];
  g.tokens_per_frame = g.pph * g.ppw;
  g.tokens = g.ppf * g.tokens_per_frame;
  g.dim = c.inner_dim();

  const Tensor& t = a.timestep;
  require(t.defined() && (t.dim() == 1 || t.dim() == 2) && t.size(0) == g.batch && (t.dim() == 1 || t.size(1) == g.ppf),
          "timestep: expected [B] or [B, F] with B=" + std::to_string(g.batch) + ", F=" + std::to_string(g.ppf) +
              (t.defined() ? ", got " + checkpoint::shape_str(t.sizes().vec()) : ""));
  require(t.scalar_type() != at::kBool, "timestep: expected integer or floating-point values");

  const Tensor& e = a.encoder_hidden_states;
  require(e.defined() && e.dim() == 3 && e.size(0) == g.batch && e.size(1) >= 1 && e.size(2) == c.text_dim,
          "encoder_hidden_states: expected [B, T, text_dim] with B=" + std::to_string(g.batch) + ", text_dim=" +
              std::to_string(c.text_dim) + (e.defined() ? ", got " + checkpoint::shape_str(e.sizes().vec()) : ""));
  require(at::isFloatingType(e.scalar_type()), "encoder_hidden_states: expected a floating-point tensor");

  const Tensor& img = a.encoder_hidden_states_image;
  if (c.image_dim) {
    const int64_t tokens = c.pos_embed_seq_len.value_or(0);
    require(img.defined() && img.dim() == 3 && img.size(0) == g.batch && img.size(1) >= 1 &&
                img.size(2) == *c.image_dim && (tokens == 0 || img.size(1) == tokens),
            "encoder_hidden_states_image: this image-to-video model needs image tokens [B, N, image_dim] with B=" +
                std::to_string(g.batch) + ", image_dim=" + std::to_string(*c.image_dim) +
                (tokens ? ", N=" + std::to_string(tokens) + " (pos_embed_seq_len: the first and the last image)"
                        : std::string()) +
                (img.defined() ? ", got " + checkpoint::shape_str(img.sizes().vec()) : ", got none"));
    require(at::isFloatingType(img.scalar_type()), "encoder_hidden_states_image: expected a floating-point tensor");
  } else {
    require(!img.defined(),
            "encoder_hidden_states_image: this model has no image branch (image_dim is unset); "
            "image tokens need an image-to-video checkpoint");
  }

  if (c.inject_sample_info) {
    require(a.fps.has_value() && a.fps->defined(),
            "fps: this model has an fps embedding (inject_sample_info); pass fps [B] with 0 for 16 fps, else 1");
    const Tensor& f = *a.fps;
    require(f.dim() == 1 && f.size(0) == g.batch && at::isIntegralType(f.scalar_type(), false),
            "fps: expected an integer tensor [B] with B=" + std::to_string(g.batch));
    require(f.min().item<int64_t>() >= 0 && f.max().item<int64_t>() <= 1,
            "fps: values must be 0 (16 fps) or 1 (any other rate)");
  }
  // (fps given to a model without the embedding is ignored, as diffusers does: pipelines always pass it.)

  require(a.num_frame_per_block >= 1, "num_frame_per_block: must be >= 1");
  require(g.ppf % a.num_frame_per_block == 0,
          "num_frame_per_block: " + std::to_string(g.ppf) + " latent frames are not a multiple of " +
              std::to_string(a.num_frame_per_block) + " (the block-causal mask needs whole blocks)");
  return g;
}

Tensor SkyReelsV2Transformer::Impl::self_attention(const AttentionWeights& a, const Tensor& n, const RopeTables& rope,
                                                   const Geometry& g, int64_t causal_block_tokens,
                                                   const KvSlot* kv, const BlockSparseAttention* sparse) const {
  if (sparse != nullptr) return block_sparse_attention(a, n, rope, g, causal_block_tokens, *sparse);
  // Heads made contiguous: oneDNN's bf16 GEMM is several times slower on row-strided operands. Split across
  // Ulysses ranks, the projections, norms and RoPE run on this rank's tokens and attention on its heads.
  const int64_t heads = config.num_attention_heads;
  Tensor q = apply_rope(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), rope, heads);
  Tensor k = apply_rope(rms_norm_across_heads(a.to_k(n), a.norm_k, config.eps), rope, heads);
  Tensor v = a.to_v(n);
  if (g.ranks != nullptr) {
    q = all_tokens_of_my_heads(q, g, heads);
    k = all_tokens_of_my_heads(k, g, heads);
    v = all_tokens_of_my_heads(v, g, heads);
  } else {
    q = split_heads(q, heads).contiguous();
    k = split_heads(k, heads).contiguous();
    v = split_heads(v, heads).contiguous();
  }
  int64_t offset = 0;
  if (kv != nullptr) {
    offset = kv->reuse_tokens;
    if (offset > 0) {  // the kept frames' keys first, as they stand in the full call
      k = at::cat({kv->k->narrow(2, 0, offset), k}, 2);
      v = at::cat({kv->v->narrow(2, 0, offset), v}, 2);
    }
    if (kv->keep_tokens > (kv->k->defined() ? kv->k->size(2) : 0)) {
      *kv->k = k.narrow(2, 0, kv->keep_tokens).clone(at::MemoryFormat::Contiguous);
      *kv->v = v.narrow(2, 0, kv->keep_tokens).clone(at::MemoryFormat::Contiguous);
    }
  }
  const Tensor o = detail::attention(q, k, v, causal_block_tokens, chunk_bytes, offset);
  return a.to_out(g.ranks != nullptr ? my_tokens_of_all_heads(o, g) : o.view(g.flat()));
}

Tensor SkyReelsV2Transformer::Impl::block_sparse_attention(const AttentionWeights& a, const Tensor& n,
                                                           const RopeTables& rope, const Geometry& g,
                                                           int64_t causal_block_tokens,
                                                           const BlockSparseAttention& sparse) const {
  // n: the computed blocks' tokens in order; rope: their rows of the call's tables.
  const int64_t heads = config.num_attention_heads, bt = sparse.block_tokens;
  const Tensor q = split_heads(apply_rope(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), rope, heads), heads)
                       .contiguous();
  const Tensor k_pre = rms_norm_across_heads(a.to_k(n), a.norm_k, config.eps);
  const Tensor v_new = a.to_v(n);
  const Tensor k_new = apply_rope(k_pre.clone(), rope, heads);  // apply_rope consumes its input: k_pre is kept
  const size_t nc = sparse.computed.size();
  sparse.fresh_k->assign(nc, Tensor());
  sparse.fresh_v->assign(nc, Tensor());
  for (size_t i = 0; i < nc; ++i) {
    const int64_t at = static_cast<int64_t>(i) * bt;
    (*sparse.fresh_k)[i] = k_pre.narrow(1, at, bt).clone(at::MemoryFormat::Contiguous);
    (*sparse.fresh_v)[i] = v_new.narrow(1, at, bt).clone(at::MemoryFormat::Contiguous);
  }
  // Keys / values of the call's blocks up to the last computed one, each at its place.
  const int64_t key_blocks = sparse.computed.back() + 1;
  Tensor k_all = at::empty({g.batch, key_blocks * bt, g.dim}, k_new.options());
  Tensor v_all = at::empty({g.batch, key_blocks * bt, g.dim}, v_new.options());
  for (size_t i = 0; i < nc; ++i) {
    const int64_t block = sparse.computed[i], from = static_cast<int64_t>(i) * bt;
    k_all.narrow(1, block * bt, bt).copy_(k_new.narrow(1, from, bt));
    v_all.narrow(1, block * bt, bt).copy_(v_new.narrow(1, from, bt));
  }
  for (size_t i = 0; i < sparse.stale.size(); ++i) {
    const int64_t block = sparse.stale[i];
    if (block >= key_blocks) break;  // after every computed block: nothing attends to it
    k_all.narrow(1, block * bt, bt).copy_(apply_rope(sparse.stale_k[i]->clone(), sparse.stale_rope[i], heads));
    v_all.narrow(1, block * bt, bt).copy_(*sparse.stale_v[i]);
  }
  const Tensor k = split_heads(k_all, heads).contiguous(), v = split_heads(v_all, heads).contiguous();
  // One attention per run of consecutive computed blocks: its queries see the keys of every block up to its own.
  std::vector<Tensor> outs;
  for (size_t i = 0; i < nc;) {
    size_t j = i + 1;
    while (j < nc && sparse.computed[j] == sparse.computed[j - 1] + 1) ++j;
    const int64_t first = sparse.computed[i], end = sparse.computed[j - 1] + 1;
    outs.push_back(detail::attention(q.narrow(2, static_cast<int64_t>(i) * bt, (end - first) * bt).contiguous(),
                                     k.narrow(2, 0, end * bt), v.narrow(2, 0, end * bt), causal_block_tokens,
                                     chunk_bytes, first * bt));
    i = j;
  }
  const Tensor o = outs.size() == 1 ? outs.front() : at::cat(outs, 1);
  return a.to_out(o.reshape(g.flat()));
}

Tensor SkyReelsV2Transformer::Impl::embed_image(const Layers& l, const Tensor& image_tokens) const {
  // diffusers' SkyReelsV2ImageEmbedding: (+ pos_embed) -> FP32LayerNorm -> Linear -> GELU (erf) -> Linear ->
  // FP32LayerNorm; its LayerNorms keep torch's default eps 1e-5, not the config's.
  constexpr double kEps = 1e-5;
  Tensor x = image_tokens.to(device, dtype);
  if (image_pos_embed.defined()) x = x + image_pos_embed;
  const Tensor n = layer_norm_fp32(x, kEps, image_norm1_weight, image_norm1_bias).to(dtype);
  const Tensor h = l.image_ff_out(at::gelu(l.image_ff_in(n)));
  return layer_norm_fp32(h, kEps, image_norm2_weight, image_norm2_bias).to(dtype);
}

Tensor SkyReelsV2Transformer::Impl::cross_attention(const BlockWeights& b, const Tensor& n,
                                                    const CrossContext& context) const {
  // No RoPE and no mask: zero-padded text rows are attended, as in diffusers. The image tokens get their own keys
  // and values and one attention of the same queries; both outputs are summed before to_out (diffusers' I2V
  // processor, minus its `total - 512` split: the two contexts are never concatenated here).
  const AttentionWeights& a = b.attn2;
  const int64_t heads = config.num_attention_heads;
  const Tensor q = split_heads(rms_norm_across_heads(a.to_q(n), a.norm_q, config.eps), heads).contiguous();
  const Tensor k = split_heads(rms_norm_across_heads(a.to_k(context.text), a.norm_k, config.eps), heads).contiguous();
  const Tensor v = split_heads(a.to_v(context.text), heads).contiguous();
  Tensor o = detail::attention(q, k, v, 0, chunk_bytes);
  if (context.image.defined()) {
    const ImageKvWeights& kv = b.image_kv;
    const Tensor k_img =
        split_heads(rms_norm_diffusers(kv.add_k(context.image), kv.norm_added_k, config.eps), heads).contiguous();
    const Tensor v_img = split_heads(kv.add_v(context.image), heads).contiguous();
    o.add_(detail::attention(q, k_img, v_img, 0, chunk_bytes));
  }
  return a.to_out(o.view({n.size(0), n.size(1), n.size(2)}));
}

Tensor SkyReelsV2Transformer::Impl::feed_forward(const BlockWeights& b, const Tensor& n) const {
  // Linear -> GELU(tanh) -> Linear, token-wise: run over chunks of tokens so the [tokens, ffn_dim] hidden state
  // (0.9 GB in bf16 at 540P for 1.3B) is never whole.
  const int64_t tokens = n.size(0) * n.size(1), dim = n.size(2);
  const int64_t chunk =
      std::clamp<int64_t>(chunk_bytes / (config.ffn_dim * static_cast<int64_t>(n.element_size())), 1, tokens);
  const Tensor flat = n.view({tokens, dim});
  Tensor out = at::empty({tokens, dim}, n.options());
  const Tensor w_out_t = b.ffn_out.weight.t();
  for (int64_t r = 0; r < tokens; r += chunk) {
    const int64_t m = std::min(chunk, tokens - r);
    const Tensor rows = flat.narrow(0, r, m);
    Tensor hidden = at::linear(rows, b.ffn_in.weight, b.ffn_in.bias);
    if (b.ffn_in.adapters != nullptr) b.ffn_in.adapters->add_to(hidden, rows);
    at::gelu_(hidden, "tanh");
    Tensor o = out.narrow(0, r, m);
    at::addmm_out(o, b.ffn_out.bias, hidden, w_out_t);
    if (b.ffn_out.adapters != nullptr) b.ffn_out.adapters->add_to(o, hidden);
  }
  return out.view(n.sizes());
}

Tensor SkyReelsV2Transformer::Impl::block_forward(const BlockWeights& b, Tensor x, const CrossContext& context,
                                                  const Tensor& modulation, const RopeTables& rope, const Geometry& g,
                                                  int64_t causal_block_tokens, const KvSlot* kv,
                                                  const BlockSparseAttention* sparse) const {
  // e = table + temb in fp32, rows [shift, scale, gate, c_shift, c_scale, c_gate], each [B, Fm, 1, D].
  const Tensor e = b.scale_shift_table.view({1, 1, 6, g.dim}) + modulation;
  auto row = [&](int64_t i) { return e.select(2, i).unsqueeze(2); };
  {
    const Tensor n = modulated_norm(x, row(1), row(0), g, config.eps, dtype);
    x = gated_residual(x, self_attention(b.attn1, n, rope, g, causal_block_tokens, kv, sparse), row(2), g);
  }
  {
    const Tensor n =
        config.cross_attn_norm ? layer_norm_fp32(x, config.eps, b.norm2_weight, b.norm2_bias).to(dtype) : x;
    x.add_(cross_attention(b, n, context));  // plain add in the compute dtype (no fp32 island)
  }
  {
    const Tensor n = modulated_norm(x, row(4), row(3), g, config.eps, dtype);
    x = gated_residual(x, feed_forward(b, n), row(5), g);
  }
  return x;
}

Tensor SkyReelsV2Transformer::Impl::head(const Linear& proj_out, const Tensor& x, const Tensor& temb,
                                         const Geometry& g) const {
  // shift/scale = table [1, 2, D] (fp32) + temb (compute dtype) -> fp32 [B, Fm, 1, D].
  const Tensor e = head_table.view({1, 1, 2, g.dim}) + temb.unsqueeze(2);
  const Tensor n = modulated_norm(x, e.select(2, 1).unsqueeze(2), e.select(2, 0).unsqueeze(2), g, config.eps, dtype);
  return unpatchify(proj_out(n), g);
}

Tensor SkyReelsV2Transformer::Impl::unpatchify(const Tensor& out, const Geometry& g) const {
  // out [B, L, pt*ph*pw*C], features ordered (pt, ph, pw, c).
  const auto& p = config.patch_size;
  return out.view({g.batch, g.ppf, g.pph, g.ppw, p[0], p[1], p[2], config.out_channels})
      .permute({0, 7, 1, 4, 2, 5, 3, 6})
      .reshape({g.batch, config.out_channels, g.frames, g.height, g.width});
}

Tensor SkyReelsV2Transformer::Impl::patchify(const Tensor& hidden_states, const Geometry& g, int64_t first) const {
  // Patch embedding: conv3d with kernel == stride is a linear over flattened (c, pt, ph, pw) patches; token order
  // f * pph * ppw + h * ppw + w.
  const auto& p = config.patch_size;
  const Geometry s = frames_from(g, first);
  Tensor x = hidden_states.narrow(2, first, s.frames)
                 .to(device, dtype)
                 .reshape({g.batch, config.in_channels, s.ppf, p[0], g.pph, p[1], g.ppw, p[2]})  // inputs may be views
                 .permute({0, 2, 4, 6, 1, 3, 5, 7})
                 .reshape({g.batch, s.tokens, config.in_channels * p[0] * p[1] * p[2]});
  return patch_embedding(x);
}

CallConditioning SkyReelsV2Transformer::Impl::condition(const Layers& l, const TransformerForwardArgs& args,
                                                        const Geometry& g) const {
  const auto& c = config;
  CallConditioning cond;
  const Tensor timestep = args.timestep.to(device);
  const Tensor ts = timestep.dim() == 1 ? timestep.unsqueeze(1) : timestep;  // [B, Fm]
  cond.fm = ts.size(1);
  const Tensor sinusoid = detail::timestep_sinusoid(ts, c.freq_dim).to(at::kFloat);
  cond.temb = l.time_2(at::silu(l.time_1(sinusoid))).to(dtype);  // fp32 MLP, then the compute dtype
  Tensor modulation = l.time_proj(at::silu(cond.temb)).view({g.batch, cond.fm, 6, g.dim});
  if (c.inject_sample_info) {
    // Each batch item adds its own fps vector to all of its frames (diffusers only manages B = 1 in DF mode).
    const Tensor fps_emb = at::index_select(fps_embedding, 0, args.fps->to(device, at::kLong));
    const Tensor fps_proj = l.fps_2(at::silu(l.fps_1(fps_emb)));
    modulation = modulation + fps_proj.view({g.batch, 1, 6, g.dim});
  }
  cond.modulation = modulation.to(at::kFloat);
  cond.context.text = l.text_2(at::gelu(l.text_1(args.encoder_hidden_states.to(device, dtype)), "tanh"));
  if (c.image_dim) cond.context.image = embed_image(l, args.encoder_hidden_states_image);
  return cond;
}

namespace {

// What a call may skip (TransformerForwardArgs' exact savings and FirstBlockCache), checked against the call.
struct Savings {
  TransformerCallState::Impl* state = nullptr;
  int64_t reuse = 0, keep = 0;  // frames
  std::optional<double> threshold;
};

Savings check_savings(const TransformerForwardArgs& a, const TransformerConfig& c, const Geometry& g) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  Savings s{a.state ? &a.state->impl() : nullptr, a.reuse_frames, a.keep_frames, a.first_block_threshold};
  require(s.state || (s.reuse == 0 && s.keep == 0 && !s.threshold),
          "state: reuse_frames, keep_frames and first_block_threshold need a TransformerCallState");
  if (s.reuse != 0 || s.keep != 0) {
    const int64_t block = a.num_frame_per_block;
    require(block > 1 && a.timestep.dim() == 2 && c.patch_size[0] == 1,
            "reuse_frames/keep_frames: exact savings need per-frame timesteps [B, F], the block-causal mask "
            "(num_frame_per_block > 1) and patch_size[0] = 1");
    require(s.reuse >= 0 && s.reuse <= s.keep && s.keep <= g.frames && s.reuse < g.frames && s.reuse % block == 0 &&
                s.keep % block == 0,
            "reuse_frames/keep_frames: need 0 <= reuse (" + std::to_string(s.reuse) + ") <= keep (" +
                std::to_string(s.keep) + ") <= F (" + std::to_string(g.frames) + "), reuse < F, whole blocks of " +
                std::to_string(block));
    const auto& st = *s.state;
    require(s.reuse == 0 || (s.reuse <= st.kept_frames && st.tokens_per_frame == g.tokens_per_frame &&
                             st.batch == g.batch),
            "reuse_frames: " + std::to_string(s.reuse) + " frames asked, the state keeps " +
                std::to_string(st.kept_frames) + " of another call's geometry");
  }
  if (const PerBlockCache* pb = a.per_block_cache) {
    require(s.state && s.reuse == 0 && s.keep == 0 && !s.threshold,
            "per_block_cache: needs a TransformerCallState and excludes reuse_frames, keep_frames and "
            "first_block_threshold");
    require(a.num_frame_per_block > 1 && a.timestep.dim() == 2 && c.patch_size[0] == 1,
            "per_block_cache: needs per-frame timesteps [B, F], the block-causal mask (num_frame_per_block > 1) and "
            "patch_size[0] = 1");
    require(pb->updated_blocks.size() == static_cast<size_t>(g.frames / a.num_frame_per_block),
            "per_block_cache: updated_blocks has " + std::to_string(pb->updated_blocks.size()) + " entries for " +
                std::to_string(g.frames / a.num_frame_per_block) + " causal blocks");
    require(std::isfinite(pb->threshold) && pb->threshold >= 0 && pb->max_skips >= 1 && pb->first_block >= 0,
            "per_block_cache: needs a finite threshold >= 0, max_skips >= 1 and first_block >= 0");
    require(c.num_layers >= 2, "per_block_cache: needs at least 2 transformer blocks");
  }
  if (a.sequence_parallel != nullptr && a.sequence_parallel->size() > 1) {
    require(c.num_attention_heads % a.sequence_parallel->size() == 0,
            "sequence_parallel: " + std::to_string(a.sequence_parallel->size()) + " ranks do not divide the " +
                std::to_string(c.num_attention_heads) + " attention heads");
  }
  if (a.taylorseer != nullptr || a.magcache != nullptr) {
    require(s.state && !(a.taylorseer && a.magcache) && s.reuse == 0 && s.keep == 0 && !s.threshold &&
                a.per_block_cache == nullptr,
            "taylorseer/magcache: need a TransformerCallState and exclude each other, reuse_frames, keep_frames, "
            "first_block_threshold and per_block_cache");
  }
  if (s.threshold) {
    require(std::isfinite(*s.threshold) && *s.threshold >= 0, "first_block_threshold: must be a finite value >= 0");
    require(c.num_layers >= 2, "first_block_threshold: FirstBlockCache needs at least 2 transformer blocks");
  }
  return s;
}

// FirstBlockCache's decision: rel as a host number; compute when there is no r_prev or rel > threshold.
std::optional<double> first_block_rel(const Tensor& residual, const Tensor& previous) {
  if (!previous.defined()) return std::nullopt;
  if (previous.sizes() != residual.sizes()) {
    throw std::invalid_argument("first_block_cache: this call has " + std::to_string(residual.size(1)) +
                                " tokens, the context's last computed call had " + std::to_string(previous.size(1)) +
                                " (cache state kept across calls of different shapes)");
  }
  return relative_change(residual, previous).item<double>();
}

// Exact savings: a call that keeps frames and reuses none starts a fresh set of kept keys / values, for its
// geometry. True when the call keeps any (one slot per layer then).
bool prepare_kept_kv(const Savings& savings, const Geometry& g, size_t layers) {
  TransformerCallState::Impl* state = savings.state;
  if (state && savings.keep > 0 && savings.reuse == 0) {
    state->reset_kv();
    state->tokens_per_frame = g.tokens_per_frame;
    state->batch = g.batch;
  }
  const bool keeps = state && savings.keep > 0;
  if (keeps) {
    state->k.resize(layers);
    state->v.resize(layers);
  }
  return keeps;
}

// The call's RoPE tables as apply_rope takes them: diffusers uses cos[..., 0::2] and sin[..., 1::2] of its tables,
// each angle repeated over its pair.
RopeTables signed_rope(const std::pair<Tensor, Tensor>& tables, int64_t head_dim) {
  const auto& [cos_full, sin_full] = tables;
  const Tensor sin_half = sin_full.slice(-1, 1, head_dim, 2);
  return RopeTables{cos_full, at::stack({sin_half.neg(), sin_half}, -1).view(cos_full.sizes())};
}

}  // namespace

at::Tensor SkyReelsV2Transformer::forward(const TransformerForwardArgs& args) const {
  const Impl& m = *impl_;
  const TransformerConfig& c = m.config;
  const Geometry g = m.check_inputs(args);
  const Savings savings = check_savings(args, c, g);
  // The call's adapters on a copy of the layers; without any, the model's own layers (the path of no adapters).
  std::optional<AdaptedLayers> adapted;
  if (!args.adapters.empty()) adapted.emplace(m.base_layers, c, args.adapters);
  const Layers& call_layers = adapted ? adapted->layers() : m.base_layers;
  c10::NoGradGuard no_grad;
  if (m.shards) {  // a sharded model gathers each block from the replica's ranks
    if (args.weight_ranks == nullptr || args.weight_ranks->size() != m.shards->ranks ||
        args.weight_ranks->rank() != m.shards->rank) {
      throw std::invalid_argument("weight_ranks: this transformer holds shard " + std::to_string(m.shards->rank) +
                                  " of " + std::to_string(m.shards->ranks) +
                                  " of its blocks' weights; pass every rank of its replica");
    }
    m.shards->gather = args.weight_ranks;
    m.shards->prefetch.clear();  // a gather a failed call left behind (its slot was never written)
    m.shards->prefetching = -1;
  }  // c10::, not at::: LibTorch 2.x no longer aliases it through ATen/ATen.h

  // Frames [reuse, F) are computed; with FirstBlockCache block 0 runs on every frame (its residual is compared
  // over the whole call, as diffusers does).
  const int64_t reuse = savings.reuse;
  const bool first_block = savings.threshold.has_value();
  Tensor x = m.patchify(args.hidden_states, g, first_block ? 0 : reuse);
  // Ulysses: each rank runs the blocks on its share of the tokens from frame `first` on.
  // The cache per causal block runs every token on every rank (not split yet): the same numbers, without the split's
  // speed-up. TaylorSeer and MagCache split their own paths (transformer_taylorseer.cpp, transformer_magcache.cpp).
  const bool splits = !args.per_block_cache && !args.taylorseer && !args.magcache;
  RankGroup* ranks =
      args.sequence_parallel != nullptr && args.sequence_parallel->size() > 1 && splits ? args.sequence_parallel
                                                                                       : nullptr;
  auto held = [&](int64_t first) {
    const Geometry sub = frames_from(g, first);
    return ranks ? split_across(sub, *ranks) : sub;
  };
  const Tensor patches = ranks && first_block ? x : Tensor();  // block 0's whole input (FirstBlockCache's residual)
  if (ranks) x = take_share(x, held(first_block ? 0 : reuse));

  // The timestep (and fps) modulation, the text / image context, the RoPE tables.
  const CallConditioning cond = m.condition(call_layers, args, g);
  const Tensor& temb = cond.temb;
  const Tensor& modulation = cond.modulation;
  const CrossContext& context = cond.context;
  const int64_t fm = cond.fm;
  const RopeTables rope = signed_rope(rope_tables(g.ppf, g.pph, g.ppw), c.attention_head_dim);

  // The call's tensors restricted to frames [first, F).
  auto per_frame = [&](const Tensor& t, int64_t first) { return fm == 1 ? t : t.narrow(1, first, fm - first); };
  auto rope_from = [&](int64_t first) {
    const int64_t begin = first * g.tokens_per_frame, n = g.tokens - begin;
    return RopeTables{rope.cos.narrow(1, begin, n), rope.signed_sin.narrow(1, begin, n)};
  };
  auto tokens_from = [&](const Tensor& t, int64_t first) {
    return first == 0 ? t : t.narrow(1, first * g.tokens_per_frame, g.tokens - first * g.tokens_per_frame).contiguous();
  };

  TransformerCallState::Impl* state = savings.state;
  const bool keeps = prepare_kept_kv(savings, g, call_layers.blocks.size());

  const int64_t layers = static_cast<int64_t>(call_layers.blocks.size());
  TransformerCallStats stats;
  stats.token_blocks_full = g.batch * g.tokens * layers;
  const int64_t causal_block_tokens = args.num_frame_per_block > 1 ? args.num_frame_per_block * g.tokens_per_frame : 0;
  if (args.per_block_cache != nullptr) {
    x = m.per_block_layers(call_layers.blocks, std::move(x), *args.per_block_cache, *state, context, modulation, rope,
                           g, args.num_frame_per_block, args.after_block, stats);
    if (args.stats) *args.stats = stats;
    m.end_gathers();
    return m.head(call_layers.proj_out, x, temb, g);
  }
  if (args.taylorseer != nullptr || args.magcache != nullptr) {  // diffusers' TaylorSeer / MagCache
    Tensor out = args.taylorseer ? m.taylorseer_forward(call_layers, std::move(x), cond, rope, g, args, *state, stats)
                                 : m.magcache_forward(call_layers, std::move(x), cond, rope, g, args, *state, stats);
    if (args.stats) *args.stats = stats;
    m.end_gathers();
    return out;
  }
  Tensor block0_out;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t first = first_block && l == 0 ? 0 : reuse;
    const Geometry sub = held(first);
    KvSlot slot;
    const bool kept_layer = keeps && !(first_block && l == 0);  // FirstBlockCache runs block 0 whole
    if (kept_layer) {
      slot = {&state->k[static_cast<size_t>(l)], &state->v[static_cast<size_t>(l)], reuse * g.tokens_per_frame,
              savings.keep * g.tokens_per_frame};
    }
    // FirstBlockCache's residual needs block 0's input (block_forward never writes it in place); elsewhere the
    // input is released inside the block as usual.
    const Tensor block_in = first_block && l == 0 ? (ranks ? patches : x) : Tensor();
    x = m.block_forward(m.ready(call_layers.blocks, static_cast<size_t>(l)), std::move(x), context, per_frame(modulation, first),
                        share_rope(rope_from(first), sub), sub, causal_block_tokens, kept_layer ? &slot : nullptr);
    stats.token_blocks_computed += g.batch * sub.tokens;
    if (args.after_block) args.after_block();
    if (first_block && l == 0) {
      // The decision is made on every token, on every rank alike: split across ranks, block 0's output is gathered.
      if (ranks) x = gather_shares(x, sub);
      const Tensor residual = x - block_in;
      stats.first_block_rel = first_block_rel(residual, state->prev_residual);
      if (stats.first_block_rel && *stats.first_block_rel <= *savings.threshold) {
        stats.skipped = true;
        stats.token_blocks_cached = g.batch * frames_from(g, reuse).tokens * (layers - 1);
        x = tokens_from(state->tail_residual + x, reuse);
        break;
      }
      state->prev_residual = residual;
      block0_out = x;
      x = tokens_from(x, reuse);
      if (ranks) x = take_share(x, held(reuse));
    }
  }
  if (ranks && !stats.skipped) x = gather_shares(x, held(reuse));  // the head runs on every token, on every rank
  if (first_block && !stats.skipped) {
    // The tail residual of every token; the kept frames [0, reuse) are final, so no later call reads theirs.
    Tensor tail = at::zeros_like(block0_out);
    tail.narrow(1, reuse * g.tokens_per_frame, x.size(1)).copy_(x - tokens_from(block0_out, reuse));
    state->tail_residual = tail;
  }
  if (keeps && !stats.skipped) state->kept_frames = std::max(state->kept_frames, savings.keep);
  if (args.stats) *args.stats = stats;
  m.end_gathers();  // FirstBlockCache may have skipped the block being prefetched: every rank finishes it alike
  const Geometry out = frames_from(g, reuse);
  return m.head(call_layers.proj_out, x, per_frame(temb, reuse), out);
}

}  // namespace skyreels::model
