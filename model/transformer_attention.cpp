// The transformer's kernels exposed as transformer_detail (transformer_skyreels_v2.h) for unit tests and
// benchmarks: the RoPE head split, the timestep sinusoid, and attention with the block-causal mask (SDPA on LibTorch
// 2.x, chunked per head without it). Separate from the forward because they are plain tensor functions, with no
// weights and no call state.
#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

namespace transformer_detail {

RopeSplit rope_split(int64_t head_dim) {
  RopeSplit s;
  s.h = s.w = 2 * (head_dim / 6);
  s.t = head_dim - s.h - s.w;
  return s;
}

at::Tensor timestep_sinusoid(const at::Tensor& timestep, int64_t dim) {
  // float64 as diffusers' get_1d_sincos_pos_embed_from_grid: at t ~ 999 fp32 angles are off by ~1e-4 rad.
  const int64_t half = dim / 2;
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(timestep.device());
  at::Tensor omega = at::pow(10000.0, at::arange(half, f64).div_(static_cast<double>(half))).reciprocal_();
  at::Tensor angle = at::outer(timestep.reshape({-1}).to(at::kDouble), omega);
  std::vector<int64_t> shape = timestep.sizes().vec();
  shape.push_back(2 * half);
  return at::cat({at::cos(angle), at::sin(angle)}, 1).view(shape);
}

namespace {

// Writes softmax(q k^T / sqrt(Dh)) v into dst ([B, Nh, Lq, Dh], any strides).
void attend_into(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 [[maybe_unused]] int64_t max_score_bytes) {
#if TORCH_VERSION_MAJOR >= 2
  dst.copy_(at::scaled_dot_product_attention(q, k, v));
#else
  // LibTorch 1.x has no public SDPA: the reference math per head, over chunks of query rows whose [rows, Lk] score
  // matrix stays under max_score_bytes (L x L at 540P would be tens of GB). The two score buffers are reused by
  // every chunk: on CPU, fresh large allocations cost a page fault per 4 KiB. Per-head 2-D GEMMs also keep
  // LibTorch 1.13 off its slow batched path for a transposed operand.
  const int64_t lq = q.size(2), lk = k.size(2);
  const int64_t rows = std::clamp<int64_t>(max_score_bytes / (lk * static_cast<int64_t>(q.element_size())), 1, lq);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor scores = at::empty({rows, lk}, q.options());
  const at::Tensor probs = at::empty({rows, lk}, q.options());
  for (int64_t b = 0; b < q.size(0); ++b) {
    for (int64_t h = 0; h < q.size(1); ++h) {
      const at::Tensor qh = q[b][h], kh_t = k[b][h].t(), vh = v[b][h], out = dst[b][h];
      for (int64_t r = 0; r < lq; r += rows) {
        const int64_t n = std::min(rows, lq - r);
        at::Tensor s = scores.narrow(0, 0, n), p = probs.narrow(0, 0, n), o = out.narrow(0, r, n);
        at::addmm_out(s, s, qh.narrow(0, r, n), kh_t, /*beta=*/0, /*alpha=*/scale);
        at::_softmax_out(p, s, -1, false);
        at::mm_out(o, p, vh);
      }
    }
  }
#endif
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t causal_block_tokens,
                     int64_t max_score_bytes, int64_t query_offset) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes() || q.size(0) != k.size(0) ||
      q.size(1) != k.size(1) || q.size(3) != k.size(3)) {
    throw std::invalid_argument("attention: expected q [B, Nh, Lq, Dh] and k, v [B, Nh, Lk, Dh]");
  }
  const int64_t lq = q.size(2);
  if (causal_block_tokens > 0 && query_offset + lq != k.size(2)) {
    throw std::invalid_argument("attention: the block-causal mask needs query_offset + Lq keys");
  }
  if (query_offset < 0 || (query_offset > 0 && (causal_block_tokens <= 0 || query_offset % causal_block_tokens))) {
    throw std::invalid_argument("attention: query_offset must be whole blocks of a block-causal mask");
  }
  at::Tensor out = at::empty({q.size(0), lq, q.size(1), q.size(3)}, q.options());
  const at::Tensor dst = out.transpose(1, 2);
  if (causal_block_tokens <= 0 || (query_offset == 0 && causal_block_tokens >= lq)) {
    attend_into(dst, q, k, v, max_score_bytes);
    return out;
  }
  // Keys of later blocks are masked out anyway: attending each query block to its key prefix is the same softmax,
  // without an L x L mask and with about half the work.
  for (int64_t start = 0; start < lq; start += causal_block_tokens) {
    const int64_t n = std::min(causal_block_tokens, lq - start);
    const int64_t keys = query_offset + start + n;
    attend_into(dst.narrow(2, start, n), q.narrow(2, start, n), k.narrow(2, 0, keys), v.narrow(2, 0, keys),
                max_score_bytes);
  }
  return out;
}

}  // namespace transformer_detail

}  // namespace skyreels::model
