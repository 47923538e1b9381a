// fp8 weights as safetensors stores them (F8_E4M3, F8_E5M2): exact decoding through one 256-entry table per format,
// and the e4m3fn encoding `skyreels convert --dtype float8_e4m3fn` writes. LibTorch 1.13 has no fp8 scalar type, so
// fp8 tensors travel as uint8 tensors of codes.
//
// The formats are the OCP 8-bit floating point ones that PyTorch implements as float8_e4m3fn and float8_e5m2:
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is the only NaN (one per sign);
//           largest finite 448, smallest subnormal 2^-9.
//   e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like: exponent 11111 is inf (mantissa 0) or NaN;
//           largest finite 57344, smallest subnormal 2^-16 (the top byte of an IEEE half).
// Every value of both formats is exact in float32, bfloat16 and float16.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>

namespace skyreels::fp8 {

enum class Format { E4M3FN, E5M2 };

const char* format_name(Format format);  // "float8_e4m3fn", "float8_e5m2" (PyTorch's names)

// code -> value, for all 256 codes.
const std::array<float, 256>& table(Format format);

// uint8 codes of any shape -> float32 values (the same shape), through table(format).
at::Tensor decode(const at::Tensor& codes, Format format);

// float values -> e4m3fn codes, rounded to the nearest value, ties to the even code, as PyTorch's
// .to(torch.float8_e4m3fn) does for every value it can represent (|x| < 464 rounds to at most 448). Where PyTorch
// would produce NaN (|x| >= 464, inf, NaN) this throws std::invalid_argument naming `what` and the value instead:
// a checkpoint never gains NaN weights silently.
at::Tensor encode_e4m3fn(const at::Tensor& values, const std::string& what);

}  // namespace skyreels::fp8
