#include "model/fp8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace skyreels::fp8 {
namespace {

float from_bits(uint32_t bits) {
  float f = 0;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A minifloat with `exp_bits` exponent and `man_bits` mantissa bits, its fields moved into a float32 bit pattern.
// `ieee_specials`: an all-ones exponent is inf/NaN (e5m2); otherwise only the all-ones code is NaN (e4m3fn).
std::array<float, 256> build(int exp_bits, int man_bits, bool ieee_specials) {
  std::array<float, 256> out{};
  const int bias = (1 << (exp_bits - 1)) - 1;
  const uint32_t exp_max = (1u << exp_bits) - 1;
  const uint32_t man_max = (1u << man_bits) - 1;
  for (uint32_t code = 0; code < 256; ++code) {
    const uint32_t sign = (code >> 7) << 31;
    const uint32_t e = (code >> man_bits) & exp_max;
    uint32_t m = code & man_max;
    if (e == exp_max && (ieee_specials || m == man_max)) {
      out[code] = from_bits(sign | (m == 0 && ieee_specials ? 0x7f800000u : 0x7fc00000u));
      continue;
    }
    if (e == 0 && m == 0) {
      out[code] = from_bits(sign);
      continue;
    }
    int32_t exponent = static_cast<int32_t>(e) - bias;
    if (e == 0) {  // subnormal: normalise the mantissa into float32's implicit-one form
      exponent = 1 - bias;
      while ((m & (1u << man_bits)) == 0) {
        m <<= 1;
        --exponent;
      }
      m &= man_max;
    }
    out[code] = from_bits(sign | (static_cast<uint32_t>(exponent + 127) << 23) | (m << (23 - man_bits)));
  }
  return out;
}

}  // namespace

const char* format_name(Format format) { return format == Format::E4M3FN ? "float8_e4m3fn" : "float8_e5m2"; }

const std::array<float, 256>& table(Format format) {
  static const std::array<float, 256> e4m3fn = build(4, 3, false);
  static const std::array<float, 256> e5m2 = build(5, 2, true);
  return format == Format::E4M3FN ? e4m3fn : e5m2;
}

at::Tensor decode(const at::Tensor& codes, Format format) {
  if (codes.scalar_type() != at::kByte) {
    throw std::invalid_argument(std::string("fp8 decode: codes must be uint8, got ") +
                                c10::toString(codes.scalar_type()));
  }
  const at::Tensor in = codes.to(at::kCPU).contiguous();
  at::Tensor out = at::empty(in.sizes(), at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const float* values = table(format).data();
  at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = values[src[i]];
  });
  return out;
}

at::Tensor encode_e4m3fn(const at::Tensor& values, const std::string& what) {
  const at::Tensor in = values.to(at::kCPU).to(at::kFloat).contiguous();
  at::Tensor out = at::empty(in.sizes(), at::TensorOptions().dtype(at::kByte));
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Codes 0x00 ... 0x7e are the non-negative finite values in increasing order; the last bit of a code is the last
  // mantissa bit, so "ties to even" is "ties to the even code".
  const float* positive = table(Format::E4M3FN).data();
  constexpr int kLargest = 0x7e;  // 448
  constexpr float kNanFrom = 464.0f;  // halfway to 480, which e4m3fn lacks: PyTorch's first NaN
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float x = src[i];
      const float a = std::fabs(x);
      if (!(a < kNanFrom)) {
        bad = i;
        dst[i] = 0x7f;
        continue;
      }
      const int hi = static_cast<int>(std::lower_bound(positive, positive + kLargest + 1, a) - positive);
      int code = std::min(hi, kLargest);
      if (hi > 0 && hi <= kLargest) {
        const float below = positive[hi - 1];
        const float above = positive[hi];
        const float d_below = a - below;
        const float d_above = above - a;
        if (d_below < d_above || (d_below == d_above && ((hi - 1) & 1) == 0)) code = hi - 1;
      }
      dst[i] = static_cast<uint8_t>(code | (std::signbit(x) ? 0x80 : 0));
    }
  });
  if (bad >= 0) {
    const int64_t i = bad.load();
    throw std::invalid_argument(what + ": value " + std::to_string(src[i]) + " at flat index " + std::to_string(i) +
                                " has no float8_e4m3fn code (|x| >= 464, inf or NaN; PyTorch would store NaN)");
  }
  return out;
}

}  // namespace skyreels::fp8
